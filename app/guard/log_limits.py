"""What the log may be made to hold: every line's message capped, and a line that repeats rate-limited.

A server's log must not grow with what clients send or with how often something fails: a 5 MB folder string in
a message, or asyncio's "socket.accept() out of system resource" (Too many open files), which it logs up to
uvicorn's backlog (2,048) times a second with a traceback each, filled 120 MB in 25 s. :class:`LogLimits`, a
logging filter on the handlers the CLI sets up, cuts a message to ``max_chars`` (its traceback is kept) and lets
the same line (logger, level, message) through at most ``burst`` times per ``period_s``; the first one
let through afterwards says how many were left out.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from moco.errors import clipped

__all__ = ["LogLimits", "install", "MAX_LOG_CHARS"]

MAX_LOG_CHARS = 2000  # of one line's message (a traceback after it is not cut)


class LogLimits(logging.Filter):
    """A logging filter: messages at most ``max_chars``, the same line at most ``burst`` times per ``period_s``."""

    def __init__(self, max_chars: int = MAX_LOG_CHARS, burst: int = 5, period_s: float = 60.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self.max_chars, self.burst, self.period_s, self.clock = max_chars, burst, period_s, clock
        self._seen: dict[tuple[str, int, str], list[float]] = {}  # line -> [window start, count, left out]
        self._lock = threading.Lock()

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        with self._lock:  # the same line: its logger, level and message (200 characters of it: one client's words)
            keep, left_out = self._count((record.name, record.levelno, message[:200]))
        if not keep:
            return False
        if len(message) > self.max_chars or left_out:
            message = clipped(message, self.max_chars)
            if left_out:
                message += f" ({left_out} more like it left out in the last {self.period_s:.0f} s)"
            record.msg, record.args = message, None
        return True

    def _count(self, key: tuple[str, int, str]) -> tuple[bool, int]:
        """(let this line through, how many like it were left out before it)."""
        now = self.clock()
        seen = self._seen.get(key)
        if seen is None or now - seen[0] >= self.period_s:
            if len(self._seen) > 10_000:  # many different lines: forget the old ones
                self._seen.clear()
            self._seen[key] = [now, 1, 0]
            return True, int(seen[2]) if seen is not None else 0
        seen[1] += 1
        if seen[1] > self.burst:
            seen[2] += 1
            return False, 0
        return True, 0


def install(handlers: list[logging.Handler] | None = None, **kwargs: float) -> LogLimits:
    """Add one :class:`LogLimits` to ``handlers`` (default: the root logger's) and return it."""
    limits = LogLimits(**kwargs)  # type: ignore[arg-type]
    for handler in handlers if handlers is not None else logging.getLogger().handlers:
        handler.addFilter(limits)
    return limits
