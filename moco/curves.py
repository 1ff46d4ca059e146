"""Plot a run's ``metrics.jsonl`` (loss, and kNN accuracy when monitored) into ``curves.png``."""

from __future__ import annotations

import json
import logging
from pathlib import Path

__all__ = ["plot_curves", "read_metrics"]

logger = logging.getLogger(__name__)


def read_metrics(path: str | Path) -> list[dict]:
    """The records of a ``metrics.jsonl`` file (an unfinished last line is ignored)."""
    records = []
    for line in Path(path).read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


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
        logger.info('skipping %s: matplotlib is not installed (pip install "moco-retrieval[plot]"); %s has the '
                    "same numbers", out_path, metrics_path)  # fmt: skip
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
    ax.set_title(f"{metrics_path.parent.name}: {len(steps)} steps")
    fig.tight_layout()
    out_path = Path(out_path)
    fig.savefig(out_path)
    plt.close(fig)
    logger.info("wrote %s", out_path)
    return out_path
