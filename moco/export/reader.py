"""An exported backbone read back: its metadata checked (:meth:`~moco.export.meta.BackboneMeta.from_strings`: it is
data from anywhere), the module rebuilt (:func:`build_exported`), its whitening (:func:`exported_whitening`) and the
width of what it embeds."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from moco.errors import UserError
from moco.export.meta import BACKBONE_ID, BackboneMeta
from moco.model.backbones import build_backbone
from moco.model.resnet import RESNETS
from moco.whiten import Whitening, embedding_features, whiten_features

__all__ = ["WhitenedBackbone", "build_exported", "embedding_dim", "exported_whitening", "load_exported"]


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


def embedding_dim(meta: BackboneMeta) -> int:
    """The width of what the export embeds (its declared ``output``; for an older file the backbone's ``embed_dim``,
    plus the channels of the stages its whitening pools)."""
    if meta.output:
        return int(meta.output["width"])
    return _features_width(meta)


def _features_width(meta: BackboneMeta) -> int:
    """The backbone's ``embed_dim`` plus the channels of the stages its whitening pools."""
    stages = (meta.whitening or {}).get("stages") or []
    return meta.embed_dim + sum(int(c) for _, c in stages)


def exported_whitening(state: dict[str, torch.Tensor], meta: BackboneMeta, path: str | Path) -> Whitening | None:
    """The whitening an exported ``.safetensors`` carries (``whitening.mean``, ``whitening.matrix``), or None."""
    if "whitening.mean" not in state and "whitening.matrix" not in state:
        return None
    try:
        return Whitening.from_state({"mean": state["whitening.mean"], "matrix": state["whitening.matrix"],
                                     **(meta.whitening or {})}, meta.embed_dim, str(path))
    except ValueError as e:
        raise UserError(f"{e}: export it again with `moco export`") from None


def load_exported(path: str | Path) -> tuple[dict[str, torch.Tensor], BackboneMeta]:
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
    checked = BackboneMeta.from_strings(meta, path)
    _check_output(state, checked, path)
    return state, checked


def _check_output(state: dict[str, torch.Tensor], meta: BackboneMeta, path: Path) -> None:
    """Refuse a declared ``output`` width other than what the weights give: the whitening's width where the file
    carries one, else the backbone's features (``embed_dim``, checked against the built backbone by
    :func:`build_exported`) with the pooled stages of its whitening."""
    if not meta.output:
        return
    declared = meta.output["width"]
    stages = (meta.whitening or {}).get("stages") or []
    mean = state.get("whitening.mean")
    width = int(mean.numel()) if mean is not None else _features_width(meta)
    if declared != width:
        what = "its whitening" if mean is not None else f"the {meta.embed_dim}-d features of {meta.arch[:60]}"
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


def build_exported(state: dict[str, torch.Tensor], meta: BackboneMeta, path: str | Path = "the backbone file",
                   ) -> nn.Module:
    """The backbone module described by exported ``meta`` (read from ``path``), with ``state`` loaded exactly.

    The module is first built without memory (on PyTorch's ``meta`` device) and its tensors compared with ``state``:
    metadata that asks for another model (a larger one) is refused before a byte of it is allocated. A ResNet is
    then given ``state``'s tensors as they are (nothing drawn at random first); another model is built and loaded."""
    kwargs = dict(meta.arch_kwargs)
    _check_settings(kwargs, state, path)
    weights = {k: v for k, v in state.items() if not k.startswith("whitening.")}
    with torch.device("meta"):
        backbone, dim = build_backbone(meta.arch, meta.small_stem, meta.image_size, init=False, **kwargs)
    want = {k: tuple(v.shape) for k, v in backbone.state_dict().items()}
    have = {k: tuple(v.shape) for k, v in weights.items()}
    if want != have:
        missing, extra = sorted(set(want) - set(have)), sorted(set(have) - set(want))
        shaped = sorted(k for k in set(want) & set(have) if want[k] != have[k])
        why = "; ".join(f"{what}: {', '.join(keys[:2])}{', ...' if len(keys) > 2 else ''}" for what, keys in
                        (("missing", missing), ("unexpected", extra), ("other shapes", shaped)) if keys)
        raise UserError(f"{path}: its weights are not those of its metadata 'arch' = {meta.arch[:60]!r} "
                        f"({why[:160]}): export the backbone again with `moco export CHECKPOINT -o {path}`")
    if dim != meta.embed_dim:
        raise UserError(f"{path}: its metadata 'embed_dim' says {meta.embed_dim}-d features but its {meta.arch} "
                        f"gives {dim}: export the backbone again with `moco export CHECKPOINT -o {path}`")
    if meta.arch in RESNETS:  # every tensor of our ResNet is in its state dict: nothing left unset
        backbone = backbone.to_empty(device="cpu")
        backbone.load_state_dict(weights, strict=True, assign=True)
    else:
        backbone, _ = build_backbone(meta.arch, meta.small_stem, meta.image_size, **kwargs)
        backbone.load_state_dict(weights, strict=True)
    return backbone.eval()
