"""Who may call the JSON API, and how much they may send: the page's login (its cookie, or HTTP Basic with the same
USER:PASS), a bearer token for programs (``--api-token``), failed attempts throttled with the page's logins, and
request bodies capped at the page's upload limit (:class:`BodyCapMiddleware`)."""

from __future__ import annotations

import base64
import binascii
import contextlib
import hmac
from dataclasses import dataclass, field
from typing import Any

from fastapi import HTTPException, Request

from app.throttle import LoginThrottle
from app.uploads import MAX_UPLOAD_MB
from moco.errors import UserError

API_PREFIX = "/api/v1"

__all__ = ["API_PREFIX", "ApiSettings", "BodyCapMiddleware", "check_access", "check_api_token", "client_address",
           "send_json", "MAX_BODY_BYTES", "MIN_TOKEN_CHARS"]  # fmt: skip


# An upload at the page's cap, base64-encoded (4/3), with room for the form or JSON around it.
MAX_BODY_BYTES = MAX_UPLOAD_MB * 1024 * 1024 * 4 // 3 + 64 * 1024
MIN_TOKEN_CHARS = 16


@dataclass
class ApiSettings:
    """Who may call the API and how searches are batched.

    ``auth``: the page's USER:PASS (None: the page is open); ``token``: a bearer token for programs (None: none);
    ``throttle``: the page's login throttle, shared; ``cors_origins``: web pages (``scheme://host[:port]``) that may
    call it from a browser besides the server's own (:mod:`app.api_cors`). Batching: ``window_ms``, ``max_batch``;
    ``max_pending``: searches admitted at once before 503.
    """

    auth: tuple[str, str] | None = None
    token: str | None = None
    throttle: LoginThrottle = field(default_factory=LoginThrottle)
    window_ms: float = 2.0
    max_batch: int = 16
    max_pending: int = 32
    cors_origins: tuple[str, ...] = ()


def check_api_token(token: str | None) -> str | None:
    """``--api-token`` checked: at least MIN_TOKEN_CHARS characters, no spaces."""
    if not token:
        return None
    spaces = any(c.isspace() for c in token)
    if len(token) < MIN_TOKEN_CHARS or spaces:
        raise UserError(f"--api-token: {len(token)} characters{' with spaces' if spaces else ''}"
                        f"; use at least {MIN_TOKEN_CHARS} without spaces, e.g. the output of "
                        "python -c 'import secrets; print(secrets.token_urlsafe())'")  # fmt: skip
    return token


def client_address(request: Request) -> str:
    return str(request.client.host if request.client else "unknown")[:200]


def _same(a: str, b: str) -> bool:
    return hmac.compare_digest(a.encode("utf-8", "surrogatepass"), b.encode("utf-8", "surrogatepass"))


def check_access(request: Request, settings: ApiSettings) -> None:
    """Let the request through, or HTTPException 401/429 (see the module docstring)."""
    if settings.auth is None and settings.token is None:
        return
    app = request.app
    cookie_id = getattr(app, "cookie_id", None)
    if cookie_id is not None and settings.auth is not None:  # logged in on the page
        cookie = request.cookies.get(f"access-token-{cookie_id}") or request.cookies.get(
            f"access-token-unsecure-{cookie_id}")  # fmt: skip
        if cookie and cookie in getattr(app, "tokens", {}):
            return
    scheme, _, credentials = request.headers.get("authorization", "").partition(" ")
    scheme, credentials = scheme.lower(), credentials.strip()
    if scheme == "bearer" and settings.token is not None:
        account, ok = "(api token)", _same(credentials, settings.token)
    elif scheme == "basic" and settings.auth is not None:
        try:
            user, _, password = base64.b64decode(credentials, validate=True).decode("utf-8").partition(":")
        except (binascii.Error, UnicodeDecodeError):
            user, password = "", ""
        account = user.strip()[:200]
        ok = _same(user, settings.auth[0]) & _same(password, settings.auth[1])
    else:
        ways = ["`Authorization: Bearer TOKEN` (the server's --api-token)" if settings.token else "",
                "HTTP Basic with the page's login (--auth)" if settings.auth else ""]
        how = " or ".join(w for w in ways if w)
        raise HTTPException(401, f"this server needs a login: send {how}",
                            headers={"WWW-Authenticate": "Bearer" if settings.token else "Basic"})  # fmt: skip
    address = client_address(request)
    wait = settings.throttle.wait(address, account)
    if wait > 0:
        raise HTTPException(429, f"too many failed logins from {address} or for this account: try again in "
                            f"{wait:.0f} s", headers={"Retry-After": str(int(wait) + 1)})  # fmt: skip
    settings.throttle.record(address, account, ok=ok)
    if not ok:
        what, flag = ("token", "--api-token") if scheme == "bearer" else ("user name or password", "--auth")
        raise HTTPException(401, f"wrong {what}: check the server's {flag}",
                            headers={"WWW-Authenticate": scheme.title()})  # fmt: skip


class BodyCapMiddleware:
    """ASGI middleware: a request to the API whose body is over ``limit`` bytes gets 413, read no further."""

    def __init__(self, app: Any, limit: int = MAX_BODY_BYTES) -> None:
        self.app, self.limit = app, limit

    def _message(self, size: int) -> str:
        return (f"the request is {size / 1e6:.1f} MB, over the {MAX_UPLOAD_MB} MB upload limit: upload a smaller copy "
                "(for example exported at 4000 px on its long side)")  # fmt: skip

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or not scope["path"].startswith(API_PREFIX + "/"):
            await self.app(scope, receive, send)
            return
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.limit:
            await send_json(send, 413, self._message(int(length)))
            return
        seen, over, started = 0, False, False

        async def capped() -> dict[str, Any]:
            nonlocal seen, over
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:
                    over = True
                    raise _TooLarge
            return message

        async def guarded(message: dict[str, Any]) -> None:
            nonlocal started
            if over:  # the route's own answer to the cut body is replaced by ours
                return
            started = started or message["type"] == "http.response.start"
            await send(message)

        with contextlib.suppress(_TooLarge):  # the body was cut at the cap: the 413 below answers
            await self.app(scope, capped, guarded)
        if over and not started:
            await send_json(send, 413, self._message(seen))


class _TooLarge(Exception):
    """Raised into the route when the body passes the cap, so that it stops reading."""


async def send_json(send: Any, code: int, detail: str) -> None:
    """An ASGI answer: ``code`` with the JSON ``{"detail": detail}`` the API's errors have."""
    import json

    await send({"type": "http.response.start", "status": code, "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": json.dumps({"detail": detail}).encode()})
