"""clip-retrieval's routes, for its clients (``ClipClient``, clip-front): ``POST /knn-service`` and ``GET
/indices-list`` under the API's prefix, so that a client pointed at ``http://HOST:PORT/api/v1`` (clip-front's
backend) or at ``.../api/v1/knn-service`` (``ClipClient(url=...)``) searches this collection.

Of a ``/knn-service`` request it honours ``image`` (base64), ``embedding_input`` (a vector of this index's space, as
``POST /embed`` gives it), ``num_images``, ``deduplicate`` and ``indice_name`` (the one name ``/indices-list`` gives;
missing: that one); ``modality`` must be ``image``. ``text`` and ``image_url`` get a 400 that says why (a MoCo model
has no text encoder; the server fetches no URL); the rest (``num_result_ids``, ``use_mclip``, the safety and
aesthetic options) is accepted and has no effect. The answer is clip-retrieval's: a list of ``{"id", "similarity",
"image_path", "url"}``, the best first, ``url`` the photo's thumbnail on this server. The query photo is not left
out (clip-retrieval does not leave it out either)."""

from __future__ import annotations

import functools

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from app.api.errors import guarded_route
from app.api.models import Filters, json_path
from app.api.search import base64_bytes
from app.api.state import Api, serve
from app.guard.access import API_PREFIX
from app.search.scope import MAX_RESULTS
from app.search.service import Found, NotFound, Several
from index.search.query import check_query_vector
from moco.errors import UserError

__all__ = ["knn_router", "KnnQuery", "KnnResult", "indices_list", "knn_service"]


class KnnQuery(BaseModel):
    """A clip-retrieval ``/knn-service`` request (its fields; those this server has no use for are accepted)."""

    model_config = ConfigDict(extra="allow")

    image: str | None = Field(None, description="the query photo's bytes, base64")
    embedding_input: list[float] | None = Field(None, min_length=1, max_length=65536,
                                                description="instead of a photo: a vector of the index's space "
                                                "(POST /embed)")
    text: str | None = Field(None, description="refused: a MoCo model has no text encoder")
    image_url: str | None = Field(None, description="refused: the server fetches no URL; send the bytes in image")
    modality: str = Field("image", description="image (the only one)")
    num_images: int = Field(40, ge=1, le=MAX_RESULTS, description="results")
    indice_name: str | None = Field(None, description="the index, as /indices-list names it (missing: that one)")
    deduplicate: bool = Field(False, description="no near-copy of a better result")


class KnnResult(BaseModel):
    """One result as clip-retrieval gives it."""

    id: int
    similarity: float = Field(description="the cosine in the index's space (the page's score)")
    image_path: str = Field(description="the photo's path under the collection's folder")
    url: str = Field(description="its thumbnail on this server")


def _knn_query(body: bytes) -> KnnQuery:
    """A ``/knn-service`` body read as JSON whatever its content type, or the 400 naming the field and the fix."""
    try:
        return KnnQuery.model_validate_json(body)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(x) for x in first["loc"]) or "body"
        raise UserError(f"{where}: {first['msg']}: send clip-retrieval's JSON, e.g. {{\"image\": BASE64, "
                        "\"modality\": \"image\", \"num_images\": 40}") from None


def _index_name(api: Api) -> str:
    """The one index the server searches, by its folder's name (clip-retrieval's ``indice_name``)."""
    return api.search.searcher.ready_index().dir.name


async def indices_list(api: Api) -> list[str]:
    """The one index this server searches, by its folder's name (clip-retrieval's `indice_name`)."""
    api.search.ready()
    return [_index_name(api)]


async def knn_service(api: Api, request: Request) -> list[KnnResult]:
    """clip-retrieval's `/knn-service` (module docstring: which fields it honours): the nearest photos to
    `image` or `embedding_input`, the best first. The body is JSON with or without a content type (ClipClient
    sends none)."""
    query = _knn_query(await request.body())
    if query.text is not None:
        raise UserError("text: this server searches by image only (a MoCo model has no text encoder): send "
                        "image (base64) or embedding_input")
    if query.image_url is not None:
        raise UserError("image_url: the server fetches no URL: send the image's bytes as base64 in image")
    if query.modality != "image":
        raise UserError(f"modality {query.modality!r}: this server has image embeddings only: use \"image\"")
    if (query.image is None) == (query.embedding_input is None):
        raise UserError("a search needs one of image (base64) and embedding_input")
    api.search.ready()
    if query.indice_name not in (None, _index_name(api)):
        raise NotFound(f"indice_name {query.indice_name!r}: this server has one index, {_index_name(api)!r} "
                       "(GET /indices-list)")
    scope = Filters().check(api.search, query.num_images)
    if query.image is not None:
        found: Found = await api.search.search_image(base64_bytes(query.image, "image"), "image", scope,
                                                     deduplicate=query.deduplicate, include_queries=True)
    else:
        vector = check_query_vector(query.embedding_input, scope.index.dim)  # D, in the index's space
        found = await api.search.search_several(Several([], [], [], [], vector), scope,
                                                deduplicate=query.deduplicate, include_queries=True)
    hits, n = found.hits, found.n
    base = str(request.base_url).rstrip("/")
    return [KnnResult(id=int(i), similarity=float(s), image_path=json_path(p),
                      url=f"{base}{API_PREFIX}/photos/{int(i)}/thumbnail")
            for i, s, p in zip(hits.ids[n], hits.scores[n], hits.paths[n])]


def knn_router(api: Api) -> APIRouter:
    """clip-retrieval's ``/knn-service`` and ``/indices-list``, answered from ``api``'s searches."""
    router = APIRouter(prefix=API_PREFIX, route_class=guarded_route(api.settings), tags=["clip-retrieval"])
    served = functools.partial(serve, router, api)
    served(indices_list, "/indices-list", "GET", response_model=list[str],
           summary="clip-retrieval's list of indexes: this one")
    served(knn_service, "/knn-service", "POST", response_model=list[KnnResult],
           summary="clip-retrieval's search: an image (base64) or an embedding",
           openapi_extra={"requestBody": {"required": True, "content": {"application/json": {
               "schema": KnnQuery.model_json_schema(ref_template="#/components/schemas/{model}")}}}})
    return router
