"""Login throttling for ``moco serve --auth`` / ``--api-token``: after a few wrong passwords, attempts wait, longer
each time.

The rule. A login attempt comes from an *address* (the socket peer; behind a reverse proxy named with
``--trusted-proxy``, the client that proxy reports in ``X-Forwarded-For``, see ``trusted_proxy_env``) for an
*account* (the username typed; ``token`` for a bearer token). One throttle counts the attempts of every door: the
page's login form here, ``Authorization`` headers in :mod:`app.api_access`. Two counts of wrong passwords are kept:

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

import ipaddress
import json
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

__all__ = ["LoginThrottle", "LoginThrottleMiddleware", "FREE", "ACCOUNT_FREE", "parse_trusted_proxies",
           "trusted_proxy_env", "NAME_CHARS"]  # fmt: skip

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
                 clock: Callable[[], float] = time.monotonic) -> None:  # fmt: skip
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


def trusted_proxy_env(trusted_proxies: Iterable[str]) -> dict[str, str]:
    """The environment that makes uvicorn (under Gradio) trust ``X-Forwarded-For`` from these peers only.

    uvicorn rewrites a request's client address from ``X-Forwarded-For`` (the right-most address that is not
    a trusted proxy) when the peer is in ``$FORWARDED_ALLOW_IPS``, read when the server starts, by default
    loopback: behind a local proxy, or from any local process, every request could name its own address.
    With no trusted proxy this is empty: the client address is the socket peer, whatever the headers say.
    """
    return {"FORWARDED_ALLOW_IPS": ",".join(trusted_proxies)}


class LoginThrottleMiddleware:
    """ASGI middleware: ``LoginThrottle`` on every ``POST`` whose path ends in ``/login``.

    The address is ``scope["client"]`` (uvicorn has applied ``trusted_proxy_env`` by then); the account is
    the form's ``username``, stripped as Gradio strips it.
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
                         "and password")  # fmt: skip
            return
        account = await _username(scope, body)
        wait = self.throttle.wait(address, account)
        if wait > 0:
            await _reply(send, 429, f"too many failed logins from {address} or for this account: try again in "
                         f"{wait:.0f} s", retry_after=int(wait) + 1)  # fmt: skip
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
