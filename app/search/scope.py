"""What a search keeps, checked once for every door: ``k``, the folder filter and the dates taken.

A :class:`Searcher` serves one index (or none yet: ``moco run`` serves the page while training and indexing still
run). :meth:`Searcher.check` turns a request's values into a :class:`Scope` (the index refreshed once, the model
checked against it, folders and dates checked, ``k`` capped) or the error naming the value: a bad folder name or
date is a :class:`~moco.errors.UserError` (the API's 400), a folder the collection does not have
:class:`NoSuchFolder` (404). :meth:`Searcher.search` then ranks query vectors within a scope. The page, the JSON API
and its batches search through these, so every door has the same checks, scores and messages.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from index.building.plan import content_hash, file_hashes
from index.catalog import display_path, taken_bound
from index.search.image_index import ImageIndex, SearchResult
from moco.errors import UserError, quoted

__all__ = ["Searcher", "Scope", "NoSuchFolder", "FOLDER_PATTERN", "MAX_RESULTS", "ALL_FOLDERS", "FOLDER_MODES",
           "folder_filter"]

MAX_RESULTS = 500
ALL_FOLDERS = "All folders"  # the folder filter's label for "no filter"
FOLDER_MODES = ("only this folder", "all but this folder")  # the folder filter includes, or excludes, its folder

# A folder filter as it may be written: parts between "/" none of which is "." or "..", no control character. One
# that is not is bad input (the JSON API's 400, its schema's pattern); one that is but names no sub-folder of the
# collection is NoSuchFolder (404).
_NAME = r"[^/\x00-\x1f\x7f-\x9f]"  # a character of a part
_PART = rf"[^./\x00-\x1f\x7f-\x9f]{_NAME}*|\.[^./\x00-\x1f\x7f-\x9f]{_NAME}*|\.\.{_NAME}+"  # not "." nor ".."
FOLDER_PATTERN = rf"^(?:(?:{_PART})?(?:/(?:{_PART})?)*)$"


def folder_filter(folder: str | None, mode: str | None) -> tuple[str | None, list[str]]:
    """The page's folder filter (a folder and one of FOLDER_MODES) as a search takes it: (folder, exclude_folders)."""
    if mode == FOLDER_MODES[1]:
        return None, [folder] if folder and folder != ALL_FOLDERS else []
    return folder, []


class NoSuchFolder(UserError):
    """A folder filter written as FOLDER_PATTERN says that names no sub-folder of the collection (the API's 404)."""


@dataclass(frozen=True)
class Scope:
    """A search's checked values: the index (refreshed), ``k`` (1 to :data:`MAX_RESULTS`), the folder on disk (None:
    all), the folders left out (on disk) and the date range as catalog ``taken`` values (None: open)."""

    index: ImageIndex
    k: int
    folder: str | None
    away: tuple[str, ...]
    taken: tuple[float | None, float | None]


class Searcher:
    """Searches of one index: ``ready_index()`` gives the index or says why there is none yet (a UserError);
    ``embedder()`` the model its queries are embedded with (checked against the index at every :meth:`check`)."""

    def __init__(self, ready_index: Callable[[], ImageIndex], embedder: Callable[[], object]) -> None:
        self.ready_index, self.embedder = ready_index, embedder
        self._folders: tuple[object, list[str], dict[str, str]] | None = None  # (index stamp, shown, shown -> disk)

    def folders(self, index: ImageIndex | None = None) -> list[str]:
        """Sub-folders of the collection (two levels), as shown, for the filter; recomputed when the index changes."""
        index = index or self.ready_index()
        stamp = index.stamp
        if self._folders is None or self._folders[0] != stamp:
            out = set()
            for path in index.catalog.rows():
                parts = path.split("/")[:-1]
                for depth in (1, 2):
                    if len(parts) >= depth:
                        out.add("/".join(parts[:depth]))
            self._folders = (stamp, sorted(display_path(f) for f in out), {display_path(f): f for f in out})
        return self._folders[1]

    def folder(self, given: str | None, what: str = "folder", index: ImageIndex | None = None) -> str | None:
        """A folder filter's folder on disk (None: all), or the error naming it: a bad name (UserError, the API's
        400) or one the collection does not have (NoSuchFolder, 404)."""
        given = given or ""
        folder = given.strip().strip("/") or None
        if folder is None or folder == ALL_FOLDERS:
            return None
        if folder not in self.folders(index):
            bad_name = re.fullmatch(FOLDER_PATTERN, given) is None
            which = "" if what == "folder" else f"{what}: "
            raise (UserError if bad_name else NoSuchFolder)(f"{which}no sub-folder {quoted(folder)} in the collection: "
                                                             f"pick one from the list, or {ALL_FOLDERS}")
        assert self._folders is not None
        return self._folders[2].get(folder, folder)

    def check(self, k: int, folder: str | None = None, exclude_folders: Sequence[str] = (),
              taken_from: str | None = None, taken_to: str | None = None) -> Scope:
        """A search's :class:`Scope`, after checking every value (dates ``YYYY-MM-DD``, both days included)."""
        index = self.ready_index()
        k = int(max(1, min(int(k), MAX_RESULTS)))
        index.refresh()  # `moco index update` may have replaced the files meanwhile
        index.check_embedder(self.embedder())  # ... or rebuilt them with another model
        on_disk = self.folder(folder, index=index)
        away = tuple(f for f in (self.folder(g, "exclude_folders", index) for g in exclude_folders or ()) if f)
        taken = (taken_bound(taken_from, False, "taken_from"), taken_bound(taken_to, True, "taken_to"))
        if None not in taken and taken[0] >= taken[1]:  # type: ignore[operator]
            raise UserError(f"taken_from {taken_from} is after taken_to {taken_to}: swap the two dates")
        if len(index) == 0:
            raise UserError("the index is empty: add photos and run `moco index update`")
        return Scope(index, k, on_disk, away, taken)

    def twins(self, files: Sequence[object] = (), data: Sequence[bytes] = ()) -> list[int]:
        """Ids of the indexed photos with the very bytes of an upload: ``files`` (paths; other values match none)
        or ``data``. They are the query photos themselves, left out of their results."""
        hashes = file_hashes(f for f in files if isinstance(f, (str, os.PathLike)))
        hashes += [content_hash(b) for b in data]
        return self.ready_index().ids_of_files(hashes) if hashes else []

    @staticmethod
    def search(scope: Scope, vectors: np.ndarray, offset: int = 0, centred: bool = False,
               exclude_ids: Sequence[int] = (), deduplicate: bool = False,
               exclude_each: Sequence[Sequence[int]] = ()) -> SearchResult:
        """Q query vectors (what the embedder gives; ``centred``: already in the index's space, as
        :meth:`ImageIndex.query_vector` makes them) ranked within ``scope``: never the photos ``exclude_ids``, nor
        for each query its own ``exclude_each`` (one per query: its photo itself); ``deduplicate``: no near-copy of a
        better result."""
        return scope.index.search(vectors, k=scope.k, folder=scope.folder, offset=max(0, int(offset)),
                                  exclude_folders=scope.away, taken=scope.taken, centred=centred,
                                  exclude_ids=exclude_ids, deduplicate=deduplicate, exclude_each=exclude_each,
                                  refresh=False)  # refreshed by check()
