"""The JSON API beside the page: ``/api/v1/...`` on the FastAPI app Gradio runs on, same port, same process.

One router per resource (:mod:`app.api.search`, :mod:`app.api.photos`, :mod:`app.api.duplicates`,
:mod:`app.api.collection`, :mod:`app.api.knn` for clip-retrieval's clients), every route answered through
:func:`app.api.errors.guarded_route`, from the :class:`app.api.state.Api` it is given.

Routes (typed request and response models; the schema at ``/api/v1/openapi.json``, a docs page at ``/api/v1/docs``
that needs nothing from the internet):

    POST /api/v1/search                    multipart: image (a file), k, folder, exclude_folders, taken_from,
                                           taken_to, offset, deduplicate, include_queries
    POST /api/v1/search/base64             JSON: {"image_base64", "filename", "k", "folder", "exclude_folders",
                                           "taken_from", "taken_to", "offset", "deduplicate", "include_queries"}
    POST /api/v1/search/multi              JSON: several photos, more like "images" and "ids", less like
                                           "not_images" and "not_ids" (or a raw "vector" of the index's space), as
                                           one query (index.search.query); "deduplicate", "include_queries", the filters
    GET  /api/v1/photos/{id}/similar       an indexed photo as the query (its stored vector): k, folder,
                                           exclude_folders, taken_from, taken_to, offset, deduplicate,
                                           include_queries
    POST /api/v1/embed                     multipart: image: its vector in the index's space
    POST /api/v1/knn-service               clip-retrieval's search (image base64 or embedding_input, num_images);
    GET  /api/v1/indices-list              and its list of indexes (this one): for ClipClient and clip-front
    GET  /api/v1/photos/{id}/thumbnail     the thumbnail the page shows (JPEG)
    GET  /api/v1/photos/{id}/original      the original, under the page's rules (indexed, inside the collection,
                                           a regular file, at most MAX_ORIGINAL_BYTES)
    GET  /api/v1/stats                     the collection's counts, index, backbone and thresholds
    GET  /api/v1/duplicates                a page of the groups of duplicates last saved (`moco index dedup` or the
                                           page): offset, limit, kind
    POST /api/v1/duplicates/{id}/keeper    JSON {"photo_id"}: the photo a group keeps
    POST /api/v1/duplicates/{id}/not-duplicates   its photos are never grouped again
    POST /api/v1/duplicates/move           JSON {"groups" | "kinds", "keepers", "dry_run"}: the others of each group
                                           moved to ROOT/.moco-duplicates, journalled; the index updated
    POST /api/v1/duplicates/undo           JSON {"batch"}: moved photos put back; the index updated
    GET  /api/v1/map                       every photo a point of the map (ids, x, y, theme arrays): method
    GET  /api/v1/themes                    the collection's themes, largest first: k
    GET  /api/v1/themes/{id}               a page of one theme's photos, most central first: offset, limit
    GET  /api/v1/unusual                   a page of the photos farthest from any other: offset, limit
    GET  /api/v1/photos                    a page of the collection: folder, theme, sort, offset, limit

The views of the whole collection are :mod:`index.overview.documents`' (what ``moco index map|themes|unusual|browse
--json`` print), computed with the index's version and kept with it.

Every search takes ``deduplicate`` (no result within the near-copy threshold of a better one) and leaves the query
photos out of its results unless ``include_queries`` (the photo searched by id; indexed files with an uploaded
image's very bytes), one photo as several: each request's own, even in a batch. Searches run
through :class:`app.search.service.SearchService`, as the page's Search does (the same checks of ``k``, the folders
and the dates, the same scores and weak-match threshold as the page and ``moco index search --json``). Concurrent
searches share the model: uploads are decoded in a small thread pool, then embedded and searched in batches
(:mod:`app.search.batcher`); past ``max_pending`` requests in flight the API answers 503 with ``Retry-After``.
The views of the whole collection (map, themes, unusual, browse) are computed one at a time in threads of their
own, a few more waiting, past which they answer 503 too (:mod:`app.api.gate`): they never hold up a search.

Errors are JSON ``{"detail": "one line"}``, the page's own messages. Access is the page's: with ``--auth`` a
request needs the page's login cookie, HTTP Basic with the same USER:PASS, or ``Authorization: Bearer TOKEN``
with ``--api-token``; failed attempts are throttled as page logins are (:mod:`app.guard.access`, one shared count).
Request bodies are capped (the page's upload cap, in base64 too); no CORS headers are added for other origins.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from fastapi.openapi.utils import get_openapi
from fastapi.responses import HTMLResponse, JSONResponse

from app.api.collection import collection_router
from app.api.docs import docs_html
from app.api.duplicates import duplicates_router
from app.api.errors import guarded_route
from app.api.knn import knn_router
from app.api.photos import photos_router
from app.api.search import search_router
from app.api.state import Api
from app.guard.access import API_PREFIX

__all__ = ["api_routes"]


def api_routes(api: Api) -> list[Any]:
    """The API's routes (to put in the FastAPI app's routes): each resource's router's, then the schema and the docs
    page."""
    routes = [route for router in (search_router(api), photos_router(api), duplicates_router(api),
                                   collection_router(api), knn_router(api)) for route in router.routes]
    schema: dict[str, Any] = {}

    def openapi_schema() -> dict[str, Any]:
        if not schema:
            schema.update(get_openapi(title="moco-retrieval search API", version="1", routes=routes,
                                      description="Search a photo collection by image or by photo; the same "
                                      "results and scores as the page."))
        return schema

    router = APIRouter(prefix=API_PREFIX, route_class=guarded_route(api.settings), tags=["search"])

    @router.get("/openapi.json", include_in_schema=False)
    def openapi() -> JSONResponse:
        return JSONResponse(openapi_schema())

    @router.get("/docs", include_in_schema=False, response_class=HTMLResponse)
    def docs() -> HTMLResponse:
        return HTMLResponse(docs_html(openapi_schema()))

    return [*routes, *router.routes]
