"""The views of the whole collection as typed documents: what ``moco index map|themes|unusual|browse --json`` print
(``to_json()``) and the JSON API's ``/api/v1/map``, ``/themes``, ``/themes/{id}``, ``/unusual`` and ``/photos``
answer, made here once so that the two cannot disagree. Paths are relative to the collection root (a name that is
not UTF-8 escaped as the page shows it); dates taken are ISO 8601 on the camera's clock.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Protocol

import numpy as np

from index.catalog import Row, date_text, display_path
from index.overview.cache import Collection
from index.overview.layout import collection_map
from index.overview.themes import collection_themes, theme_labels, theme_members
from index.overview.unusual import unusual_photos
from moco.errors import UserError

__all__ = ["Browsable", "CollectionMapDoc", "MapPoint", "CentralPhoto", "ThemeFolder", "ThemeSummary", "ThemesDoc",
           "ThemePhotoItem", "ThemePageDoc", "UnusualPhotoItem", "UnusualPageDoc", "BrowsePhotoItem",
           "BrowsePageDoc", "map_document", "map_rows", "themes_document", "theme_document", "unusual_document",
           "browse_photos", "browse_document", "MAX_PAGE", "COORD_DECIMALS"]

MAX_PAGE = 500  # photos in one page of a theme, of the unusual photos, of the collection
COORD_DECIMALS = 5  # map coordinates in [0, 1]: 1e-5 is far under a pixel of any screen


class Browsable(Collection, Protocol):
    """An index that also pages through its photos (:meth:`~index.search.image_index.ImageIndex.browse`)."""

    def browse(self, folder: str | None = None, among: list[int] | None = None, sort: str = "name",
               offset: int = 0, limit: int = 60) -> tuple[list[Row], int]: ...


# ------------------------------------------------------------------------------- the documents
# Frozen, and each ``to_json()`` is the JSON, keys in the order of the fields (asdict: the photos, a page at most).
@dataclass(frozen=True)
class CollectionMapDoc:
    """The map, compact: one list per field, in the order of ``ids`` (ascending)."""

    method: str  # "pca" or "umap"
    version: str  # the index version it was computed for
    count: int  # photos on the map: len(ids)
    ids: list[int]
    x: list[float]  # in [0, 1], to COORD_DECIMALS decimals
    y: list[float]  # in [0, 1]
    theme: list[int]  # each photo's theme id

    def to_json(self) -> dict[str, Any]:
        """``{"method", "version", "count", "ids", "x", "y", "theme"}`` (no asdict: N may be large)."""
        return {"method": self.method, "version": self.version, "count": self.count, "ids": list(self.ids),
                "x": list(self.x), "y": list(self.y), "theme": list(self.theme)}


@dataclass(frozen=True)
class MapPoint:
    """One photo of the map (:func:`map_rows`)."""

    id: int
    path: str | None  # None: the photo left the catalog since
    x: float  # in [0, 1]
    y: float
    theme: int

    def to_json(self) -> dict[str, Any]:
        """``{"id", "path", "x", "y", "theme"}``."""
        return {"id": self.id, "path": self.path, "x": self.x, "y": self.y, "theme": self.theme}


@dataclass(frozen=True)
class CentralPhoto:
    """One of a theme's most central photos."""

    id: int
    path: str | None


@dataclass(frozen=True)
class ThemeFolder:
    """One of a theme's top folders and its photos in it."""

    folder: str  # "": the collection's top folder
    count: int


@dataclass(frozen=True)
class ThemeSummary:
    """A theme: its id (0 the largest), size, most central photos (most first) and top folders (most photos first)."""

    id: int
    size: int
    central: list[CentralPhoto]
    folders: list[ThemeFolder]


@dataclass(frozen=True)
class ThemesDoc:
    """The collection's themes, largest first."""

    k: int  # the number of themes
    version: str
    count: int  # photos in the themes: every indexed photo, each in one
    themes: list[ThemeSummary]

    def to_json(self) -> dict[str, Any]:
        """``{"k", "version", "count", "themes": [{"id", "size", "central": [{"id", "path"}], "folders":
        [{"folder", "count"}]}]}``."""
        return asdict(self)


@dataclass(frozen=True)
class ThemePhotoItem:
    """A photo of a theme's page."""

    id: int
    path: str | None
    centrality: float  # the photo's cosine to its theme's centre, to 6 decimals


@dataclass(frozen=True)
class ThemePageDoc:
    """A page of one theme's photos, most central first."""

    id: int
    size: int  # the theme's photos
    offset: int
    limit: int
    next_offset: int | None  # None after the last page
    photos: list[ThemePhotoItem]

    def to_json(self) -> dict[str, Any]:
        """``{"id", "size", "offset", "limit", "next_offset", "photos": [{"id", "path", "centrality"}]}``."""
        return asdict(self)


@dataclass(frozen=True)
class UnusualPhotoItem:
    """A photo of a page of the unusual ones."""

    id: int
    path: str | None
    closest: float  # the photo's cosine to its closest other photo, to 6 decimals (1: it has a copy)


@dataclass(frozen=True)
class UnusualPageDoc:
    """A page of the unusual photos, lowest ``closest`` first."""

    total: int  # photos ranked
    offset: int
    limit: int
    next_offset: int | None
    photos: list[UnusualPhotoItem]

    def to_json(self) -> dict[str, Any]:
        """``{"total", "offset", "limit", "next_offset", "photos": [{"id", "path", "closest"}]}``."""
        return asdict(self)


@dataclass(frozen=True)
class BrowsePhotoItem:
    """A photo of a page of the collection."""

    id: int
    path: str
    taken: str | None  # ISO 8601 on the camera's clock
    width: int | None
    height: int | None


@dataclass(frozen=True)
class BrowsePageDoc:
    """A page of the collection's photos under ``folder``, of ``theme``, by ``sort``."""

    total: int  # photos that pass the filters
    offset: int
    limit: int
    next_offset: int | None
    folder: str | None  # None: all
    theme: int | None  # None: all
    sort: str  # "name", "date" or "-date"
    photos: list[BrowsePhotoItem]

    def to_json(self) -> dict[str, Any]:
        """``{"total", "offset", "limit", "next_offset", "folder", "theme", "sort", "photos": [{"id", "path",
        "taken", "width", "height"}]}``."""
        return asdict(self)


# ------------------------------------------------------------------------------- made from the index
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


def map_document(index: Collection, method: str = "pca", refresh: bool = False) -> CollectionMapDoc:
    """The map, compact (x and y rounded to :data:`COORD_DECIMALS` decimals)."""
    m = collection_map(index, method, refresh)
    xy = np.round(m.xy.astype(np.float64), COORD_DECIMALS)  # N x 2
    return CollectionMapDoc(method=m.method, version=m.version, count=len(m.ids), ids=m.ids.tolist(),
                            x=xy[:, 0].tolist(), y=xy[:, 1].tolist(), theme=m.theme.tolist())


def map_rows(index: Collection, doc: CollectionMapDoc) -> list[MapPoint]:
    """The map document photo by photo, with paths (``moco index map --json``)."""
    paths = _paths(index, doc.ids)
    return [MapPoint(id=i, path=paths.get(i), x=x, y=y, theme=t)
            for i, x, y, t in zip(doc.ids, doc.x, doc.y, doc.theme)]


def themes_document(index: Collection, k: int | None = None, refresh: bool = False) -> ThemesDoc:
    """The themes largest first, each shown by its most central photos and its top folders."""
    themes = collection_themes(index, k, refresh)
    paths = _paths(index, [i for t in themes.themes for i in t.central])
    return ThemesDoc(k=themes.k, version=themes.version, count=len(themes.ids), themes=[
        ThemeSummary(id=t.id, size=t.size, central=[CentralPhoto(id=i, path=paths.get(i)) for i in t.central],
                     folders=[ThemeFolder(folder=display_path(f), count=c) for f, c in t.folders])
        for t in themes.themes])


def theme_document(index: Collection, theme_id: int, offset: int = 0, limit: int = 60) -> ThemePageDoc:
    """A page of one theme, most central first."""
    offset, limit = _page(offset, limit)
    page, size = theme_members(index, theme_id, offset, limit)  # a UserError naming a theme the collection lacks
    ids, _, centrality = theme_labels(index)
    paths = _paths(index, page)
    cos = centrality[np.searchsorted(ids, np.asarray(page, np.int64))] if page else []
    return ThemePageDoc(id=theme_id, size=size, offset=offset, limit=limit,
                        next_offset=_next(offset, len(page), size),
                        photos=[ThemePhotoItem(id=i, path=paths.get(i), centrality=round(float(c), 6))
                                for i, c in zip(page, cos)])


def unusual_document(index: Collection, offset: int = 0, limit: int = 60) -> UnusualPageDoc:
    """A page of the unusual photos, lowest ``closest`` first."""
    offset, limit = _page(offset, limit)
    page, total = unusual_photos(index, offset, limit)
    paths = _paths(index, [i for i, _ in page])
    return UnusualPageDoc(total=total, offset=offset, limit=limit, next_offset=_next(offset, len(page), total),
                          photos=[UnusualPhotoItem(id=i, path=paths.get(i), closest=round(c, 6)) for i, c in page])


def browse_photos(index: Browsable, folder: str | None = None, theme: int | None = None, sort: str = "name",
                  offset: int = 0, limit: int = 60) -> tuple[list[Row], int]:
    """A page of the collection's photos and how many there are (:meth:`~index.search.image_index.ImageIndex.browse`)
    under ``folder`` and of ``theme`` (an id of :func:`~index.overview.themes.collection_themes`; None: all); a
    UserError naming a theme the collection lacks."""
    among = None if theme is None else theme_members(index, theme, 0, len(theme_labels(index)[0]))[0]
    return index.browse(folder, among, sort, offset, limit)


def browse_document(index: Browsable, folder: str | None = None, theme: int | None = None, sort: str = "name",
                    offset: int = 0, limit: int = 60) -> BrowsePageDoc:
    """A page of the collection (:meth:`~index.search.image_index.ImageIndex.browse`)."""
    offset, limit = _page(offset, limit)
    rows, total = browse_photos(index, folder, theme, sort, offset, limit)
    return BrowsePageDoc(total=total, offset=offset, limit=limit, next_offset=_next(offset, len(rows), total),
                         folder=folder or None, theme=theme, sort=sort,
                         photos=[BrowsePhotoItem(id=r.id, path=display_path(r.path), taken=date_text(r.date),
                                                 width=r.width, height=r.height) for r in rows])
