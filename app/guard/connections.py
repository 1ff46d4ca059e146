"""What one client's connections may cost the server: the time a request may take to arrive, and how many
connections are open at once.

uvicorn (which Gradio starts) closes an idle keep-alive connection after ``timeout_keep_alive`` (app.server.launch's
KEEP_ALIVE_S), but it never times out a request that is still arriving: a client that sends its head a byte at a
time, or nothing at all after connecting ("slowloris"), holds a connection and a file descriptor for ever, and a
few hundred of them exhaust the process's open files (then every accept fails: "Too many open files"). The
guarded protocol (:func:`guard_connections`, installed on the running server for new connections; those accepted
before, and those accepted unguarded as it comes in, are adopted by it) adds:

- a request's head (the request line and headers) must arrive within ``request_timeout_s`` of its first byte
  (of the connection's opening, for a new connection), and its body may pause at most that long between two
  reads; past it the server answers 408 and closes the connection. A request the server is answering is never
  timed out (nor a body whose reading the server itself paused), and neither is an idle keep-alive connection
  (uvicorn's own timeout closes those).
- at most ``max_connections`` open at once (default: half the files the process may still open, at most 1000),
  with a short listening queue (asyncio accepts all of it at once, before any is counted): one more first makes
  room by closing the connection whose request has been arriving the longest, else an idle one, else it is
  answered 503 and closed. The server therefore does not run out of file descriptors through connections, and a
  request that arrives whole is answered while half-sent ones wait their turn to be closed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import resource
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

__all__ = ["ConnectionLimits", "guard_connections", "default_max_connections"]

logger = logging.getLogger(__name__)

REQUEST_TIMEOUT_S = 30.0  # nginx's client_header_timeout is 60 s; a request that is not here in 30 s is not coming
MAX_CONNECTIONS = 1000
ADOPT_S = 30.0  # after the guard comes in, each sweep also adopts connections accepted unguarded meanwhile


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


def default_max_connections(connections: int = 0) -> int:
    """Connections at most by default: half the files the process may still open, its ``connections`` open now
    counted as free (the other half for connections accepted before they are counted, the index, uploads,
    thumbnails and Gradio's files), at most MAX_CONNECTIONS, at least 16."""
    available = _available_files()
    return MAX_CONNECTIONS if available is None else max(16, min(MAX_CONNECTIONS, (available + connections) // 2))


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

    def __init__(self, limits: ConnectionLimits, clock: Callable[[], float], already: int = 0) -> None:
        self.timeout = limits.request_timeout_s
        self.max = limits.max_connections or default_max_connections(already)
        self.clock = clock
        self.connections: set[_Guarded] = set()
        self.sweeping = False
        self.closed_late = 0  # connections closed because their request did not arrive in time
        self.closed_full = 0  # connections closed to stay within max_connections
        self.stragglers: Callable[[], None] = lambda: None  # adopts connections accepted unguarded (see begin)
        self.adopting_until = 0.0

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

    def begin(self, adopt_for: float = ADOPT_S) -> None:
        """In the server's loop, once the guard is in: sweep for ``adopt_for`` seconds at least, each sweep adopting
        the connections accepted unguarded around the guard's coming (a connection accepted just before the protocol
        class changed is made unguarded but counted among the server's connections only a loop turn later, after
        the guard's first look at them: never timed, it was held for ever)."""
        self.adopting_until = self.clock() + adopt_for
        if not self.sweeping:
            self.sweeping = True
            asyncio.get_running_loop().call_later(self._period(), self._sweep)

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
            self.stragglers()
            now = self.clock()
            for conn in _snapshot(self.connections):  # a copy: connections come and go while it closes some
                try:
                    since = conn.arriving_since()
                    if since is not None and now - since > self.timeout:
                        self.closed_late += 1
                        conn.close_late()
                except Exception:  # one connection's trouble never stops the sweep of the others
                    logger.debug("closing a late connection failed", exc_info=True)
        finally:  # the sweep goes on whatever happened above: a stopped sweep would leave late requests open
            if self.connections or self.clock() < self.adopting_until:
                asyncio.get_running_loop().call_later(self._period(), self._sweep)
            else:
                self.sweeping = False


class _Guarded(H11Protocol):
    """uvicorn's h11 protocol, counted in and timed while a request arrives (see the module docstring)."""

    open: _Open  # set on the class made by guard_connections

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


def _snapshot(connections: set[Any]) -> list[Any]:
    """A copy of a set the server's thread may change meanwhile."""
    for _ in range(100):
        try:
            return list(connections)
        except RuntimeError:  # changed size during the copy: again
            continue
    return []


def _adopt(conn: H11Protocol, guarded: type[_Guarded]) -> None:
    """Guard a connection accepted before the guard was installed (in the server's loop, as its callbacks)."""
    if type(conn) is not H11Protocol or conn.transport.is_closing():  # adopted already, or closing
        return
    conn.__class__ = guarded  # the same object, with the guard's methods: nothing else changes
    conn.fresh = conn.cycle is None
    conn.head_since = conn.last_data = guarded.open.clock()
    if not guarded.open.add(conn):
        conn.close_late()


def _answer(code: int, reason: str, text: str) -> bytes:
    body = (text + "\n").encode()
    return (f"HTTP/1.1 {code} {reason}\r\ncontent-type: text/plain; charset=utf-8\r\nconnection: close\r\n"
            f"content-length: {len(body)}\r\n\r\n").encode() + body


def guard_connections(server: Any, limits: ConnectionLimits | None = None,
                      clock: Callable[[], float] = time.monotonic) -> _Open:
    """Have the running uvicorn ``server`` (Gradio's ``demo.server``) guard its new connections with ``limits``.

    uvicorn reads its protocol class for every new connection, so this works on a server already started.
    Returns the connections' registry (its ``closed_late`` and ``closed_full`` counts, for tests and logs).
    """
    state = getattr(server, "server_state", None)

    def unguarded() -> list[Any]:  # connections accepted before the guard: plain H11Protocol
        return [c for c in _snapshot(getattr(state, "connections", set())) if type(c) is H11Protocol]

    opened = _Open((limits or ConnectionLimits()).check(), clock, len(unguarded()))
    guarded = type("GuardedH11Protocol", (_Guarded,), {"open": opened})
    server.config.http_protocol_class = guarded
    backlog = _backlog(opened.max)
    for listening in getattr(server, "servers", []):
        for sock in listening.sockets:
            with contextlib.closing(sock.dup()) as same:  # the same socket: its queue shortened
                same.listen(backlog)
    for conn in unguarded():  # adopted: from now on timed and counted as the new ones
        conn.loop.call_soon_threadsafe(_adopt, conn, guarded)
    opened.stragglers = lambda: [_adopt(conn, guarded) for conn in unguarded()]  # in the server's loop
    for loop in {s.get_loop() for s in getattr(server, "servers", []) if hasattr(s, "get_loop")}:
        loop.call_soon_threadsafe(opened.begin)
    logger.debug("connections: at most %d open (%d waiting to be accepted); a request must arrive within %g s",
                opened.max, backlog, opened.timeout)
    return opened
