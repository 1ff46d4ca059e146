"""Which pairs of photos the pixel check (:mod:`index.verify`) looks at: the candidates of copy detection.

Checking every pair is quadratic, so each photo puts forward a few others, from three searches:

- **the model**: its :data:`PROPOSE_K` closest photos in the index's space, and the model's pairs at the near
  threshold (a re-encoded or resized copy);
- **whole pixels**: its :data:`PROPOSE_K` closest photos by the NCC of their whole grey frames,
  :data:`PIXEL_SIDE` a side, plain and mirrored (a brighter copy, which a model may not see as close);
- **crops**: the :data:`PROPOSE_K` photos it could have been cut from. Every photo's windows at the crop shares the
  check tests (:data:`~index.verify.SCALES` under 1) and at :data:`CROP_GRID` x :data:`CROP_GRID` places, shrunk to
  :data:`CROP_SIDE` a side, go into one index; each photo's whole frame, plain and mirrored, looks up the windows
  closest to it by NCC, and their photos are its candidates. A crop is the one edit that moves every pixel of a
  small frame, and a model trained to see crops as the same scene puts a crop of a shirt beside every shirt.

The searches are exact (flat inner-product indexes) up to :data:`PIXEL_EXACT_UP_TO` photos and approximate (HNSW)
above. Photos of the same bytes are never proposed: they are exact duplicates already.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence

import numpy as np
from PIL import Image

from index.store import VectorStore
from index.verify import SCALES, Frame, unit_patches

__all__ = ["proposals", "pixel_neighbours", "crop_neighbours", "crop_windows", "PROPOSE_K", "PIXEL_SIDE",
           "CROP_SIDE", "CROP_GRID", "PIXEL_EXACT_UP_TO"]

logger = logging.getLogger(__name__)

PROPOSE_K = 5  # each photo's closest photos by the model, by whole pixels and by crops go to the pixel check
SAME_BYTES_MARGIN = 8  # k-NN slots beyond k + 1 for photos with the same bytes (not other photos)
PIXEL_SIDE = 16  # pixels a side of the whole frames whose NCC proposes pairs
CROP_SIDE = 8  # pixels a side of the crop windows (and of the whole frames that look them up)
CROP_GRID = 3  # places a side for the windows of one crop share: the corners, the edges' middles, the centre
CROP_SHARES = tuple(s for s in SCALES if s < 1.0)  # the crop shares the pixel check tests
PIXEL_EXACT_UP_TO = 20000  # photos: above, the pixel proposals come from approximate (HNSW) indexes


def proposals(store: VectorStore, ids: np.ndarray, vecs: np.ndarray, content: Mapping[int, int],
              frames_: Mapping[int, Frame], links: Mapping[int, Mapping[int, float]], chunk: int = 1024,
              k: int = PROPOSE_K) -> set[tuple[int, int]]:
    """The pairs (a < b) of photos with other bytes that the pixel check looks at: the ``links`` (the model's, at the
    near threshold), each photo's ``k`` closest other photos by the model (``vecs``: N x D in the index's space,
    searched in ``store``), by whole pixels (:func:`pixel_neighbours`) and the ``k`` it could be cut from
    (:func:`crop_neighbours`)."""
    live = set(ids.tolist())
    out: set[tuple[int, int]] = set()

    def add(i: int, j: int) -> None:
        if j >= 0 and j != i and j in live and content[i] != content[j]:
            out.add((min(i, j), max(i, j)))

    for i, nb in links.items():
        for j in nb:
            add(i, j)
    depth = k + 1 + SAME_BYTES_MARGIN
    for start in range(0, len(ids), chunk):
        _, found = store.search(vecs[start : start + chunk], depth)  # B x depth
        for q, row in enumerate(found.tolist()):
            i = int(ids[start + q])
            others = [j for j in row if j >= 0 and j != i and j in live and content[j] != content[i]]
            for j in others[:k]:
                add(i, j)
    have = [int(i) for i in ids if int(i) in frames_]
    if len(have) > 1 and k > 0:
        for i, row in pixel_neighbours(have, frames_, depth, chunk):
            for j in [j for j in row if j != i and content[j] != content[i]][:k]:
                add(i, j)
        for i, row in crop_neighbours(have, frames_, k + SAME_BYTES_MARGIN, chunk):
            for j in [j for j in row if content[j] != content[i]][:k]:
                add(i, j)
    return out


def _inner_product_index(dim: int, n: int, photos: int):  # -> faiss.Index
    """A flat inner-product index up to :data:`PIXEL_EXACT_UP_TO` photos, HNSW above (``n`` vectors to come)."""
    import faiss

    if photos <= PIXEL_EXACT_UP_TO:
        return faiss.IndexFlatIP(dim)
    store = faiss.IndexHNSWFlat(dim, 32, faiss.METRIC_INNER_PRODUCT)
    store.hnsw.efSearch = max(store.hnsw.efSearch, 128)
    logger.info("pixel proposals: an HNSW index of %d vectors (%d photos)", n, photos)
    return store


def _flat(grey: np.ndarray, side: int, mirror: bool) -> np.ndarray:
    """A frame shrunk to ``side`` a side (box filter), mirrored or not, less its mean, over its norm: side^2."""
    g = np.asarray(Image.fromarray(grey).resize((side, side), Image.Resampling.BOX), np.float32)
    g = (g[:, ::-1] if mirror else g).ravel()
    g = g - g.mean()
    return g / max(float(np.linalg.norm(g)), 1e-6)


def pixel_neighbours(ids: Sequence[int], frames_: Mapping[int, Frame], k: int,
                     chunk: int = 1024) -> Iterable[tuple[int, list[int]]]:
    """For each photo of ``ids``, twice (its query plain and mirrored), its ``k`` closest photos by the NCC of
    their whole grey frames (shrunk to :data:`PIXEL_SIDE` a side)."""
    plain = np.stack([_flat(frames_[i].grey, PIXEL_SIDE, False) for i in ids])  # N x P^2
    mirrored = np.stack([_flat(frames_[i].grey, PIXEL_SIDE, True) for i in ids])  # N x P^2
    store = _inner_product_index(plain.shape[1], len(ids), len(ids))
    store.add(plain)
    k = min(k, len(ids))
    for start in range(0, len(ids), chunk):
        for q in (plain[start : start + chunk], mirrored[start : start + chunk]):  # B x P^2
            _, found = store.search(q, k)  # B x k
            for n, row in enumerate(found.tolist()):
                yield ids[start + n], [ids[j] for j in row if j >= 0]


def crop_windows(f: Frame) -> np.ndarray:
    """A photo's crop windows: at each share of :data:`CROP_SHARES` (of both sides: the photo's shape kept) and at
    :data:`CROP_GRID` x :data:`CROP_GRID` places from corner to corner, the window's mean grey over each cell of a
    :data:`CROP_SIDE` x :data:`CROP_SIDE` grid (exact: a pixel cut by a cell's edge counts by its share inside), less
    its mean, over its norm (a flat window is all zero, and matches nothing): W x CROP_SIDE^2,
    W = len(CROP_SHARES) * CROP_GRID^2."""
    grey = np.asarray(f.image, np.float64)  # H x W, at most twice the frame's side
    h, w = grey.shape
    table = np.pad(grey, ((1, 0), (1, 0))).cumsum(0).cumsum(1)  # (H+1) x (W+1) summed-area table
    steps = np.linspace(0.0, 1.0, CROP_GRID)
    edges = np.linspace(0.0, 1.0, CROP_SIDE + 1)
    ys, xs = [], []
    for s in CROP_SHARES:
        for gy in steps:
            for gx in steps:
                ys.append((1 - s) * h * gy + s * h * edges)
                xs.append((1 - s) * w * gx + s * w * edges)
    y = np.clip(np.array(ys), 0, h)  # W x (S+1) cell edges, in pixels (fractions too)
    x = np.clip(np.array(xs), 0, w)  # W x (S+1)
    corners = _at(table, y[:, :, None], x[:, None, :])  # W x (S+1) x (S+1): the grey summed up to each corner
    sums = corners[:, 1:, 1:] - corners[:, :-1, 1:] - corners[:, 1:, :-1] + corners[:, :-1, :-1]  # W x S x S
    area = np.diff(y, axis=1)[:, :, None] * np.diff(x, axis=1)[:, None, :]  # W x S x S
    cells = sums / np.maximum(area, 1e-9)
    return unit_patches(cells.astype(np.float32)).reshape(len(cells), -1)  # W x S^2


def _at(table: np.ndarray, y: np.ndarray, x: np.ndarray) -> np.ndarray:
    """A summed-area table read between its points: bilinear, which is exact (the sum of a picture of constant
    pixels up to (y, x) is bilinear inside each pixel), so a cell cut between pixels gets its exact mean."""
    y0 = np.minimum(np.floor(y).astype(np.int64), table.shape[0] - 2)
    x0 = np.minimum(np.floor(x).astype(np.int64), table.shape[1] - 2)
    fy, fx = y - y0, x - x0
    return ((1 - fy) * (1 - fx) * table[y0, x0] + (1 - fy) * fx * table[y0, x0 + 1]
            + fy * (1 - fx) * table[y0 + 1, x0] + fy * fx * table[y0 + 1, x0 + 1])


def crop_neighbours(ids: Sequence[int], frames_: Mapping[int, Frame], k: int,
                    chunk: int = 1024) -> Iterable[tuple[int, list[int]]]:
    """For each photo of ``ids``, twice (its whole frame plain and mirrored), the other photos (at most ``k``, the
    best first) whose :func:`crop_windows` are closest to it by NCC: the photos it could have been cut from."""
    per = len(CROP_SHARES) * CROP_GRID**2
    windows = np.concatenate([crop_windows(frames_[i]) for i in ids])  # (N * per) x CROP_SIDE^2
    owner = np.repeat(np.arange(len(ids)), per)  # N * per
    store = _inner_product_index(windows.shape[1], len(windows), len(ids))
    store.add(windows)
    plain = np.stack([_flat(frames_[i].grey, CROP_SIDE, False) for i in ids])  # N x CROP_SIDE^2
    mirrored = np.stack([_flat(frames_[i].grey, CROP_SIDE, True) for i in ids])  # N x CROP_SIDE^2
    depth = min(len(windows), 16 * (k + 1))  # neighbouring windows of one photo are alike: room for k photos
    for start in range(0, len(ids), chunk):
        for q in (plain[start : start + chunk], mirrored[start : start + chunk]):  # B x CROP_SIDE^2
            sims, found = store.search(q, depth)  # B x depth
            for n in range(len(found)):
                me, row = start + n, []
                for w, s in zip(found[n].tolist(), sims[n].tolist()):
                    if w < 0 or s <= 0.0:  # no window left, or a flat one
                        break
                    o = int(owner[w])
                    if o != me and ids[o] not in row:
                        row.append(ids[o])
                        if len(row) == k:
                            break
                yield ids[me], row
