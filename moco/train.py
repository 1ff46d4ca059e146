"""The MoCo training loop: one flat loop, exact resume, CPU / one GPU / torchrun.

    python -m moco.train DATA_DIR --out RUN_DIR [flags]      (same flags as `moco train`)

Each step: schedule (lr, m) -> batch + two views -> forward (momentum update, keys, loss,
enqueue) -> backward -> optimizer step -> log -> checkpoint when due. Every random draw that shapes
a step comes from (seed, step) or from RNG states saved in the checkpoint, so N steps + resume + N
steps equal 2N steps.
"""

from __future__ import annotations

import json
import logging
import math
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from moco.augment import two_views
from moco.backbones import build_backbone, is_vit
from moco.checkpoint import load_checkpoint, save_checkpoint
from moco.config import TrainConfig, default_workers, from_plain, to_plain, validate
from moco.data import ImageCache, build_cache
from moco.device import autocast_for, init_distributed, resolve_device, resolve_precision
from moco.errors import UserError
from moco.model import MoCo, momentum_schedule
from moco.optim import BudgetFit, build_optimizer, lr_at

__all__ = ["train", "resume_config", "build_model", "cache_size_for"]

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
)


def build_model(cfg: TrainConfig) -> MoCo:
    """The MoCo module described by ``cfg`` (random init)."""
    backbone, width = build_backbone(cfg.arch, cfg.small_stem, cfg.image_size)
    return MoCo(
        backbone,
        width,
        head=cfg.head,
        dim=cfg.dim,
        hidden=cfg.mlp_hidden,
        projector_layers=cfg.projector_layers,
        predictor_layers=cfg.predictor_layers,
        K=cfg.queue_size,
        T=cfg.temperature,
        symmetric=cfg.symmetric,
        bn_splits=cfg.bn_splits,
        mask_own_keys=cfg.mask_own_keys,
    )


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


def _step_generator(seed: int, step: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed * 1_000_003 + step)


class _StopFlag:
    """Turns SIGINT/SIGTERM into a request to checkpoint and stop after the current step."""

    def __init__(self) -> None:
        self.signal: int | None = None
        self._old: dict[int, Any] = {}

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
        logger.warning("received %s: saving a checkpoint after this step", signal.Signals(signum).name)

    def __exit__(self, *exc: Any) -> None:
        for s, h in self._old.items():
            signal.signal(s, h)


def train(
    cfg: TrainConfig, resume: bool = False, progress: bool = True, stop_after: int | None = None
) -> dict[str, Any]:
    """Train MoCo on ``cfg.data_dir`` into ``cfg.out``; returns a summary dict.

    With ``resume=True`` the run continues from ``cfg.out/checkpoint.pt`` exactly where it stopped
    (model, key encoder, queue, optimizer, scaler, RNG states, position in the epoch).
    ``stop_after``: checkpoint and return once the run reaches this step, as if interrupted there
    (the schedule still spans the whole run), e.g. to split training into sessions.
    """
    d = _init_distributed(cfg.device)
    run_dir = Path(cfg.out)
    ckpt = None
    if resume:
        ckpt = load_checkpoint(run_dir / "checkpoint.pt")
        _check_resumable(from_plain(ckpt["config"]), cfg)
    validate(cfg, d.world)
    device = resolve_device(cfg.device)
    precision = resolve_precision(cfg.precision, device)
    if d.main:
        run_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(cfg.seed)

    # ---- data: decoded once into a uint8 cache (rank 0 builds it, the others reuse it)
    cache = _load_data(cfg, run_dir, ckpt, d, progress)
    n = len(cache)
    global_batch = cfg.batch_size * d.world
    if global_batch > n:
        raise UserError(
            f"the batch of {global_batch} images is larger than the {n} readable images in {cfg.data_dir}: "
            f"use --batch-size {max(2, n // d.world // cfg.bn_splits * cfg.bn_splits)} or smaller"
            + (f" (a multiple of --bn-splits {cfg.bn_splits})" if cfg.bn_splits > 1 else "")
        )
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
    model = build_model(cfg).to(device)
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
    metrics = _MetricsLog(run_dir / "metrics.jsonl", step) if d.main else None
    monitor = _knn_monitor(cfg, run_dir) if d.main and cfg.val_dir else None
    knn_every = cfg.knn_every or steps_per_epoch

    last_eval = -1
    train_start = time.monotonic() - elapsed  # training seconds so far = now - train_start (evaluations excluded)

    def evaluate() -> None:
        nonlocal last_eval, train_start
        t = time.monotonic()
        last_eval = step
        top1 = monitor.evaluate(model.backbone, device, precision, cnn)
        metrics.write({"step": step, "epoch": step / steps_per_epoch, "knn_top1": top1})
        logger.info("step %d: kNN top-1 %.2f%%", step, 100 * top1)
        train_start += time.monotonic() - t

    if monitor is not None and step == 0:
        evaluate()
    bar = _progress_bar(total_steps, step, progress and d.main)
    budget_s = cfg.time_budget * 60
    fitted = ckpt is not None and bool(ckpt.get("total_steps")) and cfg.time_budget > 0
    budget_fit = BudgetFit(budget_s, total_steps) if budget_s and not fitted and not cfg.max_steps else None

    def shortest(total: int) -> int:  # all ranks take the shortest schedule any of them fitted
        return int(_all_reduce(total, "min", d, device))

    last_save = time.monotonic()
    stopped_by, saved_step = None, step
    model.train()
    with _StopFlag() as stop:
        while step < total_steps:
            t0 = time.perf_counter()
            epoch, index = divmod(step, steps_per_epoch)
            lr = lr_at(step, cfg, total_steps, steps_per_epoch, d.world)
            m = momentum_schedule(step, total_steps, cfg.momentum, cfg.momentum_cosine)
            for group in optimizer.param_groups:
                group["lr"] = lr

            ids = _batch_ids(epoch, index, n, cfg.batch_size, cfg.seed, d)  # B
            images = torch.from_numpy(cache.array[ids]).to(device)  # B x S x S x 3 uint8, augmented where it trains
            x1, x2 = two_views(images, cfg.augment, cfg.image_size, cfg.mean, cfg.std, _step_generator(cfg.seed, step))
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
            }
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
                logger.info("time budget %.1f min: schedule fitted to %d steps (%.1f epochs)",
                            cfg.time_budget, total_steps, total_steps / steps_per_epoch)  # fmt: skip
            if budget_s and now - train_start >= budget_s:
                stopped_by = "time budget"
            if stop.signal is not None:
                stopped_by = signal.Signals(stop.signal).name
            elif stop_after is not None and step >= stop_after and step < total_steps:
                stopped_by = f"stop_after={stop_after}"
            stop_now = _all_reduce(float(stopped_by is not None), "max", d, device) > 0  # any rank stops: all do
            if stop_now or step == total_steps or now - last_save >= cfg.save_every_minutes * 60:
                _save(run_dir, cfg, model, optimizer, scaler, step, total_steps, now - train_start, cache, d)
                last_save, saved_step = now, step
            if stop_now:
                break
    bar.close()
    if monitor is not None and last_eval != step:
        evaluate()
    if saved_step != step:
        _save(run_dir, cfg, model, optimizer, scaler, step, total_steps, time.monotonic() - train_start, cache, d)
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
    }
    if metrics is not None:
        metrics.close()
    if d.world > 1:
        dist.barrier()
        dist.destroy_process_group()
    return summary


# ------------------------------------------------------------------------------------ helpers
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
        (run_dir / "skipped.txt").write_text("".join(f"{p}\t{r}\n" for p, r in cache.skipped))
    if d.world > 1:
        dist.barrier()
        if not d.main:
            cache = build_cache(cfg.data_dir, size, run_dir / "cache", progress=False, **kwargs)
    return cache


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
) -> None:
    replicas = _replica_check(model, d)
    if not d.main:
        return
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
    save_checkpoint(state, run_dir, keep=cfg.keep_checkpoints)


class _MetricsLog:
    """``metrics.jsonl``: one JSON line per step; on resume, lines past the checkpoint are dropped."""

    def __init__(self, path: Path, from_step: int) -> None:
        lines = path.read_text().splitlines() if path.exists() and from_step > 0 else []
        kept = [line for line in lines if line.strip() and json.loads(line).get("step", 0) <= from_step]
        path.write_text("".join(line + "\n" for line in kept))
        self._f = path.open("a")
        losses = [json.loads(line)["loss"] for line in kept if '"loss"' in line]
        self.last_loss: float | None = losses[-1] if losses else None

    def write(self, record: dict[str, Any]) -> None:
        record = {k: (round(v, 6) if isinstance(v, float) and math.isfinite(v) else v) for k, v in record.items()}
        self._f.write(json.dumps(record) + "\n")
        self._f.flush()
        self.last_loss = record.get("loss", self.last_loss)

    def close(self) -> None:
        self._f.close()


def _progress_bar(total: int, initial: int, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=initial, disable=not enabled, unit="step", dynamic_ncols=True, leave=True)


def main(argv: list[str] | None = None) -> int:
    """``python -m moco.train`` (the entry point for torchrun): same flags as ``moco train``."""
    from app.cli import main as cli_main

    return cli_main(["train", *(argv if argv is not None else __import__("sys").argv[1:])])


if __name__ == "__main__":
    raise SystemExit(main())
