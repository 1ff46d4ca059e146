"""Which pairs of photos the pixel check (:mod:`index.duplicates.verify`) looks at: the candidates of copy detection.

Checking every pair is quadratic, so each photo puts forward a few others, from three searches:

- **the model**: its closest photo in the index's space (:data:`MODEL_FIRST`; a large photo's :data:`PROPOSE_K`), and
  the model's pairs at the near threshold (a re-encoded or resized copy);
- **whole pixels**: its closest photo by the NCC of their whole grey frames (:data:`PIXEL_DEPTH`),
  :data:`PIXEL_SIDE` a side, plain and mirrored (a brighter copy, which a model may not see as close);
- **crops**: the photo that could best have been cut from it (:data:`PIXEL_DEPTH`). Every photo's whole frame,
  shrunk to :data:`CROP_SIDE` a side, goes into one index (one vector a photo); each photo's windows at the crop
  shares the check tests (:data:`~index.duplicates.verify.SCALES` under 1) and at a few places each
  (:data:`CROP_GRIDS`), plain and mirrored, look up the whole frames closest to them by NCC, and their photos are
  its candidates. A crop is the one edit that moves every pixel of a small frame, and a model trained to see crops as
  the same scene puts a crop of a shirt beside every shirt. The windows are made and looked up a chunk of photos at a
  time: memory holds one vector a photo, never the windows of every photo (at 50,000 photos their 45 a photo were 2.25
  million vectors, 7 GB with their graph). The vectors of both pixel searches are made from the frames a chunk at a
  time too: only the indexes hold them (above :data:`PIXEL_EXACT_UP_TO` photos, one byte a dimension). Where the
  frames are a :class:`~index.duplicates.dedup_cache.FrameFile`, the windows and those vectors are kept on disk beside
  them, so a later search (after an update) reads them instead of making them again.

A copy of a photo is the first of one of the searches: on both choose splits of bench/dedup_scale.py (10,000
Fashion-MNIST photos, 30,000 smooth pictures), every planted copy of a small photo was the first of some search; what
the searches find further down is alike photos. Where a photo has several copies, they fill its first places: a
large photo's four copies scored 0.998-0.999 there and its 70% crop came fourth, so every neighbour a large photo's
search puts at :data:`PIXEL_ALIKE` or more (an NCC, or the model's cosine) is proposed too, and the first under it. A
small photo is seen whole at 8-16 pixels a side by its searches, where alike photos (two shirts) reach
:data:`PIXEL_ALIKE` as well: besides its first, only the neighbours that tie with the first (within
:data:`ALIKE_TIE`) are proposed. On Fashion-MNIST's choose split the others were nearly half the pairs checked and
brought one copy, a 2-pixel crop that tied with an alike garment (bench/NOTES.md, fifteenth session). The model's
pairs at the near threshold (its own measure of a copy, :mod:`index.calibrate`) are proposed however far down.
Each search keeps its :data:`PROPOSE_K` closest (the neighbours, for a later search to start from). Of a small
photo's, the model's second to fifth found no copy that the rest missed on either choose split (they were 26% and 39%
of the pairs), so they are not checked; a large photo's all are (a crop of a fine texture that no pixel search put
first was among them: bench/NOTES.md, fourteenth session).

The searches are exact (flat inner-product indexes) up to :data:`PIXEL_EXACT_UP_TO` photos and approximate above
(inverted files of one byte a dimension, :data:`IVF_PROBE` cells searched, :data:`CROP_PROBE` by a crop window).
Photos of the same bytes are never proposed: they are exact duplicates already. The pairs are kept as 64-bit keys
with their best proposal score.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Container, Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
from PIL import Image

from index.duplicates.verify import SCALES, Frame, unit_patches
from index.search.store import VectorStore

__all__ = ["proposals", "Proposed", "Neighbours", "ModelFound", "MODEL_DEPTH",
           "SOURCES", "LINKED", "MODEL", "pixel_neighbours", "crop_neighbours",
           "crop_windows", "crop_windows_of", "flats_of", "model_search", "PROPOSE_K", "PIXEL_DEPTH", "PIXEL_ALIKE",
           "ALIKE_TIE",
           "SOURCE_DEPTH", "MODEL_FIRST", "PIXEL_SIDE", "CROP_SIDE", "CROP_GRIDS", "CROP_WINDOWS", "crop_places",
           "crop_families", "family_heads", "family_crops", "FAMILY_GRIDS",
           "PIXEL_EXACT_UP_TO", "MODEL_EXACT_UP_TO"]

logger = logging.getLogger(__name__)

PROPOSE_K = 5  # each photo's closest photos by the model, by whole pixels and by crops are kept (the neighbours)
PIXEL_DEPTH = 1  # of those by whole pixels and by crops, this many go to the pixel check ...
MODEL_FIRST = 1  # ... and of the model's (besides its links at the near threshold) ...
PIXEL_ALIKE = 0.98  # ... besides every one at least this close by its search (a family of copies of one photo)
ALIKE_TIE = 0.001  # ... of a small photo's, only those this close to its first too (a tie at a few pixels a side)
SOURCE_DEPTH = (MODEL_FIRST, PIXEL_DEPTH, PIXEL_DEPTH, PIXEL_DEPTH, PIXEL_DEPTH)  # per search of SOURCES
LINKED = 2.0  # the proposal score of a pair the model links at the near threshold
MODEL = 1.5  # the proposal score of a pair among the model's k nearest (above any NCC)
SAME_BYTES_MARGIN = 8  # k-NN slots beyond k + 1 for photos with the same bytes (not other photos)
MODEL_DEPTH = PROPOSE_K + 1 + SAME_BYTES_MARGIN  # the model's closest photos a photo looks up (itself among them)
PIXEL_SIDE = 16  # pixels a side of the whole frames whose NCC proposes pairs
CROP_SIDE = 8  # pixels a side of the crop windows (and of the whole frames that look them up)
CROP_SHARES = tuple(s for s in SCALES if s < 1.0)  # the crop shares the pixel check tests ...
CROP_GRIDS = (1, 2, 3, 3, 3)  # ... and places a side for each one's windows, from corner to corner (1: the centre)
CROP_WINDOWS = sum(g * g for g in CROP_GRIDS)  # windows a photo, plain (as many mirrored)
FAMILY_GRIDS = (3, 5, 7, 10, 13)  # places a side of a crop family's search (:func:`family_crops`): a few pixels apart
PIXEL_EXACT_UP_TO = 20000  # photos: above, the pixel proposals come from approximate indexes (inverted files)...
MODEL_EXACT_UP_TO = PIXEL_EXACT_UP_TO  # photos: above, the model's closest photos too (on a flat index)...
FLAT_PAIRS = 1 << 28  # ... unless the queries are few: query-photo pairs an exact search scores (after an update)
IVF_CELLS_PER_ROOT = 4  # cells of an inverted file for n vectors: this many times sqrt(n)
IVF_PROBE = 16  # cells a query looks in
CROP_PROBE = 4  # ... a crop window's query (64 a photo: 4 cells kept every copy found with 8 at 100,000 photos)
KMEANS_ROUNDS = 10  # rounds of k-means that place an inverted file's cells (faiss's own default)
FLATS_AT_ONCE = 1024  # grey frames shrunk at once (2 B a pixel of temporaries: 2 MB)
INDEX_ADD = 16384  # vectors made and added to a pixel search's index at once (their frames read at once: 38 MB)
WINDOW_BATCH = 16  # photos whose crop windows are made at once (8-16 the fastest on 20,000 frames; 32: 7% slower)

Apart = Callable[[np.ndarray, np.ndarray], np.ndarray]  # (A ids, B ids) -> A x B bools: which were taken apart
SOURCES = ("model", "pixels", "pixels mirrored", "crops", "crops mirrored")  # a photo's searches, in this order
_MODEL_SOURCE = 0


@dataclass
class Neighbours:
    """Each photo's closest other photos by each search (:data:`SOURCES`), the best first: the proposals, kept so that
    a later search looks up only what changed (:func:`proposals` ``before``)."""

    ids: np.ndarray  # N photo ids
    near: np.ndarray  # N x len(SOURCES) x k photo ids, -1 where a search found fewer
    scores: np.ndarray  # N x len(SOURCES) x k float32: the model's cosine, or the NCC

    @classmethod
    def empty(cls, ids: np.ndarray, k: int) -> Neighbours:
        n = len(ids)
        return cls(np.asarray(ids, np.int64), np.full((n, len(SOURCES), k), -1, np.int64),
                   np.full((n, len(SOURCES), k), -np.inf, np.float32))


@dataclass
class ModelFound:
    """Each photo's :data:`MODEL_DEPTH` closest photos by the model, found among all (the same search the proposals
    make): made once where the model's links are found (:func:`index.duplicates.dedup.search_duplicates`)."""

    ids: np.ndarray  # M photo ids
    near: np.ndarray  # M x MODEL_DEPTH photo ids, -1 where fewer
    sims: np.ndarray  # M x MODEL_DEPTH float32 cosines


@dataclass
class Proposed:
    """What :func:`proposals` found: the pairs, each one's best proposal score, every photo's neighbours, and how many
    photos were searched among all (the rest only among the photos new since ``before``)."""

    pairs: np.ndarray  # P x 2 ids, a < b, sorted
    scores: np.ndarray  # P
    neighbours: Neighbours
    searched: int


def proposals(store: VectorStore, ids: np.ndarray, vecs: np.ndarray, content: Mapping[int, int],
              frames_: Mapping[int, Frame], links: Mapping[int, Mapping[int, float]], chunk: int = 1024,
              k: int = PROPOSE_K, step: Callable[[int], object] | None = None,
              before: Neighbours | None = None, found: ModelFound | None = None,
              apart: Apart | None = None, large: Container[int] = ()) -> Proposed:
    """The pairs of photos with other bytes that the pixel check looks at (P x 2 ids, a < b, sorted, each pair once;
    8 bytes a pair in all): the ``links`` (the model's, at the near threshold), each photo's ``k`` closest other
    photos by the model (``vecs``: N x D in the index's space, searched in ``store``), by whole pixels
    (:func:`pixel_neighbours`) and the ``k`` that could be cut from it (:func:`crop_neighbours`), of each search the
    first :data:`SOURCE_DEPTH` (at most ``k``; all ``k`` of the model's for a photo of ``large``) and those at
    :data:`PIXEL_ALIKE` or more (of a photo not in ``large``, only those within :data:`ALIKE_TIE` of its first too,
    and no first under them); and each pair's best
    proposal score (:data:`LINKED`, :data:`MODEL`, or an NCC: only the pixel searches put it forward). The neighbours
    found are all ``k`` of each search.

    ``before``: the neighbours an earlier search found, of the photos that are as they were then (the same version,
    with or without a frame as now; :class:`~index.duplicates.dedup_cache.NeighbourFile`). A photo whose neighbours
    there are all still here is looked up only among the photos that were not: its neighbours are its earlier ones
    and those new photos, the best ``k`` (a few new photos are all scored at once by matrix products, and only those
    at its ``k``-th earlier neighbour or more are kept: the others change nothing); the others (new, or one of their
    neighbours gone or changed) are looked up among all. An exact search (flat indexes) gives the same neighbours
    either way. ``found``: the model's closest photos of some photos, found among all already (not searched again;
    ``k`` of :data:`PROPOSE_K`). ``apart(a, b)``: which photos of ``a`` were taken apart from which of ``b`` (A x B
    bools, :meth:`index.duplicates.captures.Captures.apart`): a photo that was there before does not score the new
    photos it was taken apart from (their pair is never checked). ``large``: the photos whose frames are shrunk
    from many more pixels (:data:`~index.duplicates.verify.FINE_MIN` a side or more), whose crops and fine textures
    the pixel searches see at a few pixels a side: the model's closest photos are their crops' best source.
    ``step(n)``: called as the searches go, 5 for each photo in all (a progress bar)."""
    step = step or (lambda n: None)
    live = set(ids.tolist())
    pos = {int(i): n for n, i in enumerate(ids.tolist())}
    out = Neighbours.empty(ids, k)
    known: set[int] = set()
    clean: set[int] = set()
    if before is not None and len(before.ids) and k == before.near.shape[2]:
        was = np.flatnonzero(np.isin(before.ids, ids))  # W: rows of before of photos still here
        known = set(before.ids[was].tolist())
        near = before.near[was].reshape(len(was), -1)  # W x (S * k)
        kept = was[((near < 0) | np.isin(near, before.ids[was])).all(axis=1)]  # every neighbour still here
        clean = set(before.ids[kept].tolist())
        at = np.array([pos[int(i)] for i in before.ids[kept].tolist()], np.int64)
        out.near[at], out.scores[at] = before.near[kept], before.scores[kept]
    added = [int(i) for i in ids if int(i) not in known]  # looked up by the clean photos
    dirty = [int(i) for i in ids if int(i) not in clean]  # looked up among all

    def keep(i: int, source: int, row: Sequence[int], sims: Sequence[float]) -> None:
        n = pos[i]
        if i in clean and (not len(row) or max(row) < 0):  # no new photo comes before its earlier neighbours
            return
        got = [(j, s) for j, s in zip(row, sims) if j >= 0 and j != i and j in live and content[i] != content[j]]
        if i in clean:  # its earlier neighbours and the new ones: the best k, each photo once
            got += [(j, s) for j, s in zip(out.near[n, source].tolist(), out.scores[n, source].tolist()) if j >= 0]
            got.sort(key=lambda t: -t[1])
            seen: set[int] = set()
            got = [(j, s) for j, s in got if not (j in seen or seen.add(j))]  # type: ignore[func-returns-value]
        got = got[:k]
        out.near[n, source], out.scores[n, source] = -1, -np.inf
        out.near[n, source, : len(got)] = [j for j, _ in got]
        out.scores[n, source, : len(got)] = [s for _, s in got]

    depth = k + 1 + SAME_BYTES_MARGIN
    row_of = ({int(i): n for n, i in enumerate(found.ids.tolist())}
              if found is not None and depth == MODEL_DEPTH else {})
    for queries, among in ((dirty, None), (sorted(clean), added)):
        if not queries or (among is not None and not among):  # no photo to look up, or nothing new to look up
            step(len(queries))  # (and no exact index of the new photos' vectors: all of them, in a first search)
            continue
        search = store.search if among is None else _flat_search(vecs[[pos[j] for j in among]], among)
        for start in range(0, len(queries), chunk):
            part = queries[start : start + chunk]
            at = np.array([row_of.get(i, -1) if among is None else -1 for i in part], np.int64)  # B: in found
            miss = np.flatnonzero(at < 0)
            if len(miss) == len(part):
                sims, near = search(np.ascontiguousarray(vecs[[pos[i] for i in part]]), depth)  # B x depth
            else:  # found already (the same search), the rest searched
                sims, near = found.sims[np.maximum(at, 0)], found.near[np.maximum(at, 0)]  # B x depth
                if len(miss):
                    sims[miss], near[miss] = search(np.ascontiguousarray(vecs[[pos[part[n]] for n in miss]]), depth)
            if among is not None:  # a new photo under a clean photo's k-th earlier neighbour changes nothing
                near = np.where(sims >= out.scores[[pos[i] for i in part], _MODEL_SOURCE, k - 1][:, None], near, -1)
            for i, row, sim in zip(part, near.tolist(), sims.tolist()):
                keep(i, _MODEL_SOURCE, row, sim)
            step(len(part))

    def kth(first: int) -> Callable[[int, bool], float]:
        """A clean photo's k-th earlier neighbour by search ``first`` (+1 mirrored): a new photo under it changes
        nothing (among all, every neighbour found counts)."""
        return lambda photo, mirrored: float(out.scores[pos[photo], first + mirrored, k - 1])

    have = {int(i) for i in ids if int(i) in frames_}
    step(4 * (len(ids) - len(have)))
    for queries, among, anew in (([i for i in dirty if i in have], sorted(have), True),
                                 ([i for i in sorted(clean) if i in have], [i for i in added if i in have], False)):
        if len(have) < 2 or k == 0 or not queries or not among:
            step(4 * len(queries))
            continue
        for i, flip, row, sims in pixel_neighbours(queries, frames_, depth, chunk, among, None if anew else kth(1),
                                                   None if anew else apart):
            keep(i, 1 + flip, row, sims)
            step(1)
        for i, flip, row, sims in crop_neighbours(queries, frames_, k + SAME_BYTES_MARGIN, chunk, among,
                                                  None if anew else kth(3), None if anew else apart):
            keep(i, 3 + flip, row, sims)
            step(1)
    gathered = _Pairs()
    for i, nb in links.items():
        others = [j for j in nb if j in live and content[i] != content[j]]
        gathered.add(i, others, [LINKED] * len(others))
    for start in range(0, len(ids), 65536):
        a = np.broadcast_to(out.ids[start : start + 65536, None, None], out.near[start : start + 65536].shape)
        b = out.near[start : start + 65536]  # B x S x k
        score = out.scores[start : start + 65536].copy()  # B x S x k
        alike = score >= PIXEL_ALIKE  # B x S x k: a copy of the photo by the pixels alone, nearly
        below = (b >= 0) & ~alike
        before = np.cumsum(below, axis=2) - below  # B x S x k: the neighbours before this one that are not
        big = np.array([int(i) in large for i in out.ids[start : start + 65536].tolist()], bool)  # B
        depth = np.repeat(np.minimum(np.asarray(SOURCE_DEPTH), k)[None], len(b), axis=0)  # B x S
        depth[big, _MODEL_SOURCE] = k
        tie = alike & (score >= score[:, :, :1] - ALIKE_TIE)  # B x S x k: as close as the first, nearly
        first = np.arange(b.shape[2])[None, None, :] < depth[:, :, None]  # B x S x k
        there = (b >= 0) & np.where(big[:, None, None], (before < depth[:, :, None]) | alike,  # a large photo's
                                    first | tie)  # B x S x k; a small photo's: its first and their ties
        score[:, _MODEL_SOURCE] = MODEL
        gathered.add_keys((np.minimum(a, b)[there] << 32) | np.maximum(a, b)[there], score[there])
    pairs, scores = gathered.pairs()
    return Proposed(pairs, scores, out, len(dirty))


def _cut(nb: Neighbours, large: Container[int], copies: Container[tuple[int, int]]) -> np.ndarray:
    """N x 2 bools: which crop search of each photo (plain, mirrored) found a copy first (a pair of ``copies``:
    verified), for the photos of ``large``."""
    crops = SOURCES.index("crops")
    verified = np.array(sorted((a << 32) | b for a, b in copies), np.int64)  # V keys: the verified pairs, few
    big = np.fromiter((int(i) in large for i in nb.ids.tolist()), bool, len(nb.ids))  # N
    out = np.zeros((len(nb.ids), 2), bool)  # N x 2
    for flip in (0, 1) if nb.near.shape[2] and len(verified) else ():  # (k = 0: nothing kept)
        first = nb.near[:, crops + flip, 0]  # N
        a, b = np.minimum(nb.ids, first), np.maximum(nb.ids, first)  # N, N
        out[:, flip] = big & (first >= 0) & np.isin((a << 32) | b, verified)
    return out


def family_heads(nb: Neighbours, large: Container[int], copies: Container[tuple[int, int]]) -> np.ndarray:
    """The photos of ``large`` whose crop search (plain or mirrored) found a copy first (a pair of ``copies``:
    verified), sorted (H ids): photos known to be cut, whose other crops :func:`crop_families` and
    :func:`family_crops` look for."""
    return np.sort(nb.ids[_cut(nb, large, copies).any(axis=1)])


def crop_families(nb: Neighbours, large: Container[int], copies: Container[tuple[int, int]]) -> np.ndarray:
    """The pairs (P x 2 ids, a < b, sorted, each once) of each photo of ``large`` with every other photo one of its
    crop searches found (plain or mirrored), where the first that search found is a copy of it (a pair of
    ``copies``: verified). The crops of a large photo meet its crop windows at a few pixels a side the less well the
    more they are cut, so the least cut comes first and the others of the family come under the depth the
    proposals take, among alike photos (bench/NOTES.md, eighteenth session). Only where a copy was verified: a
    library of large photos gets no more pairs for the photos without one."""
    crops = SOURCES.index("crops")
    family = _Pairs()
    for r, flip in zip(*np.nonzero(_cut(nb, large, copies))):
        i = int(nb.ids[r])
        others = [o for o in nb.near[r, crops + flip, 1:].tolist() if o >= 0 and o != i]
        family.add(i, others, [0.0] * len(others))
    return family.pairs()[0]  # P x 2


def family_crops(heads: Sequence[int], frames_: Mapping[int, Frame], targets: Sequence[int],
                 k: int = PROPOSE_K + SAME_BYTES_MARGIN, chunk: int = 64,
                 step: Callable[[int], object] | None = None) -> np.ndarray:
    """The pairs (P x 2 ids, a < b, sorted, each once) of each photo of ``heads`` (:func:`family_heads`) with the
    ``k`` photos of ``targets`` that could best have been cut from it by a search of its windows at
    :data:`FAMILY_GRIDS` places a side (plain and mirrored): :func:`crop_neighbours`, its windows a few pixels of the
    photo's image apart instead of a third of the free side. A crop cut at another place than the proposals' places
    meets their windows a fraction of a cell off, and a large photo's texture at :data:`CROP_SIDE` pixels a side does
    not forgive it: alike photos come before it (bench/NOTES.md, nineteenth session). Eleven times the windows: for
    the few photos known to be cut, not for every photo. ``step(1)``: after each photo's search, plain and mirrored
    (a progress bar)."""
    family = _Pairs()
    have = [int(i) for i in heads if int(i) in frames_]
    for i, _, row, _ in crop_neighbours(have, frames_, k, chunk, [t for t in targets if t in frames_],
                                        grids=FAMILY_GRIDS) if have else ():
        family.add(i, row, [0.0] * len(row))
        if step is not None:
            step(1)
    return family.pairs()[0]  # P x 2


def model_search(store: VectorStore, ids: np.ndarray, vecs: np.ndarray, queries: int
                 ) -> Callable[[np.ndarray, int], tuple[np.ndarray, np.ndarray]]:
    """The search that finds the model's closest photos of ``queries`` photos among ``ids`` (``vecs``: N x D, in the
    index's space): ``search(queries, k)`` gives (Q x k cosines, the best first; Q x k photo ids, -1 where fewer).
    The index's own search where it is approximate already, on a GPU, or where an exact search of the queries costs
    little (as :func:`_inner_product_index` decides); otherwise an inverted file of the vectors of its own (an exact
    search of every photo among all grows with the square of the photos), whose candidates are scored exactly: the
    cosines are the index's, only a neighbour may be missed (figures: bench/NOTES.md, fifteenth session)."""
    n = len(ids)
    if store.kind != "flat" or store.on_gpu or n <= MODEL_EXACT_UP_TO or n * queries <= FLAT_PAIRS:
        return store.search
    ivf = _inner_product_index(lambda start, stop: vecs[start:stop], n, vecs.shape[1], "model", queries)
    lookup = np.asarray(ids, np.int64)

    def search(q: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        _, at = ivf.search(q, k)  # Q x k places, -1 where fewer
        sims = np.einsum("qd,qkd->qk", q, vecs[np.maximum(at, 0)])  # Q x k exact cosines
        sims[at < 0] = -np.inf
        order = np.argsort(-sims, axis=1, kind="stable")  # Q x k
        at, sims = np.take_along_axis(at, order, 1), np.take_along_axis(sims, order, 1)
        return sims.astype(np.float32), np.where(at >= 0, lookup[np.maximum(at, 0)], -1)
    return search


def _flat_search(vectors: np.ndarray,
                 ids: Sequence[int]) -> Callable[[np.ndarray, int], tuple[np.ndarray, np.ndarray]]:
    """An exact inner-product search among ``vectors`` (M x D) of photos ``ids``: ``search(queries, k)`` gives
    (Q x k scores, Q x k photo ids, -1 where fewer)."""
    import faiss

    flat = faiss.IndexFlatIP(vectors.shape[1])
    if len(ids):
        flat.add(np.ascontiguousarray(vectors, np.float32))
    lookup = np.asarray(ids, np.int64)

    def search(queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        sims, at = flat.search(queries, max(1, min(k, len(ids))))  # Q x k
        return sims, np.where(at >= 0, lookup[np.maximum(at, 0)] if len(ids) else -1, -1)
    return search


class _Pairs:
    """Pairs of ids gathered as 64-bit keys (a << 32 | b, a < b) with their best proposal score, made unique now and
    then: memory of 12 bytes a distinct pair."""

    def __init__(self) -> None:
        self._keys, self._scores = np.empty(0, np.int64), np.empty(0, np.float32)
        self._new: list[int] = []
        self._new_scores: list[float] = []

    def add(self, i: int, others: Sequence[int], scores: Sequence[float]) -> None:
        self._new.extend((min(i, j) << 32) | max(i, j) for j in others)
        self._new_scores.extend(scores)
        if len(self._new) > 1 << 22:
            self._merge()

    def add_keys(self, keys: np.ndarray, scores: np.ndarray) -> None:
        """Add pairs given as keys (a << 32 | b, a < b) with their scores."""
        self._new.extend(keys.tolist())
        self._new_scores.extend(scores.tolist())
        if len(self._new) > 1 << 22:
            self._merge()

    def _merge(self) -> None:
        keys = np.concatenate([self._keys, np.array(self._new, np.int64)])
        scores = np.concatenate([self._scores, np.array(self._new_scores, np.float32)])
        order = np.lexsort((-scores, keys))  # by key, the best score first
        keys, scores = keys[order], scores[order]
        first = np.ones(len(keys), bool)
        first[1:] = keys[1:] != keys[:-1]
        self._keys, self._scores = keys[first], scores[first]
        self._new, self._new_scores = [], []

    def pairs(self) -> tuple[np.ndarray, np.ndarray]:
        """The distinct pairs, sorted (P x 2), and each one's best proposal score (P)."""
        self._merge()
        return np.stack([self._keys >> 32, self._keys & 0xFFFFFFFF], axis=1), self._scores


def _inner_product_index(vectors: Callable[[int, int], np.ndarray], n: int, dim: int, what: str,
                         queries: int, probe: int = IVF_PROBE):  # -> faiss.Index
    """An inner-product index of ``n`` vectors of ``dim``, made ``vectors(start, stop)`` a chunk at a time (so they
    are never all held): flat (exact) up to :data:`PIXEL_EXACT_UP_TO`, or where ``queries`` are few (a flat search
    of them scores at most :data:`FLAT_PAIRS`); otherwise an inverted file of at most
    :data:`IVF_CELLS_PER_ROOT` x sqrt(n) cells searched ``probe`` at a time, one byte a dimension (8-bit
    scalar quantizer): a quarter of the vectors' own memory, and a query's cost grows with the root of their
    number. Fewer cells where the queries are few (after an update): those that make training and searching
    cheapest, ``(queries x probe x n / (128 x KMEANS_ROUNDS))^(1/3)`` (each query then looks at a larger share
    of the vectors)."""
    import faiss

    if n <= PIXEL_EXACT_UP_TO or n * queries <= FLAT_PAIRS:
        store = faiss.IndexFlatIP(dim)
    else:
        # k-means on 64 vectors a cell costs 64 c^2 a round, the queries q (c + probe n / c): least at this c
        cheapest = np.cbrt(queries * probe * n / (128 * KMEANS_ROUNDS))
        cells = max(1, min(n // 39, int(IVF_CELLS_PER_ROOT * np.sqrt(n)), int(cheapest)))
        quantizer = faiss.IndexFlatIP(dim)
        store = faiss.IndexIVFScalarQuantizer(quantizer, dim, cells, faiss.ScalarQuantizer.QT_8bit,
                                              faiss.METRIC_INNER_PRODUCT)
        store.cp.niter = KMEANS_ROUNDS
        step = max(1, n // (64 * cells))  # k-means on at most 64 vectors a cell, spread over all of them
        sample = np.concatenate([vectors(start, min(start + step * 4096, n))[::step]
                                 for start in range(0, n, step * 4096)])
        store.train(np.ascontiguousarray(sample))
        store.nprobe = min(cells, probe)
        logger.info("%s proposals: an inverted file of %d vectors in %d cells", what, n, cells)
    for start in range(0, n, INDEX_ADD):
        store.add(np.ascontiguousarray(vectors(start, min(start + INDEX_ADD, n))))
    return store


def flats_of(greys: np.ndarray, side: int) -> np.ndarray:
    """:func:`_flat` of many grey frames at once (N x SIDE x SIDE uint8, SIDE a multiple of ``side``; not mirrored):
    N x side^2. PIL's box filter shrinks rows, then columns, each pass rounded to 8 bits (half up), and so does
    this, in integers (the same numbers as PIL's), :data:`FLATS_AT_ONCE` frames at a time (its temporaries stay
    small)."""
    f = greys.shape[1] // side
    out = np.empty((len(greys), side * side), np.float32)  # N x side^2
    for start in range(0, len(greys), FLATS_AT_ONCE):
        g = greys[start : start + FLATS_AT_ONCE]  # B x SIDE x SIDE
        x = g[:, :, 0::f].astype(np.uint16)  # B x SIDE x side: each row's sums of f pixels
        for j in range(1, f):
            x += g[:, :, j::f]
        x = (2 * x + f) // (2 * f)  # the mean, rounded half up
        y = x[:, 0::f, :].copy()  # B x side x side: each column's sums of f of those
        for j in range(1, f):
            y += x[:, j::f, :]
        y = ((2 * y + f) // (2 * f)).reshape(len(g), -1).astype(np.float32)  # B x side^2
        y -= y.mean(axis=1, keepdims=True)
        out[start : start + len(g)] = y / np.maximum(np.linalg.norm(y, axis=1, keepdims=True), 1e-6)
    return out


def _greys(frames_: Mapping[int, Frame], ids: Sequence[int]) -> np.ndarray:
    """The grey frames of photos ``ids`` (N x SIDE x SIDE uint8), read at once where ``frames_`` can
    (:meth:`~index.duplicates.dedup_cache.FrameFile.greys`)."""
    bulk = getattr(frames_, "greys", None)
    if bulk is not None:
        return bulk(ids)
    return np.stack([frames_[i].grey for i in ids]) if len(ids) else np.zeros((0, 1, 1), np.uint8)


def _images(frames_: Mapping[int, Frame], ids: Sequence[int]) -> list[np.ndarray]:
    """The grey images of photos ``ids`` (h x w uint8 each), read at once where ``frames_`` can
    (:meth:`~index.duplicates.dedup_cache.FrameFile.images`)."""
    bulk = getattr(frames_, "images", None)
    if bulk is not None:
        return bulk(ids)
    return [np.asarray(frames_[i].image, np.uint8) for i in ids]


def _flat_frames(frames_: Mapping[int, Frame], ids: Sequence[int], side: int) -> np.ndarray:
    """:func:`flats_of` the grey frames of photos ``ids`` (N x side^2), as ``frames_`` keeps them where it does
    (:meth:`~index.duplicates.dedup_cache.FrameFile.flats`: the same numbers, not made again for each search)."""
    kept = getattr(frames_, "flats", None)
    if kept is not None and side in (PIXEL_SIDE, CROP_SIDE):
        return kept(ids, side)
    return flats_of(_greys(frames_, ids), side)


def _windows(frames_: Mapping[int, Frame], ids: Sequence[int], grids: tuple[int, ...] = CROP_GRIDS) -> np.ndarray:
    """:func:`crop_windows_of` photos ``ids`` (B x W x CROP_SIDE^2), as ``frames_`` keeps them where it does
    (:meth:`~index.duplicates.dedup_cache.FrameFile.windows`: the same numbers, not made again for each search)."""
    kept = getattr(frames_, "windows", None)
    if kept is not None and grids == CROP_GRIDS:
        return kept(ids)
    return crop_windows_of(_images(frames_, ids), grids)


def _flat(grey: np.ndarray, side: int, mirror: bool) -> np.ndarray:
    """A frame shrunk to ``side`` a side (box filter), mirrored or not, less its mean, over its norm: side^2."""
    g = np.asarray(Image.fromarray(grey).resize((side, side), Image.Resampling.BOX), np.float32)
    g = (g[:, ::-1] if mirror else g).ravel()
    g = g - g.mean()
    return g / max(float(np.linalg.norm(g)), 1e-6)


def pixel_neighbours(ids: Sequence[int], frames_: Mapping[int, Frame], k: int, chunk: int = 1024,
                     targets: Sequence[int] | None = None, floor: Callable[[int, bool], float] | None = None,
                     apart: Apart | None = None) -> Iterable[tuple[int, bool, list[int], list[float]]]:
    """For each photo of ``ids``, twice (its query plain, then mirrored: the flag), its ``k`` closest photos of
    ``targets`` (None: ``ids``) by the NCC of their whole grey frames (shrunk to :data:`PIXEL_SIDE` a side), and
    those NCCs; none where the closest is under ``floor(photo, mirrored)``. With a ``floor`` (a few targets, scored at
    once), ``apart``: targets taken apart from a photo are not its neighbours (:func:`_columns`)."""
    targets = ids if targets is None else targets

    def plain(among: Sequence[int], start: int, stop: int) -> np.ndarray:  # (stop - start) x P^2
        return _flat_frames(frames_, among[start:stop], PIXEL_SIDE)

    if not len(targets):
        return
    if floor is not None and len(targets) <= PIXEL_EXACT_UP_TO:  # a few new photos: every score, at once
        few = plain(targets, 0, len(targets))  # M x P^2
        for start in range(0, len(ids), chunk):
            cols, away = _columns(ids[start : start + chunk], targets, apart)  # C, B x M
            if not len(cols):  # every target taken apart from every photo here
                for flip in (False, True):
                    yield from ((me, flip, [], []) for me in ids[start : start + chunk])
                continue
            part = plain(ids, start, start + chunk)  # B x P^2
            mirrored = part.reshape(-1, PIXEL_SIDE, PIXEL_SIDE)[:, :, ::-1].reshape(len(part), -1)  # B x P^2
            for flip, q in ((False, part), (True, mirrored)):
                yield from _over_floor(ids[start : start + chunk], flip, _spread(q @ few[cols].T, cols, len(targets)),
                                       floor, targets, k, away=away)  # B x M
        return
    store = _inner_product_index(lambda a, b: plain(targets, a, b), len(targets), PIXEL_SIDE**2, "whole-pixel",
                                 2 * len(ids))
    k = min(k, len(targets))
    for start in range(0, len(ids), chunk):
        part = plain(ids, start, start + chunk)  # B x P^2
        mirrored = part.reshape(-1, PIXEL_SIDE, PIXEL_SIDE)[:, :, ::-1].reshape(len(part), -1)  # B x P^2
        for flip, q in ((False, part), (True, np.ascontiguousarray(mirrored))):
            sims, found = store.search(q, k)  # B x k
            for n, (row, sim) in enumerate(zip(found.tolist(), sims.tolist())):
                if floor is not None and sim[0] < floor(ids[start + n], flip):
                    yield ids[start + n], flip, [], []
                    continue
                yield (ids[start + n], flip, [targets[j] for j in row if j >= 0],
                       [s for j, s in zip(row, sim) if j >= 0])


def _over_floor(part: Sequence[int], flip: bool, scores: np.ndarray, floor: Callable[[int, bool], float],
                targets: Sequence[int], k: int, crops: bool = False, away: np.ndarray | None = None
                ) -> Iterable[tuple[int, bool, list[int], list[float]]]:
    """For each photo of ``part`` (its ``scores`` with ``targets``: B x M), the ``k`` best at its ``floor`` or more
    (the best first; ties: the first target first) and those scores, none where ``away`` (B x M: taken apart); for
    ``crops``, only scores above 0, the photo itself left out."""
    floors = np.array([floor(me, flip) for me in part], np.float32)  # B
    keep = scores >= floors[:, None]  # B x M
    if away is not None:
        keep &= ~away
    if crops:
        keep &= (scores > 0.0) & (np.asarray(targets)[None, :] != np.asarray(part)[:, None])
    some = keep.any(axis=1)  # B: the photos with a new neighbour
    for n, me in enumerate(part):
        if not some[n]:
            yield me, flip, [], []
            continue
        at = np.flatnonzero(keep[n])
        at = at[np.argsort(-scores[n, at], kind="stable")[:k]]
        yield me, flip, [targets[j] for j in at.tolist()], scores[n, at].tolist()


def crop_windows(f: Frame) -> np.ndarray:
    """A photo's crop windows: at each share of :data:`CROP_SHARES` (of both sides: the photo's shape kept) and at
    G x G places from corner to corner (G of :data:`CROP_GRIDS`; one: the centre), the window's mean grey over each
    cell of a :data:`CROP_SIDE` x :data:`CROP_SIDE` grid of its image (exact: a pixel cut by a cell's edge counts by
    its share inside), less its mean, over its norm (a flat window is all zero, and matches nothing):
    :data:`CROP_WINDOWS` x CROP_SIDE^2, a share's places row by row. The places of a share near 1 lie within a
    fraction of a cell of each other (the nine of 0.96 within a third of one), so it needs fewer of them."""
    return crop_windows_of([np.asarray(f.image, np.uint8)])[0]


def crop_windows_of(images: Sequence[np.ndarray], grids: tuple[int, ...] = CROP_GRIDS) -> np.ndarray:
    """:func:`crop_windows` of several photos from their grey images (h x w uint8 each: a
    :attr:`~index.duplicates.verify.Frame.image`): B x W x CROP_SIDE^2 (W: the squares of ``grids`` summed, a share's
    places a side each). A window's cells are products of the image with the rows' and the columns' weights
    (:func:`_cell_weights`), the images of one size :data:`WINDOW_BATCH` at a time (the same numbers as one at a
    time)."""
    windows = sum(g * g for g in grids)
    out = np.empty((len(images), windows, CROP_SIDE**2), np.float32)  # B x W x S^2
    by_size: dict[tuple[int, int], list[int]] = {}
    for n, img in enumerate(images):
        by_size.setdefault(img.shape, []).append(n)
    s = CROP_SIDE
    for (h, w), group in by_size.items():
        weights = _cell_weights(h, w, grids)  # a share's (G*S x h, G*S x w)
        for start in range(0, len(group), WINDOW_BATCH):
            part = group[start : start + WINDOW_BATCH]
            grey = np.stack([images[n] for n in part]).astype(np.float32)  # B' x h x w
            shares = []
            for (r, c), g in zip(weights, grids):
                cells = r @ grey @ c.T  # B' x G*S x G*S: every row place's cells by every column place's
                shares.append(cells.reshape(len(part), g, s, g, s).transpose(0, 1, 3, 2, 4)
                              .reshape(len(part), g * g, s, s))  # B' x G^2 x S x S
            cells = np.concatenate(shares, axis=1)  # B' x W x S x S
            out[part] = unit_patches(cells.reshape(-1, s, s)).reshape(len(part), windows, s * s)
    return out


def crop_places(grid: int) -> np.ndarray:
    """Where a share's ``grid`` places a side lie, from 0 (the window at the top or left edge) to 1 (at the bottom or
    right): evenly from corner to corner, or the centre alone."""
    return np.linspace(0.0, 1.0, grid) if grid > 1 else np.array([0.5])


@functools.lru_cache(maxsize=256)  # an image has 96 pixels on its long side: about 190 shapes, about 110 kB each
def _cell_weights(h: int, w: int, grids: tuple[int, ...] = CROP_GRIDS) -> list[tuple[np.ndarray, np.ndarray]]:
    """For each share of :data:`CROP_SHARES`, how much each of the image's rows (G*S x h) and columns (G*S x w)
    counts in the mean of each cell of its windows (G places of ``grids``, S cells a side; a pixel cut by a
    cell's edge by the share inside): a cell's mean grey is ``rows @ image @ cols.T``."""
    def weights(n: int, s: float, grid: int) -> np.ndarray:  # G*S x n
        p = np.arange(n)
        out = np.empty((grid * CROP_SIDE, n), np.float32)
        for gi, g in enumerate(crop_places(grid)):
            edges = np.clip((1 - s) * n * g + s * n * np.linspace(0.0, 1.0, CROP_SIDE + 1), 0, n)  # S+1
            inside = np.clip(np.minimum(p + 1, edges[1:, None]) - np.maximum(p, edges[:-1, None]), 0, None)  # S x n
            out[gi * CROP_SIDE : (gi + 1) * CROP_SIDE] = inside / np.maximum(inside.sum(1, keepdims=True), 1e-9)
        return out
    return [(weights(h, s, g), weights(w, s, g)) for s, g in zip(CROP_SHARES, grids)]


def crop_neighbours(ids: Sequence[int], frames_: Mapping[int, Frame], k: int, chunk: int = 1024,
                    targets: Sequence[int] | None = None, floor: Callable[[int, bool], float] | None = None,
                    apart: Apart | None = None, grids: tuple[int, ...] = CROP_GRIDS
                    ) -> Iterable[tuple[int, bool, list[int], list[float]]]:
    """For each photo of ``ids``, twice (its :func:`crop_windows` plain, then mirrored: the flag), the other photos
    of ``targets`` (None: ``ids``; at most ``k``, the best first) whose whole frames (:data:`CROP_SIDE` a side) are
    closest by NCC to one of its windows: the photos that could have been cut from it, mirrored or not, with those
    NCCs; none where the closest is under ``floor(photo, mirrored)``. Only the whole frames are indexed (one vector
    a photo); each photo's windows are made and looked up a chunk of photos at a time, so memory does not grow with
    the windows. ``apart``: as :func:`pixel_neighbours`'s. ``grids``: the places a side of each share's windows
    (:func:`crop_windows_of`)."""
    targets = ids if targets is None else targets
    if not len(targets):
        return
    if floor is not None and len(targets) <= PIXEL_EXACT_UP_TO:  # a few new photos: every window's score, at once
        yield from _crops_among_few(ids, frames_, k, chunk, targets, floor, apart)
        return
    store = _inner_product_index(lambda start, stop: _flat_frames(frames_, targets[start:stop], CROP_SIDE),
                                 len(targets), CROP_SIDE**2, "crop",  # B x CROP_SIDE^2 a chunk
                                 2 * len(ids) * sum(g * g for g in grids), CROP_PROBE)
    depth = min(len(targets), k + 2)  # frames a window looks up (the photo's own whole frame may be one)
    for start in range(0, len(ids), chunk):
        part = ids[start : start + chunk]
        windows = _windows(frames_, part, grids).reshape(-1, CROP_SIDE**2)  # (B * W) x CROP_SIDE^2
        flipped = windows.reshape(-1, CROP_SIDE, CROP_SIDE)[:, :, ::-1].reshape(len(windows), -1)
        for flip, q in ((False, windows), (True, np.ascontiguousarray(flipped))):
            sims, found = store.search(q, depth)  # (B * W) x depth
            sims, found = sims.reshape(len(part), -1), found.reshape(len(part), -1)  # B x (W * depth)
            if floor is not None:
                top = sims.max(axis=1)  # B
                under = [bool(b < floor(me, flip)) for me, b in zip(part, top.tolist())]
            else:
                under = [False] * len(part)
            looked = np.flatnonzero(~np.array(under, bool))  # the photos that may have a new neighbour
            order = np.zeros(sims.shape, np.int64)  # B x (W * depth): the best window's match first
            order[looked] = np.argsort(-sims[looked], axis=1, kind="stable")
            for n, me in enumerate(part):
                if under[n]:
                    yield me, flip, [], []
                    continue
                row: list[int] = []
                best: list[float] = []
                for at in order[n].tolist():
                    o, s = int(found[n, at]), float(sims[n, at])
                    if s <= 0.0:  # no frame left, or a flat window
                        break
                    if o >= 0 and targets[o] != me and targets[o] not in row:
                        row.append(targets[o])
                        best.append(s)
                        if len(row) == k:
                            break
                yield me, flip, row, best


WINDOW_SCORES_AT_ONCE = 1 << 22  # window-photo scores worked at once (16 MB)


def _crops_among_few(ids: Sequence[int], frames_: Mapping[int, Frame], k: int, chunk: int, targets: Sequence[int],
                     floor: Callable[[int, bool], float], apart: Apart | None = None
                     ) -> Iterable[tuple[int, bool, list[int], list[float]]]:
    """:func:`crop_neighbours` among a few ``targets``, each photo's best window for each of them scored at once
    (matrix products: no k-nearest search of each window); those under ``floor(photo, mirrored)`` left out, and
    those ``apart`` says were taken apart from the photo (:func:`_columns`). The best ``k`` over all windows are the
    same: a target a window ranks under ``k + 2`` others is under ``k`` others too."""
    few = _flat_frames(frames_, targets, CROP_SIDE)  # M x S^2
    per = CROP_WINDOWS
    step = max(1, min(chunk, WINDOW_SCORES_AT_ONCE // (per * len(targets))))
    for start in range(0, len(ids), step):
        part = ids[start : start + step]
        cols, away = _columns(part, targets, apart)  # C, B x M
        if not len(cols):  # every target taken apart from every photo here: no window to make
            for flip in (False, True):
                yield from ((me, flip, [], []) for me in part)
            continue
        windows = _windows(frames_, part).transpose(1, 0, 2)  # per x B x S^2: by window
        flipped = windows.reshape(-1, CROP_SIDE, CROP_SIDE)[:, :, ::-1].reshape(windows.shape)
        for flip, w in ((False, windows), (True, flipped)):
            scores = (np.ascontiguousarray(w).reshape(-1, CROP_SIDE**2) @ few[cols].T).reshape(per, len(part), -1)
            yield from _over_floor(part, flip, _spread(scores.max(axis=0), cols, len(targets)), floor, targets, k,
                                   crops=True, away=away)  # B x M


def _columns(part: Sequence[int], targets: Sequence[int], apart: Apart | None
             ) -> tuple[np.ndarray, np.ndarray | None]:
    """The targets worth scoring for photos ``part``: those that ``apart(part, targets)`` (B x M bools: taken apart,
    by the files' dates or cameras, :class:`~index.duplicates.captures.Captures`) leaves for one photo or more (C
    indices into ``targets``), and that mask (None: no ``apart``, every target). A pair taken apart is never checked,
    so it need not be a neighbour either: the photo keeps an earlier one instead, whose pair was checked already."""
    if apart is None:
        return np.arange(len(targets)), None
    away = apart(np.asarray(part, np.int64), np.asarray(targets, np.int64))  # B x M
    return np.flatnonzero(~away.all(axis=0)), away


def _spread(scores: np.ndarray, cols: np.ndarray, m: int) -> np.ndarray:
    """B x C scores of the targets ``cols`` as B x ``m`` (-inf for the others: targets taken apart from every photo)."""
    if len(cols) == m:
        return scores
    out = np.full((len(scores), m), -np.inf, np.float32)  # B x M
    out[:, cols] = scores
    return out
