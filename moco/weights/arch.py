"""Which backbone a checkpoint holds: its architecture, small stem, image size and timm keyword arguments, from our
run config, the file's ``arch`` field or the shapes of its keys (:func:`detect_arch`)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from moco.config import backbone_kwargs, from_plain
from moco.errors import UserError
from moco.weights.layouts import SplitCheckpoint, checkpoint_num_heads, sequential_names

__all__ = ["ArchGuess", "detect_arch", "detect_vit", "moco_version"]


@dataclass
class ArchGuess:
    arch: str
    small_stem: bool = False
    image_size: int = 224
    kwargs: dict[str, Any] = field(default_factory=dict)
    how: str = ""


def _resnet_candidates() -> list[str]:
    from moco.model.resnet import RESNETS

    return list(RESNETS)


def detect_arch(split: SplitCheckpoint, image_size: int | None = None) -> ArchGuess:
    """The architecture of a checkpoint's backbone, from our config, the file's ``arch`` or the keys."""
    if split.format == "moco-retrieval" and split.meta.get("config"):
        cfg = split.meta["config"]
        return ArchGuess(cfg["arch"], bool(cfg.get("small_stem")), int(cfg.get("image_size", 224)),
                         backbone_kwargs(from_plain(cfg)), how="run config")
    sd = split.backbone
    if "pos_embed" in sd and "patch_embed.proj.weight" in sd:
        return detect_vit(split, image_size)
    small = "conv1.weight" in sd and sd["conv1.weight"].shape[-1] == 3
    hinted = split.meta.get("arch")
    names = ([hinted] if isinstance(hinted, str) and hinted in _resnet_candidates() else []) + _resnet_candidates()
    for name in names:
        from moco.model.resnet import resnet

        with torch.device("meta"):
            net = resnet(name, init=False)
        if small:
            net.conv1 = nn.Conv2d(3, net.conv1.out_channels, 3, 1, 1, bias=False, device="meta")
        net.fc = nn.Identity()
        named = sequential_names(net, sd)
        target = {k: v.shape for k, v in net.state_dict().items()}
        if set(target) == set(named) and all(named[k].shape == target[k] for k in target):
            how = "the file's 'arch' field" if name == hinted else "the shapes of its keys"
            return ArchGuess(name, small, image_size or (32 if small else 224), how=how)
    raise UserError(
        "cannot tell the backbone architecture from the checkpoint's keys: pass --arch NAME "
        "(a torchvision ResNet or timm model name)"
    )


def detect_vit(split: SplitCheckpoint, image_size: int | None, arch: str | None = None) -> ArchGuess:
    """A ViT's timm name (``arch`` if given), image size from its position grid, heads and depth."""
    import timm

    sd = split.backbone
    dim = sd["pos_embed"].shape[-1]
    patch = sd["patch_embed.proj.weight"].shape[-1]
    depth = len({k.split(".")[1] for k in sd if k.startswith("blocks.")})
    tokens = sd["pos_embed"].shape[1]
    grid = math.isqrt(tokens - 1)
    size = image_size or grid * patch
    width = {192: "tiny", 384: "small", 768: "base", 1024: "large", 1280: "huge"}.get(dim)
    name = (arch or f"vit_{width}_patch{patch}_224").removeprefix("timm/")
    if arch is None and (width is None or not timm.is_model(name)):
        raise UserError(f"a ViT of width {dim}, patch {patch}, depth {depth}: pass --arch with its timm name")
    heads = checkpoint_num_heads(split)
    kwargs: dict[str, Any] = {"num_heads": heads} if heads else {}
    how = f"{'--arch and ' if arch else ''}ViT shapes (width {dim}, depth {depth}, patch {patch})"
    if not timm.is_model(name):  # an unknown --arch: build_backbone names the choices
        return ArchGuess(arch or name, False, size, kwargs, how=how)
    with torch.device("meta"):
        probe = timm.create_model(name, pretrained=False, num_classes=0, img_size=size, **kwargs)
    if len(probe.blocks) != depth:
        kwargs["depth"] = depth
    return ArchGuess(arch or name, False, size, kwargs, how=how)


def moco_version(split: SplitCheckpoint) -> str:
    if split.format == "moco-retrieval":
        return str(split.meta.get("config", {}).get("preset", "unknown"))
    if split.format.startswith("moco-v3"):
        return "v3"
    if split.format.startswith("moco-v1/v2"):
        return "v1" if set(split.projector) == {"0.weight", "0.bias"} else "v2"
    return "unknown"
