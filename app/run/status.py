"""What `moco run` is doing now, for the UI's Status tab: the pipeline updates a ``RunStatus``, the UI polls it.

    status = RunStatus(work)                       # shared by the pipeline thread and the UI
    run_pipeline(..., status=status)               # stages, messages, index_ready, error
    snap = status.snapshot()                       # stage, messages, training progress read from metrics.jsonl
    status_markdown(snap), loss_frame(snap)        # a one-line summary and the curves for a gr.LinePlot

Training progress comes from ``WORK/run/metrics.jsonl``, read incrementally (only the bytes appended since the
last poll; a file truncated or rewritten by a resumed run is read again from its start).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from moco.training.metrics import parse_metrics

__all__ = ["STAGES", "RunStatus", "eta_seconds", "loss_frame", "status_markdown"]

logger = logging.getLogger(__name__)

STAGES = ("starting", "photos", "model", "training", "export", "indexing", "ready", "failed")
MAX_MESSAGES = 50
RECENT = 20  # per-step records the rate (ETA, img/s) is measured over
FIRST_FIT_STEP = 10  # moco.training.optim.BudgetFit's first fit (not imported: that would load torch)
MAX_PLOT_POINTS = 2000
MAX_SKIPPED_SHOWN = 10  # skipped photos named on the tab (skipped.txt lists them all)


def eta_seconds(records: Sequence[dict[str, Any]], window: int = RECENT, budget_s: float = 0.0) -> float | None:
    """Seconds of training left after the last of ``records`` (metrics.jsonl per-step records, oldest first).

    None until the schedule's length is known (the last record has ``total_steps``). The rate is that of the
    last ``window`` records (``elapsed_s`` over steps), or of the whole run so far when only one is there.
    ``budget_s``: the run's time budget (0: none), which ends it whatever its schedule: the ETA is the earlier of
    the schedule's end and the budget's (``elapsed_s`` is the budget's clock).
    """
    timed = [r for r in records if "elapsed_s" in r and "step" in r]
    if not timed or "total_steps" not in timed[-1]:
        return None
    last = timed[-1]
    first = timed[-window:][0]
    if last["step"] > first["step"]:
        rate = (last["elapsed_s"] - first["elapsed_s"]) / (last["step"] - first["step"])
    elif last["step"] > 0:
        rate = last["elapsed_s"] / last["step"]
    else:
        return None
    eta = max(0.0, (last["total_steps"] - last["step"]) * max(rate, 0.0))
    return min(eta, max(0.0, budget_s - last["elapsed_s"])) if budget_s > 0 else eta


class _MetricsTail:
    """The records of one metrics.jsonl, read incrementally from the byte offset reached so far."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.said: set[str] = set()  # what parse_metrics said once for this file (values of the wrong type)
        self._reset()

    def _reset(self) -> None:
        self.offset = 0
        self.lines = 0  # the lines read, up to ``offset``
        self.last_line = b""  # the last complete line read, ending at ``offset``: a rewritten file will differ
        self.loss: list[tuple[int, float]] = []
        self.knn: list[tuple[int, float]] = []
        self.knn_pixels: float | None = None  # the centred-pixels kNN baseline the monitor reports
        self.recent: deque[dict[str, Any]] = deque(maxlen=RECENT)

    def _rewritten(self, f: Any, size: int) -> bool:
        if size < self.offset:
            return True
        if not self.offset:
            return False
        f.seek(self.offset - len(self.last_line))
        return f.read(len(self.last_line)) != self.last_line

    def poll(self) -> None:
        """Take in the complete lines appended since the last poll (a half-written last line waits)."""
        try:
            with self.path.open("rb") as f:
                size = f.seek(0, 2)
                if self._rewritten(f, size):
                    logger.debug("%s was rewritten: reading it again", self.path)
                    self._reset()
                f.seek(self.offset)
                chunk = f.read(size - self.offset)
        except FileNotFoundError:
            self._reset()
            return
        end = chunk.rfind(b"\n") + 1
        if not end:
            return
        # a damaged line is named, then skipped; a value of the wrong type dropped (said once)
        records = parse_metrics(chunk[:end], self.path, self.lines + 1, self.said)
        self.lines += chunk.count(b"\n", 0, end)
        self.offset += end
        self.last_line = chunk[:end].splitlines(keepends=True)[-1]
        for record in records:
            if isinstance(record, dict) and isinstance(record.get("step"), int):
                self._add(record)

    def _add(self, record: dict[str, Any]) -> None:
        step = record["step"]
        if "loss" in record:
            _append(self.loss, step, record["loss"])
            while self.recent and self.recent[-1]["step"] >= step:
                self.recent.pop()
            self.recent.append(record)
        if "knn_top1" in record:
            _append(self.knn, step, record["knn_top1"])
        if "knn_pixels" in record:
            self.knn_pixels = float(record["knn_pixels"])


def _append(series: list[tuple[int, float]], step: int, value: float) -> None:
    while series and series[-1][0] >= step:  # a later record for an earlier step replaces what followed it
        series.pop()
    series.append((step, value))


class RunStatus:
    """Thread-safe state of one `moco run`: the pipeline writes it, the UI reads ``snapshot()``.

    ``run_dir`` (WORK/run): where training writes metrics.jsonl. ``index_ready``/``index_path``: set once the
    index is written. ``error``: the failure's text. ``history``: the stages entered, in order.
    """

    def __init__(self, work: str | Path, clock: Callable[[], float] = time.monotonic) -> None:
        self.work = Path(work)
        self.run_dir = self.work / "run"
        self.index_ready = False
        self.index_path: Path | None = None
        self.error: str | None = None
        self.photos_found: int | None = None  # the photo files the pipeline found (set before training)
        self.unsupported: dict[str, int] = {}  # extension -> photos not read: its package is missing here
        self.excluded = 0  # files and folders --exclude left out
        self._clock = clock
        self._lock = threading.Lock()
        self._start = self._stage_start = clock()
        self._stage, self._detail = "starting", ""
        self.history: list[str] = ["starting"]
        self._messages: deque[str] = deque(maxlen=MAX_MESSAGES)
        self._tail: _MetricsTail | None = None
        self._files: dict[Path, tuple[tuple[int, int, int], Any]] = {}  # config.json, skipped.txt: (stamp, read)

    def stage(self, name: str, detail: str = "") -> None:
        """Enter stage ``name`` (one of ``STAGES``), with a line saying what it works on."""
        if name not in STAGES:
            raise ValueError(f"unknown stage {name!r}: one of {', '.join(STAGES)}")
        with self._lock:
            self._stage, self._detail, self._stage_start = name, detail, self._clock()
            self.history.append(name)

    def say(self, message: str) -> None:
        """Keep one of the pipeline's messages (the last ``MAX_MESSAGES``)."""
        with self._lock:
            self._messages.append(str(message))

    def fail(self, error: str) -> None:
        """Stage "failed", with the error's text."""
        with self._lock:
            self.error = error
        self.stage("failed", error)

    def snapshot(self) -> dict[str, Any]:
        """The current state as plain data: stage, detail, stage_s, total_s, messages, index_ready, index_path,
        error, and training progress: step, total_steps (None until known), loss [(step, loss)], knn
        [(step, top-1 fraction)], img_s, eta_s (None until total_steps is known; never past the end of the time
        budget, time_budget_min, of the run's config.json), skipped [(path, reason)] (the first MAX_SKIPPED_SHOWN
        of the run's skipped.txt), skipped_count, photos_found, unsupported ({extension: files skipped for a
        missing package}), excluded."""
        with self._lock:
            now = self._clock()
            snap: dict[str, Any] = {
                "stage": self._stage,
                "detail": self._detail,
                "stage_s": now - self._stage_start,
                "total_s": now - self._start,
                "messages": list(self._messages),
                "history": list(self.history),
                "index_ready": self.index_ready,
                "index_path": self.index_path,
                "error": self.error,
            }
            path = Path(self.run_dir) / "metrics.jsonl"
            if self._tail is None or self._tail.path != path:
                self._tail = _MetricsTail(path)
            tail = self._tail
            tail.poll()
            recent = list(tail.recent)
            last = recent[-1] if recent else {}
            budget_min = self._read(Path(self.run_dir) / "config.json", _time_budget) or 0.0
            skipped = self._read(Path(self.run_dir) / "skipped.txt", _skipped) or []
            snap.update(
                step=last.get("step", 0),
                total_steps=last.get("total_steps"),
                loss=list(tail.loss),
                knn=list(tail.knn),
                knn_pixels=tail.knn_pixels,
                img_s=sum(r.get("img_s", 0.0) for r in recent) / len(recent) if recent else None,
                eta_s=eta_seconds(recent, budget_s=60 * budget_min),
                time_budget_min=budget_min,
                skipped=skipped[:MAX_SKIPPED_SHOWN],
                skipped_count=len(skipped),
                photos_found=self.photos_found,
                unsupported=dict(self.unsupported),
                excluded=self.excluded,
            )
        return snap

    def _read(self, path: Path, parse: Callable[[Path], Any]) -> Any:
        """``parse(path)``, read again only when the file changes; None while it is missing or unreadable."""
        try:
            st = path.stat()
        except OSError:
            self._files.pop(path, None)
            return None
        stamp = (st.st_mtime_ns, st.st_size, st.st_ino)
        if path not in self._files or self._files[path][0] != stamp:
            try:
                self._files[path] = (stamp, parse(path))
            except (OSError, ValueError) as e:
                logger.debug("%s is not readable yet (%s)", path, e)
                return None
        return self._files[path][1]


def _time_budget(path: Path) -> float:
    """The time budget (minutes, 0: none) in a run's config.json."""
    import json

    value = json.loads(path.read_text()).get("time_budget", 0.0)
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) and value > 0 else 0.0


def _skipped(path: Path) -> list[tuple[str, str]]:
    from moco.data.cache import read_skipped

    return read_skipped(path)


def _duration(seconds: float) -> str:
    """``3 min 10 s``, ``1 h 5 min``, ``45 s``."""
    s = max(0, round(seconds))
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60} s" if s % 60 else f"{s // 60} min"
    return f"{s // 3600} h {s % 3600 // 60} min"


def _training_line(snap: dict[str, Any]) -> str:
    step, total = snap.get("step", 0), snap.get("total_steps")
    if not step:
        return "**Training**: starting" + (f" ({snap['detail']})" if snap.get("detail") else "")
    parts = [f"**Training** step {step}" + (f" / {total}" if total else "")]
    if snap.get("loss"):
        parts.append(f"loss {snap['loss'][-1][1]:.2f}")
    if snap.get("knn"):
        pixels = snap.get("knn_pixels")
        parts.append(f"kNN top-1 {100 * snap['knn'][-1][1]:.1f}%"
                     + (f" (centred pixels {100 * pixels:.1f}%)" if pixels is not None else ""))
    if snap.get("img_s"):
        parts.append(f"{snap['img_s']:.0f} img/s")
    if total is None:
        parts.append(f"fitting the schedule to the time budget (ETA after step {FIRST_FIT_STEP})")
    elif snap.get("eta_s") is not None:
        parts.append(f"ETA {_duration(snap['eta_s'])}")
    return " · ".join(parts)


def status_markdown(snapshot: dict[str, Any]) -> str:
    """A short human summary of ``snapshot`` (``RunStatus.snapshot()``), in Markdown: the stage, then the photos
    that were skipped, if any (named, at most ``MAX_SKIPPED_SHOWN``), and those of a format whose package is missing
    (counted, with the fix)."""
    return _stage_markdown(snapshot) + _skipped_markdown(snapshot) + _formats_markdown(snapshot)


def _formats_markdown(snapshot: dict[str, Any]) -> str:
    from moco.data.photos import skipped_notes

    notes = skipped_notes(snapshot.get("unsupported") or {})
    excluded = snapshot.get("excluded") or 0
    lines = [f"**Not read:** {note}" for note in notes]
    if excluded:
        lines.append(f"**Excluded:** {excluded} files and folders left out by --exclude")
    return "".join(f"\n\n{line}" for line in lines)


def _skipped_markdown(snapshot: dict[str, Any]) -> str:
    from index.catalog import display_path

    count, shown = snapshot.get("skipped_count") or 0, snapshot.get("skipped") or []
    if not count:
        return ""
    found = snapshot.get("photos_found")
    of = f" of the {found} photos found" if found else f" photo{'s' * (count != 1)}"
    names = " · ".join(f"`{display_path(path).replace('`', chr(39))}` ({reason})" for path, reason in shown)
    more = f" · and {count - len(shown)} more" if count > len(shown) else ""
    return (f"\n\n**Skipped** {count}{of}, which cannot be read (neither trained on nor searchable; all in "
            f"`skipped.txt`): {names}{more}")


def _stage_markdown(snapshot: dict[str, Any]) -> str:
    stage, detail = snapshot.get("stage", "starting"), snapshot.get("detail", "")
    if stage == "training":
        return _training_line(snapshot)
    if stage == "ready":
        return "**Ready**: search is on"
    if stage == "failed":
        return f"**Failed**: {snapshot.get('error') or detail or 'unknown error'}"
    label = {"starting": "Starting", "photos": "Photos", "model": "Model", "export": "Export",
             "indexing": "Indexing"}.get(stage, stage.capitalize())
    took = _duration(snapshot.get("stage_s", 0.0))
    return f"**{label}**" + (f": {detail}" if detail else "") + f" ({took})"


def loss_frame(snapshot: dict[str, Any]) -> Any:
    """A pandas DataFrame (step, value, series) of the loss ("loss") and kNN top-1 fraction ("kNN top-1")
    curves of ``snapshot``, for a gr.LinePlot; long runs thinned to about ``MAX_PLOT_POINTS`` points a series."""
    import pandas as pd

    rows = []
    for name, series in (("loss", snapshot.get("loss") or []), ("kNN top-1", snapshot.get("knn") or [])):
        stride = max(1, len(series) // MAX_PLOT_POINTS)
        kept = series[::stride]
        if series and kept[-1] != series[-1]:
            kept.append(series[-1])
        rows += [(step, value, name) for step, value in kept]
    return pd.DataFrame(rows, columns=["step", "value", "series"])
