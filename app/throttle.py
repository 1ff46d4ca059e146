"""Login throttling for ``moco serve --auth``: after a few wrong passwords a client waits, longer each time.

``LoginThrottle`` is the policy (pure, with an injectable clock, tested against a synthetic one);
``LoginThrottleMiddleware`` applies it to the Gradio app's ``POST .../login`` as plain ASGI middleware:
while a client address is locked out it gets ``429 Too Many Requests`` with ``Retry-After``, without
its password being checked; a successful login clears its record.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["LoginThrottle", "LoginThrottleMiddleware"]


@dataclass
class _Client:
    failures: int = 0
    locked_until: float = 0.0
    last: float = 0.0


class LoginThrottle:
    """Per-client lockout after failed logins.

    Args:
        free: failures allowed before the first lockout.
        base_s: the first lockout; each further failure doubles it, up to ``max_s``.
        forget_s: a client quiet for this long starts again from zero.
        clock: seconds, monotonic (``time.monotonic``; tests pass a synthetic one).
    """

    def __init__(self, free: int = 5, base_s: float = 1.0, max_s: float = 300.0, forget_s: float = 900.0,
                 clock: Callable[[], float] = time.monotonic) -> None:  # fmt: skip
        self.free, self.base_s, self.max_s, self.forget_s, self.clock = free, base_s, max_s, forget_s, clock
        self._clients: dict[str, _Client] = {}

    def wait(self, client: str) -> float:
        """Seconds ``client`` must wait before its next login attempt is looked at (0: go ahead)."""
        c = self._clients.get(client)
        return max(0.0, c.locked_until - self.clock()) if c else 0.0

    def record(self, client: str, ok: bool) -> None:
        """The outcome of an attempt that was looked at."""
        now = self.clock()
        if ok:
            self._clients.pop(client, None)
            return
        c = self._clients.get(client)
        if c is None or now - c.last > self.forget_s:
            c = self._clients[client] = _Client()
        c.failures, c.last = c.failures + 1, now
        if c.failures >= self.free:
            c.locked_until = now + min(self.max_s, self.base_s * 2 ** (c.failures - self.free))
        if len(self._clients) > 10_000:  # many addresses: drop the ones gone quiet
            self._clients = {k: v for k, v in self._clients.items() if now - v.last <= self.forget_s}


class LoginThrottleMiddleware:
    """ASGI middleware: ``LoginThrottle`` on every ``POST`` whose path ends in ``/login``."""

    def __init__(self, app: Any, throttle: LoginThrottle | None = None) -> None:
        self.app, self.throttle = app, throttle or LoginThrottle()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope.get("method") != "POST" or not scope["path"].rstrip("/").endswith("/login"):
            await self.app(scope, receive, send)
            return
        client = (scope.get("client") or ("unknown",))[0]
        wait = self.throttle.wait(client)
        if wait > 0:
            body = json.dumps({"detail": f"too many failed logins from {client}: try again in {wait:.0f} s"}).encode()
            await send({"type": "http.response.start", "status": 429,
                        "headers": [(b"content-type", b"application/json"), (b"retry-after", b"%d" % (wait + 1))]})
            await send({"type": "http.response.body", "body": body})
            return
        status: dict[str, int] = {}

        async def capture(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                status["code"] = int(message["status"])
            await send(message)

        await self.app(scope, receive, capture)
        self.throttle.record(client, ok=status.get("code", 500) < 400)
