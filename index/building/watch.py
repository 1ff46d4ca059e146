"""Keeping an index up with its photo folder: notice what changed, wait until it settles, update.

A :class:`Watcher` learns that the folder changed from the file system's events (watchdog: inotify, FSEvents,
ReadDirectoryChangesW; the ``watch`` extra) or, without them or on a network drive where events never come
(``poll_s``), from a scan every ``poll_s`` seconds that compares each photo's size and modification time with the
last scan's. Changes are batched by :class:`Settle`: the index is updated once nothing has changed for ``settle_s``
seconds (a burst of thousands of new files, a folder renamed, a file still being copied, whose size keeps growing),
or ``max_wait_s`` after the first change of a burst that never pauses, so that a long copy becomes searchable part by
part. The update is :func:`index.building.runner.update_index`, which embeds what is new or changed, drops what is
gone and keeps what moved; a server searching the index meanwhile goes on with the version it holds and takes the
new one when it is written (as with ``moco index update`` run beside it). A failed update is logged and tried again
at the next change or after ``max_wait_s``; it never stops the watch.

Timing is decided by :class:`Settle` against a clock it is given (``time.monotonic`` by default): tests drive it with
a synthetic one.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from moco.data.photos import IMAGE_EXTENSIONS

__all__ = ["Settle", "Watcher", "WatchState", "snapshot", "SETTLE_S", "MAX_WAIT_S"]

logger = logging.getLogger(__name__)

SETTLE_S = 3.0  # seconds without a change before an update (a copy in progress keeps changing)
MAX_WAIT_S = 60.0  # seconds after a burst's first change: an update even if it has not settled
TICK_S = 0.5  # how often the watcher looks at its clock


@dataclass
class Settle:
    """When a batch of changes is due: ``settle_s`` after the last change, or ``max_wait_s`` after the first."""

    settle_s: float = SETTLE_S
    max_wait_s: float = MAX_WAIT_S
    first: float | None = None
    last: float | None = None
    hold_until: float = float("-inf")  # after a failed update: not before this

    def note(self, now: float) -> None:
        """A change at ``now``."""
        if self.first is None:
            self.first = now
        self.last = now

    def due(self, now: float) -> bool:
        """Whether the changes noted so far should be applied at ``now``."""
        if self.first is None or self.last is None or now < self.hold_until:
            return False
        return now - self.last >= self.settle_s or now - self.first >= self.max_wait_s

    def take(self) -> None:
        """The changes noted so far are being applied: later ones start a new batch."""
        self.first = self.last = None


def snapshot(root: Path) -> dict[str, tuple[int, int]]:
    """Every photo under ``root`` (hidden files and folders left out, as the index leaves them): relative path ->
    (size, modification time in ns). Only folders are listed and files stat'ed: nothing is opened."""
    out: dict[str, tuple[int, int]] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        for name in filenames:
            if name.startswith(".") or os.path.splitext(name)[1].lower() not in IMAGE_EXTENSIONS:
                continue
            path = os.path.join(dirpath, name)
            try:
                st = os.stat(path)
            except OSError:  # gone between the listing and the stat: the next scan says so
                continue
            out[os.path.relpath(path, root)] = (st.st_size, st.st_mtime_ns)
    return out


@dataclass
class WatchState:
    """What a watch has done, for the Status tab and the log."""

    root: str
    mode: str  # "events" (watchdog) or "polling every N s"
    updates: int = 0
    pending_since: float | None = None  # the clock's time of the first change not yet applied
    updating: bool = False
    last: dict[str, Any] = field(default_factory=dict)  # the last update's counts
    error: str | None = None  # the last update's failure, until one succeeds

    def describe(self) -> str:
        """One line for people."""
        text = f"Watching {self.root} ({self.mode}): {self.updates} update{'s' * (self.updates != 1)}"
        if self.last:
            text += " · last: " + ", ".join(f"{v} {k}" for k, v in self.last.items())
        if self.updating:
            text += " · updating now"
        elif self.pending_since is not None:
            text += " · changes waiting to settle"
        if self.error:
            text += f" · the last update failed: {self.error} (tried again at the next change)"
        return text


class Watcher:
    """Keeps an index up with ``root``: ``update()`` (an index update, returning its
    :class:`~index.building.runner.Summary` or counts) runs in a thread of its own whenever the folder's changes
    are due (module docstring). ``poll_s``: scan every ``poll_s`` seconds instead of listening to events (a network
    drive); None: events when watchdog is installed, else a scan every 10 s."""

    def __init__(self, root: str | Path, update: Callable[[], Any], settle_s: float = SETTLE_S,
                 max_wait_s: float = MAX_WAIT_S, poll_s: float | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.root = Path(root)
        self._update, self._clock = update, clock
        self._settle = Settle(max(settle_s, poll_s or 0.0), max_wait_s)  # polling: a change seen once a scan
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._observer: Any = None
        self._poll_s = poll_s
        if poll_s is None:
            try:
                import watchdog.observers  # noqa: F401 - the events, when the extra is installed
            except ModuleNotFoundError:
                self._poll_s = 10.0
                logger.info("watchdog is not installed (pip install watchdog, or the `watch` extra): scanning %s "
                            "every %.0f s instead", self.root, self._poll_s)
        mode = "events" if self._poll_s is None else f"scanning every {self._poll_s:g} s"
        self.state = WatchState(str(self.root), mode)
        self._seen = snapshot(self.root) if self._poll_s is not None else {}
        self._next_scan = clock() + (self._poll_s or 0.0)
        self._thread = threading.Thread(target=self._run, name="moco-watch", daemon=True)

    def start(self) -> Watcher:
        """Start listening (or scanning) and updating; returns itself."""
        if self._poll_s is None:
            from watchdog.events import FileSystemEventHandler
            from watchdog.observers import Observer

            watcher = self

            class Changed(FileSystemEventHandler):
                def on_any_event(self, event: Any) -> None:  # created, modified, moved, deleted, closed
                    if event.event_type in ("opened", "closed_no_write"):
                        return  # a read: nothing changed
                    paths = [p for p in (getattr(event, "src_path", ""), getattr(event, "dest_path", "")) if p]
                    if any(not _hidden(watcher.root, os.fsdecode(p)) for p in paths):
                        watcher.changed()

            try:
                self._observer = Observer()
                self._observer.schedule(Changed(), str(self.root), recursive=True)
                self._observer.start()
            except OSError as e:  # inotify's watches used up (a very large tree), or no events on this drive
                self._observer = None
                self._fall_back(f"the file system's events are not available for {self.root} ({e})")
        self._thread.start()
        logger.info("watching %s (%s)", self.root, self.state.mode)
        return self

    def _fall_back(self, why: str, poll_s: float = 10.0) -> None:
        """Scan every ``poll_s`` seconds instead of listening to events, saying ``why``."""
        logger.warning("%s: scanning it every %.0f s instead (raise fs.inotify.max_user_watches, or pass --poll S)",
                       why, poll_s)
        self._poll_s = poll_s
        self.state.mode = f"scanning every {poll_s:g} s"
        self._seen = snapshot(self.root)
        self._next_scan = self._clock() + poll_s

    def stop(self, timeout: float = 30.0) -> None:
        """Stop watching; an update under way is let finish (up to ``timeout`` seconds)."""
        self._stop.set()
        if self._observer is not None:
            self._observer.stop()
            self._observer.join(timeout)
        if self._thread.is_alive():
            self._thread.join(timeout)

    def changed(self) -> None:
        """Something under the folder changed now."""
        with self._lock:
            self._settle.note(self._clock())
            if self.state.pending_since is None:
                self.state.pending_since = self._settle.first

    def step(self) -> bool:
        """One look: scan when a scan is due (polling), then update when the changes are due; whether it updated.
        The watch's thread calls it every :data:`TICK_S`; tests call it with their own clock."""
        now = self._clock()
        if self._poll_s is not None and now >= self._next_scan:
            self._next_scan = now + self._poll_s
            seen = snapshot(self.root)
            if seen != self._seen:
                self._seen = seen
                self.changed()
        with self._lock:
            if not self._settle.due(now):
                return False
            self._settle.take()
            self.state.pending_since, self.state.updating = None, True
        try:
            summary = self._update()
            self.state.updates += 1
            self.state.last = _counts(summary)
            self.state.error = None
            logger.info("watch: index updated (%s)", ", ".join(f"{v} {k}" for k, v in self.state.last.items()))
        except Exception as e:  # noqa: BLE001 - a failed update never stops the watch: it is tried again
            self.state.error = str(e)
            logger.warning("watch: the update failed (%s); trying again after the next change", e)
            with self._lock:  # tried again after max_wait_s (or once later changes settle, not sooner)
                now = self._clock()
                self._settle.note(now)
                self._settle.hold_until = now + self._settle.max_wait_s
                self.state.pending_since = self._settle.first
        finally:
            self.state.updating = False
        return True

    def _run(self) -> None:
        while not self._stop.wait(TICK_S):
            self.step()


def _hidden(root: Path, path: str) -> bool:
    """Whether ``path`` is inside a hidden folder of ``root``, or is hidden itself (what the index leaves out)."""
    try:
        parts = Path(path).relative_to(root).parts
    except ValueError:
        return True
    return any(p.startswith(".") for p in parts)


def _counts(summary: Any) -> dict[str, Any]:
    """An update's counts for people: added, changed, removed, moved (what the summary has of them)."""
    if isinstance(summary, dict):
        return summary
    out = {}
    for name, key in (("new", "embedded"), ("changed", "reembedded"), ("moved", "moved"), ("removed", "removed"),
                      ("photos", "vectors")):
        value = getattr(summary, key, None)
        if isinstance(value, int):
            out[name] = value
    return out
