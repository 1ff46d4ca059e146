"""What the search page does, as plain methods (tests call them directly; :mod:`app.page.blocks` wires them to Gradio).

``SearchApp`` is the :class:`app.collection.library.Library` the page and the JSON API serve, with what only the page
does added: its searches' galleries, captions and ``Results`` between events, the details panel, the result files
handed to the browser, the Negatives tab and the Collection tab's text. It can start without an index (``moco run``
serves the page while training and indexing still run): every search then says the index is not ready, and
``attach`` turns search on.
"""

from __future__ import annotations

import asyncio
import collections
import csv
import datetime
import html
import io
import json
import logging
import secrets
import shutil
import tempfile
import threading
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from app.collection.library import Library, size_text
from app.page.negatives.from_index import IndexNegatives
from app.page.negatives.from_queue import QueueNegatives
from app.page.negatives.view import NegativesView
from app.page.overview import CollectionOverview
from app.search.scope import ALL_FOLDERS, Scope
from app.search.service import SearchService
from app.search.uploads import read_upload
from index.catalog import date_text, display_path
from index.duplicates.groups import NEAR, SIMILAR, Group
from index.search.image_index import ImageIndex
from moco.data.photos import load_rgb, open_regular
from moco.errors import UserError, plural

__all__ = ["SearchApp", "Results", "VIEW_PX", "score_text"]

logger = logging.getLogger(__name__)

VIEW_PX = 192  # the two training views are shown at least this large
PREVIEW_PX = 640  # the details panel's preview of a result (long side)
# Result files handed to the browser (CSV/JSON exports, copies of originals) go to a folder of this SearchApp's
# own (``moco-results-*`` in the temporary directory, 0700), removed by ``close()``, at exit (SIGTERM included
# under the CLI) or when the app is collected. The page serves them from there (a static path of Gradio's, behind
# the same login), each in a folder of its own with an unguessable name. While it runs, the oldest are removed past
# _KEEP_EXPORTS results, _KEEP_BYTES bytes or _KEEP_S seconds (the newest is always kept): a download link stays
# good as long as Gradio's own cached files do (app.page.blocks' GRADIO_CACHE_S), short of those caps. The count
# holds at every moment, also while results are being written at once: a folder's place is taken before it is made,
# and a result that fails midway takes its folder along.
_KEEP_EXPORTS = 10_000
_KEEP_BYTES = 256 * 1024 * 1024
_KEEP_S = 86_400.0
_clock = time.monotonic  # the age of result files (tests put a synthetic clock here)
# A CSV cell starting with one of these is a formula to a spreadsheet (OWASP "CSV injection"): it gets a "'".
_FORMULA_START = ("=", "+", "-", "@", "\t", "\r", "\n")


def _csv_cell(value: Any) -> Any:
    """A text cell a spreadsheet would run as a formula (``=cmd|' -C calc'!A0.jpg``) gets a leading "'"."""
    return "'" + value if isinstance(value, str) and value.startswith(_FORMULA_START) else value


def score_text(score: float) -> str:
    """A score as the page shows it: 3 decimals, and one that rounds to zero reads 0.000 (never -0.000)."""
    return f"{round(float(score), 3) + 0.0:.3f}"  # + 0.0 turns -0.0 into 0.0


def _path_html(path: str) -> str:
    """A path for the page with each name kept whole: a line breaks only after a "/" (.name in app.page.blocks' CSS)."""
    return "<code>" + "/<wbr>".join(f'<span class="name">{html.escape(n)}</span>' for n in path.split("/")) + "</code>"


def _folder_bytes(folder: Path) -> int:
    try:
        return sum(f.stat().st_size for f in folder.iterdir())
    except OSError:  # removed meanwhile
        return 0


@dataclass(frozen=True)
class Results:
    """A query and the results the page shows for it, kept between the page's events (its ``gr.State``): Search,
    More, a click on a result and the exports all start from it."""

    vector: np.ndarray  # D: the query's features (``centred``: the query in the index's space)
    k: int
    folder: str | None  # the folder filter, on disk (None: the whole collection)
    label: str  # the query in words: "the uploaded image", or an indexed photo's path
    source: dict[str, Any] | None  # the indexed photo searched with ({"id", "path"}); None: an upload
    ids: list[int]
    paths: list[str]
    scores: list[float]
    thumbs: list[str | None]
    dates: list[float | None] = field(default_factory=list)  # each result's date taken (catalog ``taken``)
    exclude_folders: tuple[str, ...] = ()  # on disk: no result under these
    taken: tuple[float | None, float | None] = (None, None)  # the date range searched (catalog ``taken`` values)
    taken_given: tuple[str, str] = ("", "")  # ... as the user wrote it
    centred: bool = False  # ``vector`` is in the index's space already: a query made of several photos
    positives: np.ndarray | None = None  # P x D: features of the photos searched with (None: ``vector``)
    negatives: np.ndarray | None = None  # N x D: features of the photos to be less like (None: none)
    query_ids: tuple[int, ...] = ()  # indexed photos of the query: never among its results
    photo_ids: tuple[int, ...] = ()  # indexed photos that are the query's photos (an upload's byte-identical files)

    def heading(self) -> str:
        """The query in the results' heading: an indexed photo's path as code, else the label as it is."""
        return f"`{self.label}`" if self.source else self.label


class SearchApp(Library):
    """Handlers of the UI over one index (and optionally a training checkpoint for the Negatives tab): the
    :class:`~app.collection.library.Library` the page and the API share, and what the page alone does.

    Args:
        index: the opened index; None: the page runs before the index exists (see ``attach``).
        embedder: the index's Embedder (``index.load_embedder()``).
        checkpoint: a ``moco train`` checkpoint: negatives from its saved queue; None: from the index.
        status: a :class:`app.run.status.RunStatus` shown in the Status tab while ``moco run`` works.
    """

    def __init__(self, index: ImageIndex | None = None, embedder: Any = None, checkpoint: str | Path | None = None,
                 status: Any = None) -> None:
        super().__init__(status=status)
        self.negatives_source: QueueNegatives | IndexNegatives | None = None
        self.negatives_note = ""
        self.watcher: Any = None  # an index.building.watch.Watcher of the photo folder (`moco serve --watch`)
        self._files = Path(tempfile.mkdtemp(prefix="moco-results-"))  # exports and originals handed to the browser
        self._remove_files = weakref.finalize(self, shutil.rmtree, self._files, ignore_errors=True)  # also at exit
        self._kept: collections.deque[tuple[Path, int, float]] = collections.deque()  # (folder, bytes, made at)
        self._kept_bytes = 0
        self._writing = 0  # result folders made and being written (counted in _KEEP_EXPORTS)
        self._lock = threading.Lock()
        self.overview = CollectionOverview(self.ready_index)  # the Map, Themes, Unusual and Browse tabs
        if index is not None:
            self.use(index, embedder, checkpoint)

    def use(self, index: ImageIndex, embedder: Any, checkpoint: str | Path | None = None) -> None:
        """Serve ``index`` with ``embedder``, the Negatives tab's from ``checkpoint``'s queue (None: from the
        index): search turns on."""
        index.check_embedder(embedder)  # before the negatives are made with it
        source: QueueNegatives | IndexNegatives
        note = ""
        if checkpoint is not None:
            try:
                source = QueueNegatives(checkpoint, index, embedder=embedder)
            except UserError as e:
                note = f"{e}; using the index instead"
                source = IndexNegatives(index, embedder)
        else:
            source = IndexNegatives(index, embedder)
        self.negatives_source, self.negatives_note = source, note
        super().use(index, embedder)  # last: `ready` turns true only with everything in place

    def attach(self, index_dir: str | Path, backbone: str | Path | None = None, checkpoint: str | Path | None = None,
               device: str = "auto") -> None:
        """Open the index (built meanwhile) and turn search on (``checkpoint``: the Negatives tab's, as in ``use``)."""
        index = ImageIndex.open(index_dir)
        self.use(index, index.load_embedder(backbone, device=device), checkpoint)

    def title(self) -> str:
        """The page heading: the photo folder searched and its size, or what is being prepared."""
        if self.index is None:
            return "## moco-retrieval · preparing the index (see Status)"
        return f"## moco-retrieval · `{display_path(self.index.root.name)}` · {len(self.index)} images"

    # ---------------------------------------------------------------------------------- search
    def folder_choices(self) -> list[tuple[str, str]]:
        """The filter's choices: (label, value), "All folders" first."""
        return [(ALL_FOLDERS, "")] + [(f, f) for f in self.folders()]

    def caption(self, rank: int, score: float, path: str, taken: float | None = None) -> str:
        """A result's caption: rank, centred cosine (3 decimals), weak-match marker, the day taken, the full path."""
        index = self.ready_index()
        weak = " · weak match" if index.weak_below is not None and score < index.weak_below else ""
        day = f" · {date_text(taken)[:10]}" if taken is not None else ""
        return f"#{rank} · {score_text(score)}{weak}{day} · {display_path(path)}"

    def _gallery(self, state: Results) -> list[tuple[str | None, str]]:
        dates = state.dates or [None] * len(state.paths)
        return [(thumb, self.caption(r, score, path, taken))
                for r, (path, score, thumb, taken) in enumerate(zip(state.paths, state.scores, state.thumbs, dates), 1)]

    def folder_on_disk(self, given: str | None) -> str | None:
        """A folder as the page's pickers give it (shown, maybe escaped) on disk; None for all; a UserError naming
        a folder the collection does not have."""
        return self.searcher.folder(given)

    def from_vector(self, vector: np.ndarray, k: int, folder: str | None, label: str, embed_ms: float,
                    source: dict[str, Any] | None = None, exclude_folders: Sequence[str] = (),
                    taken_from: str | None = None, taken_to: str | None = None, centred: bool = False,
                    positives: np.ndarray | None = None, negatives: np.ndarray | None = None,
                    query_ids: Sequence[int] = (), photo_ids: Sequence[int] = (), scope: Scope | None = None) -> tuple:
        """The page's (gallery, info, state) for a query vector (D; ``centred``: already in the index's space, a
        query of several photos: their features ``positives`` and ``negatives``) labelled ``label``; ``query_ids``:
        the query's indexed photos (the photo searched with, an upload's byte-identical files, the photos of several),
        left out of the results, and the info line says so; ``photo_ids``: the indexed photos the query's photos are,
        left out of a later Search again; ``scope``: the search's values checked already (None: checked here). Every
        search of the page ends here, and so does the page's Search batched by :class:`app.search.service.
        SearchService`."""
        scope = scope or self.searcher.check(k, folder, exclude_folders, taken_from, taken_to)
        index, k, folder, away, taken = scope.index, scope.k, scope.folder, scope.away, scope.taken
        t0 = time.perf_counter()
        hits = self.searcher.search(scope, vector[None], centred=centred, exclude_ids=query_ids)
        search_ms = (time.perf_counter() - t0) * 1000
        rows = hits.rows[0]
        state = Results(vector, k, folder, label, source, ids=[r.id for r in rows], paths=hits.paths[0],
                        scores=[float(s) for s in hits.scores[0][: len(rows)]],
                        thumbs=[str(index.thumb_path(r)) if r.thumb else None for r in rows],
                        dates=[r.date for r in rows], exclude_folders=away, taken=taken,
                        taken_given=(taken_from or "", taken_to or ""), centred=centred, positives=positives,
                        negatives=negatives, query_ids=tuple(int(i) for i in query_ids),
                        photo_ids=tuple(int(i) for i in photo_ids))
        where = f" in `{display_path(folder)}/`" if folder else ""
        where += "".join(f" not in `{display_path(f)}/`" for f in away)
        if taken != (None, None):
            where += f" taken {taken_from or '…'} – {taken_to or '…'}"
        info = (f"**{len(rows)} results** for {state.heading()}{where} · embed {embed_ms:.0f} ms · search "
                f"{search_ms:.1f} ms · {len(index)} images")
        if query_ids:
            info += " · the query photos are left out" if centred else " · the photo itself is left out"
        weak = index.weak_below
        if weak is not None and state.scores and state.scores[0] < weak:
            info += (f" · **no close match in the collection** (the best scores {score_text(state.scores[0])}, "
                     f"under {score_text(weak)}, what unrelated photos of the collection reach)")
        return self._gallery(state), info, state

    def search(self, image: Any, k: int = 12, folder: str | None = None, exclude_folders: Sequence[str] = (),
               taken_from: str | None = None, taken_to: str | None = None) -> tuple:
        """Upload -> (gallery items, info markdown, state)."""
        scope = self.searcher.check(k, folder, exclude_folders, taken_from, taken_to)  # said before the model runs
        img = read_upload(image, self.embedder.resize)
        t0 = time.perf_counter()
        vector = self.embedder.embed(img)[0]  # D
        twins = self.upload_twins(image)  # the photo itself, when it is indexed: left out of its results
        return self.from_vector(vector, k, folder, "the uploaded image", (time.perf_counter() - t0) * 1000,
                                exclude_folders=exclude_folders, taken_from=taken_from, taken_to=taken_to,
                                query_ids=twins, photo_ids=twins, scope=scope)

    def upload_twins(self, *uploads: Any) -> list[int]:
        """Ids of the indexed photos with an upload's very bytes (uploads that are files; others match none)."""
        return self.searcher.twins(files=uploads)

    async def search_with(self, service: SearchService, image: Any, k: int = 12, folder: str | None = None,
                          exclude_folders: Sequence[str] = (), taken_from: str | None = None,
                          taken_to: str | None = None) -> tuple:
        """:meth:`search`, the upload embedded by ``service`` in a batch with whatever else arrives (the page's
        searches and the JSON API's alike); the results made off the event loop."""
        scope = service.check(k, folder, tuple(exclude_folders or ()), taken_from, taken_to)
        vector, embed_ms, twins = await service.embed_upload(image, scope)  # D
        return await asyncio.to_thread(self.from_vector, vector, k, folder, "the uploaded image", embed_ms, None,
                                       exclude_folders, taken_from, taken_to, query_ids=twins, photo_ids=twins,
                                       scope=scope)

    def rerun(self, state: Results | None, k: int, folder: str | None, exclude_folders: Sequence[str] = (),
              taken_from: str | None = None, taken_to: str | None = None) -> tuple:
        """The same query again with a new ``k``, folder filter or dates (nothing to do before a first search)."""
        if not state:
            raise UserError("upload a photo and press Search first")
        return self.from_vector(state.vector, k, folder, state.label, 0.0, state.source, exclude_folders,
                                taken_from, taken_to, state.centred, state.positives, state.negatives,
                                state.query_ids, state.photo_ids)

    def search_again(self, state: Results | None, more_like: Sequence[Any] = (), less_like: Sequence[Any] = (),
                     uploads: Sequence[Any] = (), avoid: Sequence[Any] = (), k: int = 12, folder: str | None = None,
                     exclude_folders: Sequence[str] = (), taken_from: str | None = None,
                     taken_to: str | None = None) -> tuple:
        """"More like these, less like those": the query shown, with the results ticked ``more_like`` (ids) and the
        photos ``uploads`` added to its photos, and ``less_like`` (ids) and ``avoid`` (uploads) to the photos it is to
        be less like, searched as one query of the index's space (:meth:`ImageIndex.query_vector`); the query's
        indexed photos (and indexed files with an upload's bytes) are left out of the results. Returns (gallery,
        info, state); the state keeps every photo, so a next round adds to them."""
        if not state:
            raise UserError("search with a photo first, then tick results to search again with them")
        more = [int(i) for i in more_like or ()]
        less = [int(i) for i in less_like or ()]
        uploads, avoid = [u for u in uploads or () if u], [u for u in avoid or () if u]
        both = sorted(set(more) & set(less))
        if both:
            raise UserError(f"photo {both[0]} is ticked both 'more like' and 'less like': untick one")
        if not (more or less or uploads or avoid):
            raise UserError("tick results under 'More like these' or 'Less like these' (or add photos), then search "
                            "again")
        scope = self.searcher.check(k, folder, exclude_folders, taken_from, taken_to)  # said before the model runs
        index = scope.index
        known = index.catalog.rows_by_id(more + less)
        gone = [i for i in more + less if i not in known or known[i].deleted or known[i].status != "ok"]
        if gone:
            raise UserError(f"photo {gone[0]} is no longer in the index: search again")
        t0 = time.perf_counter()
        images = [read_upload(u, self.embedder.resize) for u in uploads + avoid]
        feats = self.embedder.embed(images) if images else np.zeros((0, index.dim), np.float32)  # U x D
        embed_ms = (time.perf_counter() - t0) * 1000
        pos = [state.positives if state.positives is not None else state.vector[None], index.vectors(np.array(
            more, np.int64)) if more else None, feats[: len(uploads)]]
        neg = [state.negatives, index.vectors(np.array(less, np.int64)) if less else None, feats[len(uploads):]]
        positives = np.concatenate([x for x in pos if x is not None and len(x)])  # P x D
        negatives = np.concatenate([x for x in neg if x is not None and len(x)] or [np.zeros((0, index.dim),
                                                                                              np.float32)])  # N x D
        query = index.query_vector(positives, negatives)  # D, in the index's space
        ids = [*state.query_ids, *state.photo_ids, *([state.source["id"]] if state.source else []), *more, *less,
               *self.upload_twins(*uploads, *avoid)]
        label = f"{len(positives)} photos" + (f", less like {len(negatives)}" if len(negatives) else "")
        return self.from_vector(query, k, folder, label, embed_ms, None, exclude_folders, taken_from, taken_to,
                                centred=True, positives=positives, negatives=negatives if len(negatives) else None,
                                query_ids=sorted(set(ids)), photo_ids=sorted(set(ids)), scope=scope)

    def search_buttons(self, state: Results | None, image: Any = None, more_like: Sequence[Any] = (),
                       less_like: Sequence[Any] = (), uploads: Sequence[Any] = (), avoid: Sequence[Any] = ()
                       ) -> tuple[bool, bool, bool]:
        """Which of Search, More results and Search again with these can act now: Search with a photo given once the
        index is ready; More after a search whose last page was full (a shorter one was the last); Search again
        after a search, with results ticked or photos added."""
        ready = self.ready and self.index is not None
        more = (ready and state is not None and 0 < len(state.ids) < len(self.index)
                and len(state.ids) % state.k == 0)
        again = ready and state is not None and bool(more_like or less_like or uploads or avoid)
        return ready and image is not None, bool(more), again

    def tick_choices(self, state: Results | None) -> list[tuple[str, int]]:
        """The results shown as choices to tick ("rank. name", id), best first."""
        if not state:
            return []
        return [(f"{r}. {display_path(p).rsplit('/', 1)[-1]}", int(i))
                for r, (i, p) in enumerate(zip(state.ids, state.paths), 1)]

    def more(self, state: Results | None) -> tuple:
        """The next ``k`` results after those shown."""
        if not state:
            raise UserError("search first, then ask for more")
        index = self.ready_index()
        t0 = time.perf_counter()
        hits = index.search(state.vector[None], k=state.k, folder=state.folder, offset=len(state.ids),
                            exclude_folders=state.exclude_folders, taken=state.taken, centred=state.centred,
                            exclude_ids=state.query_ids)
        rows = hits.rows[0]
        dates = state.dates or [None] * len(state.ids)
        state = replace(state, ids=state.ids + [r.id for r in rows], paths=state.paths + hits.paths[0],
                        scores=state.scores + [float(s) for s in hits.scores[0][: len(rows)]],
                        thumbs=state.thumbs + [str(index.thumb_path(r)) if r.thumb else None for r in rows],
                        dates=dates + [r.date for r in rows])
        info = (f"**{len(state.ids)} results** for {state.heading()} · search "
                f"{(time.perf_counter() - t0) * 1000:.1f} ms" + ("" if rows else " · no more results"))
        return self._gallery(state), info, state

    def _result(self, state: Results | None, position: int) -> tuple[int, str]:
        if not state or not 0 <= int(position) < len(state.ids):
            raise UserError("that result is no longer on the page: search again")
        return state.ids[int(position)], state.paths[int(position)]

    def select(self, state: Results | None, position: int) -> tuple:
        """Search again with the result at ``position`` (its stored vector, no re-embedding), the photo itself left
        out of its results.

        Returns (gallery, info, state); the new state's ``source`` names the photo, which the page shows
        as the query and in the details panel.
        """
        image_id, path = self._result(state, position)
        index = self.ready_index()
        vector = index.vectors(np.array([image_id]))[0]  # D
        assert state is not None
        return self.from_vector(vector, state.k, state.folder, display_path(path), 0.0,
                                {"id": image_id, "path": path}, state.exclude_folders, *state.taken_given,
                                query_ids=[image_id], photo_ids=[image_id])

    def search_id(self, image_id: int, k: int = 12, folder: str | None = None, exclude_folders: Sequence[str] = (),
                  taken_from: str | None = None, taken_to: str | None = None) -> tuple:
        """Search with an indexed photo (a point of the map, a photo of a theme): its stored vector, no
        re-embedding, the photo itself left out of its results. Returns (gallery, info, state) as :meth:`select`, the
        state's ``source`` naming the photo."""
        index = self.ready_index()
        row = index.catalog.rows_by_id([int(image_id)]).get(int(image_id))
        if row is None or row.deleted or row.status != "ok":
            raise UserError(f"photo id {image_id} is no longer in the index: draw the map again")
        vector = index.vectors(np.array([row.id]))[0]  # D
        return self.from_vector(vector, k, folder, display_path(row.path), 0.0, {"id": row.id, "path": row.path},
                                exclude_folders, taken_from, taken_to, query_ids=[row.id], photo_ids=[row.id])

    def details(self, image_id: int) -> dict[str, Any]:
        """An indexed photo for the details panel: full path, thumbnail, size, date, dimensions when readable."""
        index = self.ready_index()
        row = index.catalog.rows_by_id([int(image_id)]).get(int(image_id))
        if row is None or row.deleted:
            raise UserError(f"photo id {image_id} is no longer in the index: search again")
        when = datetime.datetime.fromtimestamp(row.mtime_ns / 1e9).strftime("%Y-%m-%d %H:%M")
        thumb = index.thumb_path(row)
        text = f"**{_path_html(display_path(row.path))}**\n\n{size_text(row.size)} · modified {when}"
        if row.date is not None:
            text += f" · taken {date_text(row.date).replace('T', ' ')[:16]}"
        if row.camera:
            text += f" · {html.escape(row.camera)}"
        preview: Any = str(thumb) if thumb else None
        try:  # a larger preview than the thumbnail, from the original (decoded reduced)
            with open_regular(index.root / row.path) as f, Image.open(f) as im:
                text += f" · {im.size[0]}×{im.size[1]} px"
            preview = load_rgb(index.root / row.path, min_short=PREVIEW_PX // 2)
            preview.thumbnail((PREVIEW_PX, PREVIEW_PX))
            if max(preview.size) < PREVIEW_PX // 2:  # a small photo, enlarged to be seen (whole pixels)
                scale = PREVIEW_PX // 2 // max(preview.size) + 1
                preview = preview.resize((preview.width * scale, preview.height * scale), Image.Resampling.NEAREST)
        except (OSError, UserError) as e:
            text += f" · the original cannot be read now ({getattr(e, 'strerror', None) or e}): thumbnail shown"
        full = str(index.root / row.path)
        return {"id": row.id, "path": row.path, "full_path": display_path(full), "thumb": str(thumb) if thumb else None,
                "preview": preview, "markdown": text}

    def close(self) -> None:
        """Remove the folder of result files (also done at exit, and when the app is collected)."""
        self._remove_files()

    @property
    def files_dir(self) -> Path:
        """The folder of the result files handed to the browser (see ``_KEEP_EXPORTS``)."""
        return self._files

    def _new_file(self, name: str) -> Path:
        """The path ``name`` in a new result folder, its place among the _KEEP_EXPORTS taken (the oldest go to make
        room): pass it to ``_keep`` once written, or to ``_discard`` if writing fails."""
        with self._lock:
            self._writing += 1
            self._evict(_clock(), keep_newest=False)
            folder = self._files / secrets.token_hex(8)  # served as it is: a name nobody else can guess
            try:
                folder.mkdir()
            except BaseException:
                self._writing -= 1
                raise
        return folder / name

    def _keep(self, newest: Path) -> None:
        """Count ``newest``'s folder (written) among the kept ones; remove the oldest past the caps, never it."""
        size, now = _folder_bytes(newest.parent), _clock()
        with self._lock:
            self._writing -= 1
            self._kept.append((newest.parent, size, now))
            self._kept_bytes += size
            self._evict(now, keep_newest=True)

    def _discard(self, path: Path) -> None:
        """Remove the folder of ``path`` (a result that could not be written whole) and give back its place."""
        shutil.rmtree(path.parent, ignore_errors=True)
        with self._lock:
            self._writing -= 1

    def _evict(self, now: float, keep_newest: bool) -> None:
        """(Under the lock.) Remove the oldest kept folders past _KEEP_EXPORTS folders (the kept and those being
        written), _KEEP_BYTES bytes or _KEEP_S seconds; ``keep_newest``: never the last kept (each search pays for
        its own folder only, whatever the number kept)."""
        while len(self._kept) > keep_newest and (len(self._kept) + self._writing > _KEEP_EXPORTS
                                                 or self._kept_bytes > _KEEP_BYTES or now - self._kept[0][2] > _KEEP_S):
            old, old_size, _ = self._kept.popleft()
            self._kept_bytes -= old_size
            shutil.rmtree(old, ignore_errors=True)

    def original(self, image_id: int) -> str:
        """A copy of an indexed photo's original file for the page (the originals folder itself is never served),
        under :meth:`open_original`'s rules. Gradio copies it into its own cache before the page is answered."""
        f, _, name = self.open_original(image_id)
        try:
            with f:
                out = self._new_file(name)
                try:
                    with open(out, "wb") as dst:
                        shutil.copyfileobj(f, dst, 1 << 20)
                except BaseException:
                    self._discard(out)
                    raise
            self._keep(out)
        except OSError as e:
            raise UserError(f"{name} cannot be read now ({e.strerror or e}): run `moco index update`") from None
        return str(out)

    def export(self, state: Results | None) -> tuple[str, str]:
        """The results shown, as CSV and JSON files (rank, path, score, weak, id): their paths.

        Scores as the page shows them (3 decimals), ``weak_match`` as true/false in both files.
        """
        if not state or not state.ids:
            raise UserError("search first: there are no results to export")
        weak = self.index.weak_below if self.index is not None else None
        dates = state.dates or [None] * len(state.ids)
        rows = [{"rank": r, "path": display_path(p), "score": float(score_text(s)),
                 "weak_match": weak is not None and s < weak, "id": i, "taken": date_text(t)}
                for r, (i, p, s, t) in enumerate(zip(state.ids, state.paths, state.scores, dates), 1)]
        table = io.StringIO(newline="")
        writer = csv.DictWriter(table, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows({**{key: _csv_cell(value) for key, value in row.items()},  # text cells: never a formula
                          "score": score_text(row["score"]), "weak_match": str(row["weak_match"]).lower()}
                         for row in rows)
        whitened = " (whitened on the collection)" if self.index and self.index.whitened else ""
        meta = {"query": state.label, "folder": display_path(state.folder or ""), "k": state.k,
                "score": "centred cosine" + whitened, "weak_below": None if weak is None else float(score_text(weak))}
        text = json.dumps({**meta, "results": rows}, indent=1, ensure_ascii=False)
        csv_path = self._new_file("results.csv")  # both files are ready: the folder lives only while they are written
        json_path = csv_path.with_name("results.json")
        try:
            csv_path.write_text(table.getvalue(), encoding="utf-8", newline="")
            json_path.write_text(text, encoding="utf-8")
        except BaseException:
            self._discard(csv_path)
            raise
        self._keep(csv_path)
        return str(csv_path), str(json_path)

    # ------------------------------------------------------------------------------- negatives
    def negatives(self, image: Any, n: int = 12, seed: int = 0) -> NegativesView:
        """Upload -> the InfoNCE view of it."""
        self.ready_index()
        assert self.negatives_source is not None
        img = read_upload(image, max(256, self.embedder.resize))
        return self.negatives_source.compute(img, n=int(n), seed=int(seed))

    def negatives_for(self, image_id: int, n: int = 12, seed: int = 0) -> NegativesView:
        """The InfoNCE view of an indexed photo (from a search result: no upload)."""
        self.ready_index()
        assert self.negatives_source is not None
        return self.negatives_source.compute_for_id(int(image_id), n=int(n), seed=int(seed))

    # ------------------------------------------------------------------------------ collection
    def collection(self, threshold: float | None = None, similar: bool = False,
                   exclude_folders: str | Sequence[str] = "") -> tuple[str, list[Group]]:
        """(stats markdown, the groups of duplicates of the last search); ``threshold`` (the near one) searches again
        first, with similar groups when ``similar``, leaving out the photos under ``exclude_folders`` (a list, or
        one text of folders separated by commas)."""
        index = self.ready_index()
        st = index.stats()
        if threshold is not None:
            given = exclude_folders.split(",") if isinstance(exclude_folders, str) else exclude_folders
            away = tuple(f for f in (self.searcher.folder(g.strip(), "exclude_folders") for g in given if g.strip())
                         if f)
            self.duplicates.find(float(threshold), similar, away)
        dup = self.duplicates.saved()
        recall = st["recall_at_10"]
        weak = st.get("weak_below")
        text = [
            f"**{plural(st['vectors'], 'image')}** searchable · {st['error']} unreadable · {st['pending']} pending",
            f"**Index:** {st['kind']} ({st['factory'] or 'faiss'}, {st['params'] or 'exact'}) · measured "
            f"recall@10 {recall if recall is not None else 'n/a'} · {'GPU' if st['on_gpu'] else 'CPU'} · "
            f"{st['size_on_disk_bytes'] / 1e6:.1f} MB on disk",
            f"**Backbone:** {st['backbone_arch']} · sha256 `{str(st['backbone_sha256'])[:12]}…` · {st['dim']}-d",
            (f"**Scores:** cosine in the index's space ({st['space_description']}) · weak match under "
             f"{weak:.3f}" if weak is not None else "**Scores:** cosine"),
            f"**Collection:** `{display_path(st['root'])}` · updated {st['updated']}",
            f"**Near-duplicate threshold:** {st['dedup_threshold']} ({st['dedup_threshold_source']})",
        ]
        if index.edges_share:  # say plainly what a search of such a model rests on
            text.insert(3, f"**Model:** trained from scratch on few photos, too weak to trust alone: "
                           f"{index.edges_share:.0%} of each score is the photos' edge layout (light and dark "
                           "versions of one scene find each other), the rest the model's")
        groups: list[Group] = []
        if dup is None:
            text.append("_No search for duplicates yet: press Find duplicates below._")
        else:
            groups = list(dup.groups)
            kinds = dup.kinds if dup.kinds is not None else (NEAR,)  # a search of an older version: near groups
            counts = ", ".join(f"{sum(g.kind == k for g in groups)} {k}" for k in kinds)
            source = dup.threshold_source or ""
            text.append(f"**{plural(len(groups), 'group')} of duplicates** ({counts}) · near: every photo at centred "
                        "cosine ≥ "
                        f"{dup.threshold} to its group's representative{f' ({source})' if source else ''}"
                        + (f" · similar ≥ {dup.similar_threshold}" if SIMILAR in kinds else "")
                        + f" · found {dup.created}")
        return "\n\n".join(text), groups
