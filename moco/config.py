"""TrainConfig: one dataclass with a comment per field, the v1/v2/v3 presets, and the CLI made from it."""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import os
import re
from dataclasses import dataclass, fields
from typing import Any

from moco.backbones import is_vit
from moco.errors import UserError

__all__ = ["TrainConfig", "PRESETS", "resolve_config", "add_config_arguments", "config_overrides"]

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


@dataclass
class TrainConfig:
    # ---- data
    data_dir: str = ""  # folder of photos, scanned recursively (jpg png webp bmp tiff gif)
    out: str = "runs/moco"  # run directory: checkpoint.pt, metrics.jsonl, skipped.txt, curves.png
    preset: str = "v2"  # the paper recipe this config starts from: v1 | v2 | v3
    image_size: int = 224  # training crop size in pixels
    cache_size: int = 0  # side of the decoded uint8 cache (0: image_size below 96 px, else image_size*8/7)
    mean: tuple[float, float, float] = IMAGENET_MEAN  # per-channel normalization mean
    std: tuple[float, float, float] = IMAGENET_STD  # per-channel normalization std
    augment: str = "v2"  # two-view recipe: v1 | v2 (aug+) | v3 (asymmetric blur/solarize)
    # ---- model
    arch: str = "resnet50"  # torchvision ResNet name or any timm model name
    small_stem: bool = False  # 3x3 stride-1 first conv and no max-pool, for 32-96 px images
    head: str = "mlp"  # projection head: linear (v1) | mlp (v2) | v3 (projector + predictor)
    dim: int = 128  # output dimension C of the projection
    mlp_hidden: int = 0  # hidden width of the MLP heads (0: the backbone width)
    projector_layers: int = 3  # v3 projector depth
    predictor_layers: int = 2  # v3 predictor depth
    queue_size: int = 65536  # K negatives in the queue (0: no queue, v3)
    temperature: float = 0.2  # T of the softmax
    momentum: float = 0.999  # m of the key encoder (v3: m0 of the cosine schedule to 1)
    momentum_cosine: bool = False  # raise m from its start value to 1 with a cosine schedule (v3)
    symmetric: bool = False  # v2: both views as queries, one queue per view
    bn_splits: int = 8  # Shuffle BN on one device: split batch norm over this many virtual devices
    mask_own_keys: bool = True  # a queue key of the query's own image (from an earlier step) is no negative
    # ---- optimization
    batch_size: int = 256  # images per step on each device
    epochs: int = 200  # passes over the photos
    max_steps: int = 0  # stop after this many steps (0: epochs x steps per epoch)
    time_budget: float = (
        0.0  # minutes of training (kNN evaluations not counted); the schedule is fitted to it (0: none)
    )
    optimizer: str = "sgd"  # sgd (v1/v2) | lars (v3 ResNet) | adamw (ViT)
    lr: float = 0.03  # learning rate for a batch of 256, scaled linearly with the global batch
    lr_schedule: str = "cosine"  # cosine | step (x0.1 at 60% and 80% of training)
    warmup_epochs: float = 0.0  # linear warm-up length in epochs
    weight_decay: float = 1e-4  # L2 penalty (v3: not on norms and biases)
    sgd_momentum: float = 0.9  # momentum of SGD / LARS, beta1 of AdamW
    # ---- evaluation
    val_dir: str = ""  # labeled folder (one sub-folder per class) for the kNN monitor
    knn_train_dir: str = ""  # labeled bank for the kNN monitor (empty: leave-one-out on val_dir)
    knn_k: int = 200  # neighbours of the kNN monitor
    knn_t: float = 0.1  # temperature of the kNN monitor's weights
    knn_every: int = 0  # steps between kNN evaluations (0: at the end of every epoch)
    # ---- start
    init: str = ""  # start from these weights (our checkpoint, official MoCo .pth.tar, torchvision/timm)
    # ---- runtime
    precision: str = "auto"  # auto | bf16 | fp16 | fp32 (auto: bf16 where the hardware runs it fast)
    device: str = "auto"  # auto | cpu | cuda
    workers: int = -1  # processes decoding photos (-1: one per CPU core)
    seed: int = 0  # seed of initialization, sampling and augmentation
    memory_format: str = (
        "auto"  # CNN layout: auto (channels_last for CNNs, contiguous for ViTs) | channels_last | contiguous
    )
    compile: bool = False  # torch.compile the model
    save_every_minutes: float = 10.0  # checkpoint period in minutes (always also at the end and on SIGINT/SIGTERM)
    keep_checkpoints: int = 2  # step-numbered checkpoint copies kept besides checkpoint.pt


# Each preset overrides the defaults above; the user's flags override the preset.
PRESETS: dict[str, dict[str, Any]] = {
    "v1": dict(
        preset="v1",
        head="linear",
        dim=128,
        queue_size=65536,
        temperature=0.07,
        momentum=0.999,
        augment="v1",
        optimizer="sgd",
        lr=0.03,
        lr_schedule="step",
        weight_decay=1e-4,
        bn_splits=8,
    ),
    "v2": dict(
        preset="v2",
        head="mlp",
        dim=128,
        queue_size=65536,
        temperature=0.2,
        momentum=0.999,
        augment="v2",
        optimizer="sgd",
        lr=0.03,
        lr_schedule="cosine",
        weight_decay=1e-4,
        bn_splits=8,
    ),
    "v3": dict(
        preset="v3",
        head="v3",
        dim=256,
        mlp_hidden=4096,
        queue_size=0,
        temperature=1.0,
        momentum=0.99,
        momentum_cosine=True,
        augment="v3",
        optimizer="lars",
        lr=0.6,
        weight_decay=1e-6,
        warmup_epochs=10,
        epochs=100,
        bn_splits=1,
        symmetric=True,
    ),
}
# v3 with a ViT backbone (the paper's ViT recipe), applied unless the user set these fields.
VIT_V3 = dict(optimizer="adamw", lr=1.5e-4, weight_decay=0.1, temperature=0.2, warmup_epochs=40, epochs=300)

CHOICES = {
    "preset": tuple(PRESETS),
    "augment": ("v1", "v2", "v3"),
    "head": ("linear", "mlp", "v3"),
    "optimizer": ("sgd", "lars", "adamw"),
    "lr_schedule": ("cosine", "step"),
    "precision": ("auto", "bf16", "fp16", "fp32"),
    "device": ("auto", "cpu", "cuda"),
    "memory_format": ("auto", "channels_last", "contiguous"),
}


def resolve_config(preset: str = "v2", **overrides: Any) -> TrainConfig:
    """Defaults <- preset <- (ViT recipe for v3) <- ``overrides``, then validated."""
    if preset not in PRESETS:
        raise UserError(f"unknown preset {preset!r}: use one of {', '.join(PRESETS)}")
    known = {f.name for f in fields(TrainConfig)}
    unknown = set(overrides) - known
    if unknown:
        raise UserError(f"unknown config field(s) {sorted(unknown)}; valid fields: {sorted(known)}")
    values: dict[str, Any] = dict(PRESETS[preset])
    if preset == "v3" and is_vit(overrides.get("arch", TrainConfig.arch)):
        values.update(VIT_V3)
    values.update(overrides)
    cfg = TrainConfig(**values)
    validate(cfg)
    return cfg


def validate(cfg: TrainConfig, world_size: int = 1) -> None:
    """Raise UserError naming the first bad field value and how to fix it."""
    for name, options in CHOICES.items():
        if getattr(cfg, name) not in options:
            raise UserError(f"--{_flag(name)} {getattr(cfg, name)!r} is not valid: use one of {', '.join(options)}")
    checks = [
        (cfg.image_size >= 16, "image-size", "use 16 or more pixels (32 for tiny photos, 224 for the paper setting)"),
        (cfg.batch_size >= 2, "batch-size", "use 2 or more: contrastive learning needs other images in the batch"),
        (cfg.bn_splits >= 1, "bn-splits", "use 1 (off) or more"),
        (cfg.epochs >= 1, "epochs", "use 1 or more"),
        (cfg.max_steps >= 0, "max-steps", "use 0 (from epochs) or a positive number"),
        (cfg.time_budget >= 0, "time-budget", "use 0 (none) or a positive number of minutes"),
        (cfg.lr > 0, "lr", "use a positive learning rate, e.g. 0.03 for v2"),
        (cfg.temperature > 0, "temperature", "use a positive temperature, e.g. 0.2"),
        (0.0 <= cfg.momentum <= 1.0, "momentum", "use a value in [0, 1], e.g. 0.999"),
        (cfg.dim >= 1, "dim", "use a positive dimension, e.g. 128"),
        (cfg.queue_size >= 0, "queue-size", "use a positive queue size, e.g. 65536"),
        (cfg.weight_decay >= 0, "weight-decay", "use 0 or a positive value"),
    ]
    for ok, flag, fix in checks:
        if not ok:
            raise UserError(f"--{flag} {getattr(cfg, flag.replace('-', '_'))} is out of range: {fix}")
    if cfg.batch_size % cfg.bn_splits or cfg.batch_size // cfg.bn_splits < 2:
        raise UserError(
            f"--batch-size {cfg.batch_size} must be a multiple of --bn-splits {cfg.bn_splits} with at least 2 "
            f"images per split: use e.g. --batch-size {max(2, cfg.batch_size // cfg.bn_splits) * cfg.bn_splits} "
            f"or --bn-splits 1"
        )
    if cfg.head == "v3" and cfg.queue_size:
        raise UserError("the v3 head uses in-batch negatives: set --queue-size 0 (or use --preset v2 for a queue)")
    if cfg.head != "v3":
        if cfg.queue_size == 0:
            raise UserError(f"--head {cfg.head} needs a queue: set --queue-size (e.g. 65536) or use --preset v3")
        if cfg.queue_size < cfg.batch_size * world_size:
            raise UserError(
                f"--queue-size {cfg.queue_size} is smaller than the {cfg.batch_size * world_size} keys enqueued "
                f"per step (batch x processes): use --queue-size {cfg.batch_size * world_size} or more"
            )


def config_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The config fields the user set on the command line (flags left at None are not set)."""
    out = {}
    for f in fields(TrainConfig):
        value = getattr(args, f.name, None)
        if value is not None and f.name not in ("data_dir", "out", "preset"):
            out[f.name] = value
    return out


def add_config_arguments(
    parser: argparse.ArgumentParser, skip: tuple[str, ...] = ("data_dir", "out", "preset", "mean", "std")
) -> None:
    """Add one ``--flag`` per TrainConfig field, help text from the field's comment, default None."""
    helps = _field_comments()
    for f in fields(TrainConfig):
        if f.name in skip:
            continue
        help_text = f"{helps.get(f.name, '')} (default: {f.default})"
        flag = f"--{_flag(f.name)}"
        if f.type in ("bool", bool):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=help_text)
        else:
            kind = {"int": int, "float": float, "str": str}[str(f.type)]
            parser.add_argument(
                flag,
                type=kind,
                default=None,
                choices=CHOICES.get(f.name),
                help=help_text,
                metavar=None if f.name in CHOICES else f.name.upper(),
            )


def default_workers(workers: int) -> int:
    """-1 means one decoding process per CPU core."""
    return (os.cpu_count() or 1) if workers < 0 else workers


def to_plain(cfg: TrainConfig) -> dict[str, Any]:
    """The config as plain types (lists for tuples), as stored in checkpoints."""
    return {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(cfg).items()}


def from_plain(d: dict[str, Any]) -> TrainConfig:
    """Inverse of ``to_plain``; unknown keys from newer versions are ignored, missing ones defaulted."""
    known = {f.name: f for f in fields(TrainConfig)}
    kw = {k: tuple(v) if isinstance(v, list) else v for k, v in d.items() if k in known}
    return TrainConfig(**kw)


def _flag(name: str) -> str:
    return name.replace("_", "-")


def _field_comments() -> dict[str, str]:
    src = inspect.getsource(TrainConfig)
    return {m[1]: m[2].strip() for m in re.finditer(r"^\s+(\w+): [^=]+=.*?#\s*(.*)$", src, re.M)}
