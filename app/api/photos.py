"""The JSON API's indexed photos: ``GET /photos/{id}`` (its path, date and pixels), ``/photos/{id}/thumbnail``
(from the index's ``thumbs/`` only) and ``/photos/{id}/original`` (under
:meth:`app.collection.library.Library.open_original`'s rules, streamed from the file it opened and checked)."""

from __future__ import annotations

import functools
import mimetypes
import urllib.parse
from typing import Any, BinaryIO

import anyio
from fastapi import APIRouter
from fastapi import Path as PathParam
from fastapi.responses import FileResponse, Response

from app.api.errors import ERRORS, guarded_route
from app.api.models import MAX_ID, BrowsePhoto
from app.api.state import Api, serve
from app.guard.access import API_PREFIX
from app.search.service import NotFound
from index.catalog import date_text, display_path

__all__ = ["photos_router", "OriginalResponse", "photo", "thumbnail", "original"]


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


def photo(api: Api, photo_id: int = PathParam(ge=0, le=MAX_ID)) -> BrowsePhoto:
    """An indexed photo's path (relative to the collection), date taken and pixels: what a page of /photos lists
    for it (the page's map shows it on hover)."""
    api.search.ready()
    row = api.library.indexed(photo_id)
    if row is None:
        raise NotFound(f"photo id {photo_id} is not an indexed photo: search again for current ids")
    return BrowsePhoto(id=row.id, path=display_path(row.path), taken=date_text(row.date), width=row.width,
                       height=row.height)


def thumbnail(api: Api, photo_id: int = PathParam(ge=0, le=MAX_ID)) -> FileResponse:
    """The thumbnail the page shows (JPEG, about 256 px), from the index's thumbs/ folder only."""
    api.search.ready()
    index = api.library.ready_index()
    row = index.catalog.rows_by_id([photo_id]).get(photo_id)
    thumb = index.thumb_path(row) if row is not None and not row.deleted else None
    thumbs = (index.dir / "thumbs").resolve()
    if thumb is None or thumbs not in thumb.resolve().parents or not thumb.is_file():
        raise NotFound(f"photo id {photo_id} has no thumbnail: search again for current ids")
    return FileResponse(thumb, media_type="image/jpeg")


def original(api: Api, photo_id: int = PathParam(ge=0, le=MAX_ID)) -> Response:
    """The original file under the page's rules: an indexed photo, inside the collection, a regular file of at
    most 64 MB; streamed from the file itself (opened once, checked, sent with its size), never from a copy."""
    api.search.ready()
    if api.library.indexed(photo_id) is None:
        raise NotFound(f"photo id {photo_id} is not an indexed photo: search again for current ids")
    f, size, name = api.library.open_original(photo_id)
    return OriginalResponse(f, size, name, mimetypes.guess_type(name)[0] or "application/octet-stream")


def photos_router(api: Api) -> APIRouter:
    """The routes of one indexed photo, answered from ``api``'s :class:`~app.collection.library.Library`."""
    router = APIRouter(prefix=API_PREFIX, route_class=guarded_route(api.settings), tags=["search"])
    served = functools.partial(serve, router, api)
    served(photo, "/photos/{photo_id}", "GET", response_model=BrowsePhoto, summary="One indexed photo",
           tags=["collection"])
    served(thumbnail, "/photos/{photo_id}/thumbnail", "GET", responses={**ERRORS, 200: {"content": {"image/jpeg": {}}}},
           response_class=FileResponse, summary="A photo's thumbnail")
    served(original, "/photos/{photo_id}/original", "GET", responses={**ERRORS, 200: {"content": {"image/*": {}}}},
           response_class=FileResponse, summary="A photo's original file")
    return router
