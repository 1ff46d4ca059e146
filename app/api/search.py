"""The JSON API's searches: ``POST /search`` (an uploaded image), ``/search/base64``, ``/search/multi`` (several
photos, or a vector) and ``GET /photos/{id}/similar`` (an indexed photo); and ``POST /embed``, a photo's vector.
Each checks its values once into a
:class:`~app.search.scope.Scope` (:class:`~app.api.state.Filters`), then writes
:class:`~app.search.service.SearchService`'s answer as JSON."""

from __future__ import annotations

import base64
import binascii
import functools
from pathlib import Path

import numpy as np
from fastapi import APIRouter, File, Form, Query, UploadFile
from fastapi import Path as PathParam

from app.api.errors import guarded_route
from app.api.models import (
    DEDUPLICATE,
    EXCLUDE_FIELD,
    FOLDER_FIELD,
    IMAGE_TYPES,
    INCLUDE_QUERIES,
    MAX_ID,
    TAKEN_FROM_FIELD,
    TAKEN_TO_FIELD,
    Base64Query,
    EmbedResponse,
    Filters,
    MultiQuery,
    SearchResponse,
)
from app.api.state import Api, serve
from app.guard.access import API_PREFIX
from app.search.scope import MAX_RESULTS
from app.search.service import Several
from index.search.query import check_query_vector
from moco.errors import UserError

__all__ = ["search_router", "base64_bytes", "search", "embed", "search_base64", "search_multi", "similar"]


def base64_bytes(text: str, what: str) -> bytes:
    """The bytes of a base64 field, or the UserError (400) naming ``what`` and how to encode a file."""
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise UserError(f"{what}: image_base64 is not base64 (standard alphabet, padded): encode the file's bytes, "
                        "e.g. base64.b64encode(open(path, 'rb').read()).decode()") from None


def _safe_name(name: str | None) -> str:
    """A client's file name as a plain name for messages and the temporary file ("upload" when it has none)."""
    base = Path(str(name or "")).name.replace("\x00", "")
    base = "".join(c for c in base if c.isprintable())[:120].strip(". ")
    return base or "upload"  # a name for messages only: the temporary file is named by SearchService._read


async def search(api: Api,
                 image: UploadFile = File(description="the query photo (JPEG, PNG, WebP, GIF, BMP, TIFF, AVIF; HEIC "
                                                      "where the server has the heic extra)",
                                          json_schema_extra={"minLength": 1}),
                 k: int = Form(12, ge=1, le=MAX_RESULTS), folder: str = Form("", **FOLDER_FIELD),
                 exclude_folders: list[str] = Form([], **EXCLUDE_FIELD),
                 taken_from: str = Form("", **TAKEN_FROM_FIELD), taken_to: str = Form("", **TAKEN_TO_FIELD),
                 offset: int = Form(0, ge=0),
                 deduplicate: bool = Form(False, description=DEDUPLICATE),
                 include_queries: bool = Form(False, description=INCLUDE_QUERIES)) -> SearchResponse:
    """The nearest photos to an uploaded image (multipart/form-data), ranked by score; the indexed files with the
    image's very bytes are left out unless `include_queries`."""
    data = await image.read()
    filters = Filters(folder, tuple(exclude_folders), taken_from, taken_to)
    scope = filters.check(api.search, k)
    return SearchResponse.of(await api.search.search_image(data, _safe_name(image.filename or "upload"), scope,
                                                          offset, deduplicate, include_queries), filters)


async def embed(api: Api, image: UploadFile = File(description="the photo (the formats of /search)",
                                                   json_schema_extra={"minLength": 1})) -> EmbedResponse:
    """An uploaded photo's vector (multipart/form-data), as the index's searches make it: the same as
    `Embedder.load(backbone, space=IDX).embed`, embedded in a batch with the searches."""
    vector, took = await api.search.embed_image(await image.read(), _safe_name(image.filename or "upload"))
    return EmbedResponse(vector=vector.tolist(), dim=len(vector), took_ms=took)


async def search_base64(api: Api, query: Base64Query) -> SearchResponse:
    """The same search with the image's bytes as base64 in a JSON body (the indexed files with those bytes left
    out unless `include_queries`)."""
    data = base64_bytes(query.image_base64, _safe_name(query.filename))
    filters = Filters(query.folder, tuple(query.exclude_folders), query.taken_from, query.taken_to)
    scope = filters.check(api.search, query.k)
    return SearchResponse.of(await api.search.search_image(data, _safe_name(query.filename), scope, query.offset,
                                                          query.deduplicate, query.include_queries), filters)


async def search_multi(api: Api, query: MultiQuery) -> SearchResponse:
    """The nearest photos to one query made of several: images (base64) and indexed photos (ids) to be like,
    others to be less like; or a raw vector of the index's space. The query photos are left out of the results
    unless `include_queries` (one image alone too, as /search/base64 leaves it out)."""
    filters = Filters(query.folder, tuple(query.exclude_folders), query.taken_from, query.taken_to)
    scope = filters.check(api.search, query.k)
    alone = not (query.images or query.ids or query.not_images or query.not_ids)  # a vector is a whole query
    vector = None if query.vector is None else check_query_vector(query.vector, scope.index.dim) if alone else \
        np.asarray(query.vector, np.float32)  # D
    photos = {side: [(base64_bytes(q.image_base64, f"{side}[{n}] ({_safe_name(q.filename)})"),
                      _safe_name(q.filename)) for n, q in enumerate(getattr(query, side))]
              for side in ("images", "not_images")}
    several = Several(photos["images"], list(query.ids), photos["not_images"], list(query.not_ids), vector)
    return SearchResponse.of(await api.search.search_several(several, scope, query.offset, query.deduplicate,
                                                            query.include_queries), filters)


async def similar(api: Api, photo_id: int = PathParam(ge=0, le=MAX_ID), k: int = Query(12, ge=1, le=MAX_RESULTS),
                  folder: str = Query("", **FOLDER_FIELD), exclude_folders: list[str] = Query([], **EXCLUDE_FIELD),
                  taken_from: str = Query("", **TAKEN_FROM_FIELD), taken_to: str = Query("", **TAKEN_TO_FIELD),
                  offset: int = Query(0, ge=0),
                  deduplicate: bool = Query(False, description=DEDUPLICATE),
                  include_queries: bool = Query(False, description=INCLUDE_QUERIES)) -> SearchResponse:
    """The nearest photos to a photo of the index (its stored vector: the page's click on a result); the photo
    itself is left out unless `include_queries`."""
    filters = Filters(folder, tuple(exclude_folders), taken_from, taken_to)
    scope = filters.check(api.search, k)
    return SearchResponse.of(await api.search.search_id(photo_id, scope, offset, deduplicate, include_queries),
                             filters)


def search_router(api: Api) -> APIRouter:
    """The search routes, answered from ``api``'s :class:`~app.search.service.SearchService`."""
    router = APIRouter(prefix=API_PREFIX, route_class=guarded_route(api.settings), tags=["search"])
    served = functools.partial(serve, router, api)
    served(search, "/search", "POST", response_model=SearchResponse, summary="Search by an uploaded image",
           openapi_extra={"requestBody": {"content": {"multipart/form-data": {
               "encoding": {"image": {"contentType": IMAGE_TYPES}}}}}})
    served(embed, "/embed", "POST", response_model=EmbedResponse, summary="A photo's vector in the index's space")
    served(search_base64, "/search/base64", "POST", response_model=SearchResponse,
           summary="Search by an image sent as base64 in JSON")
    served(search_multi, "/search/multi", "POST", response_model=SearchResponse,
           summary="Search with several photos (more like these, less like those), or a vector")
    served(similar, "/photos/{photo_id}/similar", "GET", response_model=SearchResponse,
           summary="Search by an indexed photo")
    return router
