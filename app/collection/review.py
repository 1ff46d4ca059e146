"""The review of groups of duplicates, the same for the page's Collection tab and the JSON API: a page of the last
search's groups (of some kinds), a keeper chosen, the others of a group (or of every group of a kind) moved out of
the collection, a group said to be not duplicates, the moves undone, all through :mod:`index.duplicates.resolve`.

Moves go to the collection's hidden ``ROOT/.moco-duplicates`` folder
(:data:`index.duplicates.resolve.actions.DUPLICATES_DIR`):
a destination is never taken from a request. One action runs at a time in a server (the journal's lock keeps out
other processes); the saved search is read once per change of ``dedup.json``, so paging 10,000 groups reads it once.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from index.duplicates.dedup import Search, load_duplicates, search_duplicates
from index.duplicates.groups import DEFAULT_KINDS, KINDS, SIMILAR, Group, SavedSearch
from index.duplicates.resolve.actions import (
    Outcome,
    choose_keeper,
    journal_of,
    mark_not_duplicates,
    move_duplicates,
    select_groups,
    undo_moves,
)
from index.search.image_index import ImageIndex
from index.search.index_dir import DEDUP_FILE
from moco.errors import NotFoundError, UserError

__all__ = ["DuplicateReview", "ReviewPage", "PAGE_SIZE", "MAX_PAGE"]

logger = logging.getLogger(__name__)

PAGE_SIZE = 10  # groups on a page of the Collection tab
MAX_PAGE = 500  # groups in one answer of the API at most


@dataclass(frozen=True)
class ReviewPage:
    """A page of the last search: its groups (of ``kinds``) from ``offset``, and what the search was."""

    groups: list[Group]
    total: int  # groups of these kinds in the search
    offset: int
    limit: int
    kinds: tuple[str, ...]
    search: SavedSearch  # the saved search: thresholds, rule, created, images

    @property
    def next_offset(self) -> int | None:
        return self.offset + self.limit if self.offset + self.limit < self.total else None


class DuplicateReview:
    """The actions on duplicates of one server, over the index ``ready_index()`` gives (a UserError while there is
    none). ``device``: where the index update after a move embeds the photos put back."""

    def __init__(self, ready_index: Callable[[], ImageIndex], device: str = "auto") -> None:
        self.ready_index, self.device = ready_index, device
        self._acting = threading.Lock()
        self._cache: tuple[Any, SavedSearch | None] = (None, None)
        self._cache_lock = threading.Lock()

    def saved(self) -> SavedSearch | None:
        """The last search (``dedup.json``), read again only when the file changed; None before a first one."""
        path = self.ready_index().dir / DEDUP_FILE
        try:
            st = os.stat(path)
            stamp: Any = (st.st_mtime_ns, st.st_size, st.st_ino)
        except FileNotFoundError:
            return None
        with self._cache_lock:
            if self._cache[0] != stamp:
                self._cache = (stamp, load_duplicates(path.parent))
            return self._cache[1]

    def page(self, kinds: Iterable[str] | None = None, offset: int = 0, limit: int = PAGE_SIZE) -> ReviewPage:
        """Groups ``offset`` .. ``offset + limit`` of the last search, of ``kinds`` (None: those it searched)."""
        doc = self.saved()
        if doc is None:
            raise NotFoundError(f"no search for duplicates yet: run `moco index dedup {self.ready_index().dir}` or "
                                "press Find duplicates in the page's Collection tab")
        kinds = tuple(kinds or doc.kinds or KINDS)
        bad = [k for k in kinds if k not in KINDS]
        if bad:
            raise UserError(f"kind {', '.join(map(repr, bad))}: choose among {', '.join(KINDS)}")
        offset, limit = max(0, int(offset)), max(1, min(int(limit), MAX_PAGE))
        chosen = [g for g in doc.groups if g.kind in kinds]
        return ReviewPage(chosen[offset : offset + limit], len(chosen), offset, limit, kinds, doc)

    def group(self, gid: str) -> Group:
        """Group ``gid`` of the last search (a UserError naming it when there is none)."""
        doc = self.saved()
        group = doc.group(gid) if doc else None
        if group is not None:
            return group
        raise NotFoundError(f"no group {gid!r} in the last search: it was moved, marked, or the search was made again; "
                        "reload the groups")

    def find(self, threshold: float | None = None, similar: bool = False,
             exclude_folders: Sequence[str] = ()) -> Search:
        """Search for duplicates again (``threshold``: near; None: the index's), similar groups too when asked, the
        photos under ``exclude_folders`` left out."""
        index = self.ready_index()
        kinds = KINDS if similar else DEFAULT_KINDS
        with self._acting:
            return search_duplicates(index, threshold, kinds, exclude_folders=exclude_folders)

    def keep(self, gid: str, photo: int) -> Group:
        """Keep ``photo`` of group ``gid`` (now and in later searches); the group."""
        with self._acting:
            return choose_keeper(self.ready_index(), gid, int(photo))

    def not_duplicates(self, gid: str) -> Group:
        """Say group ``gid``'s photos are not duplicates (never grouped again); the group."""
        with self._acting:
            return mark_not_duplicates(self.ready_index(), gid)

    def move(self, gids: Iterable[str] | None = None, kinds: Iterable[str] | None = None,
             keepers: Mapping[str, int] | None = None, dry_run: bool = False, dest: str | None = None) -> Outcome:
        """Move the others of groups ``gids`` (or of every group of ``kinds``: exact or near; similar groups are
        moved only by id) to ``dest`` (None or "": ``ROOT/.moco-duplicates``; the rules of ``--move-to``: a folder
        outside the collection or a hidden one in it), keeping ``keepers[group id]`` or each group's keeper;
        ``dry_run``: only say what would move."""
        gids, kinds = list(gids or []), list(kinds or [])
        if not gids and not kinds:
            raise UserError("name the groups to move (their ids) or their kinds (exact, near)")
        if not gids and SIMILAR in kinds:
            raise UserError("similar groups are different shots of one scene: review and move them one group at a "
                            "time")
        doc = self.saved()
        if doc is None:
            raise NotFoundError("no search for duplicates yet: find the duplicates first")
        groups = select_groups(doc.groups, kinds or None, gids or None)
        if keepers:
            unknown = [g for g in keepers if g not in {x.id for x in groups}]
            if unknown:
                raise NotFoundError(f"keepers for groups not moved: {', '.join(map(repr, unknown))}: no such group "
                                    "among those the request moves")
        with self._acting:
            return move_duplicates(self.ready_index(), groups, (dest or "").strip() or None, keepers, dry_run,
                                   self.device)

    def undo(self, batch: str | None = None) -> Outcome:
        """Put back the photos moved (by ``batch``, or every move not yet undone)."""
        with self._acting:
            return undo_moves(self.ready_index(), batch, self.device)

    def moved(self) -> int:
        """Photos moved and not yet put back (what Undo would put back)."""
        index = self.ready_index()
        return sum(e.state != "planned" for e in journal_of(index).outstanding())
