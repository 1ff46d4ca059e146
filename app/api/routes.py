"""The JSON API beside the page: ``/api/v1/...`` on the FastAPI app Gradio runs on, same port, same process.

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
through :meth:`SearchApp.search_vectors`, the page's own code (the same checks of ``k``, the folders
and the dates, the same scores and weak-match threshold as the page and ``moco index search --json``). Concurrent
searches share the model: uploads are decoded in a small thread pool, then embedded and searched in batches
(:mod:`app.api.batcher`); past ``max_pending`` requests in flight the API answers 503 with ``Retry-After``.
The views of the whole collection (map, themes, unusual, browse) are computed one at a time in threads of their
own, a few more waiting, past which they answer 503 too (:mod:`app.api.gate`): they never hold up a search.

Errors are JSON ``{"detail": "one line"}``, the page's own messages. Access is the page's: with ``--auth`` a
request needs the page's login cookie, HTTP Basic with the same USER:PASS, or ``Authorization: Bearer TOKEN``
with ``--api-token``; failed attempts are throttled as page logins are (:mod:`app.guard.access`, one shared count).
Request bodies are capped (the page's upload cap, in base64 too); no CORS headers are added for other origins.
"""

from __future__ import annotations

import base64
import binascii
import logging
import mimetypes
import urllib.parse
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Literal

import anyio
import numpy as np
from fastapi import APIRouter, File, Form, Query, Request, UploadFile
from fastapi import Path as PathParam
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import FileResponse, HTMLResponse, JSONResponse, Response
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException as StarletteHTTPException

from app.api.docs import docs_html
from app.api.gate import Gate
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
    BrowsePhoto,
    CollectionMap,
    Duplicates,
    ErrorResponse,
    Group,
    Hit,
    KeeperRequest,
    Kind,
    Member,
    MoveRequest,
    MoveResult,
    MultiQuery,
    PhotosPage,
    SearchResponse,
    Sort,
    Stats,
    ThemePage,
    ThemesResponse,
    UndoRequest,
    UnusualPage,
)
from app.guard.access import API_PREFIX, ApiSettings, check_access
from app.page.handlers import SearchApp
from app.page.review import MAX_PAGE
from app.search.batcher import Overloaded
from app.search.scope import MAX_RESULTS, NoSuchFolder, Scope
from app.search.service import Found, NotFound, NotReady, SearchService, Several
from index.catalog import display_path, taken_text
from index.overview.documents import MAX_PAGE as MAX_VIEW_PAGE
from index.overview.documents import (
    browse_document,
    map_document,
    theme_document,
    themes_document,
    unusual_document,
)
from index.search.image_index import ImageIndex
from index.search.query import check_query_vector
from moco.errors import NotFoundError, UserError, clipped

__all__ = ["Api", "Filters", "api_routes"]

logger = logging.getLogger(__name__)

MAX_THEMES_ASKED = 1000  # themes a request may ask for (the automatic number is at most 64)
VIEWS_RUNNING, VIEWS_WAITING = 1, 4  # views of the collection computed at once, and waiting (app/api/gate.py)
MAX_DETAIL = 1000  # characters of an error's one line at most (what it quotes of the request: far fewer)
# what each error code means, in the schema
ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorResponse, "description": what} for code, what in [
        (400, "bad input: an image that cannot be used (empty, not an image, too small or too large), a folder name "
              "with `..`, a body that is not the JSON or form described"), (401, "login or token needed"),
        (404, "no such photo, no such folder in the collection, or no groups of duplicates saved"),
        (413, "the request is over the upload cap"), (429, "too many failed logins"),
        (503, "busy (shed with Retry-After) or the index is not ready yet")]}


# ------------------------------------------------------------------------------------------- the API's state
@dataclass(frozen=True)
class Filters:
    """What a search keeps, besides its ``k``: the folder, the folders left out, the dates taken (as given)."""

    folder: str = ""
    exclude_folders: tuple[str, ...] = ()
    taken_from: str = ""
    taken_to: str = ""

    def check(self, search: SearchService, k: int) -> Scope:
        """The search's :class:`~app.search.scope.Scope` (every value checked once: its 400, or a 404 for a folder
        the collection does not have)."""
        return search.check(k, self.folder, self.exclude_folders, self.taken_from, self.taken_to)


class Api:
    """What the routes serve: the page's ``app`` (groups of duplicates, views of the collection, originals), its
    searches (``search``, a :class:`~app.search.service.SearchService` the page's Search shares), the gate of the
    views of the whole collection (``views``) and the ``settings``."""

    def __init__(self, app: SearchApp, settings: ApiSettings | None = None) -> None:
        self.app, self.settings = app, settings or ApiSettings()
        s = self.settings
        self.search = SearchService(app.searcher, s.window_ms, s.max_batch, s.max_pending)
        self.views = Gate(VIEWS_RUNNING, VIEWS_WAITING)  # the map, themes, unusual: one computed at a time

    def close(self) -> None:
        """Stop the worker threads and remove the uploads folder."""
        self.search.close()
        self.views.close()


def _response(found: Found, filters: Filters) -> SearchResponse:
    """A search's answer as the API gives it."""
    index, n = found.scope.index, found.n
    weak = index.weak_below
    hits = found.hits
    results = [Hit(rank=found.offset + r + 1, id=int(i), path=_json_path(p), score=float(s),
                   weak=weak is not None and float(s) < weak, taken=taken_text(row.taken))
               for r, (i, s, p, row) in enumerate(zip(hits.ids[n], hits.scores[n], hits.paths[n], hits.rows[n]))]
    return SearchResponse(results=results, k=found.scope.k, offset=found.offset,
                          folder=filters.folder.strip("/") or None,
                          exclude_folders=[f.strip("/") for f in filters.exclude_folders if f.strip("/")],
                          taken_from=filters.taken_from or None, taken_to=filters.taken_to or None,
                          next_offset=None if found.last else found.offset + len(results), weak_below=weak,
                          images=len(index), took_ms=found.took_ms)


def _group(index: ImageIndex, g: dict[str, Any]) -> Group:
    """A group of the saved search as the API gives it."""
    keep_hash = next((m.get("hash") for m in g["members"] if m["id"] == g.get("keep_id")), None)

    def member(m: dict[str, Any]) -> Member:
        return Member(id=int(m["id"]), path=_json_path(m["path"]),
                      score=float(m.get("similarity", m.get("best_similarity", 1.0))), copy_score=m.get("copy_score"),
                      width=m.get("width"),
                      height=m.get("height"), bytes=m.get("bytes"),
                      taken=taken_text(m.get("taken")), mtime=m.get("mtime"),
                      identical=bool(keep_hash) and m.get("hash") == keep_hash and m["id"] != g.get("keep_id"))

    by_id = {m["id"]: m for m in g["members"]}
    rep, keep = by_id.get((g.get("representative") or {}).get("id")), by_id.get(g.get("keep_id"))
    return Group(id=g.get("id", ""), kind=g.get("kind", "near"), size=int(g["size"]),
                 representative=member(rep) if rep else None, keep=member(keep) if keep else None,
                 reason=str(g.get("reason") or ""), members=[member(m) for m in g["members"]])


class OriginalResponse(Response):
    """A file already opened (and checked) streamed in chunks with its size as ``Content-Length``, closed at the end
    whatever happens (a client that leaves included). Nothing is copied, so nothing can be evicted before it is sent."""

    CHUNK = 1 << 20

    def __init__(self, f: BinaryIO, size: int, name: str, media_type: str) -> None:
        super().__init__(media_type=media_type, headers={"content-disposition": _attachment(name)})
        self.raw_headers = [(k, v) for k, v in self.raw_headers if k != b"content-length"]
        self.raw_headers.append((b"content-length", str(size).encode()))
        self.file, self.size = f, size

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            left = self.size
            while left > 0:  # exactly the size announced, even if the file grew meanwhile
                chunk = await anyio.to_thread.run_sync(self.file.read, min(self.CHUNK, left))
                if not chunk:  # shrunk meanwhile: the client sees a short body, as announced nowhere else
                    break
                left -= len(chunk)
                await send({"type": "http.response.body", "body": chunk, "more_body": left > 0})
            if left > 0:
                raise OSError(f"{self.size - left} of {self.size} bytes read: the file shrank while it was sent")
        finally:
            self.file.close()


def _attachment(name: str) -> str:
    """``Content-Disposition`` for a download named ``name``, as Starlette's FileResponse writes it."""
    quoted_name = urllib.parse.quote(name)
    return f"attachment; filename*=utf-8''{quoted_name}" if quoted_name != name else f'attachment; filename="{name}"'


def _base64(text: str, what: str) -> bytes:
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


def _json_path(path: str) -> str:
    """A catalog path as JSON text: itself, or escaped as the page shows it when it is not valid UTF-8."""
    try:
        path.encode("utf-8")
        return path
    except UnicodeEncodeError:
        return display_path(path)


# -------------------------------------------------------------------------------------- request errors
def _one_line(e: RequestValidationError) -> str:
    """FastAPI's validation errors as one line: ``k: Input should be less than or equal to 500 (got 501)``."""
    parts = []
    for err in e.errors():
        where = ".".join(str(x) for x in err.get("loc", ()) if x not in ("body", "query", "path", "form"))
        got = err.get("input")
        shown = f" (got {got!r})" if isinstance(got, (int, float, str)) and len(repr(got)) < 40 else ""
        parts.append(f"{where or 'request'}: {err.get('msg', 'invalid')}{shown}")
    return "; ".join(parts) + ": see /api/v1/docs for the expected fields"


def _error(code: int, detail: str, headers: dict[str, str] | None = None) -> JSONResponse:
    """The API's error: ``{"detail": one line}``, at most MAX_DETAIL characters whatever the request held."""
    return JSONResponse({"detail": clipped(detail, MAX_DETAIL)}, status_code=code, headers=headers)


# Starlette's words for a body it cannot parse, and ours (naming what to send instead).
_BODY_ERRORS = {
    "There was an error parsing the body": "the request body cannot be parsed: send UTF-8 JSON of the documented "
    "fields (or a multipart form for /search); see /api/v1/docs",
}


def _http_detail(e: StarletteHTTPException) -> str:
    """An HTTPException's detail as the API's one line (a form with too many fields, a body that does not parse)."""
    detail = str(e.detail)
    if e.status_code == 400:
        detail = _BODY_ERRORS.get(detail, detail)
        if detail.startswith(("Too many fields", "Too many files", "Part exceeded maximum size")):
            detail = f"the form is not what /search takes ({detail.rstrip('.')}): send image, k, folder and offset"
    return detail


# ------------------------------------------------------------------------------------------------ routes
def api_routes(service: Api) -> list[Any]:
    """The API's routes (to put in the FastAPI app's routes), the schema and the docs page among them."""
    settings = service.settings

    class _Route(APIRoute):
        """Every API route: access checked first; errors become JSON with one line."""

        def get_route_handler(self) -> Any:
            handler = super().get_route_handler()

            async def guarded(request: Request) -> Response:
                try:
                    check_access(request, settings)
                    return await handler(request)
                except StarletteHTTPException as e:  # FastAPI's, and Starlette's for a body that does not parse
                    return _error(e.status_code, _http_detail(e), e.headers)
                except RequestValidationError as e:
                    return _error(400, _one_line(e))
                except Overloaded as e:
                    return _error(503, str(e), {"Retry-After": str(e.retry_after)})
                except NotReady as e:
                    return _error(503, str(e), {"Retry-After": "10"})
                except (NotFoundError, NoSuchFolder) as e:
                    return _error(404, str(e))
                except UserError as e:
                    logger.warning("%s", clipped(str(e), MAX_DETAIL))  # one line in the log, as the page's errors
                    return _error(400, str(e))
                except Exception as e:  # noqa: BLE001 - a message, never a traceback; the log has it
                    logger.exception("API request failed")
                    return _error(500, f"{type(e).__name__}: {clipped(str(e))}. The server is still running; details "
                                  "are in its log.")

            return guarded

    router = APIRouter(prefix=API_PREFIX, route_class=_Route, tags=["search"])
    app = service.app

    @router.post("/search", response_model=SearchResponse, responses=ERRORS, summary="Search by an uploaded image",
                 openapi_extra={"requestBody": {"content": {"multipart/form-data": {
                     "encoding": {"image": {"contentType": IMAGE_TYPES}}}}}})
    async def search(image: UploadFile = File(description="the query photo (JPEG, PNG, WebP, GIF, BMP, TIFF, AVIF; "
                                                          "HEIC where the server has the heic extra)",
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
        scope = filters.check(service.search, k)
        return _response(await service.search.search_image(data, _safe_name(image.filename or "upload"), scope, offset,
                                                           deduplicate, include_queries), filters)

    @router.post("/search/base64", response_model=SearchResponse, responses=ERRORS,
                 summary="Search by an image sent as base64 in JSON")
    async def search_base64(query: Base64Query) -> SearchResponse:
        """The same search with the image's bytes as base64 in a JSON body (the indexed files with those bytes left
        out unless `include_queries`)."""
        data = _base64(query.image_base64, _safe_name(query.filename))
        filters = Filters(query.folder, tuple(query.exclude_folders), query.taken_from, query.taken_to)
        scope = filters.check(service.search, query.k)
        return _response(await service.search.search_image(data, _safe_name(query.filename), scope, query.offset,
                                                           query.deduplicate, query.include_queries), filters)

    @router.post("/search/multi", response_model=SearchResponse, responses=ERRORS,
                 summary="Search with several photos (more like these, less like those), or a vector")
    async def search_multi(query: MultiQuery) -> SearchResponse:
        """The nearest photos to one query made of several: images (base64) and indexed photos (ids) to be like,
        others to be less like; or a raw vector of the index's space. The query photos are left out of the results
        unless `include_queries` (one image alone too, as /search/base64 leaves it out)."""
        filters = Filters(query.folder, tuple(query.exclude_folders), query.taken_from, query.taken_to)
        scope = filters.check(service.search, query.k)
        alone = not (query.images or query.ids or query.not_images or query.not_ids)  # a vector is a whole query
        vector = None if query.vector is None else check_query_vector(query.vector, scope.index.dim) if alone else \
            np.asarray(query.vector, np.float32)  # D
        photos = {side: [(_base64(q.image_base64, f"{side}[{n}] ({_safe_name(q.filename)})"), _safe_name(q.filename))
                         for n, q in enumerate(getattr(query, side))] for side in ("images", "not_images")}
        several = Several(photos["images"], list(query.ids), photos["not_images"], list(query.not_ids), vector)
        return _response(await service.search.search_several(several, scope, query.offset, query.deduplicate,
                                                             query.include_queries), filters)

    @router.get("/photos/{photo_id}/similar", response_model=SearchResponse, responses=ERRORS,
                summary="Search by an indexed photo")
    async def similar(photo_id: int = PathParam(ge=0, le=MAX_ID), k: int = Query(12, ge=1, le=MAX_RESULTS),
                      folder: str = Query("", **FOLDER_FIELD), exclude_folders: list[str] = Query([], **EXCLUDE_FIELD),
                      taken_from: str = Query("", **TAKEN_FROM_FIELD), taken_to: str = Query("", **TAKEN_TO_FIELD),
                      offset: int = Query(0, ge=0),
                      deduplicate: bool = Query(False, description=DEDUPLICATE),
                      include_queries: bool = Query(False, description=INCLUDE_QUERIES)) -> SearchResponse:
        """The nearest photos to a photo of the index (its stored vector: the page's click on a result); the photo
        itself is left out unless `include_queries`."""
        filters = Filters(folder, tuple(exclude_folders), taken_from, taken_to)
        scope = filters.check(service.search, k)
        return _response(await service.search.search_id(photo_id, scope, offset, deduplicate, include_queries),
                         filters)

    @router.get("/photos/{photo_id}", response_model=BrowsePhoto, responses=ERRORS, summary="One indexed photo",
                tags=["collection"])
    def photo(photo_id: int = PathParam(ge=0, le=MAX_ID)) -> BrowsePhoto:
        """An indexed photo's path (relative to the collection), date taken and pixels: what a page of /photos lists
        for it (the page's map shows it on hover)."""
        service.search.ready()
        row = app.ready_index().catalog.rows_by_id([photo_id]).get(photo_id)
        if row is None or row.deleted or row.status != "ok":
            raise NotFound(f"photo id {photo_id} is not an indexed photo: search again for current ids")
        return BrowsePhoto(id=row.id, path=display_path(row.path), taken=taken_text(row.taken), width=row.width,
                           height=row.height)

    @router.get("/photos/{photo_id}/thumbnail", responses={**ERRORS, 200: {"content": {"image/jpeg": {}}}},
                response_class=FileResponse, summary="A photo's thumbnail")
    def thumbnail(photo_id: int = PathParam(ge=0, le=MAX_ID)) -> FileResponse:
        """The thumbnail the page shows (JPEG, about 256 px), from the index's thumbs/ folder only."""
        service.search.ready()
        index = app.ready_index()
        row = index.catalog.rows_by_id([photo_id]).get(photo_id)
        thumb = index.thumb_path(row) if row is not None and not row.deleted else None
        thumbs = (index.dir / "thumbs").resolve()
        if thumb is None or thumbs not in thumb.resolve().parents or not thumb.is_file():
            raise NotFound(f"photo id {photo_id} has no thumbnail: search again for current ids")
        return FileResponse(thumb, media_type="image/jpeg")

    @router.get("/photos/{photo_id}/original", responses={**ERRORS, 200: {"content": {"image/*": {}}}},
                response_class=FileResponse, summary="A photo's original file")
    def original(photo_id: int = PathParam(ge=0, le=MAX_ID)) -> Response:
        """The original file under the page's rules: an indexed photo, inside the collection, a regular file of at
        most 64 MB; streamed from the file itself (opened once, checked, sent with its size), never from a copy."""
        service.search.ready()
        index = app.ready_index()
        row = index.catalog.rows_by_id([photo_id]).get(photo_id)
        if row is None or row.deleted or row.status != "ok":
            raise NotFound(f"photo id {photo_id} is not an indexed photo: search again for current ids")
        f, size, name = app.open_original(photo_id)
        return OriginalResponse(f, size, name, mimetypes.guess_type(name)[0] or "application/octet-stream")

    @router.get("/stats", response_model=Stats, responses=ERRORS, summary="The collection and its index")
    def stats() -> Stats:
        """Counts, index kind, backbone, thresholds and the folder filter's choices."""
        service.search.ready()
        index = app.ready_index()
        index.refresh()
        st = index.stats()
        return Stats(images=st["vectors"], unreadable=st["error"], pending=st["pending"], kind=st["kind"],
                     on_gpu=st["on_gpu"], dim=st["dim"], weak_below=st["weak_below"],
                     dedup_threshold=st["dedup_threshold"],
                     dedup_rule=(st.get("dedup_last") or {}).get("rule"),
                     dedup_last_threshold=(st.get("dedup_last") or {}).get("threshold"),
                     backbone_arch=st["backbone_arch"], backbone_sha256=st["backbone_sha256"],
                     space=st["space_description"], updated=st["updated"], folders=app.folders())

    @router.get("/duplicates", response_model=Duplicates, responses=ERRORS, summary="Groups of duplicates, a page")
    def duplicates(offset: int = Query(0, ge=0), limit: int = Query(100, ge=1, le=MAX_PAGE),
                   kind: list[Kind] = Query([], description="exact, near, similar (repeatable; none: those "
                                            "searched)", max_length=3)) -> Duplicates:
        """A page of the groups last saved by `moco index dedup` or the page's Collection tab: exact, then near, then
        similar groups, each kind largest first; `next_offset` for the next page."""
        service.search.ready()
        index = app.ready_index()
        try:
            page = app.duplicates.page(kind or None, offset, limit)
        except UserError as e:  # no search yet, or a damaged dedup.json: no groups to give (not the request's fault)
            raise NotFound(str(e)) from None
        search = page.search
        return Duplicates(threshold=float(search["threshold"]), similar_threshold=search.get("similar_threshold"),
                          rule=search.get("rule"), threshold_source=search.get("threshold_source"),
                          created=search.get("created"), total=page.total, offset=page.offset, limit=page.limit,
                          next_offset=page.next_offset, groups=[_group(index, g) for g in page.groups])

    @router.post("/duplicates/{group_id}/keeper", response_model=Group, responses=ERRORS,
                 summary="Choose the photo a group keeps")
    def keeper(choice: KeeperRequest, group_id: str = PathParam(max_length=100)) -> Group:
        """Keep this photo of the group (now, and in later searches); the group as it is now."""
        service.search.ready()
        return _group(app.ready_index(), app.duplicates.keep(group_id, choice.photo_id))

    @router.post("/duplicates/{group_id}/not-duplicates", response_model=Group, responses=ERRORS,
                 summary="Say a group is not duplicates")
    def not_duplicates(group_id: str = PathParam(max_length=100)) -> Group:
        """Its photos are never grouped again (the marks live in the catalog and survive index updates); the group
        leaves the saved search."""
        service.search.ready()
        return _group(app.ready_index(), app.duplicates.not_duplicates(group_id))

    @router.post("/duplicates/move", response_model=MoveResult, responses=ERRORS,
                 summary="Move the photos groups do not keep")
    def move(request: MoveRequest) -> MoveResult:
        """Move every photo of the groups named (or of every group of the kinds named) but its keeper into the
        collection's hidden `.moco-duplicates` folder, keeping its path (a taken name gets a suffix; nothing is
        deleted or overwritten), journalled; then the index is updated and the duplicates are searched again."""
        service.search.ready()
        out = app.duplicates.move(request.groups, request.kinds, request.keepers, request.dry_run)
        return MoveResult.model_validate(out.as_dict())

    @router.post("/duplicates/undo", response_model=MoveResult, responses=ERRORS, summary="Put moved photos back")
    def undo(request: UndoRequest) -> MoveResult:
        """Put back the photos moved by one action (`batch`), or every photo moved and not yet put back; then the
        index is updated."""
        service.search.ready()
        return MoveResult.model_validate(app.duplicates.undo(request.batch).as_dict())

    @router.get("/map", response_model=CollectionMap, responses=ERRORS, summary="The map of the collection",
                tags=["collection"])
    async def collection_map(method: Literal["pca", "umap"] = Query("pca", description="pca, or umap where the server "
                                                                    "has the map extra")) -> CollectionMap:
        """Every indexed photo once, a point in [0, 1]² (alike photos close, from the index's centred features) with its
        theme: compact, one array per field. Computed once per index version and kept with the index."""
        service.search.ready()
        try:
            return CollectionMap.model_validate(await service.views.run(map_document, app.ready_index(), method))
        except UserError as e:
            if method == "umap":  # this server lacks the map extra: it has no such map (the message names the fix)
                raise NotFound(str(e)) from None
            raise

    @router.get("/themes", response_model=ThemesResponse, responses=ERRORS, summary="The collection's themes",
                tags=["collection"])
    async def themes(k: int | None = Query(None, ge=1, le=MAX_THEMES_ASKED, description="this many themes (default: "
                                           "from the collection's size, round(sqrt(N/2)) from 2 to 64)")
                     ) -> ThemesResponse:
        """Groups of alike photos (spherical k-means on the index's centred features), largest first, each with its most
        central photos and its top folders; every photo in exactly one."""
        service.search.ready()
        return ThemesResponse.model_validate(await service.views.run(themes_document, app.ready_index(), k))

    @router.get("/themes/{theme_id}", response_model=ThemePage, responses=ERRORS, summary="A theme's photos, a page",
                tags=["collection"])
    async def theme(theme_id: int = PathParam(ge=0, le=MAX_ID), offset: int = Query(0, ge=0),
                    limit: int = Query(60, ge=1, le=MAX_VIEW_PAGE)) -> ThemePage:
        """A page of one theme's photos (of the default themes, as GET /api/v1/themes lists them), most central
        first; `next_offset` for the next page."""
        service.search.ready()
        try:
            doc = await service.views.run(theme_document, app.ready_index(), theme_id, offset, limit)
            return ThemePage.model_validate(doc)
        except UserError as e:
            raise NotFound(str(e)) from None

    @router.get("/unusual", response_model=UnusualPage, responses=ERRORS, summary="Unusual photos, a page",
                tags=["collection"])
    async def unusual(offset: int = Query(0, ge=0), limit: int = Query(60, ge=1, le=MAX_VIEW_PAGE)) -> UnusualPage:
        """The photos farthest from any other, by their centred cosine to their closest other photo, lowest first
        (a photo with an exact copy scores 1: never unusual)."""
        service.search.ready()
        return UnusualPage.model_validate(await service.views.run(unusual_document, app.ready_index(), offset, limit))

    @router.get("/photos", response_model=PhotosPage, responses=ERRORS, summary="Browse the collection, a page",
                tags=["collection"])
    async def photos(folder: str = Query("", **FOLDER_FIELD),  # type: ignore[arg-type]
                     theme: int | None = Query(None, ge=0, le=MAX_ID, description="only the photos of this theme"),
                     sort: Sort = Query("name", description="name (the path), date (taken, oldest first) or -date "
                                        "(newest first)"),
                     offset: int = Query(0, ge=0), limit: int = Query(60, ge=1, le=MAX_VIEW_PAGE)) -> PhotosPage:
        """A page of the collection's photos under `folder`, of `theme`, sorted; photos without a date come last
        when sorted by date."""
        service.search.ready()
        on_disk = app.searcher.folder(folder)  # a bad name 400, a folder the collection lacks 404
        index = app.ready_index()

        def page() -> dict[str, Any]:
            if theme is not None:
                try:
                    theme_document(index, theme, 0, 1)  # a theme the collection lacks: 404, as GET /themes/{id}
                except UserError as e:
                    raise NotFound(str(e)) from None
            return browse_document(index, on_disk, theme, sort, offset, limit)

        return PhotosPage.model_validate(await service.views.run(page))

    routes = list(router.routes)
    schema: dict[str, Any] = {}

    def openapi_schema() -> dict[str, Any]:
        if not schema:
            schema.update(get_openapi(title="moco-retrieval search API", version="1", routes=routes,
                                      description="Search a photo collection by image or by photo; the same "
                                      "results and scores as the page."))
        return schema

    @router.get("/openapi.json", include_in_schema=False)
    def openapi() -> JSONResponse:
        return JSONResponse(openapi_schema())

    @router.get("/docs", include_in_schema=False, response_class=HTMLResponse)
    def docs() -> HTMLResponse:
        return HTMLResponse(docs_html(openapi_schema()))

    return list(router.routes)
