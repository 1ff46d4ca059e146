"""An exported backbone read back: its metadata checked key by key (it is data from anywhere), the module rebuilt
(:func:`build_exported`), its whitening (:func:`exported_whitening`) and the width of what it embeds."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from moco.errors import UserError
from moco.model.backbones import ARCH_KWARGS, build_backbone, is_known_arch
from moco.model.resnet import RESNETS
from moco.whiten import Whitening, embedding_features, whiten_features

__all__ = ["BACKBONE_ID", "WhitenedBackbone", "build_exported", "embedding_dim", "exported_whitening", "load_exported"]

logger = logging.getLogger(__name__)


BACKBONE_ID = "moco-retrieval/backbone"


class WhitenedBackbone(nn.Module):
    """``backbone`` followed by a whitening (:mod:`moco.whiten`, of the features it was fitted on: mirror-averaged,
    with pooled stages):
    L2-normalized whitened embeddings (N x D)."""

    def __init__(self, backbone: nn.Module, whitening: Whitening) -> None:
        super().__init__()
        self.backbone = backbone
        self.register_buffer("mean", torch.from_numpy(whitening.mean.copy()))  # D
        eye = torch.eye(whitening.dim)  # centring only: the identity keeps one program for both
        self.register_buffer("matrix", eye if whitening.matrix is None else torch.from_numpy(whitening.matrix.copy()))
        self.mirror = whitening.mirror  # average each view's features with its mirror image's first
        self.stages = whitening.stage_names  # pooled before the backbone's output

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        f = embedding_features(self.backbone, x, self.mirror, self.stages)  # N x D'
        return F.normalize(whiten_features(F.normalize(f, dim=1), self.mean, self.matrix), dim=1)  # N x D


def embedding_dim(meta: dict[str, str]) -> int:
    """The width of what the export embeds (its declared ``output``; for an older file the backbone's ``embed_dim``,
    plus the channels of the stages its whitening pools)."""
    if meta.get("output"):
        return int(json.loads(meta["output"])["width"])
    stages = json.loads(meta.get("whitening") or "{}").get("stages") or []
    return int(meta["embed_dim"]) + sum(int(c) for _, c in stages)


def exported_whitening(state: dict[str, torch.Tensor], meta: dict[str, str], path: str | Path) -> Whitening | None:
    """The whitening an exported ``.safetensors`` carries (``whitening.mean``, ``whitening.matrix``), or None."""
    if "whitening.mean" not in state and "whitening.matrix" not in state:
        return None
    info = json.loads(meta.get("whitening") or "{}")
    try:
        return Whitening.from_state({"mean": state["whitening.mean"], "matrix": state["whitening.matrix"], **info},
                                    int(meta["embed_dim"]), str(path))
    except ValueError as e:
        raise UserError(f"{e}: export it again with `moco export`") from None


def load_exported(path: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Tensors and metadata of an exported ``.safetensors`` backbone (checked to be ours)."""
    from moco.files import read_safetensors

    path = Path(path)
    if not path.is_file():
        raise UserError(f"backbone file {path} does not exist: create it with `moco export CHECKPOINT -o {path}`")
    try:
        state, meta = read_safetensors(path)
    except Exception as e:  # noqa: BLE001 - any parse failure means an unusable file
        raise UserError(f"cannot read {path} as safetensors ({e}); export it again with `moco export`") from None
    if meta.get("format") != BACKBONE_ID:
        raise UserError(f"{path} is a safetensors file but not a moco-retrieval backbone (no metadata): "
                        "export it with `moco export`")
    meta = _checked_meta(meta, path)
    _check_output(state, meta, path)
    return state, meta


# The metadata a backbone file may carry: it is data from anywhere, so only these keys pass, each checked before
# anything is built from it. Bounds: 16 px is the smallest crop training takes, 4096 px 18x the papers' 224 (no
# backbone we export is fed more; one such image is already 200 MB in float32); the resize is at least the crop
# and at most twice it (we write the crop or crop * 8/7; timm's crop_pct stays above 0.5), so a decoded photo is
# at most 4x the crop's pixels; widths up to 65536 (the widest timm backbones give a few thousand features).
_META_TEXT = ("format", "format_version", "arch", "crop", "interpolation", "source_file", "source_sha256",
              "source_format", "moco_version")


_META_INTS = {"image_size": (16, 4096), "embed_dim": (1, 65536), "backbone_dim": (1, 65536)}


_META_JSON = {"small_stem": bool, "mean": list, "std": list, "arch_kwargs": dict, "whitening": dict, "output": dict,
              "dropped": dict, "training": dict}


_META_REQUIRED = ("arch", "small_stem", "embed_dim", "image_size", "resize", "mean", "std")


_NOT_JSON = object()


def _checked_meta(meta: dict[str, str], path: Path) -> dict[str, str]:
    """The known keys of ``meta`` (read from ``path``), each checked (a missing one, a wrong type, a value out of
    bounds: a UserError naming the file, the key and the fix); unknown keys are dropped, with a warning."""

    def bad(key: str, why: str) -> UserError:
        return UserError(f"{path}: its metadata {key!r} {why}: export the backbone again with `moco export "
                         f"CHECKPOINT -o {path}`")

    for key in _META_REQUIRED:
        if key not in meta:
            raise bad(key, "is missing")
    known = {*_META_TEXT, *_META_INTS, *_META_JSON, "resize"}
    if unknown := sorted(set(meta) - known):
        logger.warning("%s: ignoring metadata %s (not known to this version)", path, ", ".join(map(repr, unknown)))
    if not meta["arch"].strip():
        raise bad("arch", "is empty")
    if not is_known_arch(meta["arch"]):
        raise UserError(f"{path}: its metadata 'arch' = {meta['arch'][:60]!r} is not a backbone this version builds "
                        "(a torchvision ResNet or a model of the installed timm): install the timm it was exported "
                        f"with, or export the backbone again with `moco export CHECKPOINT -o {path}`")
    bounds = dict(_META_INTS)
    for key in (*_META_INTS, "resize"):  # image_size first: the resize's bounds follow from it
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
    for key, kind in _META_JSON.items():
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
    return {k: v for k, v in meta.items() if k in known}


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


def _check_output(state: dict[str, torch.Tensor], meta: dict[str, str], path: Path) -> None:
    """Refuse a declared ``output`` width other than what the weights give: the whitening's width where the file
    carries one, else the backbone's features (``embed_dim``, checked against the built backbone by
    :func:`build_exported`) with the pooled stages of its whitening."""
    if not meta.get("output"):
        return
    declared = json.loads(meta["output"])["width"]
    stages = json.loads(meta.get("whitening") or "{}").get("stages") or []
    features = int(meta["embed_dim"]) + sum(int(c) for _, c in stages)
    mean = state.get("whitening.mean")
    width = int(mean.numel()) if mean is not None else features
    if declared != width:
        what = "its whitening" if mean is not None else f"the {meta['embed_dim']}-d features of {meta['arch'][:60]}"
        raise UserError(f"{path}: its metadata 'output' declares width {declared}, but its weights give {width}-d "
                        f"vectors ({what}{' with the pooled stages' if stages and mean is None else ''}): export "
                        f"the backbone again with `moco export CHECKPOINT -o {path}`")


def _check_settings(kwargs: dict, state: dict[str, torch.Tensor], path: str | Path) -> None:
    """Refuse ``arch_kwargs`` that ask for more than the weights hold (a ViT's ``depth`` against its ``blocks.N``,
    its ``embed_dim`` against its position embedding), before anything is built: a 20 MB file must not make us
    build a model of gigabytes (or spend minutes making thousands of blocks) to find out."""
    blocks = {k.split(".")[1] for k in state if k.startswith("blocks.")}
    width = next((int(state[k].shape[-1]) for k in ("pos_embed", "cls_token") if k in state), None)
    for key, held in (("depth", len(blocks) if blocks else None), ("embed_dim", width)):
        if key in kwargs and held is not None and kwargs[key] != held:
            raise UserError(f"{path}: its metadata 'arch_kwargs' asks for {key} = {kwargs[key]}, but its weights hold "
                            f"{held}: export the backbone again with `moco export CHECKPOINT -o {path}`")


def build_exported(state: dict[str, torch.Tensor], meta: dict[str, str], path: str | Path = "the backbone file",
                   ) -> nn.Module:
    """The backbone module described by exported ``meta`` (read from ``path``), with ``state`` loaded exactly.

    The module is first built without memory (on PyTorch's ``meta`` device) and its tensors compared with ``state``:
    metadata that asks for another model (a larger one) is refused before a byte of it is allocated. A ResNet is
    then given ``state``'s tensors as they are (nothing drawn at random first); another model is built and loaded."""
    kwargs = json.loads(meta.get("arch_kwargs", "{}"))
    _check_settings(kwargs, state, path)
    weights = {k: v for k, v in state.items() if not k.startswith("whitening.")}
    with torch.device("meta"):
        backbone, dim = build_backbone(meta["arch"], json.loads(meta["small_stem"]), int(meta["image_size"]),
                                       init=False, **kwargs)
    want = {k: tuple(v.shape) for k, v in backbone.state_dict().items()}
    have = {k: tuple(v.shape) for k, v in weights.items()}
    if want != have:
        missing, extra = sorted(set(want) - set(have)), sorted(set(have) - set(want))
        shaped = sorted(k for k in set(want) & set(have) if want[k] != have[k])
        why = "; ".join(f"{what}: {', '.join(keys[:2])}{', ...' if len(keys) > 2 else ''}" for what, keys in
                        (("missing", missing), ("unexpected", extra), ("other shapes", shaped)) if keys)
        raise UserError(f"{path}: its weights are not those of its metadata 'arch' = {meta['arch'][:60]!r} "
                        f"({why[:160]}): export the backbone again with `moco export CHECKPOINT -o {path}`")
    if dim != int(meta["embed_dim"]):
        raise UserError(f"{path}: its metadata 'embed_dim' says {meta['embed_dim']}-d features but its {meta['arch']} "
                        f"gives {dim}: export the backbone again with `moco export CHECKPOINT -o {path}`")
    if meta["arch"] in RESNETS:  # every tensor of our ResNet is in its state dict: nothing left unset
        backbone = backbone.to_empty(device="cpu")
        backbone.load_state_dict(weights, strict=True, assign=True)
    else:
        backbone, _ = build_backbone(meta["arch"], json.loads(meta["small_stem"]), int(meta["image_size"]), **kwargs)
        backbone.load_state_dict(weights, strict=True)
    return backbone.eval()
