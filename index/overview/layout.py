"""A map of the collection: every photo a point in the plane, alike photos close, computed from the index's centred
features (:func:`index.overview.cache.centred_vectors`: centred on the index's mean, without its whitening, whose
equal weight on every direction leaves a plane of most spread with little in it).

``pca`` (the default, numpy only): the two directions along which the photos' vectors spread most; deterministic,
seconds for 100,000 photos. ``umap`` (the ``map`` extra, umap-learn): a layout that keeps each photo's neighbours
beside it, so themes show as islands; slower (about a minute for 10,000 photos on one core), seeded.

The points are scaled into [0, 1] with one factor for both axes (distances keep their proportions; the shorter
axis is centred). Each point carries its photo's theme (:mod:`index.overview.themes`). Cached with the index's
version (:mod:`index.overview.cache`, ``IDX/map-<method>.npz``): computed again only when the index changed.
"""

from __future__ import annotations

import io
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from index.overview.cache import Collection, cached, centred_vectors
from index.overview.themes import theme_labels
from moco.errors import UserError
from moco.extras import install_hint
from moco.files import atomic_write

__all__ = ["CollectionMap", "collection_map", "pca_layout", "umap_layout", "scale_unit", "save_map_png", "map_faces",
           "METHODS", "MAP_EXTRA", "FACES_GRID"]

logger = logging.getLogger(__name__)

METHODS = ("pca", "umap")
MAP_EXTRA = install_hint("map")
UMAP_NEIGHBOURS = 15  # umap-learn's default
SEED = 0
FACES_GRID = 10  # the drawn map shows a photo's thumbnail in each occupied cell of a 10 x 10 grid


@dataclass(frozen=True)
class CollectionMap:
    """Every indexed photo once: ``ids`` (N int64, ascending), ``xy`` (N x 2 float32 in [0, 1]), ``theme`` (N
    int32: its theme's id), the ``method`` and the index ``version`` it was computed for."""

    ids: np.ndarray
    xy: np.ndarray
    theme: np.ndarray
    method: str
    version: str


def scale_unit(xy: np.ndarray) -> np.ndarray:
    """``xy`` (N x 2) scaled into [0, 1] with one factor for both axes, the shorter one centred."""
    xy = np.asarray(xy, np.float64)  # N x 2
    if not len(xy):
        return np.zeros((0, 2), np.float32)
    lo, hi = xy.min(0), xy.max(0)
    span = float((hi - lo).max())
    if span <= 0:
        return np.full(xy.shape, 0.5, np.float32)
    out = (xy - lo) / span  # N x 2, the longer axis spans [0, 1]
    out += (1.0 - (hi - lo) / span) / 2  # the shorter one centred
    return np.clip(out, 0.0, 1.0).astype(np.float32)


def pca_layout(x: np.ndarray) -> np.ndarray:
    """The projection (N x 2) of ``x`` (N x D) on its two principal directions, each signed so that its largest
    loading is positive (the same vectors give the same map)."""
    if len(x) < 2:
        return np.zeros((len(x), 2), np.float32)
    mean = x.mean(0, dtype=np.float64).astype(np.float32)  # D
    cov = np.zeros((x.shape[1], x.shape[1]), np.float64)  # D x D
    for start in range(0, len(x), 16384):
        c = x[start : start + 16384] - mean  # B x D
        cov += (c.T @ c).astype(np.float64)
    _, vecs = np.linalg.eigh(cov)  # ascending eigenvalues
    top = vecs[:, ::-1][:, :2]  # D x 2
    top *= np.sign(top[np.abs(top).argmax(0), [0, 1]])  # sign: the largest loading positive
    return ((x - mean) @ top.astype(np.float32)).astype(np.float32)  # N x 2


def umap_layout(x: np.ndarray) -> np.ndarray:
    """UMAP (umap-learn) of ``x`` (N x D, unit rows: Euclidean order = cosine order) into N x 2, seeded; a
    UserError naming the extra when umap-learn is not installed."""
    try:
        import umap
    except ImportError:
        raise UserError(f"--method umap needs umap-learn: {MAP_EXTRA} (or use the default --method pca)") from None
    if len(x) <= UMAP_NEIGHBOURS + 1:  # too few photos for a neighbour graph: the plane of most spread
        return pca_layout(x)
    reducer = umap.UMAP(n_components=2, n_neighbors=UMAP_NEIGHBOURS, metric="euclidean", random_state=SEED)
    return np.asarray(reducer.fit_transform(x), np.float32)  # N x 2


def collection_map(index: Collection, method: str = "pca", refresh: bool = False) -> CollectionMap:
    """The map of ``index``'s collection by ``method`` (:data:`METHODS`), computed or read for its current version
    (``refresh``: computed again)."""
    if method not in METHODS:
        raise UserError(f"map method {method!r}: choose {' or '.join(METHODS)}")
    if method == "umap":
        try:
            import umap  # noqa: F401  (said before anything is read)
        except ImportError:
            raise UserError(f"--method umap needs umap-learn: {MAP_EXTRA} (or use the default --method pca)") \
                from None

    def compute() -> dict[str, np.ndarray]:
        ids, x = centred_vectors(index)  # N, N x D
        logger.info("laying out %d photos (%s)", len(ids), method)
        xy = pca_layout(x) if method == "pca" else umap_layout(x)  # N x 2
        return {"ids": ids, "xy": scale_unit(xy)}

    arrays, version = cached(index, f"map-{method}", {"method": method, "vectors": "centred"}, compute,
                              refresh=refresh)
    t_ids, t_labels, _ = theme_labels(index)
    ids = arrays["ids"]
    theme = np.full(len(ids), -1, np.int32)  # N; -1 only if the catalog changed between the two reads
    if len(t_ids):
        at = np.clip(np.searchsorted(t_ids, ids), 0, len(t_ids) - 1)
        hit = t_ids[at] == ids
        theme[hit] = t_labels[at[hit]]
    return CollectionMap(ids, arrays["xy"], theme, method, version)


def map_faces(xy: np.ndarray, grid: int = FACES_GRID) -> list[tuple[int, int, int]]:
    """The photos a drawn map shows as thumbnails: in each cell of a ``grid`` x ``grid`` split of [0, 1]² that holds
    points, the point closest to the cell's centre (ties: the first); as (column, row, position in ``xy``)."""
    if not len(xy):
        return []
    xy = np.asarray(xy, np.float64)  # N x 2
    cell = np.clip((xy * grid).astype(np.int64), 0, grid - 1)  # N x 2
    key = cell[:, 1] * grid + cell[:, 0]  # N
    centre = (cell + 0.5) / grid  # N x 2
    d = ((xy - centre) ** 2).sum(1)  # N
    order = np.lexsort((np.arange(len(xy)), d, key))  # by cell, then distance, then position
    first = order[np.r_[True, key[order][1:] != key[order][:-1]]]  # the closest point of each occupied cell
    return [(int(cell[i, 0]), int(cell[i, 1]), int(i)) for i in first]


def save_map_png(m: CollectionMap, path: str | Path, title: str = "",
                 thumbs: Callable[[int], Path | None] | None = None) -> Path:
    """Draw the map ``m`` as a PNG at ``path``, each point coloured by its theme, each theme's id written at its
    photos' median point, and (``thumbs``: a photo id's thumbnail file, or None) a thumbnail of one photo in each
    occupied cell of a grid (:func:`map_faces`), framed in its theme's colour; a UserError naming the ``plot`` extra
    when matplotlib is not installed, or naming ``path`` when it is not a .png."""
    path = Path(path)
    if path.suffix.lower() != ".png":
        raise UserError(f"-o {path}: the map is drawn as a PNG: give a name ending in .png")
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise UserError(f"-o {path} draws the map with matplotlib: {install_hint('plot')} (or leave out "
                        "-o: the map is computed and kept all the same)") from None
    fig = Figure(figsize=(8, 8), dpi=150)  # no pyplot: no global state shared with a server's threads
    FigureCanvasAgg(fig)
    ax = fig.add_axes((0.02, 0.02, 0.96, 0.92 if title else 0.96))
    n = len(m.ids)
    colours = _theme_colours(m.theme)  # N x 4
    ax.scatter(m.xy[:, 0], m.xy[:, 1], s=max(0.5, min(24.0, 20_000 / max(n, 1))), c=colours, linewidths=0)
    if thumbs is not None:
        _draw_faces(ax, m, colours, thumbs)
    for t in np.unique(m.theme[m.theme >= 0]):
        cx, cy = np.median(m.xy[m.theme == t], axis=0)
        ax.text(cx, cy, str(int(t)), fontsize=8, ha="center", va="center", weight="bold", zorder=5,
                bbox={"boxstyle": "round,pad=0.15", "fc": "white", "ec": "none", "alpha": 0.7})
    ax.set_xlim(-0.02, 1.02)
    ax.set_ylim(-0.02, 1.02)
    ax.set_aspect("equal")
    ax.set_xticks([])
    ax.set_yticks([])
    if title:
        ax.set_title(title, fontsize=10)
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    atomic_write(path, lambda f: f.write(buf.getvalue()))
    return path


def _draw_faces(ax: Any, m: CollectionMap, colours: np.ndarray, thumbs: Callable[[int], Path | None]) -> None:
    """Each face of :func:`map_faces` drawn at its point, about 70% of a grid cell wide (within the map)."""
    from PIL import Image

    half = 0.35 / FACES_GRID
    for _, _, i in map_faces(m.xy):
        thumb = thumbs(int(m.ids[i]))
        if thumb is None:
            continue
        try:
            with Image.open(thumb) as im:
                face = np.asarray(im.convert("RGB").resize((96, 96), Image.Resampling.BICUBIC))
        except OSError as e:  # a thumbnail gone or damaged: that cell keeps its dots
            logger.debug("no thumbnail for photo %d on the map: %s", int(m.ids[i]), e)
            continue
        x, y = np.clip(m.xy[i], half, 1 - half)
        ax.imshow(face, extent=(x - half, x + half, y - half, y + half), zorder=3, interpolation="antialiased")
        ax.add_patch(_frame(x, y, half, colours[i]))


def _frame(x: float, y: float, half: float, colour: np.ndarray) -> Any:
    from matplotlib.patches import Rectangle

    return Rectangle((x - half, y - half), 2 * half, 2 * half, fill=False, lw=1.5, ec=tuple(colour[:3]), zorder=4)


def _theme_colours(theme: np.ndarray) -> np.ndarray:
    """N x 4 RGBA: a theme's colour from a fixed cycle of 20 well-separated ones (grey for none)."""
    from matplotlib import colormaps

    cycle = np.asarray(colormaps["tab20"].colors, np.float64)  # 20 x 3
    out = np.empty((len(theme), 4))
    out[:, :3] = cycle[np.maximum(theme, 0) % len(cycle)]
    out[:, 3] = 0.85
    out[theme < 0] = (0.6, 0.6, 0.6, 0.5)
    return out
