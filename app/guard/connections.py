"""What one client's connections may cost the server: the time a request may take to arrive, and how many
connections are open at once, given to uvicorn as its configuration (:func:`connection_settings`: the ``http``
protocol class and the ``backlog`` of ``uvicorn.Config``), in place from the server's first connection.

uvicorn closes an idle keep-alive connection after ``timeout_keep_alive`` (app.server.launch's KEEP_ALIVE_S), but it
never times out a request that is still arriving: a client that sends its head a byte at a time, or nothing at all
after connecting ("slowloris"), holds a connection and a file descriptor for ever, and a few hundred of them exhaust
the process's open files (then every accept fails: "Too many open files"). uvicorn has no setting for that, nor for
closing connections to make room (its ``limit_concurrency`` answers 503 to every request past the count, the good
ones too, and closes no connection), so the protocol class given to it is uvicorn's h11 protocol with:

- a request's head (the request line and headers) must arrive within ``request_timeout_s`` of its first byte
  (of the connection's opening, for a new connection), and its body may pause at most that long between two
  reads; past it the server answers 408 and closes the connection. A request the server is answering is never
  timed out (nor a body whose reading the server itself paused), and neither is an idle keep-alive connection
  (uvicorn's own timeout closes those).
- at most ``max_connections`` open at once (default: half the files the process may still open, at most 1000),
  with a short listening queue (uvicorn's ``backlog``: asyncio accepts all of it at once, before any is counted):
  one more first makes room by closing the connection whose request has been arriving the longest, else an idle
  one, else it is answered 503 and closed. The server therefore does not run out of file descriptors through
  connections, and a request that arrives whole is answered while half-sent ones wait their turn to be closed.
"""

from __future__ import annotations

import asyncio
import logging
import os
import resource
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

__all__ = ["ConnectionLimits", "connection_settings", "default_max_connections"]

logger = logging.getLogger(__name__)

REQUEST_TIMEOUT_S = 30.0  # nginx's client_header_timeout is 60 s; a request that is not here in 30 s is not coming
MAX_CONNECTIONS = 1000


def _available_files() -> int | None:
    """Files this process may still open (the soft limit less those open now); None: no limit."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return None
    try:
        in_use = len(os.listdir("/proc/self/fd"))
    except OSError:  # not Linux: a guess of what a server holds open
        in_use = 64
    return max(0, soft - in_use)


def default_max_connections() -> int:
    """Connections at most by default: half the files the process may still open when the server starts (the other
    half for connections accepted before they are counted, the index, uploads, thumbnails and Gradio's files), at
    most MAX_CONNECTIONS, at least 16."""
    available = _available_files()
    return MAX_CONNECTIONS if available is None else max(16, min(MAX_CONNECTIONS, available // 2))


def _backlog(max_connections: int) -> int:
    """The listening queue's length: asyncio accepts a whole queue at once before any connection is counted, so
    a short one (a quarter of the connections, 8 to 128) keeps a burst within the files left."""
    return max(8, min(128, max_connections // 4))


@dataclass
class ConnectionLimits:
    """``request_timeout_s``: the time a request's head may take to arrive (and its body to pause);
    ``max_connections``: connections open at once (None: :func:`default_max_connections`)."""

    request_timeout_s: float = REQUEST_TIMEOUT_S
    max_connections: int | None = None

    def check(self) -> ConnectionLimits:
        """Itself, or a ValueError naming the value (the CLI checks its flags before this)."""
        few = self.max_connections is not None and self.max_connections < 1
        if not 0 < self.request_timeout_s <= 3600 or few:
            raise ValueError(f"ConnectionLimits(request_timeout_s={self.request_timeout_s}, max_connections="
                             f"{self.max_connections}): the timeout must be 0 to 3600 s, the count at least 1")
        return self


class _Open:
    """The guarded connections of one server, and the sweep that closes those whose request is overdue."""

    def __init__(self, limits: ConnectionLimits, clock: Callable[[], float]) -> None:
        self.timeout = limits.request_timeout_s
        self.max = limits.max_connections or default_max_connections()
        self.clock = clock
        self.connections: set[_Guarded] = set()
        self.sweeping = False
        self.closed_late = 0  # connections closed because their request did not arrive in time
        self.closed_full = 0  # connections closed to stay within max_connections

    def add(self, conn: _Guarded) -> bool:
        """Count ``conn`` in, making room first when full; False when there is none (``conn`` is to be refused)."""
        if len(self.connections) >= self.max:
            victim = self._victim()
            if victim is None:
                return False
            self.closed_full += 1
            victim.close_late()
        self.connections.add(conn)
        if not self.sweeping:
            self.sweeping = True
            asyncio.get_running_loop().call_later(self._period(), self._sweep)
        return True

    def _victim(self) -> _Guarded | None:
        """The connection to close for a new one: the request arriving the longest, else the longest idle."""
        arriving = [c for c in self.connections if c.arriving_since() is not None]
        if arriving:
            return min(arriving, key=lambda c: c.arriving_since() or self.clock())
        idle = [c for c in self.connections if c.idle()]
        return min(idle, key=lambda c: c.last_data) if idle else None

    def _period(self) -> float:
        return min(1.0, max(0.05, self.timeout / 4))

    def _sweep(self) -> None:
        try:
            now = self.clock()
            for conn in list(self.connections):  # a copy: it closes some (all in the server's loop)
                try:
                    since = conn.arriving_since()
                    if since is not None and now - since > self.timeout:
                        self.closed_late += 1
                        conn.close_late()
                except Exception:  # one connection's trouble never stops the sweep of the others
                    logger.debug("closing a late connection failed", exc_info=True)
        finally:  # the sweep goes on whatever happened above: a stopped sweep would leave late requests open
            if self.connections:
                asyncio.get_running_loop().call_later(self._period(), self._sweep)
            else:
                self.sweeping = False


class _Guarded(H11Protocol):
    """uvicorn's h11 protocol, counted in and timed while a request arrives (see the module docstring)."""

    open: _Open  # set on the class made by connection_settings

    def connection_made(self, transport: Any) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.fresh = True  # no request head complete yet
        self.head_since = self.last_data = self.open.clock()
        if not self.open.add(self):
            self.transport.write(_answer(503, "Service Unavailable", "the server is at its connection limit: "
                                         "try again in a few seconds"))
            self.transport.close()

    def data_received(self, data: bytes) -> None:
        now = self.open.clock()
        if not self._head_waiting():  # idle between requests: a new request starts arriving
            self.head_since = now
        self.last_data = now
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:
            self.fresh = False

    def connection_lost(self, exc: Exception | None) -> None:
        self.open.connections.discard(self)
        super().connection_lost(exc)

    def handle_websocket_upgrade(self, event: Any) -> None:
        self.open.connections.discard(self)  # another protocol owns the connection from now on
        super().handle_websocket_upgrade(event)

    def _head_waiting(self) -> bool:
        """A request head is awaited: a new connection's first, or a part of one is buffered."""
        return self.conn.their_state is h11.IDLE and (self.fresh or bool(self.conn.trailing_data[0]))

    def arriving_since(self) -> float | None:
        """Since when the client owes us data of a request (None: it owes nothing: idle, or being answered)."""
        if self._head_waiting():
            return self.head_since
        if self.conn.their_state is h11.SEND_BODY and not self.flow.read_paused:
            return self.last_data
        return None

    def idle(self) -> bool:
        """Between two requests with nothing buffered (what uvicorn's keep-alive timeout closes)."""
        return self.conn.their_state is h11.IDLE and not self._head_waiting() and (
            self.cycle is None or self.cycle.response_complete)

    def close_late(self) -> None:
        """Close the connection: with 408 when no response of ours is under way."""
        self.open.connections.discard(self)
        if self.transport.is_closing():
            return
        if self.cycle is None or self.cycle.response_complete:
            self.transport.write(_answer(408, "Request Timeout", "the request did not arrive in time"))
        self.transport.close()


def _answer(code: int, reason: str, text: str) -> bytes:
    body = (text + "\n").encode()
    return (f"HTTP/1.1 {code} {reason}\r\ncontent-type: text/plain; charset=utf-8\r\nconnection: close\r\n"
            f"content-length: {len(body)}\r\n\r\n").encode() + body


def connection_settings(limits: ConnectionLimits | None = None,
                        clock: Callable[[], float] = time.monotonic) -> tuple[dict[str, Any], _Open]:
    """``uvicorn.Config`` settings that guard a server's connections with ``limits``: its ``http`` protocol class
    (this module's, for one server) and its listening queue's ``backlog``; and the connections' registry (its
    ``max``, ``closed_late`` and ``closed_full``, for tests and logs)."""
    opened = _Open((limits or ConnectionLimits()).check(), clock)
    guarded = type("GuardedH11Protocol", (_Guarded,), {"open": opened})
    backlog = _backlog(opened.max)
    logger.debug("connections: at most %d open (%d waiting to be accepted); a request must arrive within %g s",
                 opened.max, backlog, opened.timeout)
    return {"http": guarded, "backlog": backlog}, opened
