"""How every route of the JSON API answers: the access rule checked first, then an error of any kind as JSON
``{"detail": "one line"}`` with its code (:func:`guarded_route`), and what each code means in the schema
(``ERRORS``)."""

from __future__ import annotations

import logging
from typing import Any

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException as StarletteHTTPException

from app.api.models import ErrorResponse
from app.guard.access import ApiSettings, check_access
from app.search.batcher import Overloaded
from app.search.scope import NoSuchFolder
from app.search.service import NotReady
from moco.errors import NotFoundError, UserError, clipped

__all__ = ["ERRORS", "MAX_DETAIL", "guarded_route", "error"]

logger = logging.getLogger(__name__)

MAX_DETAIL = 1000  # characters of an error's one line at most (what it quotes of the request: far fewer)
# what each error code means, in the schema
ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorResponse, "description": what} for code, what in [
        (400, "bad input: an image that cannot be used (empty, not an image, too small or too large), a folder name "
              "with `..`, a body that is not the JSON or form described"), (401, "login or token needed"),
        (404, "no such photo, no such folder in the collection, or no groups of duplicates saved"),
        (413, "the request is over the upload cap"), (429, "too many failed logins"),
        (503, "busy (shed with Retry-After) or the index is not ready yet")]}


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


def error(code: int, detail: str, headers: dict[str, str] | None = None) -> JSONResponse:
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


def guarded_route(settings: ApiSettings) -> type[APIRoute]:
    """The route class of every API router: access checked under ``settings`` first; errors become JSON with one
    line (a UserError 400, not found 404, busy or not ready 503 with ``Retry-After``, anything else 500)."""

    class Guarded(APIRoute):
        """Every API route: access checked first; errors become JSON with one line."""

        def get_route_handler(self) -> Any:
            handler = super().get_route_handler()

            async def guarded(request: Request) -> Response:
                try:
                    check_access(request, settings)
                    return await handler(request)
                except StarletteHTTPException as e:  # FastAPI's, and Starlette's for a body that does not parse
                    return error(e.status_code, _http_detail(e), e.headers)
                except RequestValidationError as e:
                    return error(400, _one_line(e))
                except Overloaded as e:
                    return error(503, str(e), {"Retry-After": str(e.retry_after)})
                except NotReady as e:
                    return error(503, str(e), {"Retry-After": "10"})
                except (NotFoundError, NoSuchFolder) as e:
                    return error(404, str(e))
                except UserError as e:
                    logger.warning("%s", clipped(str(e), MAX_DETAIL))  # one line in the log, as the page's errors
                    return error(400, str(e))
                except Exception as e:  # noqa: BLE001 - a message, never a traceback; the log has it
                    logger.exception("API request failed")
                    return error(500, f"{type(e).__name__}: {clipped(str(e))}. The server is still running; details "
                                 "are in its log.")

            return guarded

    return Guarded
