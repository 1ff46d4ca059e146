"""Signals during training: SIGINT/SIGTERM ask the loop to checkpoint and stop after its step (:class:`StopFlag`);
during the end-of-run fit, which may take minutes, they stop it at once (:class:`Interrupted`)."""

from __future__ import annotations

import contextlib
import logging
import signal
from typing import Any

__all__ = ["StopFlag", "Interrupted"]

logger = logging.getLogger(__name__)


class Interrupted(BaseException):
    """A signal during the end-of-run fit (``StopFlag.at_once``): the fit is dropped, its checkpoint kept. Not an
    Exception, as KeyboardInterrupt: code that reports and goes on (logging's handlers) must not swallow it."""


class StopFlag:
    """Turns SIGINT/SIGTERM into a request to checkpoint and stop after the current step; inside ``at_once()``
    (the end-of-run fit, which may take minutes) into ``Interrupted`` at once."""

    def __init__(self) -> None:
        self.signal: int | None = None
        self._old: dict[int, Any] = {}
        self._at_once = False

    def __enter__(self) -> StopFlag:
        import threading

        if threading.current_thread() is threading.main_thread():
            for s in (signal.SIGINT, signal.SIGTERM):
                self._old[s] = signal.signal(s, self._handle)
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        if self.signal is not None:  # a second Ctrl-C stops at once
            raise KeyboardInterrupt
        self.signal = signum
        if self._at_once:
            raise Interrupted(signal.Signals(signum).name)
        logger.warning("received %s: saving a checkpoint after this step", signal.Signals(signum).name)

    @contextlib.contextmanager
    def at_once(self):
        """Signals in this block raise ``Interrupted`` (a signal already received raises it on entry)."""
        if self.signal is not None:
            raise Interrupted(signal.Signals(self.signal).name)
        self._at_once = True
        try:
            yield
        finally:
            self._at_once = False

    def __exit__(self, *exc: Any) -> None:
        for s, h in self._old.items():
            signal.signal(s, h)
