"""The flags of ``moco train`` and ``python -m moco.train`` and the run's one-line summary: importable without torch,
so that building the CLI's parser (``moco --help``, ``moco index stats``) does not load the trainer."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

__all__ = ["DESCRIPTION", "add_train_arguments", "summary_line"]

DESCRIPTION = (
    "Train MoCo v1/v2/v3 on a folder of unlabeled photos (recursive). Writes RUN_DIR/checkpoint.pt, config.json, "
    "metrics.jsonl, skipped.txt and curves.png. Flags override the --config file's values, which override the "
    "preset's."
)


def add_train_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of ``moco train`` and ``python -m moco.train``: DATA_DIR, --out, run control, one per config field."""
    from moco.config import PRESETS
    from moco.config_flags import add_config_arguments

    p.add_argument("data_dir", metavar="DATA_DIR", nargs="?", help="folder of photos (optional with --resume)")
    p.add_argument("--out", required=True, metavar="RUN_DIR", help="run directory")
    p.add_argument("--preset", choices=tuple(PRESETS), default=None,
                   help="recipe to start from: v1 | v2 | v3 (the papers) | cpu (short CPU runs; see the README) "
                   "(default: cpu for a --time-budget run on a CPU, else v2)")
    p.add_argument("--resume", action="store_true", help="continue RUN_DIR/checkpoint.pt exactly where it stopped")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--config", default=None, metavar="FILE",
                   help="JSON or YAML file of config fields (e.g. a run's config.json): preset <- file <- flags")
    p.add_argument("--tensorboard", action="store_true",
                   help="also write the metrics as TensorBoard scalars to RUN_DIR/tensorboard (needs the "
                   "tensorboard extra)")
    p.add_argument(
        "--stop-after",
        type=int,
        default=None,
        metavar="STEP",
        help="checkpoint and exit at this step, as if interrupted (the schedule still spans the whole "
        "run): to split training over job slots; continue with --resume",
    )
    add_config_arguments(p)


def summary_line(summary: dict[str, Any], run_dir: Path) -> str:
    """One line about a finished (or stopped) run, for the console."""
    how = f" (stopped by {summary['stopped_by']}; continue with --resume)" if summary["stopped_by"] else ""
    if summary["stopped_by"] == "time budget":  # finished, maybe short of its schedule
        planned = summary.get("planned_steps")
        how = (f" (stopped by its time budget at {summary['steps']} of {planned} steps)" if planned
               else " (its time budget is spent)")  # fmt: skip
    loss, white = summary["final_loss"], summary.get("whitening")
    mirror = " and their mirror images" if white and white.get("mirror") else ""
    stages = f", {white['dim']}-d with the pooled {'/'.join(white['stages'])}" if white and white.get("stages") else ""
    fitted = (f"; whitening fitted on {white['rows']} photos{mirror}{stages} in {white['seconds']:.1f} s"
              if white else "")  # fmt: skip
    return (
        f"trained {summary['steps']}/{summary['total_steps']} steps on {summary['images']} images "
        f"({summary['skipped']} skipped) on {summary['device']} {summary['precision']}{how}; "
        f"final loss {loss if loss is None else round(loss, 4)}{fitted}; checkpoint {run_dir / 'checkpoint.pt'}"
    )
