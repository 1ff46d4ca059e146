"""A run's checkpoints: what one holds and how the loop writes it (:class:`Checkpoints`), which flags a resume may
change, and where a run stands (:func:`run_state`)."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from moco.config import TrainConfig, from_plain, to_plain
from moco.data.cache import ImageCache
from moco.errors import UserError
from moco.files import atomic_write
from moco.model.builder import MoCo
from moco.runtime import Dist
from moco.weights.layouts import CHECKPOINT_ID, CHECKPOINT_VERSION, load_checkpoint
from moco.whiten import Whitening

__all__ = ["RESUMABLE_OVERRIDES", "run_state", "run_end", "resume_config", "check_resumable", "rng_state",
           "set_rng_state", "save_run", "Checkpoints", "save_checkpoint"]

logger = logging.getLogger(__name__)


# Fields that may change when resuming a run; everything else must match the checkpoint.
RESUMABLE_OVERRIDES = (
    "epochs",
    "max_steps",
    "time_budget",
    "workers",
    "save_every_minutes",
    "keep_checkpoints",
    "device",
    "compile",
    "val_dir",
    "knn_train_dir",
    "knn_every",
    "knn_k",
    "knn_t",
    "whiten",
    "whiten_stages",
    "whiten_edges",
)


def run_state(ckpt: dict[str, Any]) -> str:
    """Where the run saved in ``ckpt`` stands: "training" (steps left), "whitening" (its steps done but the
    whitening its config asks for not fitted: the end-of-run fit was interrupted) or "done". Its steps are done
    at its total, or once its time budget is spent (runs stopped by it before that was recorded as their end).
    ``train(cfg, resume=True)`` finishes the first two, the second without a step."""
    cfg = from_plain(ckpt["config"])
    step, total = int(ckpt.get("step", 0)), int(ckpt.get("total_steps") or 0)
    spent = cfg.time_budget > 0 and float(ckpt.get("elapsed", 0.0)) >= cfg.time_budget * 60
    if not (total and step >= total) and not spent:
        return "training"
    return "whitening" if cfg.whiten and "whitening" not in ckpt else "done"


def run_end(ckpt: dict[str, Any]) -> str:
    """How the finished run saved in ``ckpt`` ended, for a message: "600/600 steps", or "stopped by its time budget
    at 471 of 600 steps" (the schedule's length then; runs of older versions: their saved total)."""
    step, total = int(ckpt.get("step", 0)), int(ckpt.get("total_steps") or 0)
    planned = int(ckpt.get("planned_steps") or 0)
    cfg = from_plain(ckpt["config"])
    if not planned and total > step and cfg.time_budget > 0 and float(ckpt.get("elapsed", 0.0)) >= cfg.time_budget * 60:
        planned = total  # an older run, stopped by its budget before the end was recorded as its total
    if planned > step:
        return f"stopped by its time budget at {step} of {planned} steps"
    return f"{step}/{total} steps"


def resume_config(run_dir: str | Path, overrides: dict[str, Any] | None = None,
                  ckpt: dict[str, Any] | None = None) -> TrainConfig:
    """The config saved in ``run_dir/checkpoint.pt`` with ``overrides`` of the fields that may change. ``ckpt``: that
    checkpoint as the caller read it (:func:`moco.weights.layouts.load_checkpoint`); None: read here."""
    saved = from_plain((ckpt if ckpt is not None else load_checkpoint(Path(run_dir) / "checkpoint.pt"))["config"])
    saved.out = str(run_dir)
    for name, value in (overrides or {}).items():
        if name == "data_dir" and value and Path(value).resolve() != Path(saved.data_dir).resolve():
            raise UserError(
                f"--resume continues the run on {saved.data_dir}, not {value}: drop the folder argument, "
                "or start a new run (with --init RUN/checkpoint.pt to start from this run's weights)"
            )
        if name != "data_dir":
            setattr(saved, name, value)
    return saved


def check_resumable(saved: TrainConfig, cfg: TrainConfig) -> None:
    """Resuming must keep everything that shapes the result, except ``RESUMABLE_OVERRIDES``."""
    differ = [
        f"{name}={getattr(saved, name)!r} (now {getattr(cfg, name)!r})"
        for name in to_plain(saved)
        if name not in (*RESUMABLE_OVERRIDES, "out", "data_dir") and getattr(saved, name) != getattr(cfg, name)
    ]
    if differ:
        raise UserError(
            f"cannot resume {cfg.out}: the run was trained with {', '.join(differ)}; only "
            f"{', '.join(RESUMABLE_OVERRIDES)} may change on --resume (or start a new run with --init)"
        )


def rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def replica_check(model: MoCo, d: Dist) -> list[list[float]]:
    """Checksums of the queue on every rank; they must agree (all ranks enqueue the same gathered keys)."""
    if getattr(model, "queue", None) is None:
        return []
    sums = torch.tensor(
        [model.queue.double().sum().item(), float(model.queue_ids.sum()), float(model.queue_ptr)],
        dtype=torch.float64,
        device=model.queue.device,
    )  # 3
    if d.world == 1:
        return [sums.tolist()]
    parts = [torch.empty_like(sums) for _ in range(d.world)]
    dist.all_gather(parts, sums)
    if any(not torch.equal(p, parts[0]) for p in parts):
        raise RuntimeError(f"the MoCo queues differ across ranks: {[p.tolist() for p in parts]}")
    return [p.tolist() for p in parts]


def save_run(
    run_dir: Path,
    cfg: TrainConfig,
    model: MoCo,
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler,
    step: int,
    total_steps: int,
    elapsed: float,
    cache: ImageCache,
    d: Dist,
    whitening: Whitening | None = None,
    replicas: list[list[float]] | None = None,
    planned: int = 0,
) -> list[list[float]]:
    """Checkpoint the run (every rank: the queues' check is collective, rank 0 writes); returns the queues'
    checksums. ``replicas`` given (rank 0 alone): those of the state saved at this step, saved again with
    ``whitening``. ``planned``: the schedule's length when the time budget ended the run before it (kept as
    ``planned_steps``, so that the run is later reported as cut short)."""
    replicas = replica_check(model, d) if replicas is None else replicas
    if not d.main:
        return replicas
    state = {
        "replica_queue_checksums": replicas,
        "config": to_plain(cfg),
        "step": step,
        "total_steps": total_steps,
        "elapsed": elapsed,
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "scaler": scaler.state_dict() if scaler.is_enabled() else {},
        "rng": rng_state(),
        "data_root": str(Path(cfg.data_dir).resolve()),
        "files": list(cache.files),
    }
    if planned > step:
        state["planned_steps"] = planned
    if whitening is not None:  # only the final checkpoint: it belongs to these weights
        state["whitening"] = whitening.state()
    save_checkpoint(state, run_dir, keep=cfg.keep_checkpoints, replace=whitening is not None)
    return replicas


class Checkpoints:
    """The run's checkpoint writer: due every ``save_every_minutes``; it remembers the state it saved last (its
    training seconds, the queues' checksums), which the end-of-run whitening is saved with."""

    def __init__(self, run_dir: Path, cfg: TrainConfig, model: MoCo, optimizer: torch.optim.Optimizer,
                 scaler: torch.amp.GradScaler, cache: ImageCache, d: Dist, ckpt: dict | None, elapsed: float,
                 now: float) -> None:
        self.run_dir, self.cfg, self.cache, self.d = run_dir, cfg, cache, d
        self.model, self.optimizer, self.scaler = model, optimizer, scaler
        self.last, self.elapsed = now, elapsed
        self.replicas = ckpt.get("replica_queue_checksums", []) if ckpt is not None else []
        self.planned = int(ckpt.get("planned_steps") or 0) if ckpt is not None else 0  # set when the budget ends it

    def due(self, now: float) -> bool:
        return now - self.last >= self.cfg.save_every_minutes * 60

    def save(self, step: int, total_steps: int, elapsed: float, now: float) -> None:
        """Checkpoint step ``step`` (every rank: the queues' check is collective; rank 0 writes)."""
        self.elapsed = elapsed
        self.replicas = save_run(self.run_dir, self.cfg, self.model, self.optimizer, self.scaler, step,
                              total_steps, elapsed, self.cache, self.d, planned=self.planned)
        self.last = now

    def add_whitening(self, step: int, total_steps: int, whitening: Whitening) -> None:
        """The state saved last, again, now with its whitening (rank 0 alone)."""
        save_run(self.run_dir, self.cfg, self.model, self.optimizer, self.scaler, step, total_steps, self.elapsed,
              self.cache, self.d, whitening, self.replicas, self.planned)


def save_checkpoint(state: dict[str, Any], run_dir: str | Path, keep: int = 2, replace: bool = False) -> Path:
    """Write ``state`` to ``run_dir/checkpoint.pt`` atomically; keep ``keep`` step-numbered copies.

    The numbered copy is a second file (not a hard link), so damage to one never damages the other; ``replace``:
    rewrite the copy of this step too (the same step saved again with more in it, e.g. the run's whitening).
    """
    run_dir = Path(run_dir)
    state = {"format": CHECKPOINT_ID, "version": CHECKPOINT_VERSION, **state}
    path = run_dir / "checkpoint.pt"
    atomic_write(path, lambda f: torch.save(state, f))
    if keep > 0:
        numbered = run_dir / f"checkpoint-{int(state['step']):08d}.pt"
        if replace or not numbered.exists():
            atomic_write(numbered, lambda f: _copy_into(path, f))
        for old in sorted(run_dir.glob("checkpoint-*.pt"))[:-keep]:
            old.unlink(missing_ok=True)
    logger.info("saved %s (step %d)", path, state["step"])
    return path


def _copy_into(src: Path, f: Any) -> None:
    with open(src, "rb") as s:
        shutil.copyfileobj(s, f, 1 << 20)
