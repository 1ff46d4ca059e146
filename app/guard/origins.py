"""Which web pages may call the server from a browser: its own, and the origins named with ``--api-cors-origin``;
and which names it answers to.

The server's outermost layers (:func:`guard_middleware`, on the app uvicorn runs, from its first request), in order:

1. :class:`HostGuardMiddleware`: the ``Host`` header, on every route. A page whose own name its DNS later points at
   this machine (DNS rebinding) calls the server as its own origin, with ``Host`` and ``Origin`` both its name, which
   no origin check can tell from the server's own page. So the server answers only to the names it has: localhost
   (and ``*.localhost``), any IP address (a rebinding page has a name), the ``--host`` name, and names given with
   ``--allowed-host`` (``*``: any, for a proxy that checks names itself); other names get 403, as Jupyter refuses
   non-local ``Host`` names. This holds whatever address it is bound to: reached by a name on the LAN or behind a
   reverse proxy, name it. Hand-written: Starlette's ``TrustedHostMiddleware`` takes a list of names, and cannot
   let every IP address through (a server bound to 0.0.0.0 is reached by any of its addresses) nor say the fix.
2. :class:`OriginGuardMiddleware`: what CORS does not do. A browser sends ``Origin`` with a request another site's
   script makes, with the visitor's login cookie (Gradio's is ``SameSite=None``). The API refuses, with 403, every
   request (preflights too) whose ``Origin`` is neither the server's own (the ``Host`` it was called by) nor named:
   nothing it would do is done. The page's routes refuse, with 403, every request of another site's page that would
   change something (any method but GET, HEAD and OPTIONS: an upload, a queued event, a login) and its websockets
   (cross-site request forgery); its other requests are answered as to a program, without their ``Origin``, so no
   CORS header lets the other site's script read the answer.
3. Starlette's ``CORSMiddleware``: the CORS headers of the named origins (the answer, the preflight), on every
   route. Its presence also turns off Gradio's own CORS middleware, which reflects any origin with credentials when
   the server is reached under a name other than localhost (gr.mount_gradio_app's documented rule).
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Sequence
from typing import Any
from urllib.parse import urlsplit

from app.guard.access import API_PREFIX, send_json
from moco.errors import UserError

__all__ = ["OriginGuardMiddleware", "HostGuardMiddleware", "guard_middleware", "check_cors_origins",
           "check_allowed_hosts", "host_allowed"]

_ORIGIN = re.compile(r"^https?://[^/\s?#@]+$")
_NAME = re.compile(r"^[a-z0-9_-]+(\.[a-z0-9_-]+)*$")
_DEFAULT_PORTS = {"http": 80, "https": 443}
ALLOW_METHODS = ("GET", "POST", "OPTIONS")  # what a named origin's page may send
ALLOW_HEADERS = ("Authorization", "Content-Type")
EXPOSE_HEADERS = ("Retry-After",)  # a script told 503 may read how long to wait


def check_cors_origins(values: Sequence[str]) -> tuple[str, ...]:
    """``--api-cors-origin`` values (repeated or comma-separated) as origins ``scheme://host[:port]``, lower case."""
    out: list[str] = []
    for value in (v.strip() for item in values for v in item.split(",")):
        if not value:
            continue
        if value == "*":
            raise UserError("--api-cors-origin '*': name each web page's origin (e.g. --api-cors-origin "
                            "https://app.example): '*' would let any site read your photos with a visitor's "
                            "login")
        origin = value.rstrip("/").lower()
        if not _ORIGIN.match(origin):
            raise UserError(f"--api-cors-origin {value!r}: expected an origin, scheme://host[:port] with no path, "
                            "e.g. https://app.example or http://localhost:3000")
        out.append(_canonical(origin))
    return tuple(dict.fromkeys(out))


def check_allowed_hosts(values: Sequence[str]) -> tuple[str, ...]:
    """``--allowed-host`` values (repeated or comma-separated) as host names, lower case; ``*``: any name."""
    out: list[str] = []
    for value in (v.strip() for item in values for v in item.split(",")):
        name = value.lower().rstrip(".")
        if value and name != "*" and not _NAME.match(name):
            raise UserError(f"--allowed-host {value!r}: expected a host name as the address bar shows it, without "
                            "scheme, port or path, e.g. --allowed-host photos.example")
        out += [name] if value else []
    return tuple(dict.fromkeys(out))


def _host_name(host: str) -> str:
    """A ``Host`` header's name, lower case, without its port, brackets or final dot."""
    host = host.strip().lower()
    if host.startswith("[") and "]" in host:
        return host[1 : host.index("]")]
    name, sep, port = host.rpartition(":")
    return (name if sep and port.isdigit() and ":" not in name else host).rstrip(".")


def host_allowed(host: str, bind: str = "127.0.0.1", names: Sequence[str] = ()) -> bool:
    """Whether a request's ``Host`` names this server (the module's rule): empty, an IP address, localhost or
    ``*.localhost``, the ``bind`` name, or one of ``names`` (``*``: any)."""
    name = _host_name(host)
    if not name or "*" in names or name == "localhost" or name.endswith(".localhost"):
        return True
    try:
        ipaddress.ip_address(name)
        return True
    except ValueError:
        return name in names or name == bind.strip().lower().rstrip(".")


class HostGuardMiddleware:
    """ASGI middleware for every route: a ``Host`` that does not name this server (:func:`host_allowed`) gets 403."""

    def __init__(self, app: Any, bind: str = "127.0.0.1", names: Sequence[str] = ()) -> None:
        self.app, self.bind, self.names = app, bind, tuple(names)

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        host = _headers(scope).get(b"host", b"").decode("latin-1") if scope["type"] in ("http", "websocket") else ""
        if host_allowed(host, self.bind, self.names):
            await self.app(scope, receive, send)
        elif scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})
        else:
            name = _host_name(host)[:100]
            fix = f"--allowed-host {name}" if _NAME.match(name) else "--allowed-host NAME"
            await send_json(send, 403, f"this server does not answer to the name {name!r} (the request's Host): "
                            f"start it with {fix} if that is its name; other names are refused against DNS "
                            "rebinding")


def _canonical(origin: str) -> str:
    """A flag's origin as browsers send it (``scheme://host[:port]``, no default port); UserError for a bad port."""
    out = _origin(origin)
    if out is None:
        raise UserError(f"--api-cors-origin {origin!r}: its port is not a number from 0 to 65535")
    return out


def _origin(value: str) -> str | None:
    """``value`` (an ``Origin`` header, lower case) as ``scheme://host[:port]`` without a default port; None when it
    is not one (``null``, a path, a bad port)."""
    if not _ORIGIN.match(value):
        return None
    parts = urlsplit(value)
    try:
        port = parts.port
    except ValueError:
        return None
    host = parts.hostname or ""
    if ":" in host:  # IPv6
        host = f"[{host}]"
    keep = port is not None and port != _DEFAULT_PORTS[parts.scheme]
    return f"{parts.scheme}://{host}{f':{port}' if keep else ''}"


def _same_origin(origin: str | None, host: str) -> bool:
    """Whether ``origin`` (canonical) names the server itself: its host[:port] is the request's ``Host``."""
    if origin is None or not host:
        return False
    scheme, _, want = origin.partition("://")
    host = host.lower()
    return host == want or host == f"{want}:{_DEFAULT_PORTS[scheme]}"


def _request_origin(headers: dict[bytes, bytes]) -> tuple[str, str | None, bool]:
    """(the ``Origin`` as sent, lower case ("" when none); its canonical form or None; whether it is the server's)."""
    sent = headers.get(b"origin", b"").decode("latin-1").strip().lower()
    origin = _origin(sent) if sent else None
    return sent, origin, _same_origin(origin, headers.get(b"host", b"").decode("latin-1"))


def _headers(scope: dict[str, Any]) -> dict[bytes, bytes]:
    return dict(scope.get("headers") or [])


def _is_api(scope: dict[str, Any]) -> bool:
    return scope["type"] == "http" and (scope["path"] == API_PREFIX or scope["path"].startswith(API_PREFIX + "/"))


_SAFE_METHODS = ("GET", "HEAD", "OPTIONS")  # what another site's page may send to the page's routes: it changes nothing


class OriginGuardMiddleware:
    """ASGI middleware, outside ``CORSMiddleware``: a request from another site's page (an ``Origin`` that is neither
    the server's own nor in ``allowed``) gets 403 from the API, 403 from the page's routes unless it only reads
    (GET, HEAD, OPTIONS), and its websockets are closed; a read of the page's routes passes without its ``Origin``.
    No ``Origin`` (a program, a navigation), the server's own and a named one pass as they are."""

    def __init__(self, app: Any, allowed: Sequence[str] = ()) -> None:
        self.app, self.allowed = app, frozenset(allowed)

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        sent, origin, own = _request_origin(_headers(scope))
        if not sent or own or origin in self.allowed:
            await self.app(scope, receive, send)
        elif scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})
        elif _is_api(scope):
            await _refuse(send, sent, origin)
        elif scope["method"] not in _SAFE_METHODS:
            await send_json(send, 403, f"a web page from {origin or repr(sent[:100])} may not send {scope['method']} "
                            "requests to this page's routes (they carry the visitor's login): use the page itself")
        else:
            headers = [(k, v) for k, v in scope["headers"] if k.lower() != b"origin"]
            await self.app({**scope, "headers": headers}, receive, send)


async def _refuse(send: Any, sent: str, origin: str | None) -> None:
    """403 for a page from ``origin`` (canonical; None: ``sent``, the header, names no origin, e.g. ``null``)."""
    if origin is None:
        detail = (f"a web page with Origin {sent[:100]!r} may not call this API: only pages from origins named with "
                  "--api-cors-origin (scheme://host[:port]) may")
    else:
        detail = f"a web page from {origin} may not call this API: start the server with --api-cors-origin {origin} "
        detail += "to allow that page"
    await send_json(send, 403, detail)


def guard_middleware(bind: str = "127.0.0.1", names: Sequence[str] = (), origins: Sequence[str] = ()) -> list[Any]:
    """The server's outermost middleware, the first outermost (the module's docstring): the ``Host`` check (``bind``,
    ``names``: :func:`host_allowed`), the origin guard and the CORS headers of ``origins``."""
    from starlette.middleware import Middleware
    from starlette.middleware.cors import CORSMiddleware

    return [Middleware(HostGuardMiddleware, bind=bind, names=names),
            Middleware(OriginGuardMiddleware, allowed=origins),
            Middleware(CORSMiddleware, allow_origins=list(origins), allow_methods=ALLOW_METHODS,
                       allow_headers=ALLOW_HEADERS, expose_headers=EXPOSE_HEADERS, allow_credentials=True,
                       max_age=600)]
