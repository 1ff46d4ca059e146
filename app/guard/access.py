"""Who may call the server, and how much they may send: one access rule for every route of the port (the page,
Gradio's own API, queue, file and upload routes, the JSON API), whatever the server is given.

With ``--auth USER:PASS``, ``--api-token TOKEN`` or both, a request needs one of: the page's login cookie (its login
form takes USER:PASS, or the user name ``token`` with TOKEN as the password), ``Authorization: Bearer TOKEN``, or
HTTP Basic with either pair. :class:`AccessMiddleware` checks it before any route runs; an anonymous request reaches
only the login form (``GET /`` answers 200 with a small form of its own: Gradio's page would name the collection's
folders in its API description) and Gradio's packaged frontend files. Failed attempts, from the page's form and from
``Authorization`` alike, count in one :class:`LoginThrottle` per address and account (the account of a token is
``token``). Request bodies to the API are capped at the page's upload limit (:class:`BodyCapMiddleware`).

The throttle. A login attempt comes from an *address* (the socket peer; behind a reverse proxy named with
``--trusted-proxy``, the client that proxy reports in ``X-Forwarded-For``: uvicorn's ``forwarded_allow_ips``, in
app.server.launch) for an *account* (the username typed; ``token`` for a bearer token). After a few wrong
passwords, attempts wait, longer each time; one throttle counts the attempts of every door (the page's login form,
``Authorization`` headers). Two counts of wrong passwords are kept:

- per (address, account): ``free`` (5) failures, then that address waits before trying that account again:
  ``base_s`` (1 s), doubling with each further failure up to ``max_s`` (5 min). Other accounts from the same
  address, and the same account from other addresses, are not held by it.
- per account, from all addresses together: ``account_free`` (20) failures, then the account waits the same
  way, whichever address asks: rotating addresses cannot try unlimited passwords for one account. Addresses
  that logged into the account successfully before (its 16 latest, while the server runs) are not held by
  this wait, only by their own count, so someone else's guessing cannot lock the owner out.

A success clears the (address, account) count, not the account's (else the owner's logins would hand the
guesser new tries). A count quiet for ``forget_s`` (15 min) starts again from zero. While an attempt must
wait it is answered ``429 Too Many Requests`` with ``Retry-After``, without its password being checked.

``LoginThrottle`` is the policy (pure, with an injectable clock, tested against a synthetic one);
``LoginThrottleMiddleware`` applies it to the Gradio app's ``POST .../login`` as plain ASGI middleware.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import hmac
import html
import ipaddress
import json
import secrets
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from fastapi import HTTPException
from starlette.requests import HTTPConnection

from app.search.uploads import MAX_UPLOAD_MB
from moco.errors import UserError

__all__ = ["LoginThrottle", "LoginThrottleMiddleware", "FREE", "ACCOUNT_FREE", "parse_trusted_proxies",
           "NAME_CHARS"]

FREE = 5  # wrong passwords from one address for one account before it waits
ACCOUNT_FREE = 20  # wrong passwords for one account, from all addresses, before it waits
KNOWN_ADDRESSES = 16  # addresses remembered per account after a successful login
KNOWN_ACCOUNTS = 1000  # accounts whose addresses are remembered (the latest to log in)
MAX_FORM_BYTES = 64 * 1024  # a login form larger than this is refused (413) before anything is checked
NAME_CHARS = 256  # usernames and addresses are kept to this length (memory per record stays bounded)


@dataclass
class _Count:
    failures: int = 0
    locked_until: float = 0.0
    last: float = 0.0


class LoginThrottle:
    """Lockouts after failed logins, per (address, account) and per account (the rule: the module's docstring).

    Args:
        free: failures from one address for one account before it waits.
        account_free: failures for one account, from all addresses, before the account waits.
        base_s: the first wait; each further failure doubles it, up to ``max_s``.
        forget_s: a count quiet for this long starts again from zero.
        max_records: counts kept at most; past it the quiet ones go, then those whose wait ends first.
        clock: seconds, monotonic (``time.monotonic``; tests pass a synthetic one).
    """

    def __init__(self, free: int = FREE, account_free: int = ACCOUNT_FREE, base_s: float = 1.0, max_s: float = 300.0,
                 forget_s: float = 900.0, max_records: int = 50_000,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.free, self.account_free, self.base_s, self.max_s = free, account_free, base_s, max_s
        self.forget_s, self.max_records, self.clock = forget_s, max_records, clock
        self._counts: dict[tuple[str, ...], _Count] = {}
        self._known: dict[str, dict[str, None]] = {}  # account -> addresses it logged in from, oldest first

    def __len__(self) -> int:
        return len(self._counts)

    def wait(self, address: str, account: str) -> float:
        """Seconds an attempt from ``address`` for ``account`` must wait before it is looked at (0: go ahead)."""
        now = self.clock()
        waits = [self._wait(("pair", address, account), now)]
        if address not in self._known.get(account, {}):
            waits.append(self._wait(("account", account), now))
        return max(waits)

    def record(self, address: str, account: str, ok: bool) -> None:
        """The outcome of an attempt that was looked at."""
        now = self.clock()
        if ok:
            self._counts.pop(("pair", address, account), None)
            known = self._known.pop(account, {})
            known.pop(address, None)
            known[address] = None
            while len(known) > KNOWN_ADDRESSES:
                del known[next(iter(known))]
            self._known[account] = known  # the latest last
            while len(self._known) > KNOWN_ACCOUNTS:
                del self._known[next(iter(self._known))]
            return
        self._fail(("pair", address, account), self.free, now)
        self._fail(("account", account), self.account_free, now)
        if len(self._counts) > self.max_records:
            self._shrink(now)

    def _wait(self, key: tuple[str, ...], now: float) -> float:
        c = self._counts.get(key)
        return max(0.0, c.locked_until - now) if c else 0.0

    def _fail(self, key: tuple[str, ...], free: int, now: float) -> None:
        c = self._counts.get(key)
        if c is None or now - c.last > self.forget_s:
            c = self._counts[key] = _Count()
        c.failures, c.last = c.failures + 1, now
        if c.failures >= free:
            c.locked_until = now + min(self.max_s, self.base_s * 2 ** (c.failures - free))

    def _shrink(self, now: float) -> None:
        """Down to 3/4 of ``max_records``: first the quiet counts, then those whose wait ends soonest.

        A flood of new names cannot push out a long lockout: it goes after every count that frees sooner.
        """
        live = {k: c for k, c in self._counts.items() if now - c.last <= self.forget_s}
        keep = self.max_records * 3 // 4
        if len(live) > keep:
            live = dict(sorted(live.items(), key=lambda kc: (kc[1].locked_until, kc[1].last))[-keep:])
        self._counts = live


def parse_trusted_proxies(values: Iterable[str]) -> list[str]:
    """``--trusted-proxy`` values (each one address or network, or several separated by commas), checked."""
    out = []
    for value in values:
        for item in filter(None, (v.strip() for v in value.split(","))):
            try:
                out.append(str(ipaddress.ip_network(item, strict=False) if "/" in item else ipaddress.ip_address(item)))
            except ValueError:
                from moco.errors import UserError

                raise UserError(f"--trusted-proxy {item!r}: not an IP address or network; name the reverse proxy "
                                "that connects to this server, e.g. --trusted-proxy 127.0.0.1 or 10.0.0.0/8") from None
    return out


class LoginThrottleMiddleware:
    """ASGI middleware: ``LoginThrottle`` on every ``POST`` whose path ends in ``/login``.

    The address is ``scope["client"]`` (uvicorn has applied ``X-Forwarded-For`` from a trusted proxy by then); the
    account is the form's ``username``, stripped as Gradio strips it.
    """

    def __init__(self, app: Any, throttle: LoginThrottle | None = None) -> None:
        # `is None`, not `or`: an empty LoginThrottle has len() 0, and the API's shared one would be replaced
        self.app, self.throttle = app, throttle if throttle is not None else LoginThrottle()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope.get("method") != "POST" or not scope["path"].rstrip("/").endswith("/login"):
            await self.app(scope, receive, send)
            return
        address = str((scope.get("client") or ("unknown",))[0])[:NAME_CHARS]
        body = await _read_body(receive)
        if body is None:
            await _reply(send, 413, f"a login form is at most {MAX_FORM_BYTES // 1024} kB: send only the username "
                         "and password")
            return
        account = await _username(scope, body)
        wait = self.throttle.wait(address, account)
        if wait > 0:
            await _reply(send, 429, f"too many failed logins from {address} or for this account: try again in "
                         f"{wait:.0f} s", retry_after=int(wait) + 1)
            return
        status: dict[str, int] = {}
        sent = False

        async def replay() -> dict[str, Any]:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: the disconnect, when it comes

        async def capture(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                status["code"] = int(message["status"])
            await send(message)

        await self.app(scope, replay, capture)
        self.throttle.record(address, account, ok=status.get("code", 500) < 400)


async def _read_body(receive: Any) -> bytes | None:
    """The request body, or None when it is over ``MAX_FORM_BYTES``."""
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] != "http.request":  # the client left: nothing to check
            return b"".join(chunks)
        chunks.append(message.get("body", b""))
        size += len(chunks[-1])
        if size > MAX_FORM_BYTES:
            return None
        if not message.get("more_body"):
            return b"".join(chunks)


async def _username(scope: dict[str, Any], body: bytes) -> str:
    """The form's ``username`` (urlencoded or multipart, parsed as Gradio's FastAPI route parses it); "" if none."""
    from starlette.requests import Request

    async def once() -> dict[str, Any]:
        return {"type": "http.request", "body": body, "more_body": False}

    try:
        name = (await Request(scope, once).form(max_files=0, max_fields=16)).get("username")
    except Exception:  # noqa: BLE001 - a malformed form is Gradio's to refuse; it is still an attempt, for ""
        name = None
    return name.strip()[:NAME_CHARS] if isinstance(name, str) else ""


async def _reply(send: Any, code: int, detail: str, retry_after: int | None = None) -> None:
    headers = [(b"content-type", b"application/json")]
    if retry_after is not None:
        headers.append((b"retry-after", b"%d" % retry_after))
    await send({"type": "http.response.start", "status": code, "headers": headers})
    await send({"type": "http.response.body", "body": json.dumps({"detail": detail}).encode()})


API_PREFIX = "/api/v1"

__all__ = ["API_PREFIX", "ApiSettings", "AccessMiddleware", "BodyCapMiddleware", "check_access", "check_api_token",
           "client_address", "login_ok", "page_login", "send_json", "MAX_BODY_BYTES", "MIN_TOKEN_CHARS",
           "PUBLIC_PREFIXES", "TOKEN_USER"]


# An upload at the page's cap, base64-encoded (4/3), with room for the form or JSON around it.
MAX_BODY_BYTES = MAX_UPLOAD_MB * 1024 * 1024 * 4 // 3 + 64 * 1024
MIN_TOKEN_CHARS = 16
TOKEN_USER = "token"  # the user name that logs in with the token (the page's form, HTTP Basic); its throttle account
# Served to anyone: Gradio's packaged frontend files (the same for every Gradio app, nothing of the collection), and
# the route Gradio's launch calls once without a login (it runs the startup events, once, and answers true or false).
PUBLIC_PREFIXES = ("/assets/", "/static/", "/svelte/", "/favicon.ico", "/manifest.json", "/robots.txt",
                   "/gradio_api/startup-events")


@dataclass
class ApiSettings:
    """Who may call the API and how searches are batched.

    ``auth``: the page's USER:PASS (None: none); ``token``: a bearer token for programs (None: none); with neither
    the server is open. ``throttle``: the failed-login count of every door; ``cors_origins``: web pages
    (``scheme://host[:port]``) that may call it from a browser besides the server's own; ``allowed_hosts``: names
    it answers to besides localhost and its own address (:mod:`app.guard.origins`). Batching: ``window_ms``,
    ``max_batch``; ``max_pending``: searches admitted at once before 503.
    """

    auth: tuple[str, str] | None = None
    token: str | None = None
    throttle: LoginThrottle = field(default_factory=LoginThrottle)
    window_ms: float = 2.0
    max_batch: int = 16
    max_pending: int = 32
    cors_origins: tuple[str, ...] = ()
    allowed_hosts: tuple[str, ...] = ()


def check_api_token(token: str | None) -> str | None:
    """``--api-token`` checked: at least MIN_TOKEN_CHARS characters, no spaces."""
    if not token:
        return None
    spaces = any(c.isspace() for c in token)
    if len(token) < MIN_TOKEN_CHARS or spaces:
        raise UserError(f"--api-token: {len(token)} characters{' with spaces' if spaces else ''}"
                        f"; use at least {MIN_TOKEN_CHARS} without spaces, e.g. the output of "
                        "python -c 'import secrets; print(secrets.token_urlsafe())'")
    return token


def client_address(request: HTTPConnection) -> str:
    return str(request.client.host if request.client else "unknown")[:NAME_CHARS]


def _same(a: str, b: str) -> bool:
    return hmac.compare_digest(a.encode("utf-8", "surrogatepass"), b.encode("utf-8", "surrogatepass"))


def login_ok(settings: ApiSettings, user: str, password: str) -> bool:
    """Whether USER:PASS is ``--auth``'s pair, or ``token`` with the ``--api-token`` (the page's form and Basic)."""
    user = user.strip()
    ok = settings.auth is not None and _same(user, settings.auth[0]) & _same(password, settings.auth[1])
    return ok or (settings.token is not None and _same(user, TOKEN_USER) & _same(password, settings.token))


def page_login(settings: ApiSettings) -> Callable[[str, str], bool] | None:
    """The ``auth`` of Gradio's ``launch``: :func:`login_ok` (None when the server is open)."""
    if settings.auth is None and settings.token is None:
        return None
    return lambda user, password: login_ok(settings, user, password)


def _page_cookie(request: HTTPConnection) -> bool:
    """Whether the request carries a login of the page (a session Gradio's ``/login`` handed out)."""
    app = request.app
    cookie_id = getattr(app, "cookie_id", None)
    if cookie_id is None:
        return False
    cookie = request.cookies.get(f"access-token-{cookie_id}") or request.cookies.get(
        f"access-token-unsecure-{cookie_id}")
    return bool(cookie) and cookie in getattr(app, "tokens", {})


def check_access(request: HTTPConnection, settings: ApiSettings) -> str | None:
    """Let the request through, or HTTPException 401/429 (see the module docstring).

    Returns the account an ``Authorization`` header proved (None: an open server, or the page's cookie).
    """
    if (settings.auth is None and settings.token is None) or _page_cookie(request):
        return None
    scheme, _, credentials = request.headers.get("authorization", "").partition(" ")
    scheme, credentials = scheme.lower(), credentials.strip()
    if scheme == "bearer" and settings.token is not None:
        account, ok = TOKEN_USER, _same(credentials, settings.token)
    elif scheme == "basic":
        try:
            user, _, password = base64.b64decode(credentials, validate=True).decode("utf-8").partition(":")
        except (binascii.Error, UnicodeDecodeError):
            user, password = "", ""
        account, ok = user.strip()[:NAME_CHARS], login_ok(settings, user, password)
    else:
        ways = ["`Authorization: Bearer TOKEN` (the server's --api-token)" if settings.token else "",
                "HTTP Basic with the page's login (--auth)" if settings.auth else ""]
        how = " or ".join(w for w in ways if w)
        raise HTTPException(401, f"this server needs a login: send {how}",
                            headers={"WWW-Authenticate": "Bearer" if settings.token else "Basic"})
    address = client_address(request)
    wait = settings.throttle.wait(address, account)
    if wait > 0:
        raise HTTPException(429, f"too many failed logins from {address} or for this account: try again in "
                            f"{wait:.0f} s", headers={"Retry-After": str(int(wait) + 1)})
    settings.throttle.record(address, account, ok=ok)
    if not ok:
        what, flag = ("token", "--api-token") if scheme == "bearer" else ("user name or password", "--auth")
        raise HTTPException(401, f"wrong {what}: check the server's {flag}",
                            headers={"WWW-Authenticate": scheme.title()})
    return account


class AccessMiddleware:
    """ASGI middleware, before every route: :func:`check_access` (the module's rule).

    An anonymous request may only post the login form (``/login``, throttled by
    :class:`app.guard.access.LoginThrottleMiddleware`) and fetch :data:`PUBLIC_PREFIXES`; ``GET /`` answers 200 with
    the login form. A page route called with ``Authorization`` gets a page session for its account (one per
    account, kept in Gradio's own table): Gradio's routes check only their cookie.
    """

    def __init__(self, app: Any, settings: ApiSettings) -> None:
        self.app, self.settings = app, settings
        self._sessions: dict[str, str] = {}  # account -> the page session handed to its Authorization requests

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        s = self.settings
        if scope["type"] not in ("http", "websocket") or (s.auth is None and s.token is None):
            await self.app(scope, receive, send)
            return
        request = HTTPConnection(scope)
        path, method = scope["path"], scope.get("method", "GET")
        api = path == API_PREFIX or path.startswith(API_PREFIX + "/")
        if not api and "authorization" not in request.headers and not _page_cookie(request):
            if (method == "POST" and path.rstrip("/") == "/login") or (
                    method in ("GET", "HEAD") and path.startswith(PUBLIC_PREFIXES)):
                await self.app(scope, receive, send)
            elif scope["type"] == "websocket":
                await send({"type": "websocket.close", "code": 1008})
            elif path == "/" and method in ("GET", "HEAD"):
                await _send_login_page(send, s)
            else:
                await send_json(send, 401, _needs_login(s))
            return
        try:
            account = check_access(request, s)
        except HTTPException as e:
            if scope["type"] == "websocket":
                await send({"type": "websocket.close", "code": 1008})
            else:
                await send_json(send, e.status_code, str(e.detail), e.headers)
            return
        if account is not None and not api:
            scope = self._with_session(scope, request.app, account)
        await self.app(scope, receive, send)

    def _with_session(self, scope: dict[str, Any], app: Any, account: str) -> dict[str, Any]:
        """``scope`` with the page session of ``account`` as its only cookie (minted once, again after a logout)."""
        cookie_id, tokens = getattr(app, "cookie_id", None), getattr(app, "tokens", None)
        if cookie_id is None or tokens is None:
            return scope
        session = self._sessions.get(account)
        if session is None or tokens.get(session) != account:
            session = self._sessions[account] = secrets.token_urlsafe(16)
            tokens[session] = account
        cookie = f"access-token-{cookie_id}={session}; access-token-unsecure-{cookie_id}={session}".encode()
        return {**scope, "headers": [*[(k, v) for k, v in scope["headers"] if k != b"cookie"], (b"cookie", cookie)]}


def _needs_login(settings: ApiSettings) -> str:
    ways = ["`Authorization: Bearer TOKEN` (--api-token)" if settings.token else "",
            "HTTP Basic (--auth)" if settings.auth else ""]
    return f"this server needs a login: log in on its page (/), or send {' or '.join(w for w in ways if w)}"


_LOGIN_PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><meta name="viewport" content="width=device-width, initial-scale=1">
<title>Log in</title><style>body{{font:16px system-ui,sans-serif;max-width:24rem;margin:4rem auto;padding:0 1rem}}
label,input,button{{display:block;width:100%;box-sizing:border-box;margin:.4rem 0}}input,button{{padding:.5rem}}
#error{{color:#b00020}}</style></head>
<body><h1>Photo search</h1><p>{how}</p>
<form id="login"><label>User name <input name="username" value="{user}" autocomplete="username" required></label>
<label>Password <input name="password" type="password" autocomplete="current-password" required autofocus></label>
<button type="submit">Log in</button></form><p id="error" role="alert"></p>
<script>
document.getElementById("login").addEventListener("submit", async (event) => {{
  event.preventDefault();
  const r = await fetch("login", {{method: "POST", body: new URLSearchParams(new FormData(event.target))}});
  if (r.ok) {{ location.reload(); return; }}
  let detail = "";
  try {{ detail = (await r.json()).detail; }} catch (e) {{}}
  document.getElementById("error").textContent = r.status === 400 ? "Wrong user name or password." : String(detail);
}});
</script></body></html>
"""


async def _send_login_page(send: Any, settings: ApiSettings) -> None:
    """A login form (200, as Gradio's login page) posting to ``/login``; the page reloads once logged in."""
    ways = ["the user name and password of the server's --auth" if settings.auth else "",
            f"the user name {TOKEN_USER} and the server's --api-token as the password" if settings.token else ""]
    how = "Log in with " + " or with ".join(w for w in ways if w) + "."
    body = _LOGIN_PAGE.format(how=html.escape(how), user=TOKEN_USER if settings.auth is None else "").encode()
    headers = [(b"content-type", b"text/html; charset=utf-8"), (b"cache-control", b"no-store"),
               (b"content-security-policy", b"frame-ancestors 'none'"), (b"content-length", b"%d" % len(body))]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class BodyCapMiddleware:
    """ASGI middleware: a request to the API whose body is over ``limit`` bytes gets 413, read no further."""

    def __init__(self, app: Any, limit: int = MAX_BODY_BYTES) -> None:
        self.app, self.limit = app, limit

    def _message(self, size: int) -> str:
        return (f"the request is {size / 1e6:.1f} MB, over the {MAX_UPLOAD_MB} MB upload limit: upload a smaller copy "
                "(for example exported at 4000 px on its long side)")

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


async def send_json(send: Any, code: int, detail: str, headers: dict[str, str] | None = None) -> None:
    """An ASGI answer: ``code`` with the JSON ``{"detail": detail}`` the API's errors have (and ``headers``)."""
    import json

    extra = [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": code,
                "headers": [(b"content-type", b"application/json"), *extra]})
    await send({"type": "http.response.body", "body": json.dumps({"detail": detail}).encode()})


