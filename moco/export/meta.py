"""The metadata of an exported backbone (as timm's ``PretrainedCfg``): one typed value, :class:`BackboneMeta`, that the
exporter builds, every writer stores as strings (:meth:`BackboneMeta.to_strings`: a safetensors header, ONNX's
``metadata_props``, a pt2 program's ``moco_meta.json``) and the reader checks back (:meth:`BackboneMeta.from_strings`:
a file's metadata is data from anywhere, so each key is checked before anything is built from it)."""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from moco.errors import UserError
from moco.model.backbones import ARCH_KWARGS, is_known_arch

__all__ = ["BACKBONE_ID", "BackboneMeta"]

logger = logging.getLogger(__name__)


BACKBONE_ID = "moco-retrieval/backbone"  # the metadata "format" of every file we export


@dataclass(frozen=True)
class BackboneMeta:
    """What an exported backbone is and how to feed it: the model, its preprocessing, what it outputs, where it came
    from. Optional fields are None where an older export does not carry them (:meth:`to_strings` leaves them out)."""

    arch: str  # the backbone: a torchvision ResNet, or a model of timm ("vit_small_patch16_224")
    small_stem: bool  # the ResNet's small-image stem (3x3 conv, no max-pool)
    embed_dim: int  # the width of the module's output (a pt2/ONNX program with a space: the space's width)
    image_size: int  # the square crop fed to the model, px
    resize: int  # the short side a photo is resized to before the center crop, px
    mean: tuple[float, float, float]  # per-channel normalization of pixels in 0..1: (x - mean) / std
    std: tuple[float, float, float]
    arch_kwargs: dict[str, Any] = field(default_factory=dict)  # settings of the model (a ViT's num_heads, depth)
    crop: str = "center"
    interpolation: str = "bicubic"
    source_file: str | None = None  # the checkpoint's file name (any bytes, as text)
    source_sha256: str | None = None  # the checkpoint's sha256
    source_format: str | None = None  # the checkpoint's layout ("moco-retrieval", "moco-v1/v2 (official)", ...)
    moco_version: str | None = None
    dropped: dict[str, int] | None = None  # source entries not exported, counted by reason
    training: dict[str, Any] | None = None  # a summary of the run (epoch, preset, batch size, ...)
    whitening: dict[str, Any] | None = None  # the space the file carries: shrinkage, count, source, mirror, stages
    backbone_dim: int | None = None  # a program with its space inside: the backbone's own width
    output: dict[str, Any] | None = None  # what it outputs: width, whitened, centred, normalized, mirror, stages, ...
    format_version: str = "1"

    def __post_init__(self) -> None:
        # the values as a file holds them (JSON's lists, string keys): what is written is what is read back
        for name in ("mean", "std"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        for name in ("arch_kwargs", "dropped", "training", "whitening", "output"):
            if getattr(self, name) is not None:
                object.__setattr__(self, name, json.loads(json.dumps(getattr(self, name))))

    def to_strings(self) -> dict[str, str]:
        """The metadata as a file stores it: text keys and values, in the order the exporter has always written them
        (JSON with Python's default separators; ``dropped`` with sorted keys)."""
        out = {"format": BACKBONE_ID, "format_version": self.format_version, "arch": self.arch,
               "arch_kwargs": json.dumps(self.arch_kwargs), "small_stem": json.dumps(self.small_stem),
               "embed_dim": str(self.embed_dim), "image_size": str(self.image_size), "resize": str(self.resize),
               "crop": self.crop, "interpolation": self.interpolation, "mean": json.dumps(list(self.mean)),
               "std": json.dumps(list(self.std))}
        optional = {"source_file": self.source_file, "source_sha256": self.source_sha256,
                    "source_format": self.source_format, "moco_version": self.moco_version,
                    "dropped": None if self.dropped is None else json.dumps(self.dropped, sort_keys=True),
                    "training": None if self.training is None else json.dumps(self.training),
                    "whitening": None if self.whitening is None else json.dumps(self.whitening),
                    "backbone_dim": None if self.backbone_dim is None else str(self.backbone_dim),
                    "output": None if self.output is None else json.dumps(self.output)}
        return {**out, **{k: v for k, v in optional.items() if v is not None}}

    @classmethod
    def from_strings(cls, meta: Mapping[str, str], path: str | Path) -> BackboneMeta:
        """The metadata ``meta`` read from ``path``, each known key checked (a missing one, a wrong type, a value out
        of bounds: a UserError naming the file, the key and the fix); unknown keys are dropped, with a warning."""
        values = _checked(meta, Path(path))
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in values.items() if k in names})


# Bounds: 16 px is the smallest crop training takes, 4096 px 18x the papers' 224 (no backbone we export is fed more;
# one such image is already 200 MB in float32); the resize is at least the crop and at most twice it (we write the
# crop or crop * 8/7; timm's crop_pct stays above 0.5), so a decoded photo is at most 4x the crop's pixels; widths up
# to 65536 (the widest timm backbones give a few thousand features).
_TEXT = ("format", "format_version", "arch", "crop", "interpolation", "source_file", "source_sha256", "source_format",
         "moco_version")


_INTS = {"image_size": (16, 4096), "embed_dim": (1, 65536), "backbone_dim": (1, 65536)}


_JSON = {"small_stem": bool, "mean": list, "std": list, "arch_kwargs": dict, "whitening": dict, "output": dict,
         "dropped": dict, "training": dict}


_REQUIRED = ("arch", "small_stem", "embed_dim", "image_size", "resize", "mean", "std")


_NOT_JSON = object()


def _checked(meta: Mapping[str, str], path: Path) -> dict[str, Any]:
    """The known keys of ``meta`` (read from ``path``), each checked and parsed to its type."""

    def bad(key: str, why: str) -> UserError:
        return UserError(f"{path}: its metadata {key!r} {why}: export the backbone again with `moco export "
                         f"CHECKPOINT -o {path}`")

    for key in _REQUIRED:
        if key not in meta:
            raise bad(key, "is missing")
    known = {*_TEXT, *_INTS, *_JSON, "resize"}
    if unknown := sorted(set(meta) - known):
        logger.warning("%s: ignoring metadata %s (not known to this version)", path, ", ".join(map(repr, unknown)))
    if not meta["arch"].strip():
        raise bad("arch", "is empty")
    if not is_known_arch(meta["arch"]):
        raise UserError(f"{path}: its metadata 'arch' = {meta['arch'][:60]!r} is not a backbone this version builds "
                        "(a torchvision ResNet or a model of the installed timm): install the timm it was exported "
                        f"with, or export the backbone again with `moco export CHECKPOINT -o {path}`")
    values: dict[str, Any] = {k: meta[k] for k in _TEXT if k in meta}
    bounds = dict(_INTS)
    for key in (*_INTS, "resize"):  # image_size first: the resize's bounds follow from it
        if key not in meta:
            continue
        try:
            value = int(meta[key])
        except ValueError:
            raise bad(key, f"= {meta[key][:40]!r} is not a whole number") from None
        lo, hi = bounds[key]
        if not lo <= value <= hi:
            raise bad(key, f"= {value} is outside {lo}..{hi}")
        if key == "image_size":
            bounds["resize"] = (value, 2 * value)
        values[key] = value
    for key, kind in _JSON.items():
        if key not in meta:
            continue
        try:
            value = json.loads(meta[key])
        except (ValueError, RecursionError):
            value = _NOT_JSON  # said below, as the key's own kind where it has one
        if key == "small_stem" and not isinstance(value, bool):
            raise bad(key, f"= {meta[key][:40]!r} is not true or false")
        if value is _NOT_JSON:
            raise bad(key, f"= {meta[key][:40]!r} is not valid JSON")
        if key in ("mean", "std") and not (isinstance(value, list) and len(value) == 3 and all(
                isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) for v in value)):
            raise bad(key, f"= {meta[key][:40]} is not three finite numbers, one per channel")
        if key == "std" and min(value) <= 0:
            raise bad(key, f"= {meta[key][:40]} is not positive (pixels are divided by it)")
        if not isinstance(value, kind):
            raise bad(key, f"= {meta[key][:40]!r} is not a JSON object")
        if key == "arch_kwargs":
            _check_arch_kwargs(value, path)
        if key == "output" and not (isinstance(value.get("width"), int) and 1 <= value["width"] <= 65536):
            raise bad(key, f"width = {str(value.get('width'))[:20]!r} is not a width from 1 to 65536")
        stages = (value.get("stages") or []) if key == "whitening" else []
        if not (isinstance(stages, list) and all(isinstance(p, list) and len(p) == 2 and isinstance(p[0], str)
                                                 and isinstance(p[1], int) and p[1] > 0 for p in stages)):
            raise bad(key, "stages are not [name, channels] pairs")
        values[key] = value
    return values


_KWARG_MAX = 65536  # an architecture setting's integer (heads, depth, width, patch): beyond any model's


def _check_arch_kwargs(kwargs: dict, path: Path) -> None:
    """Refuse a setting of ``arch_kwargs`` that :data:`moco.model.backbones.ARCH_KWARGS` does not allow, or a value of
    the wrong type or out of bounds, naming the file, the setting and the fix (nothing else reaches timm)."""
    for key, value in kwargs.items():
        types = ARCH_KWARGS.get(key)
        shown = f"{str(key)[:40]!r} = {str(value)[:40]!r}"
        if types is None:
            why = f"is not an architecture setting this version passes on (allowed: {', '.join(sorted(ARCH_KWARGS))})"
        elif not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
            why = f"is not {' or '.join(t.__name__ for t in types)}"
        elif isinstance(value, int | float) and not isinstance(value, bool) and not 0 < value <= _KWARG_MAX:
            why = f"is outside 1..{_KWARG_MAX}"
        else:
            continue
        raise UserError(f"{path}: its metadata 'arch_kwargs' has {shown}, which {why}: re-export the backbone with "
                        f"`moco export CHECKPOINT -o {path}`")
