"""The MoCo training loop: one flat loop, exact resume, CPU / one GPU / torchrun.

    python -m moco.training DATA_DIR --out RUN_DIR [flags]      (same flags as `moco train`)

Each step: schedule (lr, m) -> batch + two views -> forward (momentum update, keys, loss,
enqueue) -> backward -> optimizer step -> log -> checkpoint when due. Every random draw that shapes
a step comes from (seed, step) or from RNG states saved in the checkpoint, so N steps + resume + N
steps equal 2N steps.
"""

from __future__ import annotations

import contextlib
import json
import logging
import signal
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from moco.config import TrainConfig, from_plain, to_plain, validate
from moco.data.augment import two_views
from moco.data.cache import ImageCache
from moco.data.workers import exit_if_importing_main
from moco.files import atomic_write, lock_dir, make_dirs
from moco.model.builder import momentum_schedule
from moco.runtime import Dist, resolve_device, resolve_precision
from moco.training.checkpoints import Checkpoints, check_resumable
from moco.training.memory import check_memory
from moco.training.metrics import MetricsLog, progress_bar, shown_total, summary_writer_class
from moco.training.optim import BudgetClock, BudgetFit, crop_size_at, lr_at, lr_decay, step_cost
from moco.training.setup import (
    Setup,
    bn_splits_for,
    build_model,
    check_collection,
    knn_monitor,
    load_data,
    safe_precision,
    setup,
)
from moco.training.stop import StopFlag
from moco.training.summary import TrainingSummary
from moco.training.whitening import end_of_run_fit, whitening_summary
from moco.weights.layouts import SplitCheckpoint, load_checkpoint, load_init
from moco.whiten import Whitening

__all__ = ["train"]

logger = logging.getLogger(__name__)

_clock = time.monotonic  # the time budget's clock (a test puts a synthetic one here)


def _batch_ids(epoch: int, index: int, n: int, batch: int, seed: int, d: Dist) -> np.ndarray:
    """This rank's dataset ids for step ``index`` of ``epoch``: a seeded permutation per epoch,
    global batches of ``batch x world`` drawn in order, rank r taking its slice (drop last)."""
    perm = np.random.default_rng([seed, epoch]).permutation(n)
    start = index * batch * d.world + d.rank * batch
    return perm[start : start + batch]


def _step_generator(seed: int, step: int, rank: int = 0) -> torch.Generator:
    """The augmentation draws of ``step`` on process ``rank``: each rank its own (rank 0 = one process).

    torch seeds a CPU generator with the low 32 bits only, so the rank term is one of them: rank r's seeds run
    r x 2654435761 (about 2^32 / golden ratio) apart from rank 0's, modulo 2^32.
    """
    return torch.Generator().manual_seed((seed * 1_000_003 + step + rank * 2_654_435_761) % 2**32)


def train(
    cfg: TrainConfig, resume: bool = False, progress: bool = True, stop_after: int | None = None,
    tensorboard: bool = False, init: SplitCheckpoint | None = None, checkpoint: dict[str, Any] | None = None,
) -> TrainingSummary:
    """Train MoCo on ``cfg.data_dir`` into ``cfg.out``; returns its :class:`~moco.training.summary.TrainingSummary`.

    With ``resume=True`` the run continues from ``cfg.out/checkpoint.pt`` exactly where it stopped
    (model, key encoder, queue, optimizer, scaler, RNG states, position in the epoch).
    ``stop_after``: checkpoint and return once the run reaches this step, as if interrupted there
    (the schedule still spans the whole run), e.g. to split training into sessions.
    ``tensorboard``: also write the metrics.jsonl records as TensorBoard scalars to ``cfg.out/tensorboard``.
    ``init``: ``cfg.init`` as the caller read it (:func:`moco.weights.layouts.read_checkpoint`); None: read here.
    ``checkpoint``: with ``resume``, ``cfg.out/checkpoint.pt`` as the caller read it
    (:func:`moco.weights.layouts.load_checkpoint`, for its config); None: read here.
    The resolved config is written to ``cfg.out/config.json`` before training starts. While the run lasts it holds
    ``cfg.out``'s lock (:func:`moco.files.lock_dir`): a second run on that directory refuses, naming it.
    """
    exit_if_importing_main()  # a script's top-level call, run again by a decoding worker: that worker stops there
    with contextlib.ExitStack() as held:  # the run directory's lock, once taken
        return _train(cfg, resume, progress, stop_after, tensorboard, init, held, checkpoint)


def _train(cfg: TrainConfig, resume: bool, progress: bool, stop_after: int | None, tensorboard: bool,
           init: SplitCheckpoint | None, held: contextlib.ExitStack,
           checkpoint: dict[str, Any] | None = None) -> TrainingSummary:
    writer_class = summary_writer_class() if tensorboard else None  # missing tensorboard: fail before any work
    d = Dist.join(cfg.device)
    cfg = replace(cfg, bn_splits=bn_splits_for(cfg, d.world))  # auto resolved for this run; the checkpoint keeps it
    run_dir = Path(cfg.out)
    ckpt = None
    if resume:
        ckpt = checkpoint if checkpoint is not None else load_checkpoint(run_dir / "checkpoint.pt")
        check_resumable(from_plain(ckpt["config"]), cfg)
    validate(cfg, d.world)
    device = resolve_device(cfg.device)
    precision = safe_precision(cfg, device, resolve_precision(cfg.precision, device))
    check_memory(cfg, device.type, device.index or 0)  # a run that cannot fit is refused before it allocates
    torch.manual_seed(cfg.seed)
    model = build_model(cfg)  # before any work: a wrong --arch (or its options) is said at once
    if ckpt is None and cfg.init:  # ... and weights that do not fit it: loaded now, read once
        load_init(model, init if init is not None else cfg.init)
    if d.main:
        undo = make_dirs(run_dir)
        held.enter_context(lock_dir(run_dir, "--out"))  # a second run on this directory refuses here

        def undo_if_failed_early(failed: type[BaseException] | None, *_: object) -> bool:
            if failed is not None and not (run_dir / "checkpoint.pt").exists():
                undo()  # failed before its first checkpoint: what this run created goes (config.json, cache/ ...)
            return False  # the error goes on

        held.push(undo_if_failed_early)  # runs before the lock is released
        config_json = (json.dumps(to_plain(cfg), indent=2) + "\n").encode()
        atomic_write(run_dir / "config.json", lambda f: f.write(config_json))
    cache = load_data(cfg, run_dir, ckpt, d, progress)  # decoded once into a uint8 cache (rank 0 builds it)
    check_collection(cfg, len(cache), d)
    steps_per_epoch = len(cache) // (cfg.batch_size * d.world)
    s = setup(cfg, ckpt, d, device, precision, run_dir, steps_per_epoch, (len(cache), len(cache.skipped)), model)
    step, total_steps = s.step, s.total_steps
    metrics = MetricsLog(run_dir / "metrics.jsonl", step, writer_class) if d.main else None
    monitor = knn_monitor(cfg, run_dir) if d.main and cfg.val_dir else None
    knn_every = cfg.knn_every or steps_per_epoch
    last_eval = metrics.last_eval if metrics is not None else -1  # a resumed run's last evaluation
    clock = BudgetClock(s.elapsed, cfg.time_budget * 60, _clock)  # training seconds (evaluations excluded)
    loop = _Loop(cfg, s, cache, d, device, precision, steps_per_epoch, clock)

    def evaluate() -> None:
        nonlocal last_eval
        with clock.paused():
            last_eval = step
            _evaluate(loop, monitor, metrics, step)

    if monitor is not None and step == 0:
        evaluate()
    total_steps, budget_fit = _resumed_schedule(cfg, ckpt, step, total_steps, s.elapsed, d)
    schedule_known = budget_fit is None  # False until the schedule is first fitted to the time budget
    bar = progress_bar(shown_total(total_steps, schedule_known), step, progress and d.main)
    saver = Checkpoints(run_dir, cfg, s.model, s.optimizer, s.scaler, cache, d, ckpt, s.elapsed, clock.now())
    if total_steps < s.total_steps:  # a resumed run whose budget was spent: it ended short of its schedule
        saver.planned = saver.planned or s.total_steps
    stopped_by = None
    s.model.train()
    with StopFlag() as stop:
        while step < total_steps:
            record = _train_step(loop, step, total_steps, total_steps if schedule_known else None)
            step += 1
            if metrics is not None:
                metrics.write(record)
            bar.update(1)
            bar.set_postfix(loss=f"{record['loss']:.4f}", lr=f"{record['lr']:.3g}", m=f"{record['m']:.4f}",
                            img_s=f"{record['img_s']:.0f}")
            if monitor is not None and (step % knn_every == 0 or step == total_steps):
                evaluate()
            now = clock.now()
            agree = lambda t: int(d.reduce(t, "min", device))  # noqa: E731 - the shortest schedule of any rank
            fit = budget_fit and budget_fit.update(step, clock.at(now), agree=agree)
            if fit:  # all ranks take the shortest schedule any of them fitted
                total_steps = bar.total = fit
                schedule_known = True
                bar.refresh()  # the fitted total (and so an ETA) shows at once
                logger.info("time budget %.1f min: schedule fitted to %d steps (%.1f epochs)",
                            cfg.time_budget, total_steps, total_steps / steps_per_epoch)
            stopped_by = _stop_reason(clock.spent(now), stop, stop_after, step, total_steps)
            stop_now = d.reduce(float(stopped_by is not None), "max", device) > 0  # any rank stops: all do
            if stop_now and d.reduce(float(clock.spent(now)), "max", device) > 0:
                stopped_by = stopped_by or "time budget"
                saver.planned = total_steps  # the schedule it was cut short of, for the reports
                total_steps = step  # the budget is spent: the run is finished here, and the next one reuses it
            if stop_now or step == total_steps or saver.due(now):
                saver.save(step, total_steps, clock.at(now), now)
            if stop_now:
                break
        bar.close()
        if monitor is not None and last_eval != step:
            evaluate()
        # a finished run's whitening, saved into the checkpoint of its last step (saved above: a run is finished
        # only once its checkpoint carries it, so an interrupted fit is redone by the next run)
        whitening, fit_s = None, 0.0
        if cfg.whiten and d.main and step >= total_steps and stop.signal is None:
            whitening, fit_s = end_of_run_fit(s.model.backbone, cache, cfg, device, precision, s.channels_last, stop)
        if whitening is not None:
            saver.add_whitening(step, total_steps, whitening)
            if monitor is not None:
                _evaluate_exported(loop, monitor, metrics, whitening, step)
    if stop.signal is not None:
        stopped_by = signal.Signals(stop.signal).name
    if d.main:
        from moco.training.metrics import plot_curves

        plot_curves(run_dir / "metrics.jsonl", run_dir / "curves.png")
    summary = TrainingSummary(
        run_dir=str(run_dir), steps=step, total_steps=total_steps, images=len(cache), skipped=len(cache.skipped),
        unsupported=dict(cache.unsupported), excluded=cache.excluded, stopped_by=stopped_by, signal=stop.signal,
        precision=precision, device=str(device), final_loss=metrics.last_loss if metrics else None,
        whitening=whitening_summary(whitening, fit_s), planned_steps=saver.planned if saver.planned > step else None)
    if metrics is not None:
        metrics.close()
    d.close()
    return summary


# ------------------------------------------------------------------------------------ the loop's parts


def _resumed_schedule(cfg: TrainConfig, ckpt: dict | None, step: int, total_steps: int, elapsed: float,
                      d: Dist) -> tuple[int, BudgetFit | None]:
    """The schedule's length and its fit to the time budget (None: no fit to do). A resumed run whose budget was
    spent ends where it is; one fitted before keeps its length."""
    budget_s = cfg.time_budget * 60
    if ckpt is not None and step < total_steps and budget_s and elapsed >= budget_s:
        logger.info("the time budget of %g min was spent at step %d: the run ends there", cfg.time_budget, step)
        total_steps = step  # finished where its budget ran out (older runs did not record it)
    if ckpt is not None and step >= total_steps and cfg.whiten and "whitening" not in ckpt and d.main:
        logger.info("finished earlier (step %d of %d) but its whitening was not fitted (interrupted): fitting it "
                    "now, without a training step", step, total_steps)
    fitted = ckpt is not None and bool(ckpt.get("total_steps")) and cfg.time_budget > 0
    fit_budget = budget_s and not fitted and not cfg.max_steps
    return total_steps, (BudgetFit(budget_s, total_steps, cost=step_cost(cfg)) if fit_budget else None)


@dataclass
class _Loop:
    """What every step of one run works with, fixed for the run."""

    cfg: TrainConfig
    s: Setup
    cache: ImageCache
    d: Dist
    device: torch.device
    precision: str
    steps_per_epoch: int
    clock: BudgetClock


def _train_step(loop: _Loop, step: int, total_steps: int, known_total: int | None) -> dict[str, Any]:
    """Step ``step`` (0-based) of a schedule of ``total_steps``: lr and momentum, the batch's two views, forward,
    backward, optimizer step. Returns its metrics record (``step``: the steps done after it; ``total_steps``:
    ``known_total``, once the schedule is fitted to the budget)."""
    cfg, s, cache, d, device, steps_per_epoch = loop.cfg, loop.s, loop.cache, loop.d, loop.device, loop.steps_per_epoch
    t0 = time.perf_counter()
    epoch, index = divmod(step, steps_per_epoch)
    lr = lr_at(step, cfg, total_steps, steps_per_epoch, d.world)
    m = momentum_schedule(step, total_steps, cfg.momentum, cfg.momentum_cosine)
    for group in s.optimizer.param_groups:
        group["lr"] = lr
    if cfg.decorrelation_decay:  # the term fades out with the learning rate
        s.model.decorrelation = cfg.decorrelation * lr_decay(step, cfg, total_steps, steps_per_epoch, d.world)
    ids = _batch_ids(epoch, index, len(cache), cfg.batch_size, cfg.seed, d)  # B
    images = torch.from_numpy(cache.array[ids]).to(device)  # B x S x S x 3 uint8, augmented where it trains
    draws = _step_generator(cfg.seed, step, d.rank)  # this rank's own augmentations, the same on resume
    size = crop_size_at(step, cfg, total_steps)  # image_size, or less early on with progressive resolution
    x1, x2 = two_views(images, cfg.augment, size, cfg.mean, cfg.std, draws, cfg.crop_min)
    x1, x2 = (_memory_format(x, s.channels_last) for x in (x1, x2))  # B x 3 x s x s each
    ids_t = torch.from_numpy(ids).to(device)
    t_data = time.perf_counter() - t0
    with s.autocast:
        loss, stats = s.net(x1, x2, m, ids_t)
    if not torch.isfinite(loss):
        raise RuntimeError(f"loss became {loss.item()} at step {step} (lr {lr:.4g}); the last checkpoint in "
                           f"{Path(cfg.out)} is kept: lower --lr, or use --precision fp32, then --resume")
    s.optimizer.zero_grad(set_to_none=True)
    s.scaler.scale(loss).backward()
    s.scaler.step(s.optimizer)
    s.scaler.update()
    dt = time.perf_counter() - t0
    record = {"step": step + 1, "epoch": (step + 1) / steps_per_epoch, "loss": loss.item(), "lr": lr, "m": m,
              "img_s": cfg.batch_size * d.world / dt, "data_ms": 1000 * t_data, "step_ms": 1000 * dt,
              "pos_sim": float(stats["pos_sim"]), "elapsed_s": loop.clock.seconds()}  # elapsed_s: the budget's clock
    if known_total is not None:
        record["total_steps"] = known_total
    if cfg.min_image_size:
        record["crop"] = size
    if "decorrelation" in stats:
        record["decorrelation"] = float(stats["decorrelation"])
        record["decorrelation_weight"] = s.model.decorrelation
    return record


def _stop_reason(spent: bool, stop: StopFlag, stop_after: int | None, step: int, total_steps: int) -> str | None:
    """Why this rank stops after ``step`` (None: it goes on): a signal, ``stop_after``, or the spent budget."""
    if stop.signal is not None:
        return signal.Signals(stop.signal).name
    if stop_after is not None and step >= stop_after and step < total_steps:
        return f"stop_after={stop_after}"
    return "time budget" if spent else None


def _evaluate(loop: _Loop, monitor: Any, metrics: MetricsLog, step: int) -> None:
    """kNN top-1 of the backbone now (centred and whitened, against the pixels'), logged and recorded."""
    s = loop.s
    top1, white = monitor.evaluate(s.model.backbone, loop.device, loop.precision, s.channels_last)
    pixels = monitor.pixels_top1()
    white_pixels = monitor.pixels_whitened_top1()
    metrics.write({"step": step, "epoch": step / loop.steps_per_epoch, "knn_top1": top1, "knn_pixels": pixels,
                   "knn_whitened": white, "knn_pixels_whitened": white_pixels})
    logger.info("step %d: kNN top-1 %.2f%% (centred pixels %.2f%%, %+.2f points); whitened %.2f%% (pixels %s)",
                step, 100 * top1, 100 * pixels, 100 * (top1 - pixels), 100 * white,
                "n/a" if white_pixels is None else f"{100 * white_pixels:.2f}%")


def _evaluate_exported(loop: _Loop, monitor: Any, metrics: MetricsLog, whitening: Whitening, step: int) -> None:
    """kNN top-1 of what the export embeds (the backbone with the run's whitening), logged and recorded."""
    s = loop.s
    exported = monitor.evaluate_exported(s.model.backbone, whitening, loop.device, loop.precision, s.channels_last)
    metrics.write({"step": step, "epoch": step / loop.steps_per_epoch, "knn_exported": exported})
    logger.info("step %d: kNN top-1 %.2f%% with the run's whitening (what the export embeds)", step, 100 * exported)


# ------------------------------------------------------------------------------------ helpers

def _memory_format(x: torch.Tensor, channels_last: bool) -> torch.Tensor:
    return x.contiguous(memory_format=torch.channels_last) if channels_last else x



