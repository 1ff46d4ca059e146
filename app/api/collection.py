"""The JSON API's views of the whole collection: ``GET /stats`` (its counts, index and thresholds), ``/map``,
``/themes``, ``/themes/{id}``, ``/unusual`` and ``/photos`` (a page of it): :mod:`index.overview.documents`' (what
``moco index map|themes|unusual|browse --json`` print), computed one at a time through ``api.views``
(:mod:`app.api.gate`): they never hold up a search."""

from __future__ import annotations

import functools
from typing import Literal

from fastapi import APIRouter, Query
from fastapi import Path as PathParam

from app.api.errors import guarded_route
from app.api.models import (
    FOLDER_FIELD,
    MAX_ID,
    CollectionMap,
    PhotosPage,
    Sort,
    Stats,
    ThemePage,
    ThemesResponse,
    UnusualPage,
)
from app.api.state import Api, serve
from app.guard.access import API_PREFIX
from app.search.service import NotFound
from index.overview.documents import MAX_PAGE as MAX_VIEW_PAGE
from index.overview.documents import (
    BrowsePageDoc,
    browse_document,
    map_document,
    theme_document,
    themes_document,
    unusual_document,
)
from moco.errors import UserError

__all__ = ["collection_router", "stats", "collection_map", "themes", "theme", "unusual", "photos"]

MAX_THEMES_ASKED = 1000  # themes a request may ask for (the automatic number is at most 64)


def stats(api: Api) -> Stats:
    """Counts, index kind, backbone, thresholds and the folder filter's choices."""
    api.search.ready()
    index = api.library.ready_index()
    index.refresh()
    st = index.stats()
    return Stats(images=st["vectors"], unreadable=st["error"], pending=st["pending"], kind=st["kind"],
                 on_gpu=st["on_gpu"], dim=st["dim"], weak_below=st["weak_below"],
                 dedup_threshold=st["dedup_threshold"],
                 dedup_rule=(st.get("dedup_last") or {}).get("rule"),
                 dedup_last_threshold=(st.get("dedup_last") or {}).get("threshold"),
                 backbone_arch=st["backbone_arch"], backbone_sha256=st["backbone_sha256"],
                 space=st["space_description"], updated=st["updated"], folders=api.library.folders())


async def collection_map(api: Api, method: Literal["pca", "umap"] = Query("pca", description="pca, or umap where the "
                                                                          "server has the map extra")) -> CollectionMap:
    """Every indexed photo once, a point in [0, 1]² (alike photos close, from the index's centred features) with its
    theme: compact, one array per field. Computed once per index version and kept with the index."""
    api.search.ready()
    try:
        doc = await api.views.run(map_document, api.library.ready_index(), method)
        return CollectionMap.model_validate(doc.to_json())
    except UserError as e:
        if method == "umap":  # this server lacks the map extra: it has no such map (the message names the fix)
            raise NotFound(str(e)) from None
        raise


async def themes(api: Api, k: int | None = Query(None, ge=1, le=MAX_THEMES_ASKED, description="this many themes "
                                                 "(default: from the collection's size, round(sqrt(N/2)) from 2 to 64)")
                 ) -> ThemesResponse:
    """Groups of alike photos (spherical k-means on the index's centred features), largest first, each with its most
    central photos and its top folders; every photo in exactly one."""
    api.search.ready()
    return ThemesResponse.model_validate((await api.views.run(themes_document, api.library.ready_index(), k)).to_json())


async def theme(api: Api, theme_id: int = PathParam(ge=0, le=MAX_ID), offset: int = Query(0, ge=0),
                limit: int = Query(60, ge=1, le=MAX_VIEW_PAGE)) -> ThemePage:
    """A page of one theme's photos (of the default themes, as GET /api/v1/themes lists them), most central
    first; `next_offset` for the next page."""
    api.search.ready()
    try:
        doc = await api.views.run(theme_document, api.library.ready_index(), theme_id, offset, limit)
        return ThemePage.model_validate(doc.to_json())
    except UserError as e:
        raise NotFound(str(e)) from None


async def unusual(api: Api, offset: int = Query(0, ge=0), limit: int = Query(60, ge=1, le=MAX_VIEW_PAGE)
                  ) -> UnusualPage:
    """The photos farthest from any other, by their centred cosine to their closest other photo, lowest first
    (a photo with an exact copy scores 1: never unusual)."""
    api.search.ready()
    doc = await api.views.run(unusual_document, api.library.ready_index(), offset, limit)
    return UnusualPage.model_validate(doc.to_json())


async def photos(api: Api, folder: str = Query("", **FOLDER_FIELD),  # type: ignore[arg-type]
                 theme: int | None = Query(None, ge=0, le=MAX_ID, description="only the photos of this theme"),
                 sort: Sort = Query("name", description="name (the path), date (taken, oldest first) or -date "
                                    "(newest first)"),
                 offset: int = Query(0, ge=0), limit: int = Query(60, ge=1, le=MAX_VIEW_PAGE)) -> PhotosPage:
    """A page of the collection's photos under `folder`, of `theme`, sorted; photos without a date come last
    when sorted by date."""
    api.search.ready()
    on_disk = api.library.searcher.folder(folder)  # a bad name 400, a folder the collection lacks 404
    index = api.library.ready_index()

    def page() -> BrowsePageDoc:
        if theme is not None:
            try:
                theme_document(index, theme, 0, 1)  # a theme the collection lacks: 404, as GET /themes/{id}
            except UserError as e:
                raise NotFound(str(e)) from None
        return browse_document(index, on_disk, theme, sort, offset, limit)

    return PhotosPage.model_validate((await api.views.run(page)).to_json())


def collection_router(api: Api) -> APIRouter:
    """The collection's routes, answered from ``api``'s :class:`~app.collection.library.Library`."""
    router = APIRouter(prefix=API_PREFIX, route_class=guarded_route(api.settings), tags=["search"])
    served = functools.partial(serve, router, api)
    served(stats, "/stats", "GET", response_model=Stats, summary="The collection and its index")
    served(collection_map, "/map", "GET", response_model=CollectionMap, summary="The map of the collection",
           tags=["collection"])
    served(themes, "/themes", "GET", response_model=ThemesResponse, summary="The collection's themes",
           tags=["collection"])
    served(theme, "/themes/{theme_id}", "GET", response_model=ThemePage, summary="A theme's photos, a page",
           tags=["collection"])
    served(unusual, "/unusual", "GET", response_model=UnusualPage, summary="Unusual photos, a page",
           tags=["collection"])
    served(photos, "/photos", "GET", response_model=PhotosPage, summary="Browse the collection, a page",
           tags=["collection"])
    return router
