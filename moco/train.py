"""The MoCo training loop: one flat loop, exact resume, CPU / one GPU / torchrun.

    python -m moco.train DATA_DIR --out RUN_DIR [flags]      (same flags as `moco train`)

Each step: schedule (lr, m) -> batch + two views -> forward (momentum update, keys, loss,
enqueue) -> backward -> optimizer step -> log -> checkpoint when due. Every random draw that shapes
a step comes from (seed, step) or from RNG states saved in the checkpoint, so N steps + resume + N
steps equal 2N steps.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import signal
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from moco.augment import two_views
from moco.backbones import build_backbone, is_vit
from moco.checkpoint import atomic_write, load_checkpoint, lock_dir, save_checkpoint
from moco.config import TrainConfig, backbone_kwargs, default_workers, from_plain, to_plain, uses_v3_vit, validate
from moco.curves import read_metrics
from moco.data import ImageCache, build_cache, write_skipped
from moco.device import autocast_for, init_distributed, resolve_device, resolve_precision
from moco.errors import UserError
from moco.model import MoCo, momentum_schedule
from moco.optim import BudgetFit, build_optimizer, crop_size_at, lr_at, lr_decay, step_cost
from moco.sync_bn import convert_sync_bn
from moco.whiten import STAGES, Whitening, feature_widths, fit_whitening, resnet_stages

__all__ = ["train", "run_state", "resume_config", "build_model", "cache_size_for", "shown_total", "whitening_stages"]

logger = logging.getLogger(__name__)

# Photos the end-of-training whitening is fitted on (--whiten): 1,000 gave the same kNN as 20,000 on Fashion-MNIST
# (Ledoit-Wolf shrinks what fewer rows cannot estimate); 5,000 cost 2.4 s on one core for resnet10t at 32 px.
WHITEN_ROWS = 5000
# --whiten-stages auto pools the earlier stages only when the whitening is fitted on at least this many photos per
# dimension of the pooled features: a whitening fitted on the collection it searches (as an index's is) lost 3.3
# points of kNN with the stages on 240 Fashion-MNIST images (960-d), 0.5-0.7 on 500-1,000, broke even at 2,000
# and gained 0.9 at 5,000 (BENCHMARKS.md, ninth round).
STAGE_ROWS_PER_DIM = 2

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
)


def build_model(cfg: TrainConfig) -> MoCo:
    """The MoCo module described by ``cfg`` (random init), with split BN for this process (``_bn_splits``)."""
    backbone, width = build_backbone(cfg.arch, cfg.small_stem, cfg.image_size, cfg.zero_init_residual,
                                     moco_v3_vit=uses_v3_vit(cfg), **backbone_kwargs(cfg))  # fmt: skip
    return MoCo(
        backbone,
        width,
        head=cfg.head,
        dim=cfg.dim,
        hidden=cfg.mlp_hidden,
        head_bn=cfg.head_bn,
        projector_layers=cfg.projector_layers,
        predictor_layers=cfg.predictor_layers,
        predictor_last_bn=cfg.predictor_last_bn,
        K=cfg.queue_size,
        T=cfg.temperature,
        symmetric=cfg.symmetric,
        bn_splits=_bn_splits(cfg, dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1),
        mask_own_keys=cfg.mask_own_keys,
        decorrelation=cfg.decorrelation,
    )


def _bn_splits(cfg: TrainConfig, world: int) -> int:
    """``cfg.bn_splits``, or for 0 (auto): one BN group per process under torchrun (the real Shuffle BN across
    ranks, as the official code) and for v3; on one process (Shuffle BN simulated, v1/v2) up to 8 virtual
    devices (the official CIFAR demo's), as many as keep 16 images per group (at least 2 groups)."""
    if cfg.bn_splits:
        return cfg.bn_splits
    if world > 1 or cfg.head == "v3":
        return 1
    fits = [s for s in range(8, 1, -1) if cfg.batch_size % s == 0 and cfg.batch_size // s >= 2]
    return next((s for s in fits if cfg.batch_size // s >= 16), fits[-1] if fits else 1)


def _warn_small_bn_groups(cfg: TrainConfig, world: int, sync_bn: bool) -> None:
    """A warning when batch norm normalises over fewer than 16 images (noisy statistics). `moco train` gives it,
    about its flags; `moco run` chooses its own settings (app.pipeline.training_overrides) and says them."""
    group = cfg.batch_size * world if sync_bn else cfg.batch_size // cfg.bn_splits
    if group >= 16:
        return
    how = (f"synchronized over {world} processes x --batch-size {cfg.batch_size}" if sync_bn
           else f"--batch-size {cfg.batch_size} per process / --bn-splits {cfg.bn_splits}")  # fmt: skip
    logger.warning(
        "%d images per batch-norm group (%s), fewer than 16: its batch statistics are noisy, which can slow or "
        "destabilize training; raise --batch-size%s if memory allows",
        group, how, " or lower --bn-splits" if cfg.bn_splits > 1 else "",
    )  # fmt: skip


def cache_size_for(image_size: int, cache_size: int = 0) -> int:
    """Side of the decoded cache: the crop size for small images, else the usual resize (256 for 224)."""
    if cache_size:
        return cache_size
    return image_size if image_size < 96 else round(image_size * 8 / 7)


@dataclass
class _Dist:
    rank: int = 0
    world: int = 1

    @property
    def main(self) -> bool:
        return self.rank == 0


def _init_distributed(device_name: str) -> _Dist:
    """Join the torchrun process group when launched by torchrun (WORLD_SIZE > 1)."""
    return _Dist(*init_distributed(device_name))


def _batch_ids(epoch: int, index: int, n: int, batch: int, seed: int, d: _Dist) -> np.ndarray:
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


class _Interrupted(BaseException):
    """A signal during the end-of-run fit (``_StopFlag.at_once``): the fit is dropped, its checkpoint kept. Not an
    Exception, as KeyboardInterrupt: code that reports and goes on (logging's handlers) must not swallow it."""


class _StopFlag:
    """Turns SIGINT/SIGTERM into a request to checkpoint and stop after the current step; inside ``at_once()``
    (the end-of-run fit, which may take minutes) into ``_Interrupted`` at once."""

    def __init__(self) -> None:
        self.signal: int | None = None
        self._old: dict[int, Any] = {}
        self._at_once = False

    def __enter__(self) -> _StopFlag:
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
            raise _Interrupted(signal.Signals(signum).name)
        logger.warning("received %s: saving a checkpoint after this step", signal.Signals(signum).name)

    @contextlib.contextmanager
    def at_once(self):
        """Signals in this block raise ``_Interrupted`` (a signal already received raises it on entry)."""
        if self.signal is not None:
            raise _Interrupted(signal.Signals(self.signal).name)
        self._at_once = True
        try:
            yield
        finally:
            self._at_once = False

    def __exit__(self, *exc: Any) -> None:
        for s, h in self._old.items():
            signal.signal(s, h)


def train(
    cfg: TrainConfig, resume: bool = False, progress: bool = True, stop_after: int | None = None,
    tensorboard: bool = False,
) -> dict[str, Any]:
    """Train MoCo on ``cfg.data_dir`` into ``cfg.out``; returns a summary dict.

    With ``resume=True`` the run continues from ``cfg.out/checkpoint.pt`` exactly where it stopped
    (model, key encoder, queue, optimizer, scaler, RNG states, position in the epoch).
    ``stop_after``: checkpoint and return once the run reaches this step, as if interrupted there
    (the schedule still spans the whole run), e.g. to split training into sessions.
    ``tensorboard``: also write the metrics.jsonl records as TensorBoard scalars to ``cfg.out/tensorboard``.
    The resolved config is written to ``cfg.out/config.json`` before training starts. While the run lasts it holds
    ``cfg.out``'s lock (:func:`moco.checkpoint.lock_dir`): a second run on that directory refuses, naming it.
    """
    with contextlib.ExitStack() as held:  # the run directory's lock, once taken
        return _train(cfg, resume, progress, stop_after, tensorboard, held)


def _train(cfg: TrainConfig, resume: bool, progress: bool, stop_after: int | None, tensorboard: bool,
           held: contextlib.ExitStack) -> dict[str, Any]:  # fmt: skip
    writer_class = _summary_writer_class() if tensorboard else None  # missing tensorboard: fail before any work
    d = _init_distributed(cfg.device)
    cfg = replace(cfg, bn_splits=_bn_splits(cfg, d.world))  # auto resolved for this run; the checkpoint keeps it
    run_dir = Path(cfg.out)
    ckpt = None
    if resume:
        ckpt = load_checkpoint(run_dir / "checkpoint.pt")
        _check_resumable(from_plain(ckpt["config"]), cfg)
    validate(cfg, d.world)
    device = resolve_device(cfg.device)
    precision = _safe_precision(cfg, device, resolve_precision(cfg.precision, device))
    if d.main:
        run_dir.mkdir(parents=True, exist_ok=True)
        held.enter_context(lock_dir(run_dir, "--out"))  # a second run on this directory refuses here
        config_json = (json.dumps(to_plain(cfg), indent=2) + "\n").encode()
        atomic_write(run_dir / "config.json", lambda f: f.write(config_json))
    torch.manual_seed(cfg.seed)

    # ---- data: decoded once into a uint8 cache (rank 0 builds it, the others reuse it)
    cache = _load_data(cfg, run_dir, ckpt, d, progress)
    n = len(cache)
    global_batch = cfg.batch_size * d.world
    if global_batch > n:
        per, splits = n // d.world, max(1, cfg.bn_splits)  # a batch: a multiple of the splits, 2 images in each
        if per < 2:
            each = f"{d.world} processes x a batch of 2" if d.world > 1 else "a batch of 2"
            raise UserError(f"{cfg.data_dir} has {n} readable photo{'s' * (n != 1)}: training needs at least "
                            f"{2 * d.world} ({each}): add photos to it")  # fmt: skip
        fix = (f"--batch-size {per // splits * splits} or smaller (a multiple of --bn-splits {splits})"
               if per >= 2 * splits and splits > 1 else f"--batch-size {per} or smaller" if splits == 1
               else f"--batch-size {per} --bn-splits 1")  # fmt: skip
        raise UserError(f"the batch of {global_batch} images is larger than the {n} readable images in "
                        f"{cfg.data_dir}: use {fix}")  # fmt: skip
    if cfg.queue_size > n:
        logger.warning(
            "queue of K=%d keys is larger than the collection (%d images): each image sits in the queue "
            "about %.0f times; its own stale keys are %s. A --queue-size of at most %d wastes less compute.",
            cfg.queue_size,
            n,
            cfg.queue_size / n,
            "masked out" if cfg.mask_own_keys else "NOT masked",
            n,
        )
    steps_per_epoch = n // global_batch

    # ---- model, optimizer, scaler
    model = build_model(cfg)
    sync_bn = cfg.head == "v3" and d.world > 1
    if sync_bn:  # as the official v3: every BN (momentum encoder too) normalises over all processes' batches
        model = convert_sync_bn(model, device)
    model = model.to(device)
    cnn = _channels_last(cfg)
    if cnn:
        model = model.to(memory_format=torch.channels_last)
    optimizer = build_optimizer(model, cfg)
    scaler = torch.amp.GradScaler(device.type, enabled=precision == "fp16")
    step, elapsed, total_steps = 0, 0.0, cfg.max_steps or cfg.epochs * steps_per_epoch
    if ckpt is not None:
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        if ckpt.get("scaler"):
            scaler.load_state_dict(ckpt["scaler"])
        step, elapsed = int(ckpt["step"]), float(ckpt.get("elapsed", 0.0))
        if not cfg.max_steps and cfg.epochs == from_plain(ckpt["config"]).epochs:
            total_steps = int(ckpt.get("total_steps") or total_steps)  # the schedule the run was fitted to
        _set_rng_state(ckpt["rng"])
        logger.info("resumed %s at step %d of %d", run_dir / "checkpoint.pt", step, total_steps)
    elif cfg.init:
        from moco.formats import load_init  # ours, official MoCo, lightly, solo-learn, torchvision/timm

        load_init(model, cfg.init)
    net: nn.Module = model
    if d.world > 1:
        # every rank enqueues the same all-gathered keys, so buffers need no broadcast (checked at each save)
        net = nn.parallel.DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None, broadcast_buffers=False
        )
    if cfg.compile:  # the encoders only: the MoCo step around them updates buffers in place
        for encoder in (model.backbone, model.backbone_momentum):
            encoder.compile()
    autocast = autocast_for(device, precision)
    if d.main:
        logger.info(
            "training %s %s on %d images (%d skipped), %d steps/epoch, %d steps, batch %dx%d, %s %s",
            cfg.preset,
            cfg.arch,
            n,
            len(cache.skipped),
            steps_per_epoch,
            total_steps,
            cfg.batch_size,
            d.world,
            device,
            precision,
        )

    # ---- the loop
    metrics = _MetricsLog(run_dir / "metrics.jsonl", step, writer_class) if d.main else None
    monitor = _knn_monitor(cfg, run_dir) if d.main and cfg.val_dir else None
    knn_every = cfg.knn_every or steps_per_epoch

    last_eval = metrics.last_eval if metrics is not None else -1  # a resumed run's last evaluation
    train_start = time.monotonic() - elapsed  # training seconds so far = now - train_start (evaluations excluded)

    def evaluate() -> None:
        nonlocal last_eval, train_start
        t = time.monotonic()
        last_eval = step
        (top1, white), pixels = monitor.evaluate(model.backbone, device, precision, cnn), monitor.pixels_top1()
        white_pixels = monitor.pixels_whitened_top1()
        metrics.write({"step": step, "epoch": step / steps_per_epoch, "knn_top1": top1, "knn_pixels": pixels,
                       "knn_whitened": white, "knn_pixels_whitened": white_pixels})  # fmt: skip
        logger.info("step %d: kNN top-1 %.2f%% (centred pixels %.2f%%, %+.2f points); whitened %.2f%% (pixels %s)",
                    step, 100 * top1, 100 * pixels, 100 * (top1 - pixels), 100 * white,
                    "n/a" if white_pixels is None else f"{100 * white_pixels:.2f}%")  # fmt: skip
        train_start += time.monotonic() - t

    if monitor is not None and step == 0:
        evaluate()
    budget_s = cfg.time_budget * 60
    if ckpt is not None and step < total_steps and budget_s and elapsed >= budget_s:
        logger.info("the time budget of %g min was spent at step %d: the run ends there", cfg.time_budget, step)
        total_steps = step  # finished where its budget ran out (older runs did not record it)
    if ckpt is not None and step >= total_steps and cfg.whiten and "whitening" not in ckpt and d.main:
        logger.info("finished earlier (step %d of %d) but its whitening was not fitted (interrupted): fitting it "
                    "now, without a training step", step, total_steps)  # fmt: skip
    fitted = ckpt is not None and bool(ckpt.get("total_steps")) and cfg.time_budget > 0
    fit_budget = budget_s and not fitted and not cfg.max_steps
    budget_fit = BudgetFit(budget_s, total_steps, cost=step_cost(cfg)) if fit_budget else None
    schedule_known = budget_fit is None  # False until the schedule is first fitted to the time budget
    bar = _progress_bar(shown_total(total_steps, schedule_known), step, progress and d.main)

    def shortest(total: int) -> int:  # all ranks take the shortest schedule any of them fitted
        return int(_all_reduce(total, "min", d, device))

    last_save = time.monotonic()
    stopped_by, saved_elapsed = None, elapsed
    replicas = ckpt.get("replica_queue_checksums", []) if ckpt is not None else []  # of the state last saved
    model.train()
    with _StopFlag() as stop:
        while step < total_steps:
            t0 = time.perf_counter()
            epoch, index = divmod(step, steps_per_epoch)
            lr = lr_at(step, cfg, total_steps, steps_per_epoch, d.world)
            m = momentum_schedule(step, total_steps, cfg.momentum, cfg.momentum_cosine)
            for group in optimizer.param_groups:
                group["lr"] = lr
            if cfg.decorrelation_decay:  # the term fades out with the learning rate
                model.decorrelation = cfg.decorrelation * lr_decay(step, cfg, total_steps, steps_per_epoch, d.world)

            ids = _batch_ids(epoch, index, n, cfg.batch_size, cfg.seed, d)  # B
            images = torch.from_numpy(cache.array[ids]).to(device)  # B x S x S x 3 uint8, augmented where it trains
            draws = _step_generator(cfg.seed, step, d.rank)  # this rank's own augmentations, the same on resume
            size = crop_size_at(step, cfg, total_steps)  # image_size, or less early on with progressive resolution
            x1, x2 = two_views(images, cfg.augment, size, cfg.mean, cfg.std, draws, cfg.crop_min)
            x1, x2 = (_memory_format(x, cnn) for x in (x1, x2))  # B x 3 x s x s each
            ids_t = torch.from_numpy(ids).to(device)
            t_data = time.perf_counter() - t0

            with autocast:
                loss, stats = net(x1, x2, m, ids_t)
            if not torch.isfinite(loss):
                raise RuntimeError(
                    f"loss became {loss.item()} at step {step} (lr {lr:.4g}); the last checkpoint in {run_dir} is "
                    "kept: lower --lr, or use --precision fp32, then --resume"
                )
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            step += 1

            dt = time.perf_counter() - t0
            record = {
                "step": step,
                "epoch": step / steps_per_epoch,
                "loss": loss.item(),
                "lr": lr,
                "m": m,
                "img_s": global_batch / dt,
                "data_ms": 1000 * t_data,
                "step_ms": 1000 * dt,
                "pos_sim": float(stats["pos_sim"]),
                "elapsed_s": time.monotonic() - train_start,  # the budget's clock: training seconds so far
            }
            if schedule_known:
                record["total_steps"] = total_steps
            if cfg.min_image_size:
                record["crop"] = size
            if "decorrelation" in stats:
                record["decorrelation"] = float(stats["decorrelation"])
                record["decorrelation_weight"] = model.decorrelation
            if metrics is not None:
                metrics.write(record)
            bar.update(1)
            bar.set_postfix(loss=f"{record['loss']:.4f}", lr=f"{lr:.3g}", m=f"{m:.4f}", img_s=f"{record['img_s']:.0f}")

            if monitor is not None and (step % knn_every == 0 or step == total_steps):
                evaluate()
            now = time.monotonic()
            fit = budget_fit and budget_fit.update(step, now - train_start, agree=shortest)
            if fit:
                total_steps = bar.total = fit
                schedule_known = True
                bar.refresh()  # the fitted total (and so an ETA) shows at once
                logger.info("time budget %.1f min: schedule fitted to %d steps (%.1f epochs)",
                            cfg.time_budget, total_steps, total_steps / steps_per_epoch)  # fmt: skip
            if budget_s and now - train_start >= budget_s:
                stopped_by = "time budget"
            if stop.signal is not None:
                stopped_by = signal.Signals(stop.signal).name
            elif stop_after is not None and step >= stop_after and step < total_steps:
                stopped_by = f"stop_after={stop_after}"
            stop_now = _all_reduce(float(stopped_by is not None), "max", d, device) > 0  # any rank stops: all do
            if stop_now and budget_s and _all_reduce(float(now - train_start >= budget_s), "max", d, device) > 0:
                stopped_by = stopped_by or "time budget"
                total_steps = step  # the budget is spent: the run is finished here, and the next one reuses it
            if stop_now or step == total_steps or now - last_save >= cfg.save_every_minutes * 60:
                saved_elapsed = now - train_start
                replicas = _save(run_dir, cfg, model, optimizer, scaler, step, total_steps, saved_elapsed, cache, d)
                last_save = now
            if stop_now:
                break
        bar.close()
        if monitor is not None and last_eval != step:
            evaluate()
        # ---- the end of a finished run: its whitening, saved into the checkpoint of its last step (saved above:
        # a run is finished only once its checkpoint carries it, so an interrupted fit is redone by the next run)
        whitening, fit_s = None, 0.0
        if cfg.whiten and d.main and step >= total_steps and stop.signal is None:
            fit_start = time.monotonic()
            try:
                with stop.at_once():  # a signal drops the fit: the checkpoint stays without it, the next run fits it
                    whitening = _fit_whitening(model.backbone, cache, cfg, device, precision, cnn)
            except _Interrupted as e:
                logger.warning("received %s during the whitening's fit: stopping; the next run fits it", e)
            fit_s = time.monotonic() - fit_start
        if whitening is not None:  # rank 0 alone: the state saved at this step, now with its whitening
            _save(run_dir, cfg, model, optimizer, scaler, step, total_steps, saved_elapsed, cache, d, whitening,
                  replicas)  # fmt: skip
        if whitening is not None and monitor is not None:
            exported = monitor.evaluate_exported(model.backbone, whitening, device, precision, cnn)
            metrics.write({"step": step, "epoch": step / steps_per_epoch, "knn_exported": exported})
            logger.info("step %d: kNN top-1 %.2f%% with the run's whitening (what the export embeds)", step,
                        100 * exported)  # fmt: skip
    if stop.signal is not None:
        stopped_by = signal.Signals(stop.signal).name
    if d.main:
        from moco.curves import plot_curves

        plot_curves(run_dir / "metrics.jsonl", run_dir / "curves.png")
    summary = {
        "run_dir": str(run_dir),
        "steps": step,
        "total_steps": total_steps,
        "images": n,
        "skipped": len(cache.skipped),
        "stopped_by": stopped_by,
        "signal": stop.signal,
        "precision": precision,
        "device": str(device),
        "final_loss": metrics.last_loss if metrics else None,
        "whitening": None if whitening is None else {"rows": whitening.count, "shrinkage": whitening.shrinkage,
                                                     "mirror": whitening.mirror, "dim": whitening.dim,
                                                     "stages": list(whitening.stage_names),
                                                     "seconds": round(fit_s, 2)},  # fmt: skip
    }
    if metrics is not None:
        metrics.close()
    if d.world > 1:
        dist.barrier()
        dist.destroy_process_group()
    return summary


# ------------------------------------------------------------------------------------ helpers
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


def resume_config(run_dir: str | Path, overrides: dict[str, Any] | None = None) -> TrainConfig:
    """The config saved in ``run_dir/checkpoint.pt`` with ``overrides`` of the fields that may change."""
    saved = from_plain(load_checkpoint(Path(run_dir) / "checkpoint.pt")["config"])
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


def _check_resumable(saved: TrainConfig, cfg: TrainConfig) -> None:
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


def _load_data(cfg: TrainConfig, run_dir: Path, ckpt: dict | None, d: _Dist, progress: bool) -> ImageCache:
    size = cache_size_for(cfg.image_size, cfg.cache_size)
    files = list(ckpt["files"]) if ckpt is not None else None
    kwargs = dict(files=files, workers=default_workers(cfg.workers), strict=ckpt is not None)
    if d.main:
        cache = build_cache(cfg.data_dir, size, run_dir / "cache", progress=progress, **kwargs)
        if ckpt is None:  # a resumed run decodes only the files recorded: the first run's list stays
            write_skipped(run_dir / "skipped.txt", cache.skipped)
    if d.world > 1:
        dist.barrier()
        if not d.main:
            cache = build_cache(cfg.data_dir, size, run_dir / "cache", progress=False, **kwargs)
    return cache


SMALLEST_BF16_CROP = 32  # stride-32 CNNs: smaller crops give 1x1 maps to stride-2 convolutions


def _safe_precision(cfg: TrainConfig, device: torch.device, precision: str) -> str:
    """``precision``, unless bf16 on a CPU would meet crops under 32 px on a stride-32 CNN: their 1x1 maps reach
    stride-2 convolutions, whose bf16 backward on CPUs (oneDNN) can return NaN. ``auto`` then falls back to
    fp32 (logged); an explicit ``--precision bf16`` is refused with the fixes."""
    smallest = min(cfg.image_size, cfg.min_image_size or cfg.image_size)
    if precision != "bf16" or device.type != "cpu" or cfg.small_stem or is_vit(cfg.arch) \
            or smallest >= SMALLEST_BF16_CROP:  # fmt: skip
        return precision
    why = (f"crops of {smallest} px on {cfg.arch} without --small-stem put 1x1 feature maps into stride-2 "
           "convolutions, whose bf16 backward on CPUs can return NaN")  # fmt: skip
    if cfg.precision == "bf16":
        raise UserError(f"--precision bf16: {why}; use --small-stem, crops of {SMALLEST_BF16_CROP} px or more "
                        "(--image-size, --min-image-size), or --precision fp32")  # fmt: skip
    logger.warning("%s: training in fp32 instead (--small-stem or %d px crops keep bf16's speed)", why,
                   SMALLEST_BF16_CROP)  # fmt: skip
    return "fp32"


def _channels_last(cfg: TrainConfig) -> bool:
    """channels_last for CNNs unless asked otherwise: faster on GPUs, 1.2-1.7x per step here (bench/layout.py)."""
    return not is_vit(cfg.arch) and cfg.memory_format != "contiguous"


def _knn_monitor(cfg: TrainConfig, run_dir: Path):
    from moco.knn import KnnMonitor

    size = cache_size_for(cfg.image_size, cfg.cache_size)
    return KnnMonitor(
        cfg.val_dir,
        cfg.knn_train_dir,
        size,
        run_dir / "cache",
        cfg.image_size,
        cfg.mean,
        cfg.std,
        cfg.knn_k,
        cfg.knn_t,
        default_workers(cfg.workers),
    )


def _memory_format(x: torch.Tensor, channels_last: bool) -> torch.Tensor:
    return x.contiguous(memory_format=torch.channels_last) if channels_last else x


def _all_reduce(value: float, op: str, d: _Dist, device: torch.device) -> float:
    """``value`` reduced over all ranks (``op``: "min" | "max"), on ``device`` (NCCL needs a GPU tensor)."""
    if d.world == 1:
        return value
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN if op == "min" else dist.ReduceOp.MAX)
    return float(t.item())


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _replica_check(model: MoCo, d: _Dist) -> list[list[float]]:
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


def _save(
    run_dir: Path,
    cfg: TrainConfig,
    model: MoCo,
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler,
    step: int,
    total_steps: int,
    elapsed: float,
    cache: ImageCache,
    d: _Dist,
    whitening: Whitening | None = None,
    replicas: list[list[float]] | None = None,
) -> list[list[float]]:
    """Checkpoint the run (every rank: the queues' check is collective, rank 0 writes); returns the queues'
    checksums. ``replicas`` given (rank 0 alone): those of the state saved at this step, saved again with
    ``whitening``."""
    replicas = _replica_check(model, d) if replicas is None else replicas
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
        "rng": _rng_state(),
        "data_root": str(Path(cfg.data_dir).resolve()),
        "files": list(cache.files),
    }
    if whitening is not None:  # only the final checkpoint: it belongs to these weights
        state["whitening"] = whitening.state()
    save_checkpoint(state, run_dir, keep=cfg.keep_checkpoints, replace=whitening is not None)
    return replicas


def whitening_stages(backbone: nn.Module, choice: str, rows: int, image_size: int
                     ) -> tuple[tuple[str, ...], tuple[int, ...]]:  # fmt: skip
    """The stages (names, channels) a whitening fitted on ``rows`` photos pools for ``--whiten-stages choice``:
    a ResNet's layer1-3 when on, or when auto and ``rows`` >= ``STAGE_ROWS_PER_DIM`` x their total width; else none."""
    stages = resnet_stages(backbone) if choice != "off" else ()
    if choice != "off" and not stages:
        logger.info("whitening: the backbone has no stages %s; its output alone is whitened", "/".join(STAGES))
    widths, width = feature_widths(backbone, stages, image_size)
    dim = width + sum(widths)
    if stages and choice == "auto" and rows < STAGE_ROWS_PER_DIM * dim:
        logger.info("whitening: %d photos are too few to whiten %d-d features with the pooled %s (%d needed; "
                    "--whiten-stages on forces them): the last stage's alone", rows, dim, "/".join(stages),
                    STAGE_ROWS_PER_DIM * dim)  # fmt: skip
        return (), ()
    return stages, widths


def _fit_whitening(backbone: nn.Module, cache: ImageCache, cfg: TrainConfig, device: torch.device, precision: str,
                   channels_last: bool) -> Whitening:  # fmt: skip
    """The whitening (:mod:`moco.whiten`, Ledoit-Wolf) of the trained backbone's mirror-averaged features of up to
    ``WHITEN_ROWS`` photos (a seeded draw), in the view the export embeds (resize, center crop); with
    ``whiten_stages`` (on; auto: given ``STAGE_ROWS_PER_DIM`` photos per dimension), a ResNet's pooled layer1-3
    outputs before its own."""
    from moco.knn import extract_features

    n = len(cache)
    rows = np.sort(np.random.default_rng(cfg.seed).choice(n, min(n, WHITEN_ROWS), replace=False))  # R
    stages, widths = whitening_stages(backbone, cfg.whiten_stages, len(rows), cfg.image_size)
    feats = extract_features(backbone, np.asarray(cache.array[rows]), cfg.image_size, cfg.mean, cfg.std, device,
                             precision=precision, channels_last=channels_last, mirror=True, stages=stages)  # R x D'
    # embeddings average each photo with its mirror image, and pool the same stages
    whitening = replace(fit_whitening(feats.numpy()), mirror=True, stages=tuple(zip(stages, widths)))
    logger.info("whitening: fitted on %d of %d photos and their mirror images, %d-d features%s (Ledoit-Wolf "
                "shrinkage %.3f); the export carries it", len(rows), n, whitening.dim,
                f" with the pooled {', '.join(stages)}" if stages else "", whitening.shrinkage)  # fmt: skip
    return whitening


class _MetricsLog:
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


def _summary_writer_class() -> Any:
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


def _progress_bar(total: int | None, initial: int, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=initial, disable=not enabled, unit="step", dynamic_ncols=True, leave=True)


DESCRIPTION = (
    "Train MoCo v1/v2/v3 on a folder of unlabeled photos (recursive). Writes RUN_DIR/checkpoint.pt, config.json, "
    "metrics.jsonl, skipped.txt and curves.png. Flags override the --config file's values, which override the "
    "preset's."
)


def add_train_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of ``moco train`` and ``python -m moco.train``: DATA_DIR, --out, run control, one per config field."""
    from moco.config import PRESETS, add_config_arguments

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


def train_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """Resolve the config (preset <- --config file <- flags, or the checkpoint's on --resume) and train; returns
    train()'s summary."""
    from moco.config import PRESETS, config_overrides, cpu_image_size, default_preset, load_config_file, resolve_config
    from moco.data import short_sides

    from_file = load_config_file(args.config) if args.config else {}
    data_dir = args.data_dir or from_file.get("data_dir", "")  # DATA_DIR overrides the file's, as any flag does
    from_file.pop("data_dir", None)
    from_file.pop("out", None)  # --out is required and always wins
    file_preset = from_file.pop("preset", None)
    preset = args.preset or file_preset
    overrides = {**from_file, **config_overrides(args)}
    run_dir = Path(args.out)
    if args.resume:
        if not (run_dir / "checkpoint.pt").exists():
            raise UserError(f"--resume: no checkpoint at {run_dir / 'checkpoint.pt'}; drop --resume to start a new run")
        if preset:
            overrides["preset"] = preset
        cfg = resume_config(run_dir, {**overrides, "data_dir": data_dir})
    else:
        if not data_dir:
            raise UserError("training needs DATA_DIR, the folder of photos to train on (or --resume with --out)")
        if (run_dir / "checkpoint.pt").exists():
            raise UserError(
                f"{run_dir} already holds a training run: add --resume to continue it, or choose another --out"
            )
        if not preset:
            preset = default_preset(overrides.get("time_budget", 0.0), overrides.get("device", "auto"))
            if preset == "cpu":
                logger.info("a time budget on a CPU: the cpu preset (short-run recipe; --preset v2 for the paper's)")
        if preset == "cpu" and "image_size" not in overrides and not is_vit(overrides.get("arch", "")):
            overrides["image_size"] = cpu_image_size(short_sides(data_dir))
            if overrides["image_size"] != PRESETS["cpu"]["image_size"]:
                logger.info("small photos: the cpu preset trains at %d px, their own size (--image-size to choose)",
                            overrides["image_size"])  # fmt: skip
        cfg = resolve_config(preset, data_dir=data_dir, out=args.out, **overrides)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if int(os.environ.get("RANK", "0")) == 0 and cfg.bn_splits >= 0:  # the flags' user is told, not train()'s callers
        _warn_small_bn_groups(replace(cfg, bn_splits=_bn_splits(cfg, world)), world, cfg.head == "v3" and world > 1)
    return train(cfg, resume=args.resume, progress=not args.quiet, stop_after=args.stop_after,
                 tensorboard=args.tensorboard)


def summary_line(summary: dict[str, Any], run_dir: Path) -> str:
    """One line about a finished (or stopped) run, for the console."""
    how = f" (stopped by {summary['stopped_by']}; continue with --resume)" if summary["stopped_by"] else ""
    if summary["stopped_by"] == "time budget":  # finished
        how = " (its time budget is spent)"
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


def main(argv: list[str] | None = None) -> int:
    """``python -m moco.train`` (the entry point for torchrun): the flags of ``moco train``; 2 on bad input."""
    from tqdm.contrib.logging import logging_redirect_tqdm

    parser = argparse.ArgumentParser(prog="python -m moco.train", description=DESCRIPTION)
    add_train_arguments(parser)
    args = parser.parse_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, stream=sys.stderr,
                        format=f"[rank {rank}] %(levelname)s: %(message)s" if rank else "%(levelname)s: %(message)s")
    try:
        with logging_redirect_tqdm():
            summary = train_from_args(args)
    except UserError as e:  # StorageError, NetworkError (disk full, offline) exit 1: not bad input
        print(f"{parser.prog}: error: {e}", file=sys.stderr)
        return e.exit_code
    if rank == 0:
        print(summary_line(summary, Path(args.out)))
    return 128 + summary["signal"] if summary["signal"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
