"""The views of the whole collection as JSON documents: what ``moco index map|themes|unusual|browse --json`` print
and the JSON API's ``/api/v1/map``, ``/themes``, ``/themes/{id}``, ``/unusual`` and ``/photos`` answer, made here
once so that the two cannot disagree. Paths are relative to the collection root (a name that is not UTF-8 escaped
as the page shows it); dates taken are ISO 8601 on the camera's clock.
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np

from index.catalog import Row, display_path, taken_text
from index.overview.cache import Collection
from index.overview.layout import collection_map
from index.overview.themes import collection_themes, theme_labels, theme_members
from index.overview.unusual import unusual_photos
from moco.errors import UserError

__all__ = ["Browsable", "map_document", "map_rows", "themes_document", "theme_document", "unusual_document",
           "browse_photos", "browse_document", "MAX_PAGE", "COORD_DECIMALS"]

MAX_PAGE = 500  # photos in one page of a theme, of the unusual photos, of the collection
COORD_DECIMALS = 5  # map coordinates in [0, 1]: 1e-5 is far under a pixel of any screen


class Browsable(Collection, Protocol):
    """An index that also pages through its photos (:meth:`~index.search.image_index.ImageIndex.browse`)."""

    def browse(self, folder: str | None = None, among: list[int] | None = None, sort: str = "name",
               offset: int = 0, limit: int = 60) -> tuple[list[Row], int]: ...


def _page(offset: int, limit: int) -> tuple[int, int]:
    if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
        raise UserError(f"offset {offset!r}: give a whole number of photos to skip, 0 or more")
    if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= MAX_PAGE:
        raise UserError(f"limit {limit!r}: give a number of photos from 1 to {MAX_PAGE}")
    return offset, limit


def _next(offset: int, shown: int, total: int) -> int | None:
    return offset + shown if shown and offset + shown < total else None


def _paths(index: Collection, ids: list[int]) -> dict[int, str]:
    rows = index.catalog.rows_by_id(ids)
    return {i: display_path(r.path) for i, r in rows.items()}


def map_document(index: Collection, method: str = "pca", refresh: bool = False) -> dict[str, Any]:
    """The map, compact: ``{"method", "version", "count", "ids", "x", "y", "theme"}`` (one array each, in the order
    of ``ids``, ascending; x and y in [0, 1], to :data:`COORD_DECIMALS` decimals; theme: the photo's theme id)."""
    m = collection_map(index, method, refresh)
    xy = np.round(m.xy.astype(np.float64), COORD_DECIMALS)  # N x 2
    return {"method": m.method, "version": m.version, "count": len(m.ids), "ids": m.ids.tolist(),
            "x": xy[:, 0].tolist(), "y": xy[:, 1].tolist(), "theme": m.theme.tolist()}


def map_rows(index: Collection, doc: dict[str, Any]) -> list[dict[str, Any]]:
    """The map document photo by photo: ``[{"id", "path", "x", "y", "theme"}, ...]`` (``moco index map --json``)."""
    paths = _paths(index, doc["ids"])
    return [{"id": i, "path": paths.get(i), "x": x, "y": y, "theme": t}
            for i, x, y, t in zip(doc["ids"], doc["x"], doc["y"], doc["theme"])]


def themes_document(index: Collection, k: int | None = None, refresh: bool = False) -> dict[str, Any]:
    """``{"k", "version", "count", "themes": [{"id", "size", "central": [{"id", "path"}], "folders": [{"folder",
    "count"}]}]}``: the themes largest first, each shown by its most central photos and its top folders (``""``:
    the collection's top folder)."""
    themes = collection_themes(index, k, refresh)
    paths = _paths(index, [i for t in themes.themes for i in t.central])
    return {"k": themes.k, "version": themes.version, "count": len(themes.ids), "themes": [
        {"id": t.id, "size": t.size, "central": [{"id": i, "path": paths.get(i)} for i in t.central],
         "folders": [{"folder": display_path(f), "count": c} for f, c in t.folders]} for t in themes.themes]}


def theme_document(index: Collection, theme_id: int, offset: int = 0, limit: int = 60) -> dict[str, Any]:
    """A page of one theme: ``{"id", "size", "offset", "limit", "next_offset", "photos": [{"id", "path",
    "centrality"}]}``, most central first (centrality: the photo's cosine to the theme's centre)."""
    offset, limit = _page(offset, limit)
    page, size = theme_members(index, theme_id, offset, limit)  # a UserError naming a theme the collection lacks
    ids, _, centrality = theme_labels(index)
    paths = _paths(index, page)
    cos = centrality[np.searchsorted(ids, np.asarray(page, np.int64))] if page else []
    return {"id": theme_id, "size": size, "offset": offset, "limit": limit,
            "next_offset": _next(offset, len(page), size),
            "photos": [{"id": i, "path": paths.get(i), "centrality": round(float(c), 6)} for i, c in zip(page, cos)]}


def unusual_document(index: Collection, offset: int = 0, limit: int = 60) -> dict[str, Any]:
    """A page of the unusual photos: ``{"total", "offset", "limit", "next_offset", "photos": [{"id", "path",
    "closest"}]}``, lowest ``closest`` first (the photo's cosine to its closest other photo)."""
    offset, limit = _page(offset, limit)
    page, total = unusual_photos(index, offset, limit)
    paths = _paths(index, [i for i, _ in page])
    return {"total": total, "offset": offset, "limit": limit, "next_offset": _next(offset, len(page), total),
            "photos": [{"id": i, "path": paths.get(i), "closest": round(c, 6)} for i, c in page]}


def browse_photos(index: Browsable, folder: str | None = None, theme: int | None = None, sort: str = "name",
                  offset: int = 0, limit: int = 60) -> tuple[list[Row], int]:
    """A page of the collection's photos and how many there are (:meth:`~index.search.image_index.ImageIndex.browse`)
    under ``folder`` and of ``theme`` (an id of :func:`~index.overview.themes.collection_themes`; None: all); a
    UserError naming a theme the collection lacks."""
    among = None if theme is None else theme_members(index, theme, 0, len(theme_labels(index)[0]))[0]
    return index.browse(folder, among, sort, offset, limit)


def browse_document(index: Browsable, folder: str | None = None, theme: int | None = None, sort: str = "name",
                    offset: int = 0, limit: int = 60) -> dict[str, Any]:
    """A page of the collection: ``{"total", "offset", "limit", "next_offset", "folder", "theme", "sort", "photos":
    [{"id", "path", "taken", "width", "height"}]}`` (:meth:`~index.search.image_index.ImageIndex.browse`)."""
    offset, limit = _page(offset, limit)
    rows, total = browse_photos(index, folder, theme, sort, offset, limit)
    return {"total": total, "offset": offset, "limit": limit, "next_offset": _next(offset, len(rows), total),
            "folder": folder or None, "theme": theme, "sort": sort,
            "photos": [{"id": r.id, "path": display_path(r.path), "taken": taken_text(r.taken), "width": r.width,
                        "height": r.height} for r in rows]}
