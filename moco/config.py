"""TrainConfig: one dataclass with a help text per field, the v1/v2/v3 presets, the checks of its values, and
the two ways a person sets it, both generated from the fields and checked by the same rule: the command-line flags
(one ``--flag`` per field with its help, its default and the presets' own values; ``moco train``,
``python -m moco.training``) and a ``--config`` file (the fields set in a JSON or YAML file). Pure data, without torch.

YAML is read safely: PyYAML's SafeLoader (with floats as a person writes them), and a document whose aliases would
expand it past ``MAX_YAML_NODES`` values (an alias bomb) or that nests too deeply is refused before it is built.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import re
import reprlib
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

from moco.errors import UserError

__all__ = ["TrainConfig", "PRESETS", "default_preset", "cpu_image_size", "resolve_config", "backbone_kwargs",
           "uses_v3_vit", "is_vit", "add_config_arguments", "config_overrides", "MAX_YAML_NODES", "load_config_file"]

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


@dataclass(frozen=True)
class Bounds:
    """What a numeric field can mean: a value from ``lo`` to ``hi`` (each value, for mean and std), or ``off`` (the
    value that means off or auto); ``fix`` tells the user so. The flags and ``--config`` files are checked by it."""

    lo: float
    hi: float
    fix: str
    off: float | None = None

    def holds(self, value: Any) -> bool:
        """Whether ``value`` (a number, or a tuple of them) is within these bounds."""
        return all(v == self.off or self.lo <= v <= self.hi for v in (value if isinstance(value, tuple) else (value,)))


def _field(default: Any, help: str, bounds: Bounds | None = None) -> Any:
    """A TrainConfig field: its default, its one-line help (`moco train --help` shows it as written) and, for a
    number, the bounds of what it can mean."""
    return field(default=default, metadata={"help": help, "bounds": bounds})


# Sizes: 16 px is the smallest crop a stride-16/32 backbone takes, 4096 px 18x the papers' 224 (one such crop is
# 200 MB in float32, as an export's metadata allows, moco.export.reader); widths and depths far beyond any published.
_PIXELS = Bounds(16, 4096, "use 16 to 4096 pixels (32 for tiny photos, 224 for the paper setting)")
_MAX_COUNT = 10**9  # steps, evaluations: a billion steps is centuries of training


@dataclass
class TrainConfig:
    # ---- data
    data_dir: str = _field("", "folder of photos, scanned recursively (jpg png webp bmp tiff gif avif; heic and "
                           "raw with their extras)")
    exclude: tuple[str, ...] = _field((), "a folder or files under data_dir never read: a pattern relative to it, "
                                      "e.g. 'private/**' or '*.gif' (repeat the flag for more; a resume keeps them)")
    out: str = _field("runs/moco", "run directory: checkpoint.pt, metrics.jsonl, skipped.txt, curves.png")
    preset: str = _field("v2", "the recipe this config starts from: v1 | v2 | v3 (the papers) | cpu (short CPU runs)")
    image_size: int = _field(224, "training crop size in pixels", _PIXELS)
    min_image_size: int = _field(
        0, "progressive resolution: crops start at this size and grow to image_size by 75% of training (0: off)",
        Bounds(16, 4096, "use 0 (off) or a size from 16 to --image-size", off=0),
    )
    cache_size: int = _field(0, "side of the decoded uint8 cache (0: image_size below 96 px, else image_size*8/7)",
                             Bounds(16, 8192, "use 0 (from --image-size) or a side from 16 to 8192 pixels, e.g. 256 "
                                    "for 224-px crops", off=0))
    mean: tuple[float, float, float] = _field(IMAGENET_MEAN, "per-channel normalization mean", Bounds(
        0, 1, "each value is the mean of a channel of pixels scaled to 0..1, so from 0 to 1, e.g. 0.485,0.456,0.406"))
    std: tuple[float, float, float] = _field(IMAGENET_STD, "per-channel normalization std", Bounds(
        1e-3, 1, "each value must be positive (pixels are divided by it), the spread of a channel of pixels scaled "
        "to 0..1: from 0.001 to 1, e.g. 0.229,0.224,0.225"))
    augment: str = _field("v2", "two-view recipe: v1 | v2 (aug+) | v3 (asymmetric blur/solarize) | v3-vit (crop >= 8%)")
    crop_min: float = _field(0.0, "smallest area fraction of the random resized crop, both views (0: the recipe's, "
                             "0.2 or v3-vit's 0.08; official moco-v3's --crop-min)",
                             Bounds(0, 1, "use 0 (the recipe's) or an area fraction in (0, 1], e.g. 0.08"))
    # ---- model
    arch: str = _field("resnet50", "torchvision ResNet name or any timm model name")
    small_stem: bool = _field(False, "3x3 stride-1 first conv and no max-pool, for 32-96 px images")
    head: str = _field("mlp", "projection head: linear (v1) | mlp (v2) | v3 (projector + predictor)")
    dim: int = _field(128, "output dimension C of the projection",
                      Bounds(1, 65536, "use a positive dimension up to 65536, e.g. 128"))
    mlp_hidden: int = _field(0, "hidden width of the MLP heads (0: the backbone width)",
                             Bounds(1, 65536, "use 0 (the backbone's width) or a width up to 65536, e.g. 2048", off=0))
    head_bn: bool = _field(False, "v2 head: batch norm after its hidden layer (Linear-BN-ReLU-Linear, as MoCo v3's "
                           "and SimCLR's projectors; off in v2 as published)")
    projector_layers: int = _field(3, "v3 projector depth", Bounds(1, 16, "use 1 to 16 layers, e.g. 3"))
    predictor_layers: int = _field(2, "v3 predictor depth", Bounds(1, 16, "use 1 to 16 layers, e.g. 2"))
    predictor_last_bn: bool = _field(False, "v3: an affine-free BN ends the predictor (official: ViT yes, ResNet no)")
    zero_init_residual: bool = _field(False, "torchvision ResNets: zero the last BN gamma of each residual block")
    num_heads: int = _field(0, "ViT attention heads (0: the timm model's; 12 for MoCo v3's ViT-S and its checkpoints)",
                            Bounds(1, 1024, "use 0 (the model's own) or a positive number of heads, e.g. 12", off=0))
    vit_v3_tweaks: str = _field("auto", "ViT: MoCo v3's fixed 2-D sin-cos positions, frozen patch projection and "
                                "init (vits.py): auto (the v3 preset without --init, as the official code trains "
                                "from scratch; else timm's learnable ones) | on | off")
    queue_size: int = _field(65536, "K negatives in the queue (0: no queue, v3)", Bounds(
        0, 2**24, "use 0 (v3: no queue) or a queue of up to 16777216 keys (256x the papers'), e.g. 65536"))
    temperature: float = _field(0.2, "T of the softmax",
                                Bounds(1e-3, 100, "use a positive temperature from 0.001 to 100, e.g. 0.2"))
    momentum: float = _field(0.999, "m of the key encoder (v3: m0 of the cosine schedule to 1)",
                             Bounds(0, 1, "use a value in [0, 1], e.g. 0.999"))
    momentum_cosine: bool = _field(False, "raise m from its start value to 1 with a cosine schedule (v3)")
    symmetric: bool = _field(False, "v2: both views as queries, one queue per view")
    bn_splits: int = _field(0, "Shuffle BN: split batch norm over this many virtual devices per process "
                                "(0: auto, 8 on one device, 1 per process under torchrun and for v3)",
                          Bounds(0, 32768, "use 0 (auto), 1 (off) or more, at most half --batch-size"))
    mask_own_keys: bool = _field(True, "a queue key of the query's own image (from an earlier step) is no negative")
    decorrelation: float = _field(0.0, "weight of a penalty on correlated backbone features, added to the loss "
                                  "(0: off, as the papers; the cpu preset: 0.1)",
                                  Bounds(0, 100, "use 0 (off) or a positive weight up to 100, e.g. 0.1"))
    decorrelation_decay: bool = _field(False, "after the warm-up, scale the decorrelation weight with the learning "
                                       "rate's decay (weight x lr / peak lr: full early, 0 at the end)")
    whiten: bool = _field(False, "at the end, fit a whitening of the backbone's features on (up to 5,000 of) the "
                          "photos; the export carries it and every embedding applies it (the cpu preset: on)")
    whiten_stages: str = _field("off", "ResNets: the whitened embedding also takes the pooled outputs of layer1-3 "
                                "beside the last stage's: on | off | auto (on when the whitening is fitted on at "
                                "least twice as many photos as those features have dimensions; the cpu preset)")
    whiten_edges: str = _field("off", "the whitened embedding also takes each photo's edge layout (orientations of "
                               "its grey's gradients, moco.edges) beside the network's features: on | off | auto "
                               "(on for a run from scratch on fewer than 100 photos; the cpu preset)")
    # ---- optimization
    batch_size: int = _field(256, "images per step on each device", Bounds(
        2, 65536, "use 2 or more: contrastive learning needs other images in the batch (at most 65536), e.g. 256"))
    epochs: int = _field(200, "passes over the photos", Bounds(1, 10**6, "use 1 or more (at most 1000000), e.g. 200"))
    max_steps: int = _field(0, "stop after this many steps (0: epochs x steps per epoch)",
                            Bounds(0, _MAX_COUNT, "use 0 (from epochs) or a positive number up to 10^9"))
    time_budget: float = _field(
        0.0, "minutes of training (kNN evaluations not counted); the schedule is fitted to it (0: none)",
        Bounds(0, 10**6, "use 0 (none) or a positive number of minutes, at most 1000000 (two years)"),
    )
    optimizer: str = _field("sgd", "sgd (v1/v2) | lars (v3 ResNet) | adamw (ViT)")
    lr: float = _field(0.03, "learning rate for a batch of 256, scaled linearly with the global batch",
                       Bounds(1e-8, 100, "use a positive learning rate from 1e-8 to 100, e.g. 0.03 for v2"))
    lr_schedule: str = _field("cosine", "cosine | step (x0.1 at 60% and 80% of training)")
    warmup_epochs: float = _field(0.0, "linear warm-up length in epochs",
                                  Bounds(0, 10**6, "use 0 (none) or a positive number of epochs, e.g. 10"))
    weight_decay: float = _field(1e-4, "L2 penalty (v3: not on norms and biases)",
                                 Bounds(0, 10, "use 0 or a positive value up to 10, e.g. 1e-4 (SGD), 0.1 (AdamW)"))
    sgd_momentum: float = _field(0.9, "momentum of SGD / LARS, beta1 of AdamW",
                                 Bounds(0, 0.999, "use a value from 0 to 0.999 (AdamW divides by 1 - it), e.g. 0.9"))
    # ---- evaluation
    val_dir: str = _field("", "labeled folder (one sub-folder per class) for the kNN monitor")
    knn_train_dir: str = _field("", "labeled bank for the kNN monitor (empty: leave-one-out on val_dir)")
    knn_k: int = _field(200, "neighbours of the kNN monitor",
                        Bounds(1, 10**6, "use 1 to 1000000 neighbours, e.g. 200"))
    knn_t: float = _field(0.1, "temperature of the kNN monitor's weights",
                          Bounds(1e-3, 100, "use a positive temperature from 0.001 to 100, e.g. 0.1"))
    knn_every: int = _field(0, "steps between kNN evaluations (0: at the end of every epoch)",
                            Bounds(0, _MAX_COUNT, "use 0 (every epoch) or a positive number of steps"))
    # ---- start
    init: str = _field("", "start from these weights (our checkpoint, official MoCo .pth.tar or NAME: see `moco "
                       "pretrained`, torchvision/timm)")
    # ---- runtime
    precision: str = _field("auto", "auto | bf16 | fp16 | fp32 (auto: bf16 where the hardware runs it fast)")
    device: str = _field("auto", "auto | cpu | cuda | mps (auto: CUDA, then Apple's MPS, then the CPU)")
    workers: int = _field(-1, "processes decoding photos (-1: one per CPU core)", Bounds(
        0, 1024, "use -1 (one per CPU core), 0 (decode in this process) or up to 1024 processes", off=-1))
    seed: int = _field(0, "seed of initialization, sampling and augmentation",
                       Bounds(0, 2**32 - 1, "use a whole number from 0 to 4294967295, e.g. 0"))
    memory_format: str = _field(
        "auto", "CNN layout: auto (channels_last for CNNs, contiguous for ViTs) | channels_last | contiguous"
    )
    compile: bool = _field(False, "torch.compile the model")
    save_every_minutes: float = _field(
        10.0, "checkpoint period in minutes (always also at the end and on SIGINT/SIGTERM)",
        Bounds(0, 1e9, "use 0 (every step) or a positive number of minutes (1e9: only at the end and on a signal), "
               "e.g. 10"),
    )
    keep_checkpoints: int = _field(2, "step-numbered checkpoint copies kept besides checkpoint.pt",
                                   Bounds(0, 1000, "use 0 to 1000 copies, e.g. 2"))


_V2: dict[str, Any] = dict(
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
)
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
    ),
    "v2": _V2,
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
        projector_layers=2,  # builder.py MoCo_ResNet: 2-layer projector, predictor without a last BN
        zero_init_residual=True,  # main_moco.py: torchvision ResNet with zero_init_residual=True
    ),
    # Short runs on a CPU (chosen by bench/quality_per_minute.py, see BENCHMARKS.md): v2's loss, head and
    # augmentation with a shallower network, a smaller batch (more updates per minute), a queue a short run fills.
    "cpu": {
        **_V2,  # v2's head, loss, temperature, momentum, augmentation, optimizer and schedule
        "preset": "cpu",
        "queue_size": 4096,
        "lr": 0.06,
        "arch": "resnet10t",
        "batch_size": 128,
        "image_size": 112,
        "decorrelation": 0.1,  # moco.model.loss.decorrelation on the backbone's features (BENCHMARKS.md, fifth round)
        "whiten": True,  # a whitening fitted on the photos after training (moco.whiten; BENCHMARKS.md, rounds 6-7)
        "whiten_stages": "auto",  # ... of the earlier stages' pooled outputs too (BENCHMARKS.md, ninth round)
        "whiten_edges": "auto",  # ... and of the photos' edge layout after a run from scratch on few photos
    },
}
# v3 with a ViT backbone (the paper's ViT recipe: CONFIG.md, builder.py MoCo_ViT), applied unless the user set these.
VIT_V3 = dict(optimizer="adamw", lr=1.5e-4, weight_decay=0.1, temperature=0.2, warmup_epochs=40, epochs=300,
              projector_layers=3, predictor_last_bn=True, augment="v3-vit")
# Attention heads of vits.py's models where timm's namesake differs (timm's vit_small_patch16_224 has 6).
VIT_V3_HEADS = {"vit_small_patch16_224": 12}

CHOICES = {
    "preset": tuple(PRESETS),
    "augment": ("v1", "v2", "v3", "v3-vit"),
    "head": ("linear", "mlp", "v3"),
    "optimizer": ("sgd", "lars", "adamw"),
    "lr_schedule": ("cosine", "step"),
    "precision": ("auto", "bf16", "fp16", "fp32"),
    "device": ("auto", "cpu", "cuda", "mps"),
    "memory_format": ("auto", "channels_last", "contiguous"),
    "whiten_stages": ("auto", "on", "off"),
    "whiten_edges": ("auto", "on", "off"),
    "vit_v3_tweaks": ("auto", "on", "off"),
}


def resolve_config(preset: str = "v2", **overrides: Any) -> TrainConfig:
    """Defaults <- preset <- (ViT recipe for v3) <- ``overrides``, then validated. Pure: no file is read (the
    commands read an ``--init`` checkpoint once and pass what it fixes, :func:`moco.weights.layouts.init_settings`)."""
    if preset not in PRESETS:
        raise UserError(f"unknown preset {preset!r}: use one of {', '.join(PRESETS)}")
    known = {f.name for f in fields(TrainConfig)}
    unknown = set(overrides) - known
    if unknown:
        raise UserError(f"unknown config field(s) {sorted(unknown)}; valid fields: {sorted(known)}")
    values: dict[str, Any] = dict(PRESETS[preset])
    arch = overrides.get("arch", TrainConfig.arch)
    if preset == "v3" and is_vit(arch):
        values.update(VIT_V3)
        if arch.removeprefix("timm/") in VIT_V3_HEADS:
            values["num_heads"] = VIT_V3_HEADS[arch.removeprefix("timm/")]
    values.update(overrides)
    cfg = TrainConfig(**values)
    validate(cfg)
    return cfg


def default_preset(time_budget: float, device: str) -> str:
    """The preset of a run that names none: ``cpu`` for a time-budgeted run on a CPU, else ``v2``."""
    from moco.runtime import resolve_device

    return "cpu" if time_budget and resolve_device(device).type == "cpu" else "v2"


SMALL_PHOTOS = 160  # median short side (px) under which the cpu preset trains at the photos' own size


def cpu_image_size(sides: Sequence[int]) -> int:
    """The cpu preset's crop for photos of these short sides: its 112 px, or for small photos (median short
    side under SMALL_PHOTOS) that median rounded down to 16 px, within 32..64: no compute spent on upscaling
    (28-px Fashion-MNIST learnt more per minute at 32 px than at 64 px, BENCHMARKS.md)."""
    side = statistics.median(sides) if sides else SMALL_PHOTOS
    if side >= SMALL_PHOTOS:
        return PRESETS["cpu"]["image_size"]
    return int(min(64, max(32, side // 16 * 16)))


def uses_v3_vit(cfg: TrainConfig) -> bool:
    """Whether ``cfg`` trains MoCo v3's ViT (fixed sin-cos positions, frozen patch projection): ``vit_v3_tweaks``,
    where auto means the v3 preset from scratch (with --init the weights' own positions and projection learn on)."""
    if not is_vit(cfg.arch) or cfg.vit_v3_tweaks == "off":
        return False
    return cfg.vit_v3_tweaks == "on" or (cfg.preset == "v3" and not cfg.init)


def backbone_kwargs(cfg: TrainConfig) -> dict[str, Any]:
    """The architecture settings of ``cfg`` that ``build_backbone`` takes besides arch, stem and image size."""
    return {"num_heads": cfg.num_heads} if cfg.num_heads else {}


# The bounds each numeric field declares (the one table of them: flags, --config files and validate read it).
_BOUNDS: dict[str, Bounds] = {f.name: f.metadata["bounds"] for f in fields(TrainConfig) if f.metadata.get("bounds")}


_PATTERNS = ("exclude",)  # the fields that hold --exclude patterns (moco.excludes)


def field_problem(name: str, value: Any) -> str | None:
    """What is wrong with ``value`` for field ``name`` on its own ("X is out of range: fix"), or None."""
    if name in _PATTERNS:
        from moco.excludes import check_patterns

        try:
            check_patterns(value, f"--{flag_name(name)}")
        except UserError as e:
            return str(e).partition(" ")[2] or str(e)
        return None
    if name in CHOICES and value not in CHOICES[name]:
        return f"{short_repr(value)} is not valid: use one of {', '.join(CHOICES[name])}"
    bounds = _BOUNDS.get(name)
    fix = bounds.fix if bounds else ""
    numbers = value if isinstance(value, tuple) else (value,) if isinstance(value, float) else ()
    if not all(math.isfinite(v) for v in numbers):
        return f"{show_value(value)} is not a finite number: {fix or 'e.g. ' + show_value(getattr(TrainConfig, name))}"
    if bounds is not None and not bounds.holds(value):
        return f"{show_value(value)} is out of range: {fix}"
    return None


def validate(cfg: TrainConfig, world_size: int = 1) -> None:
    """Raise UserError naming the first bad field value and how to fix it."""
    for f in fields(TrainConfig):
        if problem := field_problem(f.name, getattr(cfg, f.name)):
            raise UserError(f"--{flag_name(f.name)} {problem}")
    checks = [
        (cfg.min_image_size <= cfg.image_size, "min-image-size",
         f"use 0 (off) or a size from 16 to --image-size {cfg.image_size}"),
        (cfg.decorrelation > 0 or not cfg.decorrelation_decay, "decorrelation",
         "--decorrelation-decay scales the term's weight: set one, e.g. --decorrelation 0.1, or drop the decay"),
    ]
    for ok, flag, fix in checks:
        if not ok:
            raise UserError(f"--{flag} {getattr(cfg, flag.replace('-', '_'))} is out of range: {fix}")
    if cfg.min_image_size and is_vit(cfg.arch):
        raise UserError(f"--min-image-size {cfg.min_image_size}: progressive resolution is for CNNs (a ViT's position "
                        f"embedding is fixed to --image-size); drop it for --arch {cfg.arch}")
    if cfg.vit_v3_tweaks == "on" and not is_vit(cfg.arch):
        raise UserError(f"--vit-v3-tweaks on applies to ViT backbones; --arch {cfg.arch} is not one: drop it")
    if cfg.num_heads and not is_vit(cfg.arch):
        raise UserError(f"--num-heads {cfg.num_heads} applies to ViT backbones; --arch {cfg.arch} is not one: "
                        "drop --num-heads")
    if cfg.bn_splits and (cfg.batch_size % cfg.bn_splits or cfg.batch_size // cfg.bn_splits < 2):
        raise UserError(
            f"--batch-size {cfg.batch_size} must be a multiple of --bn-splits {cfg.bn_splits} with at least 2 "
            f"images per split: use e.g. --batch-size {max(2, cfg.batch_size // cfg.bn_splits) * cfg.bn_splits} "
            f"or --bn-splits 1"
        )
    if cfg.head == "v3" and cfg.queue_size:
        raise UserError("the v3 head uses in-batch negatives: set --queue-size 0 (or use --preset v2 for a queue)")
    if cfg.head == "v3" and cfg.bn_splits > 1:
        raise UserError(f"--bn-splits {cfg.bn_splits} splits batch norm for Shuffle BN, but v3 does not shuffle its "
                        "keys: use --bn-splits 1 (under torchrun v3 synchronizes batch norm over all processes)")
    if cfg.head != "v3":
        if cfg.queue_size == 0:
            raise UserError(f"--head {cfg.head} needs a queue: set --queue-size (e.g. 65536) or use --preset v3")
        if cfg.queue_size < cfg.batch_size * world_size:
            raise UserError(
                f"--queue-size {cfg.queue_size} is smaller than the {cfg.batch_size * world_size} keys enqueued "
                f"per step (batch x processes): use --queue-size {cfg.batch_size * world_size} or more"
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
    kw.setdefault("vit_v3_tweaks", "on")  # saved before the field existed: every ViT was built with them
    return TrainConfig(**kw)


def flag_name(name: str) -> str:
    """Field ``name`` as its command-line flag, less the leading dashes: ``batch_size`` -> ``batch-size``."""
    return name.replace("_", "-")


_repr = reprlib.Repr()
_repr.maxlevel, _repr.maxlist, _repr.maxdict, _repr.maxstring, _repr.maxother = 2, 4, 4, 60, 60


def short_repr(value: Any) -> str:
    """``repr(value)``, shortened: a value from a file can be huge (or refer to itself)."""
    return _repr.repr(value)


def show_value(value: Any) -> str:
    """A default as a user types it: on/off, R,G,B, none for an empty path."""
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, tuple):
        return ",".join(str(v) for v in value) or "none"
    return str(value) if value != "" else "none"


def config_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The config fields the user set on the command line (flags left at None are not set)."""
    out = {}
    for f in fields(TrainConfig):
        value = getattr(args, f.name, None)
        if value is not None and f.name not in ("data_dir", "out", "preset"):
            out[f.name] = value
    return out


def add_config_arguments(
    parser: argparse.ArgumentParser, skip: tuple[str, ...] = ("data_dir", "out", "preset")
) -> None:
    """Add one ``--flag`` per TrainConfig field with the field's help and default; flags default to None (unset)."""
    for f in fields(TrainConfig):
        if f.name in skip:
            continue
        help_text = f"{f.metadata.get('help', '')} {_default_text(f.name, f.default)}".replace("%", "%%")
        flag = f"--{flag_name(f.name)}"
        if f.type in ("bool", bool):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=help_text)
        elif f.name in _PATTERNS:  # repeated: each flag adds a pattern
            parser.add_argument(flag, action=_AppendTuple, default=None, help=help_text, metavar="GLOB")
        elif str(f.type).startswith("tuple"):  # mean, std: one value per channel
            rgb = _rgb_type(flag, f.name)
            parser.add_argument(flag, type=rgb, default=None, help=help_text, metavar="R,G,B")
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


class _AppendTuple(argparse.Action):
    """A repeated flag whose values collect into a tuple (the field's type), in the order given."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        setattr(namespace, self.dest, (*(getattr(namespace, self.dest, None) or ()), values))


def _default_text(name: str, default: Any) -> str:
    """'(default: X)', followed by the presets' own values where they differ from X."""
    own = [f"{p}: {show_value(v[name])}" for p, v in PRESETS.items() if v.get(name, default) != default]
    if name in VIT_V3 and VIT_V3[name] != PRESETS["v3"].get(name, default):
        own.append(f"v3 with a ViT: {show_value(VIT_V3[name])}")
    return f"(default: {show_value(default)}; preset {', '.join(own)})" if own else f"(default: {show_value(default)})"


def _rgb_type(flag: str, name: str) -> Callable[[str], tuple[float, float, float]]:
    """The argparse type of --mean/--std: 'R,G,B' -> a tuple of three floats, within the field's bounds (the same
    check as ``validate``'s, which a --config file's values pass too)."""

    def parse(text: str) -> tuple[float, float, float]:
        example = show_value(getattr(TrainConfig, name))
        try:
            values = tuple(float(v) for v in text.split(","))
        except ValueError:
            values = ()
        if len(values) != 3:
            raise argparse.ArgumentTypeError(f"{text!r}: give three numbers, one per channel, e.g. {flag} {example}")
        if problem := field_problem(name, values):
            raise argparse.ArgumentTypeError(f"{text!r}: {problem}")
        return values  # type: ignore[return-value]

    return parse


def load_config_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The TrainConfig fields set in a JSON or YAML file (``--config``), type-checked; UserError names key and fix.

    The file is a mapping of field names (as in a run's ``config.json``) to values; ``preset`` picks the recipe
    whose defaults the other keys override. Lists become tuples (``mean``, ``std``).
    """
    text = _read_config_text(path)
    if str(path).lower().endswith((".yaml", ".yml")):
        try:
            import yaml
        except ImportError as e:
            raise UserError(f"--config {path}: reading YAML needs PyYAML: pip install pyyaml, or write the config "
                            "as JSON (a .json file)") from e
        try:
            data = _load_yaml(text, path)
        except yaml.YAMLError as e:
            raise UserError(f"--config {path} is not valid YAML: {_yaml_problem(e)}") from None
    elif str(path).lower().endswith(".json"):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise UserError(f"--config {path} is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}") from e
    else:
        raise UserError(f"--config {path}: give a .json, .yaml or .yml file (a run's config.json works as is)")
    if not isinstance(data, dict):
        raise UserError(f"--config {path} must hold a mapping of config fields to values, e.g. "
                        '{"arch": "resnet18", "epochs": 100}')
    known = {f.name: f for f in fields(TrainConfig)}
    out: dict[str, Any] = {}
    for key, value in data.items():
        if key not in known:
            import difflib

            close = difflib.get_close_matches(str(key), known, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise UserError(f"--config {path}: unknown key {key!r}: {hint}valid keys are the TrainConfig fields "
                            f"({', '.join(known)})")
        out[key] = _config_value(path, key, str(known[key].type), value)
        if key != "preset" and (problem := field_problem(key, out[key])):  # the flags' own checks, naming the file
            raise UserError(f"--config {path}: {key} = {problem}")
    if "preset" in out and out["preset"] not in PRESETS:
        raise UserError(f"--config {path}: preset {out['preset']!r} is unknown: use one of {', '.join(PRESETS)}")
    return out


MAX_YAML_NODES = 10_000  # a config is ~70 values; an alias bomb ("billion laughs") expands 400 bytes to billions


@functools.cache
def _yaml_loader() -> type:
    """PyYAML's SafeLoader that also reads 3e-2 and 1.0e5 as floats (YAML 1.1 wants a dot and a signed exponent)."""
    import yaml

    class Loader(yaml.SafeLoader):
        """SafeLoader with the float rule below added (a class of its own: SafeLoader itself stays as it is)."""

    exponent = re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$")
    Loader.add_implicit_resolver("tag:yaml.org,2002:float", exponent, list("-+.0123456789"))
    return Loader


def _load_yaml(text: str, path: str | os.PathLike[str]) -> Any:
    """The document in ``text``, refused before it is built when its aliases expand it past ``MAX_YAML_NODES``."""
    loader = _yaml_loader()(text)
    try:
        try:
            node = loader.get_single_node()
        except RecursionError:
            raise UserError(f"--config {path} nests lists or mappings too deeply: a config is a flat mapping of "
                            "field names to values") from None
        if node is None:
            return None
        size = _expanded_size(node, MAX_YAML_NODES)
        if size is None:
            raise UserError(f"--config {path}: an alias (*name) refers to itself: a config is a flat mapping of "
                            "field names to values; write the values out")
        if size > MAX_YAML_NODES:
            raise UserError(f"--config {path}: its aliases (*name) expand it to more than {MAX_YAML_NODES} values "
                            "(an alias bomb?): a config is a flat mapping of field names to values; write the values "
                            "out")
        return loader.construct_document(node)
    finally:
        loader.dispose()


def _yaml_problem(err: Any) -> str:
    """PyYAML's error ``err`` in one line, where it is (its own message quotes the file in several lines)."""
    problem = getattr(err, "problem", None) or str(err).splitlines()[0]
    mark = getattr(err, "problem_mark", None)
    where = f" at line {mark.line + 1} column {mark.column + 1}" if mark is not None else ""
    if "unhashable key" in problem:
        return (f"a key{where} is a list or a mapping: a config's keys are field names, one per line, e.g. "
                "arch: resnet18")
    return f"{problem[:200]}{where}"


def _expanded_size(node: Any, limit: int) -> int | None:
    """Nodes under ``node`` with every alias expanded (counting stops past ``limit``); None for a cycle."""
    import yaml

    sizes: dict[int, int] = {}  # id(node) -> its expanded size: each distinct node is walked once
    open_: set[int] = set()

    def size(n: Any) -> int | None:
        if id(n) in sizes:
            return sizes[id(n)]
        if id(n) in open_:
            return None  # an alias inside its own anchor
        open_.add(id(n))
        children = (n.value if isinstance(n, yaml.SequenceNode)
                    else [x for pair in n.value for x in pair] if isinstance(n, yaml.MappingNode) else [])
        total = 1
        for child in children:
            sub = size(child)
            if sub is None:
                return None
            total += sub
            if total > limit:
                break
        open_.discard(id(n))
        sizes[id(n)] = total
        return total

    return size(node)


def _read_config_text(path: str | os.PathLike[str]) -> str:
    """The text of the file at ``path`` (UTF-8), or UserError saying why it cannot be read."""
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except FileNotFoundError as e:
        raise UserError(f"--config {path}: file not found") from e
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"--config {path} cannot be read ({e}): give a readable UTF-8 JSON or YAML file") from e


def _config_value(path: str | os.PathLike[str], key: str, kind: str, value: Any) -> Any:
    """``value`` of field ``key`` (annotated ``kind``) from a config file, checked (ints accepted for floats)."""
    wrong = f"--config {path}: {key} = {short_repr(value)} is not"
    if kind == "bool":
        if not isinstance(value, bool):
            raise UserError(f"{wrong} true or false")
        return value
    if key in _PATTERNS:
        if not (isinstance(value, list | tuple) and all(isinstance(v, str) for v in value)):
            raise UserError(f"{wrong} a list of patterns, e.g. {key}: ['private/**', '*.gif']")
        return tuple(value)
    if kind.startswith("tuple"):
        if not (isinstance(value, list | tuple) and len(value) == 3
                and all(isinstance(v, int | float) and not isinstance(v, bool) for v in value)):
            raise UserError(f"{wrong} three numbers, one per channel, e.g. [0.485, 0.456, 0.406]")
        return tuple(float(v) for v in value)
    if kind == "float" and isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    if kind == "int" and isinstance(value, int) and not isinstance(value, bool):
        return value
    if kind == "str" and isinstance(value, str):
        return value
    example = show_value(getattr(TrainConfig, key))
    raise UserError(f"{wrong} a{'n' if kind == 'int' else ''} {kind}: write e.g. {key}: {example}")


def is_vit(arch: str) -> bool:
    """True for the Vision Transformer family (timm ``vit_*`` / ``deit*``), which v3 trains with AdamW."""
    name = arch.removeprefix("timm/").lower()
    return name.startswith(("vit_", "deit"))
