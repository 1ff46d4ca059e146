"""The whole collection on the page: the Map tab's data and selections, the Themes tab's cards, the Unusual tab's
ranking and the Browse tab's grid, as plain values (:mod:`app.page.blocks` wires them to components).

The views themselves are the index's (:mod:`index.overview`: the map's layout, the themes, the photos farthest from
any other, ``browse_photos``), computed with the index's version and kept with it; this module turns them into
what the page shows. The map goes to the browser once, compact (:func:`map_payload`: base64 typed arrays, 16 bytes
a photo: 1.6 MB for 100,000), and is drawn there (:mod:`app.page.map_view`); a selection drawn on it comes back as a
shape, and the photos inside are counted here as the browser counts them (:func:`region_mask`, on the same quantised
points).
"""

from __future__ import annotations

import base64
import html
import logging
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from index.catalog import Row, date_text, display_path
from index.search.image_index import ImageIndex
from moco.errors import UserError, plural

__all__ = ["CollectionOverview", "map_payload", "region_mask", "quantise", "SORTS", "PAGE", "MAX_SELECTED",
           "MAX_FOLDER_COLOURS", "MAX_LASSO_POINTS"]

logger = logging.getLogger(__name__)

PAGE = 60  # photos per page of a theme, of the unusual ones, of the Browse grid
MAX_SELECTED = 200  # photos of a map selection shown (the count says how many it holds)
MAX_FOLDER_COLOURS = 24  # the largest folders get a colour of their own; the others share one
MAX_LASSO_POINTS = 1000  # a lasso's corners taken (the page sends at most 200)
SORTS = {"name": "name", "date (oldest first)": "date", "date (newest first)": "-date"}  # label -> browse's sort
NO_THEME = 65535  # a point's theme or folder code when it has none (drawn grey)


def quantise(xy: np.ndarray) -> np.ndarray:
    """Map coordinates in [0, 1] (N x 2 float) as the page draws and selects them: N x 2 uint16 in 0..65535."""
    return np.round(np.clip(np.asarray(xy, np.float64), 0.0, 1.0) * 65535).astype(np.uint16)  # N x 2


def _b64(a: np.ndarray) -> str:
    return base64.b64encode(np.ascontiguousarray(a).astype(a.dtype.newbyteorder("<"), copy=False).tobytes()).decode()


def map_payload(ids: np.ndarray, xy: np.ndarray, theme: np.ndarray, folder: np.ndarray, themes: list[dict[str, Any]],
                folders: list[str], thumbs: str, other_folders: int = 0, method: str = "pca",
                version: str = "") -> dict[str, Any]:
    """The map as the page's script reads it: ``ids`` (N), ``xy`` (N x 2 in [0, 1]), ``theme`` and ``folder`` (N:
    each point's place in ``themes`` / ``folders``, NO_THEME for none) as base64 little-endian typed arrays (ids
    uint32, or float64 past 2**32; the rest uint16), the legends, and ``thumbs``, the URL a photo's id and ".jpg"
    complete into its thumbnail."""
    ids = np.asarray(ids, np.int64)  # N
    n = len(ids)
    assert xy.shape == (n, 2) and len(theme) == n and len(folder) == n, (xy.shape, len(theme), len(folder), n)
    wide = n and int(ids.max()) >= 2**32
    return {
        "n": n,
        "ids": _b64(ids.astype(np.float64 if wide else np.uint32)),
        "ids_type": "f64" if wide else "u32",
        "xy": _b64(quantise(xy)),  # N x 2, row-major: x0 y0 x1 y1 ...
        "theme": _b64(np.asarray(theme).astype(np.uint16)),
        "folder": _b64(np.asarray(folder).astype(np.uint16)),
        "themes": themes,
        "folders": folders,
        "other_folders": int(other_folders),
        "thumbs": thumbs,
        "method": method,
        "version": version,
    }


def region_mask(q: np.ndarray, shape: str, points: Sequence[Sequence[float]]) -> np.ndarray:
    """Which points (``q``: N x 2 quantised, :func:`quantise`) lie in a selection drawn on the map: a ``box`` (two
    corners, edges included) or a ``lasso`` (a polygon of 3 or more corners, the even-odd rule), both in the same
    quantised coordinates: N bool, exactly as the page's script counts them."""
    try:
        pts = np.asarray(points, np.float64)  # P x 2
    except (TypeError, ValueError):
        pts = np.zeros((0,))
    if pts.ndim != 2 or pts.shape[1] != 2 or not np.isfinite(pts).all():
        raise UserError(f"a map selection is a list of [x, y] corners, got {str(points)[:80]}: draw it again")
    x, y = q[:, 0].astype(np.float64), q[:, 1].astype(np.float64)  # N, N
    if shape == "box":
        if len(pts) != 2:
            raise UserError(f"a box selection has 2 corners, got {len(pts)}: draw it again")
        (x0, y0), (x1, y1) = pts.min(0), pts.max(0)
        return (x >= x0) & (x <= x1) & (y >= y0) & (y <= y1)
    if shape != "lasso":
        raise UserError(f"map selection {shape!r}: choose box or lasso")
    if not 3 <= len(pts) <= MAX_LASSO_POINTS:
        raise UserError(f"a lasso has 3 to {MAX_LASSO_POINTS} corners, got {len(pts)}: draw it again")
    odd = np.zeros(len(q), bool)  # N
    for (xa, ya), (xb, yb) in zip(pts, np.roll(pts, 1, axis=0)):  # each edge once, as the script walks them
        if ya == yb:
            continue  # a flat edge: no crossing (the script's test is false for it too)
        crosses = (ya > y) != (yb > y)
        with np.errstate(divide="ignore", invalid="ignore"):
            odd ^= crosses & (x < (xb - xa) * (y - ya) / (yb - ya) + xa)
    return odd


def _top_folder(path: str) -> str:
    return path.split("/", 1)[0] if "/" in path else ""


class CollectionOverview:
    """The Map, Themes, Unusual and Browse tabs over the index ``ready_index()`` returns (a UserError until there is
    one). The map's payload and its quantised points are kept per index version."""

    def __init__(self, ready_index: Callable[[], ImageIndex]) -> None:
        self.ready_index = ready_index
        self._map: tuple[str, dict[str, Any], np.ndarray, np.ndarray] | None = None  # (key, payload, ids, q)

    def _index(self) -> ImageIndex:
        index = self.ready_index()
        index.refresh()  # `moco index update` may have replaced the files meanwhile
        if len(index) == 0:
            raise UserError("the index is empty: add photos and run `moco index update`")
        return index

    # ------------------------------------------------------------------------------------- map
    def map(self, thumbs: str = "", method: str = "pca") -> dict[str, Any]:
        """The map payload (:func:`map_payload`) of the collection's current version; ``thumbs``: the URL of the
        index's ``thumbs/`` folder as the browser fetches it (with a trailing "/")."""
        from index.overview.layout import collection_map
        from index.overview.themes import collection_themes

        index = self._index()
        cmap = collection_map(index, method=method)
        key = f"{cmap.version}:{method}:{thumbs}"
        if self._map is not None and self._map[0] == key:
            return self._map[1]
        themes = collection_themes(index)
        place = np.full(max([t.id for t in themes.themes], default=0) + 2, NO_THEME, np.int64)  # theme id -> its card
        place[[t.id for t in themes.themes]] = np.arange(len(themes.themes))
        theme = place[np.where((cmap.theme >= 0) & (cmap.theme < len(place) - 1), cmap.theme, -1)]  # N; none: NO_THEME
        labels = [{"id": t.id, "size": t.size, "label": f"theme {t.id} ({t.size})"} for t in themes.themes]
        rows = index.catalog.rows_by_id(cmap.ids.tolist())
        top = [_top_folder(rows[int(i)].path) if int(i) in rows else "" for i in cmap.ids]
        counts = Counter(top).most_common()
        named = [f for f, _ in counts[:MAX_FOLDER_COLOURS]]
        code = {f: n for n, f in enumerate(named)}
        folder = np.array([code.get(f, NO_THEME) for f in top], np.int64)  # N
        payload = map_payload(cmap.ids, cmap.xy, theme, folder, labels,
                              [display_path(f) if f else "(top folder)" for f in named], thumbs,
                              other_folders=max(0, len(counts) - len(named)), method=method, version=cmap.version)
        self._map = (key, payload, cmap.ids, quantise(cmap.xy))
        return payload

    def map_text(self) -> str:
        """The Map tab's heading: what the map shows and how to use it."""
        assert self._map is not None
        payload = self._map[1]
        return (f"**{payload['n']} photos**, alike photos close together ({payload['method'].upper()} of the "
                f"index's space, {len(payload['themes'])} themes). Hover a point to see its photo, click it to "
                "search with it; drag a box (or a lasso) to see the photos inside.")

    def region(self, shape: str, points: Sequence[Sequence[float]], limit: int = MAX_SELECTED,
               version: str | None = None) -> tuple[list[int], int]:
        """The photos inside a selection drawn on the map (:func:`region_mask`): the first ``limit`` ids (in the
        map's order: by id) and how many there are. ``version``: the map's the selection was drawn on (a
        UserError when the map is no longer that one)."""
        if self._map is None:
            self.map()
        assert self._map is not None
        _, payload, ids, q = self._map
        if version is not None and version != payload["version"]:
            raise UserError("the collection changed since this map was drawn: open the Map tab again (or reload "
                            "the page) and draw the selection again")
        inside = ids[region_mask(q, shape, points)]  # M
        return [int(i) for i in inside[: max(0, int(limit))]], len(inside)

    # ------------------------------------------------------------------------------- galleries
    def gallery(self, ids: Sequence[int], captions: Sequence[str] | None = None) -> list[tuple[str | None, str]]:
        """Gallery items (thumbnail path, caption) of photo ``ids`` still in the index, in their order: the
        caption given, or the photo's path (and its day taken)."""
        index = self.ready_index()
        rows = index.catalog.rows_by_id(ids)
        out = []
        for n, i in enumerate(ids):
            row = rows.get(int(i))
            if row is None:
                continue
            thumb = index.thumb_path(row)
            out.append((str(thumb) if thumb else None, captions[n] if captions else _caption(row)))
        return out

    # ---------------------------------------------------------------------------------- themes
    def themes(self) -> tuple[str, list[tuple[str, int]]]:
        """(the themes as cards of HTML: each its most central photos, its size and its folders; the choices of
        the Browse tab's theme filter: (label, id))."""
        from index.overview.themes import collection_themes

        index = self._index()
        themes = collection_themes(index)
        central = index.catalog.rows_by_id([i for t in themes.themes for i in t.central])
        cards = []
        for t in themes.themes:
            imgs = []
            for i in t.central:
                row = central.get(int(i))
                thumb = index.thumb_path(row) if row else None
                if thumb is not None:
                    imgs.append(f'<img src="gradio_api/file={html.escape(str(thumb))}" alt="" '
                                f'title="{html.escape(display_path(row.path))}" loading="lazy">')
            folders = " · ".join(f"<code>{html.escape(display_path(f) + '/' if f else '(top folder)')}</code> "
                                 f"{c}" for f, c in t.folders)
            cards.append(f'<div class="theme-card" data-theme="{t.id}" role="button" tabindex="0">'
                         f"<h4>Theme {t.id} · {plural(t.size, 'photo')}</h4>"
                         f"<div class=theme-thumbs>{''.join(imgs)}</div>"
                         f'<p class="theme-folders">{folders}</p></div>')
        head = (f"<p class=theme-head><b>{len(themes.themes)} themes</b> of {len(themes.ids)} photos, by size: each "
                "shown by its most central photos and its folders. Click one to browse it.</p>")
        choices = [(f"Theme {t.id} ({plural(t.size, 'photo')})", t.id) for t in themes.themes]
        return head + "".join(cards), choices

    # --------------------------------------------------------------------------------- unusual
    def unusual(self, offset: int = 0,
                limit: int = PAGE) -> tuple[list[tuple[str | None, str]], list[int], str, int]:
        """A page of the photos farthest from any other, most unusual first: (gallery, their ids, the page in
        words, the offset shown); each caption its rank, its cosine to the closest other photo and its path."""
        from index.overview.unusual import unusual_photos

        index = self._index()
        offset = max(0, int(offset))
        page, total = unusual_photos(index, offset=offset, limit=limit)
        if not page and total and offset:  # past the end: the last page
            return self.unusual((total - 1) // limit * limit, limit)
        rows = index.catalog.rows_by_id([i for i, _ in page])
        captions = [f"#{offset + r} · closest other {score:.3f} · {display_path(rows[i].path) if i in rows else i}"
                    for r, (i, score) in enumerate(page, 1)]
        ids = [i for i, _ in page]
        where = (f"Photos {offset + 1}–{offset + len(page)} of **{total}**, the least like any other first "
                 "(the cosine to the closest other photo: the lower, the more unusual)" if page
                 else "No photos to rank (a collection of two or more photos has some).")
        return self.gallery(ids, captions), ids, where, offset

    # ---------------------------------------------------------------------------------- browse
    def browse(self, folder: str | None = None, theme: int | None = None, sort: str = "name", offset: int = 0,
               limit: int = PAGE) -> tuple[list[tuple[str | None, str]], list[int], str, int]:
        """A page of the collection's grid, in ``folder`` (on disk; None: all) and ``theme`` (None: all), sorted by
        ``sort`` (a value of SORTS): (gallery, its ids, the page in words, the offset shown)."""
        from index.overview.documents import browse_photos

        index = self._index()
        offset = max(0, int(offset))
        rows, total = browse_photos(index, folder=folder, theme=theme, sort=sort, offset=offset, limit=limit)
        if not rows and total and offset:  # past the end: the last page
            return self.browse(folder, theme, sort, (total - 1) // limit * limit, limit)
        what = "".join([f" in `{display_path(folder)}/`" if folder else "",
                        f" of theme {int(theme)}" if theme is not None else ""])
        order = next((label for label, value in SORTS.items() if value == sort), sort)
        where = (f"Photos {offset + 1}–{offset + len(rows)} of **{total}**{what}, by {order}" if rows
                 else f"No photos{what}.")
        gallery = [(str(index.thumb_path(r)) if r.thumb else None, _caption(r)) for r in rows]
        return gallery, [r.id for r in rows], where, offset


def _caption(row: Row) -> str:
    day = f"{date_text(row.date)[:10]} · " if row.date is not None else ""
    return day + display_path(row.path)
