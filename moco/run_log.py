"""What a run reports while it trains: ``metrics.jsonl`` (and TensorBoard), the progress bar."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from moco.checkpoint import atomic_write
from moco.curves import read_metrics
from moco.errors import UserError

__all__ = ["MetricsLog", "summary_writer_class", "shown_total", "progress_bar"]


class MetricsLog:
    """``metrics.jsonl``: one JSON line per step; on resume, lines past the checkpoint are dropped, and so are lines
    a kill cut off or damaged (each named in a warning, :func:`moco.curves.parse_metrics`).

    With a ``writer_class`` (TensorBoard's SummaryWriter) every numeric field but ``step`` is also written as a
    scalar to ``RUN_DIR/tensorboard``, events past the checkpoint purged on resume.
    """

    def __init__(self, path: Path, from_step: int, writer_class: Any = None) -> None:
        records = read_metrics(path) if path.exists() and from_step > 0 else []  # damaged and torn lines named
        records = [r for r in records if r["step"] <= from_step]
        text = "".join(json.dumps(r) + "\n" for r in records).encode()
        atomic_write(path, lambda f: f.write(text))  # written back whole
        self._f = path.open("a")
        losses = [r["loss"] for r in records if "loss" in r]
        self.last_loss: float | None = losses[-1] if losses else None
        self.last_eval = max((r["step"] for r in records if "knn_top1" in r), default=-1)  # the last kNN's step
        self._tb = None
        if writer_class is not None:
            self._tb = writer_class(str(path.parent / "tensorboard"), purge_step=from_step + 1 if from_step else None)

    def write(self, record: dict[str, Any]) -> None:
        record = {k: (round(v, 6) if isinstance(v, float) and math.isfinite(v) else v) for k, v in record.items()}
        self._f.write(json.dumps(record) + "\n")
        self._f.flush()
        self.last_loss = record.get("loss", self.last_loss)
        if self._tb is not None:
            for key, value in record.items():
                if key != "step" and isinstance(value, int | float):
                    self._tb.add_scalar(key, value, record["step"])
            self._tb.flush()  # watched live: `tensorboard --logdir RUN_DIR`

    def close(self) -> None:
        self._f.close()
        if self._tb is not None:
            self._tb.close()


def summary_writer_class() -> Any:
    """TensorBoard's SummaryWriter, or a UserError naming the extra to install."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as e:
        raise UserError('--tensorboard needs the tensorboard package: pip install "moco-retrieval[tensorboard]" '
                        "(or drop --tensorboard; metrics.jsonl has the same records)") from e  # fmt: skip
    return SummaryWriter


def shown_total(total_steps: int, schedule_known: bool) -> int | None:
    """The total the progress bar shows: none (steps and rate only, no ETA) while a time-budget schedule is not
    fitted yet, whose planned length would give a meaningless ETA; else ``total_steps``."""
    return total_steps if schedule_known else None


def progress_bar(total: int | None, initial: int, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=initial, disable=not enabled, unit="step", dynamic_ncols=True, leave=True)
