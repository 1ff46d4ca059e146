"""What a run trains with: the model (:func:`build_model`), its batch-norm groups, precision and memory format, its
decoded photos, checked against its batch and queue, and the state it starts from (:func:`setup`: built, or
restored from a checkpoint)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from moco.config import TrainConfig, backbone_kwargs, default_workers, from_plain, is_vit, uses_v3_vit
from moco.data.cache import ImageCache, build_cache, cache_size_for, write_skipped
from moco.errors import UserError
from moco.model.backbones import build_backbone
from moco.model.builder import MoCo
from moco.model.sync_bn import convert_sync_bn
from moco.runtime import Dist, autocast_for
from moco.training.checkpoints import set_rng_state
from moco.training.optim import build_optimizer

__all__ = ["build_model", "bn_splits_for", "warn_small_bn_groups", "Setup", "check_collection", "setup", "load_data",
           "safe_precision", "channels_last_for", "knn_monitor"]

logger = logging.getLogger(__name__)


def build_model(cfg: TrainConfig) -> MoCo:
    """The MoCo module described by ``cfg`` (random init), with split BN for this process (``bn_splits_for``)."""
    backbone, width = build_backbone(cfg.arch, cfg.small_stem, cfg.image_size, cfg.zero_init_residual,
                                     moco_v3_vit=uses_v3_vit(cfg), **backbone_kwargs(cfg))
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
        bn_splits=bn_splits_for(cfg, dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1),
        mask_own_keys=cfg.mask_own_keys,
        decorrelation=cfg.decorrelation,
    )


def bn_splits_for(cfg: TrainConfig, world: int) -> int:
    """``cfg.bn_splits``, or for 0 (auto): one BN group per process under torchrun (the real Shuffle BN across
    ranks, as the official code) and for v3; on one process (Shuffle BN simulated, v1/v2) up to 8 virtual
    devices (the official CIFAR demo's), as many as keep 16 images per group (at least 2 groups)."""
    if cfg.bn_splits:
        return cfg.bn_splits
    if world > 1 or cfg.head == "v3":
        return 1
    fits = [s for s in range(8, 1, -1) if cfg.batch_size % s == 0 and cfg.batch_size // s >= 2]
    return next((s for s in fits if cfg.batch_size // s >= 16), fits[-1] if fits else 1)


def warn_small_bn_groups(cfg: TrainConfig, world: int, sync_bn: bool) -> None:
    """A warning when batch norm normalises over fewer than 16 images (noisy statistics). `moco train` gives it,
    about its flags; `moco run` chooses its own settings (app.run.pipeline.training_overrides) and says them."""
    group = cfg.batch_size * world if sync_bn else cfg.batch_size // cfg.bn_splits
    if group >= 16:
        return
    how = (f"synchronized over {world} processes x --batch-size {cfg.batch_size}" if sync_bn
           else f"--batch-size {cfg.batch_size} per process / --bn-splits {cfg.bn_splits}")
    logger.warning(
        "%d images per batch-norm group (%s), fewer than 16: its batch statistics are noisy, which can slow or "
        "destabilize training; raise --batch-size%s if memory allows",
        group, how, " or lower --bn-splits" if cfg.bn_splits > 1 else "",
    )


@dataclass
class Setup:
    """What a run trains with: built, or restored from its checkpoint."""

    model: MoCo
    net: nn.Module  # the model, or its DistributedDataParallel wrapper
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    autocast: Any
    channels_last: bool
    step: int
    elapsed: float  # training seconds of earlier sessions
    total_steps: int


def check_collection(cfg: TrainConfig, n: int, d: Dist) -> None:
    """Refuse a batch larger than the ``n`` readable photos (naming the fix); warn of a queue longer than them."""
    global_batch = cfg.batch_size * d.world
    if global_batch > n:
        per, splits = n // d.world, max(1, cfg.bn_splits)  # a batch: a multiple of the splits, 2 images in each
        if per < 2:
            each = f"{d.world} processes x a batch of 2" if d.world > 1 else "a batch of 2"
            raise UserError(f"{cfg.data_dir} has {n} readable photo{'s' * (n != 1)}: training needs at least "
                            f"{2 * d.world} ({each}): add photos to it")
        fix = (f"--batch-size {per // splits * splits} or smaller (a multiple of --bn-splits {splits})"
               if per >= 2 * splits and splits > 1 else f"--batch-size {per} or smaller" if splits == 1
               else f"--batch-size {per} --bn-splits 1")
        raise UserError(f"the batch of {global_batch} images is larger than the {n} readable images in "
                        f"{cfg.data_dir}: use {fix}")
    if cfg.queue_size > n:
        logger.warning("queue of K=%d keys is larger than the collection (%d images): each image sits in the queue "
                       "about %.0f times; its own stale keys are %s. A --queue-size of at most %d wastes less compute.",
                       cfg.queue_size, n, cfg.queue_size / n, "masked out" if cfg.mask_own_keys else "NOT masked",
                       n)


def setup(cfg: TrainConfig, ckpt: dict | None, d: Dist, device: torch.device, precision: str, run_dir: Path,
           steps_per_epoch: int, counts: tuple[int, int], model: MoCo | None = None) -> Setup:
    """The model (Sync BN for v3 under torchrun, channels_last for CNNs), optimizer and scaler, from ``ckpt`` when
    resuming (step, training seconds, schedule, RNG states). ``model``: ``build_model(cfg)`` made earlier, with
    ``cfg.init`` loaded (train builds it before decoding the photos, so that a wrong architecture or weights that do
    not fit it are said at once)."""
    model = model if model is not None else build_model(cfg)
    if cfg.head == "v3" and d.world > 1:  # as the official v3: every BN (momentum encoder too) uses all processes
        model = convert_sync_bn(model, device)
    model = model.to(device)
    cnn = channels_last_for(cfg)
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
        set_rng_state(ckpt["rng"])
        logger.info("resumed %s at step %d of %d", run_dir / "checkpoint.pt", step, total_steps)
    net: nn.Module = model
    if d.world > 1:
        # every rank enqueues the same all-gathered keys, so buffers need no broadcast (checked at each save)
        net = nn.parallel.DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None, broadcast_buffers=False
        )
    if cfg.compile:  # the encoders only: the MoCo step around them updates buffers in place
        for encoder in (model.backbone, model.backbone_momentum):
            encoder.compile()
    if d.main:
        logger.info("training %s %s on %d images (%d skipped), %d steps/epoch, %d steps, batch %dx%d, %s %s",
                    cfg.preset, cfg.arch, *counts, steps_per_epoch, total_steps, cfg.batch_size, d.world, device,
                    precision)
    return Setup(model, net, optimizer, scaler, autocast_for(device, precision), cnn, step, elapsed, total_steps)


def load_data(cfg: TrainConfig, run_dir: Path, ckpt: dict | None, d: Dist, progress: bool) -> ImageCache:
    size = cache_size_for(cfg.image_size, cfg.cache_size)
    files = list(ckpt["files"]) if ckpt is not None else None
    kwargs = dict(files=files, workers=default_workers(cfg.workers), strict=ckpt is not None, exclude=cfg.exclude)
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


def safe_precision(cfg: TrainConfig, device: torch.device, precision: str) -> str:
    """``precision``, unless bf16 on a CPU would meet crops under 32 px on a stride-32 CNN: their 1x1 maps reach
    stride-2 convolutions, whose bf16 backward on CPUs (oneDNN) can return NaN. ``auto`` then falls back to
    fp32 (logged); an explicit ``--precision bf16`` is refused with the fixes."""
    smallest = min(cfg.image_size, cfg.min_image_size or cfg.image_size)
    if precision != "bf16" or device.type != "cpu" or cfg.small_stem or is_vit(cfg.arch) \
            or smallest >= SMALLEST_BF16_CROP:
        return precision
    why = (f"crops of {smallest} px on {cfg.arch} without --small-stem put 1x1 feature maps into stride-2 "
           "convolutions, whose bf16 backward on CPUs can return NaN")
    if cfg.precision == "bf16":
        raise UserError(f"--precision bf16: {why}; use --small-stem, crops of {SMALLEST_BF16_CROP} px or more "
                        "(--image-size, --min-image-size), or --precision fp32")
    logger.warning("%s: training in fp32 instead (--small-stem or %d px crops keep bf16's speed)", why,
                   SMALLEST_BF16_CROP)
    return "fp32"


def channels_last_for(cfg: TrainConfig) -> bool:
    """channels_last for CNNs unless asked otherwise: faster on GPUs (bench/layout.py; its figures: BENCHMARKS.md,
    "Memory layout")."""
    return not is_vit(cfg.arch) and cfg.memory_format != "contiguous"


def knn_monitor(cfg: TrainConfig, run_dir: Path):
    from moco.training.knn import KnnMonitor

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
