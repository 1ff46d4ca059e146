"""What a run reports while it trains, and what reads it back: ``metrics.jsonl`` written (and TensorBoard) with the
progress bar (:class:`MetricsLog`), read by the one reader of it (:func:`read_metrics`, for training, the Status
tab and the benchmarks) and plotted (loss, and kNN accuracy when monitored) into ``curves.png``.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

from moco.config import short_repr
from moco.errors import UserError
from moco.extras import install_hint
from moco.files import atomic_write

__all__ = ["MetricsLog", "summary_writer_class", "shown_total", "progress_bar", "parse_metrics", "plot_curves",
           "read_metrics"]

logger = logging.getLogger(__name__)

class MetricsLog:
    """``metrics.jsonl``: one JSON line per step; on resume, lines past the checkpoint are dropped, and so are lines
    a kill cut off or damaged (each named in a warning, :func:`moco.training.metrics.parse_metrics`).

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
        raise UserError(f"--tensorboard needs the tensorboard package: {install_hint('tensorboard')} "
                        "(or drop --tensorboard; metrics.jsonl has the same records)") from e
    return SummaryWriter


def shown_total(total_steps: int, schedule_known: bool) -> int | None:
    """The total the progress bar shows: none (steps and rate only, no ETA) while a time-budget schedule is not
    fitted yet, whose planned length would give a meaningless ETA; else ``total_steps``."""
    return total_steps if schedule_known else None


def progress_bar(total: int | None, initial: int, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=initial, disable=not enabled, unit="step", dynamic_ncols=True, leave=True)


_SHOWN = 5  # damaged line numbers named in the warning

# The fields of a record that training writes and its readers use, and their kinds (an int is a float too). A value of
# another type (valid JSON, written by something else) is dropped from its record, named in the warning; None is the
# kNN monitor's "not measured" where it may be.
NUMBERS: dict[str, type] = {
    "epoch": float, "loss": float, "lr": float, "m": float, "img_s": float, "data_ms": float, "step_ms": float,
    "pos_sim": float, "elapsed_s": float, "total_steps": int, "crop": int, "decorrelation": float,
    "decorrelation_weight": float, "knn_top1": float, "knn_pixels": float, "knn_whitened": float,
    "knn_pixels_whitened": float, "knn_exported": float,
}
_MAY_BE_NONE = ("knn_whitened", "knn_pixels_whitened")


def parse_metrics(data: bytes, path: str | Path, first_line: int = 1, said: set[str] | None = None,
                  ) -> list[dict[str, Any]]:
    """The records in ``data``, the bytes of ``path`` (a ``metrics.jsonl``) from line ``first_line`` on: the one
    reader of that file. A line that is not a record (a JSON object with an integer ``step``) is skipped, and one
    warning names the file and the lines: a damaged line by its number (nested too deeply for JSON too); a last line
    without its newline as torn (cut off by a kill while it was written); a value of the wrong type for its field
    (``NUMBERS``) is dropped from its record. A reader following a live run passes complete lines only, and a
    ``said`` set of its own: values of the wrong type are then named once for the file, not at every read."""
    lines = data.split(b"\n")
    torn = lines.pop() if lines else b""  # what follows the last newline: empty when the file ends with one
    records, damaged, wrong = [], [], []
    for number, line in enumerate(lines, first_line):
        record = _record(line)
        if record is not None:
            records.append(_typed(record, number, wrong))
        elif line.strip():
            damaged.append(number)
    last = _record(torn) if torn.strip() else None
    if last is not None:  # whole, only its newline missing
        records.append(_typed(last, first_line + len(lines), wrong))
    problems = []
    if damaged:
        more = f" and {len(damaged) - _SHOWN} more" if len(damaged) > _SHOWN else ""
        numbers = ", ".join(map(str, damaged[:_SHOWN])) + more
        problems.append(f"damaged line{'s' if len(damaged) > 1 else ''} {numbers} (not a JSON record)")
    if torn.strip() and last is None:
        problems.append(f"a torn last line {first_line + len(lines)} (cut off while it was written: a killed run)")
    if wrong and "types" not in (said if said is not None else set()):
        shown = "; ".join(wrong[:_SHOWN]) + (f"; and {len(wrong) - _SHOWN} more lines" if len(wrong) > _SHOWN else "")
        problems.append(f"values of the wrong type ({shown}){' (said once)' if said is not None else ''}")
        if said is not None:
            said.add("types")
    if problems:
        logger.warning("%s: skipped %s; %d records read", path, " and ".join(problems), len(records))
    return records


def _record(line: bytes) -> dict[str, Any] | None:
    try:
        record = json.loads(line)
    except (ValueError, RecursionError):  # not JSON, not UTF-8, or nested past what the parser takes
        return None
    step = record.get("step") if isinstance(record, dict) else None
    return record if isinstance(step, int) and not isinstance(step, bool) else None


def _typed(record: dict[str, Any], number: int, wrong: list[str]) -> dict[str, Any]:
    """``record`` (line ``number``) without its values of the wrong type, each described in ``wrong``."""
    bad = [k for k, kind in NUMBERS.items() if k in record and not _is_number(record[k], kind)
           and not (record[k] is None and k in _MAY_BE_NONE)]
    if not bad:
        return record
    values = ", ".join(f"{k!r} = {short_repr(record[k])}" for k in bad)
    wrong.append(f"line {number} (step {record['step']}): {values}, not {'numbers' if len(bad) > 1 else 'a number'}")
    return {k: v for k, v in record.items() if k not in bad}


def _is_number(value: Any, kind: type) -> bool:
    return isinstance(value, int if kind is int else int | float) and not isinstance(value, bool)


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """The records of a ``metrics.jsonl`` file (:func:`parse_metrics`: damaged and torn lines skipped, named)."""
    return parse_metrics(Path(path).read_bytes(), path)


def plot_curves(metrics_path: str | Path, out_path: str | Path) -> Path | None:
    """Write the loss curve (and kNN top-1 where logged) to ``out_path``; None when there is nothing to plot
    (or matplotlib, the ``plot`` extra, is not installed)."""
    metrics_path = Path(metrics_path)
    if not metrics_path.exists():
        return None
    records = read_metrics(metrics_path)
    steps = [r for r in records if "loss" in r]
    if not steps:
        return None
    try:
        import matplotlib
    except ModuleNotFoundError as e:
        if e.name != "matplotlib":
            raise
        logger.info("skipping %s: matplotlib is not installed (%s); %s has the same numbers", out_path,
                    install_hint("plot"), metrics_path)
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    knn = [r for r in records if "knn_top1" in r]
    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=100)
    x = [r["step"] for r in steps]
    y = [r["loss"] for r in steps]
    ax.plot(x, y, color="#9ab", lw=0.8, label="loss (per step)")
    w = max(1, len(y) // 50)
    if len(y) >= 2 * w > 2:
        smooth = [sum(y[max(0, i - w + 1) : i + 1]) / len(y[max(0, i - w + 1) : i + 1]) for i in range(len(y))]
        ax.plot(x, smooth, color="#137", lw=1.6, label=f"loss (mean of {w})")
    ax.set_xlabel("step")
    ax.set_ylabel("InfoNCE loss")
    ax.grid(alpha=0.3)
    if knn:
        ax2 = ax.twinx()
        ax2.plot([r["step"] for r in knn], [100 * r["knn_top1"] for r in knn], "o-", color="#c50", label="kNN top-1 %")
        pixels = [r["knn_pixels"] for r in knn if "knn_pixels" in r]
        if pixels:  # the floor: the same kNN on centred pixels
            ax2.axhline(100 * pixels[-1], color="#c50", ls="--", lw=1, label=f"centred pixels {100 * pixels[-1]:.1f}%")
        ax2.set_ylabel("kNN top-1 (%)")
        ax2.legend(loc="upper right")
    ax.legend(loc="upper left" if knn else "best")
    name = metrics_path.parent.name.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
    ax.set_title(f"{name}: {len(steps)} steps")  # a name's bytes that are not UTF-8 shown escaped, as \xe9
    fig.tight_layout()
    out_path = Path(out_path)
    fig.savefig(out_path)
    plt.close(fig)
    logger.info("wrote %s", out_path)
    return out_path
