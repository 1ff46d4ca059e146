"""Themes: the collection cut into groups of alike photos by spherical k-means on the index's centred features.

Every photo belongs to exactly one theme, the one whose centre (a unit vector) it scores highest with (cosine of the
features centred on the index's mean, :func:`index.overview.cache.centred_vectors`: without the whitening, which
flattens what tells kinds of photos apart, each averaged with those of its :data:`SMOOTH` closest other photos in
the search space: :func:`smoothed_vectors`); its ``centrality`` is that score. The averaging lends each photo what
its neighbours share: on Fashion-MNIST's report split it lifted the themes from 0.713 to 0.732 purity (NMI 0.477 to
0.496) at the automatic 64 themes, above k-means on whitened pixels (0.722 / 0.493), chosen on another split
(bench/NOTES.md); it costs one k-NN search of every photo by the index's own store, once per index version.
Themes are numbered by size, the largest 0 (ties: the theme holding the smaller photo id first), and shown by their
most central photos, their size and their top folders. The number of themes, unless given, follows the collection's
size (:func:`auto_themes`).

FAISS's own ``Kmeans`` (``spherical=True``: centres renormalized after each step, so they stay on the unit sphere
with the photos), seeded: the same index gives the same themes. It trains on at most 256 photos per theme (a
seeded sample: FAISS's default), then every photo is assigned. A theme left empty by that assignment is dropped.

Cached with the index's version (:mod:`index.overview.cache`, ``IDX/themes.npz``); themes of another number than
the automatic one are kept in memory only.
"""

from __future__ import annotations

import logging
import math
import posixpath
from collections import Counter
from dataclasses import dataclass

import numpy as np

from index.overview.cache import Collection, cached, centred_vectors, space_vectors
from index.search.store import require_faiss
from moco.errors import UserError

__all__ = ["Theme", "Themes", "collection_themes", "theme_members", "theme_labels", "auto_themes", "smoothed_vectors",
           "MIN_THEMES", "MAX_THEMES", "CENTRAL", "TOP_FOLDERS", "SMOOTH"]

logger = logging.getLogger(__name__)

# sqrt(N / 2), the old rule of thumb for a number of clusters (Mardia et al., Multivariate Analysis, 1979), between
# MIN_THEMES and MAX_THEMES: 100 photos get 7 themes of ~14, 1,000 get 22 of ~45, from 8,192 photos 64. More than 64
# is more than a person reads on one page; a big collection gets bigger themes, browsed a page at a time.
MIN_THEMES, MAX_THEMES = 2, 64
CENTRAL = 12  # photos that show a theme
TOP_FOLDERS = 5  # folders named per theme
NITER = 25  # k-means iterations (FAISS's default is 25 too)
SEED = 1234
SMOOTH = 10  # a photo's features are averaged with those of this many closest other photos before the k-means
_ASK_MORE = 6  # neighbours asked for beyond SMOOTH + 1: itself, and a few the catalog may no longer list


def smoothed_vectors(index: Collection, ids: np.ndarray, x: np.ndarray, chunk: int = 2048) -> np.ndarray:
    """``x`` (N x D centred, L2-normalized features of the photos ``ids``, ascending) each summed with the features of
    its :data:`SMOOTH` closest other photos among ``ids`` (the index's own k-NN in its search space), L2-normalized:
    N x D. A photo with fewer such neighbours found keeps those it has."""
    sids, s = space_vectors(index)  # N, N x D: the search space, the same photos in the same order
    if len(ids) < 2 or not np.array_equal(sids, ids):
        return x
    k = min(SMOOTH + 1 + _ASK_MORE, index.store.ntotal)
    out = x.copy()  # N x D
    for start in range(0, len(ids), chunk):
        _, found = index.store.search(s[start : start + chunk], k)  # B x k, best first
        at = np.clip(np.searchsorted(ids, found), 0, len(ids) - 1)  # B x k: positions in ids
        own = ids[start : start + chunk, None]  # B x 1
        live = (found >= 0) & (ids[at] == found) & (found != own)  # B x k: another photo of ids
        live &= np.cumsum(live, axis=1) <= SMOOTH  # the first SMOOTH of them
        rows, cols = np.nonzero(live)
        np.add.at(out, start + rows, x[at[rows, cols]])
    return out / np.maximum(np.linalg.norm(out, axis=1, keepdims=True), 1e-12)


def auto_themes(n: int) -> int:
    """The number of themes of a collection of ``n`` photos: round(sqrt(n / 2)) in [MIN_THEMES, MAX_THEMES], and
    never more than ``n``."""
    return min(n, max(MIN_THEMES, min(MAX_THEMES, round(math.sqrt(n / 2)))))


@dataclass(frozen=True)
class Theme:
    """One theme: its id (0 the largest), its size, its most central photo ids (most central first, up to
    :data:`CENTRAL`) and its top folders with their counts (``""``: the collection's top folder), most first."""

    id: int
    size: int
    central: list[int]
    folders: list[tuple[str, int]]


@dataclass(frozen=True)
class Themes:
    """The themes of a collection: ``ids`` (N int64, ascending) and ``labels`` (N int32: the theme of each photo),
    ``centrality`` (N float32: each photo's cosine to its theme's centre), ``themes`` (by id: largest first), their
    number ``k`` and the index version they were computed for."""

    ids: np.ndarray
    labels: np.ndarray
    centrality: np.ndarray
    themes: list[Theme]
    k: int
    version: str

    def members(self, theme_id: int) -> np.ndarray:
        """The photo ids of theme ``theme_id``, most central first (ties: the smaller id)."""
        at = np.flatnonzero(self.labels == theme_id)  # M
        order = np.lexsort((self.ids[at], -self.centrality[at]))
        return self.ids[at[order]]


def _kmeans(x: np.ndarray, k: int) -> dict[str, np.ndarray]:
    """Spherical k-means of ``x`` (N x D, unit rows) into ``k``: labels by size rank, centrality, centres."""
    n, d = x.shape
    if n == 0 or k == 0:
        return {"labels": np.zeros(0, np.int32), "centrality": np.zeros(0, np.float32),
                "centres": np.zeros((0, d), np.float32)}
    faiss = require_faiss()
    km = faiss.Kmeans(d, k, niter=NITER, spherical=True, seed=SEED, min_points_per_centroid=1, verbose=False)
    km.train(x)
    centres = np.ascontiguousarray(km.centroids, np.float32)  # k x D
    centres /= np.maximum(np.linalg.norm(centres, axis=1, keepdims=True), 1e-12)
    labels = np.empty(n, np.int64)
    score = np.empty(n, np.float32)
    for start in range(0, n, 8192):
        s = x[start : start + 8192] @ centres.T  # B x k
        labels[start : start + 8192] = s.argmax(1)
        score[start : start + 8192] = s.max(1)
    sizes = np.bincount(labels, minlength=k)  # k
    first = np.full(k, n, np.int64)
    np.minimum.at(first, labels, np.arange(n))  # the first (smallest id) photo of each theme
    kept = [c for c in np.lexsort((first, -sizes)) if sizes[c]]  # by size, ties: the smaller first photo
    rank = np.full(k, -1, np.int64)
    rank[kept] = np.arange(len(kept))
    return {"labels": rank[labels].astype(np.int32), "centrality": score, "centres": centres[kept]}


def _theme_arrays(index: Collection, k: int | None = None, refresh: bool = False) -> tuple[dict[str, np.ndarray], str]:
    """The themes' arrays (``ids``, ``labels``, ``centrality``, ``centres``) and the index version, computed or read
    (:func:`index.overview.cache.cached`); the automatic ones are kept in the index directory, others in memory."""
    if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 1):
        n_live = index.catalog.counts()["ok"]
        raise UserError(f"--themes {k!r}: give a whole number of themes of at least 1 (or leave it out: "
                        f"{auto_themes(n_live)} for this collection of {n_live} photos)")
    auto = k is None

    def compute() -> dict[str, np.ndarray]:
        vids, x = centred_vectors(index)  # N, N x D
        want = auto_themes(len(vids)) if auto else min(k, len(vids))
        logger.info("cutting %d photos into %d themes (spherical k-means on the index's centred features, each "
                    "averaged with its %d closest photos)", len(vids), want, SMOOTH)
        return {"ids": vids, **_kmeans(smoothed_vectors(index, vids, x), want)}

    return cached(index, "themes", {"k": "auto" if auto else k, "vectors": f"centred, {SMOOTH} closest"}, compute,
                  refresh=refresh, keep=auto)


def collection_themes(index: Collection, k: int | None = None, refresh: bool = False) -> Themes:
    """The themes of ``index``'s collection: ``k`` of them (None: :func:`auto_themes` of its size), computed or
    read for its current version (``refresh``: computed again), each with its most central photos and its folders
    (read from the catalog now: a photo moved since counts where it is)."""
    arrays, version = _theme_arrays(index, k, refresh)
    vids, labels, centrality = arrays["ids"], arrays["labels"], arrays["centrality"]
    ids, paths, _ = index.catalog.entries()
    path_of = dict(zip(ids.tolist(), paths))
    themes = []
    k_found = len(arrays["centres"])
    for t in range(k_found):
        at = np.flatnonzero(labels == t)  # M
        order = at[np.lexsort((vids[at], -centrality[at]))]
        folders = Counter(posixpath.dirname(path_of[i]) for i in vids[at].tolist() if i in path_of)
        themes.append(Theme(t, len(at), [int(i) for i in vids[order[:CENTRAL]]],
                            sorted(folders.items(), key=lambda fc: (-fc[1], fc[0]))[:TOP_FOLDERS]))
    return Themes(vids, labels, centrality, themes, k_found, version)


def theme_labels(index: Collection) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(ids N ascending, labels N, centrality N) of the automatic themes, without reading the catalog's rows (for
    the map, a page of a theme, browsing by theme)."""
    arrays, _ = _theme_arrays(index)
    return arrays["ids"], arrays["labels"], arrays["centrality"]


def theme_members(index: Collection, theme_id: int, offset: int = 0, limit: int = 60) -> tuple[list[int], int]:
    """A page of theme ``theme_id``'s photo ids, most central first (ties: the smaller id), and the theme's size; a
    UserError naming the id and the themes there are when it has none."""
    ids, labels, centrality = theme_labels(index)
    k = int(labels.max()) + 1 if len(labels) else 0
    if isinstance(theme_id, bool) or not isinstance(theme_id, (int, np.integer)) or not 0 <= theme_id < k:
        raise UserError(f"theme {theme_id!r}: this collection has themes 0 to {k - 1} "
                        f"(`moco index themes {index.dir}` lists them)" if k else
                        f"theme {theme_id!r}: this collection has no themes (no photos indexed)")
    at = np.flatnonzero(labels == theme_id)  # M
    members = ids[at[np.lexsort((ids[at], -centrality[at]))]]
    offset, limit = max(0, int(offset)), max(0, int(limit))
    return [int(i) for i in members[offset : offset + limit]], len(members)
