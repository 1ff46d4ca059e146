"""What a run returns: :class:`TrainingSummary` (``train()``'s value) and its :class:`WhiteningSummary`. Importable
without torch, as :mod:`moco.training.command` (which reads it for the console's line) is."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["TrainingSummary", "WhiteningSummary"]


@dataclass(frozen=True)
class WhiteningSummary:
    """The end-of-run whitening a finished run fitted (``--whiten``)."""

    rows: int  # photos it was fitted on
    shrinkage: float  # Ledoit-Wolf: 0 (the sample covariance) .. 1 (centring only)
    mirror: bool  # fitted on mirror-averaged features (each photo with its mirror image)
    dim: int  # the width of the features it whitens (the backbone's plus the pooled stages' channels)
    stages: tuple[str, ...]  # the stages pooled before the backbone's output (empty: its output alone)
    seconds: float  # the fit's time, rounded to 0.01 s


@dataclass(frozen=True)
class TrainingSummary:
    """A finished (or stopped) run, as :func:`moco.training.loop.train` returns it."""

    run_dir: str
    steps: int  # the step the run stopped at
    total_steps: int  # its schedule (the fitted one under a time budget; ``steps`` once the budget is spent)
    images: int  # photos it trained on (decoded into the cache)
    skipped: int  # photos that could not be decoded (listed in ``run_dir/skipped.txt``)
    unsupported: dict[str, int]  # extension -> files never read: the package that reads them is missing
    excluded: int  # files and folders the scan left out (``exclude``)
    stopped_by: str | None  # "SIGINT", "SIGTERM", "stop_after=N", "time budget"; None: it ran its schedule
    signal: int | None  # the signal that stopped it, if any
    precision: str  # the resolved precision: "fp32", "bf16", "fp16"
    device: str  # e.g. "cpu", "cuda:0"
    final_loss: float | None  # the last step's loss (None: no step was logged, or not rank 0)
    whitening: WhiteningSummary | None  # None: no whitening fitted by this call (not asked, interrupted, not rank 0)
    planned_steps: int | None  # the schedule a spent time budget cut it short of; None: not cut short
