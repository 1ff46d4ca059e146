"""Admission for the routes whose work can take seconds to minutes: views of the whole collection.

A map, a set of themes (for each ``k`` asked), the unusual photos: each is computed once per index version, then
served from memory, but the first computation is k-means, a projection or a k-NN of every photo. Thirty requests for
thirty values of ``k`` in Starlette's thread pool ran thirty of them at once: searches waited for the CPU and the
pool, and the memory tripled. A :class:`Gate` runs that work in threads of its own, ``running`` at a time, with at
most ``waiting`` more queued; one more request gets :class:`~app.search.batcher.Overloaded` at once (503 with
``Retry-After``). Searches never pass through it, so they never wait behind it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import math
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from app.search.batcher import Overloaded

__all__ = ["Gate"]

R = TypeVar("R")


class Gate:
    """At most ``running`` calls at once in the gate's own threads and ``waiting`` more in line; past that,
    :class:`Overloaded` (``what`` names them in its message)."""

    def __init__(self, running: int = 1, waiting: int = 4, what: str = "views of the collection",
                 clock: Callable[[], float] = time.monotonic) -> None:
        if running < 1 or waiting < 0:
            raise ValueError(f"Gate(running={running}, waiting={waiting}): at least one running, none or more waiting")
        self.running, self.limit, self.what, self.clock = running, running + waiting, what, clock
        self.pending = 0  # admitted calls not finished yet
        self._lock = threading.Lock()
        self._pool = concurrent.futures.ThreadPoolExecutor(running, thread_name_prefix="gate")
        self._last_s = 1.0  # the last call's duration: what Retry-After is computed from

    def retry_after(self) -> int:
        """Seconds after which a shed request may find a place: the line's drain time, at least 1."""
        return max(1, math.ceil(self.pending / self.running * self._last_s))

    async def run(self, fn: Callable[..., R], *args: Any) -> R:
        """``fn(*args)`` in the gate's threads, once admitted; Overloaded at once when the line is full."""
        with self._lock:
            if self.pending >= self.limit:
                raise Overloaded(self.pending, self.retry_after(), self.what)
            self.pending += 1
        try:
            t0 = self.clock()
            try:
                return await asyncio.get_running_loop().run_in_executor(self._pool, functools.partial(fn, *args))
            finally:
                self._last_s = self.clock() - t0
        finally:
            with self._lock:
                self.pending -= 1

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
