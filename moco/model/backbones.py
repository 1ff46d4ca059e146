"""Build a backbone by name: any ResNet of torchvision's family (our own module, :mod:`moco.model.resnet`) or any
timm model, never downloading weights.

A backbone maps images ``N x 3 x H x W`` to features ``N x D`` (no classifier). The heads live in
``moco.model``; keeping them apart makes export a prefix filter (STYLE.md 5).
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch
from torch import nn

from moco.config import is_vit  # torch-free (the CLI's parser needs it)
from moco.errors import UserError
from moco.model.resnet import RESNETS, resnet

__all__ = ["build_backbone", "SplitBatchNorm", "convert_split_bn", "sincos_2d", "is_known_arch", "ARCH_KWARGS"]

logger = logging.getLogger(__name__)


def build_backbone(
    arch: str, small_stem: bool = False, image_size: int = 224, zero_init_residual: bool = False, *,
    moco_v3_vit: bool = False, init: bool = True, **timm_kwargs: Any,
) -> tuple[nn.Module, int]:
    """Return ``(backbone, num_features)`` for ``arch``, randomly initialized.

    ``arch`` is a torchvision ResNet name (``resnet18``, ``resnet50``, ``wide_resnet50_2``,
    ``resnext50_32x4d``...) or any timm model name (``timm/`` prefix forces timm). ``small_stem``
    replaces the 7x7/2 conv and max-pool by a 3x3/1 conv, for 32-96 px images. ``zero_init_residual``
    zeroes the last BN gamma of each torchvision residual block (MoCo v3; timm ResNets do it by default).
    ``moco_v3_vit``: a ViT becomes MoCo v3's (vits.py: its init, fixed sin-cos positions, frozen patch
    projection), as the official code trains from scratch; else timm's ViT, every weight learnable.
    ``timm_kwargs`` go to ``timm.create_model`` (e.g. ``num_heads=12`` for MoCo v3's ViT-S). ``init`` False: a
    ResNet's weights are left uninitialized (to be loaded; timm initializes its models always).
    """
    name = arch.removeprefix("timm/")
    if not arch.startswith("timm/") and _is_torchvision_resnet(name) and not timm_kwargs:
        return _torchvision_resnet(name, small_stem, zero_init_residual, init)
    return _timm_model(name, small_stem, image_size, timm_kwargs, moco_v3_vit)


def is_known_arch(arch: str) -> bool:
    """Whether :func:`build_backbone` builds ``arch``: a torchvision ResNet or a model of the installed timm."""
    name = arch.removeprefix("timm/")
    if not arch.startswith("timm/") and _is_torchvision_resnet(name):
        return True
    import timm

    return bool(timm.is_model(name))


def _is_torchvision_resnet(name: str) -> bool:
    return name in RESNETS


def _torchvision_resnet(name: str, small_stem: bool, zero_init_residual: bool = False,
                        init: bool = True) -> tuple[nn.Module, int]:
    model = resnet(name, zero_init_residual=zero_init_residual, init=init)
    width = model.fc.in_features
    model.fc = nn.Identity()
    if small_stem:
        model.conv1 = nn.Conv2d(3, model.conv1.out_channels, 3, 1, 1, bias=False)
        model.maxpool = nn.Identity()
    return model, width


def _timm_model(name: str, small_stem: bool, image_size: int, extra: dict[str, Any],
                moco_v3_vit: bool = False) -> tuple[nn.Module, int]:
    import timm

    if not timm.is_model(name):
        close = timm.list_models(f"*{name.split('_')[0]}*")[:8]
        raise UserError(
            f"unknown backbone --arch {name!r}: not a torchvision ResNet nor a timm model"
            + (f"; similar timm names: {', '.join(close)}" if close else "")
            + "; e.g. resnet18, resnet50, vit_small_patch16_224, convnext_tiny"
        )
    kwargs: dict = {**_checked_kwargs(name, extra), "pretrained": False, "num_classes": 0}  # never downloads
    if is_vit(name):
        kwargs["img_size"] = image_size
    try:
        model = timm.create_model(name, **kwargs)
    except AssertionError as e:  # timm's checks, e.g. a width that the number of heads does not divide
        if not extra:
            raise
        settings = ", ".join(f"{k}={v}" for k, v in extra.items())
        raise UserError(f"{name} cannot be built with {settings} ({e}): choose values the model allows, e.g. "
                        "--num-heads 6 or 12 for a 384-wide ViT-S") from None
    if moco_v3_vit and is_vit(name):
        _moco_v3_vit(model)
    if small_stem:
        conv = getattr(model, "conv1", None)
        if not isinstance(conv, nn.Conv2d) or not hasattr(model, "maxpool"):
            raise UserError(
                f"--small-stem works for ResNet-style models (conv1 + maxpool); {name!r} has no such stem: "
                "drop --small-stem, or use a torchvision ResNet such as resnet18"
            )
        model.conv1 = nn.Conv2d(3, conv.out_channels, 3, 1, 1, bias=False)
        model.maxpool = nn.Identity()
    return model, int(model.num_features)


# Architecture settings a backbone may carry (export metadata, --init guesses) and their types. Nothing
# else reaches timm.create_model: a file's metadata must not be able to ask for weights or a download URL.
ARCH_KWARGS: dict[str, tuple[type, ...]] = {
    "num_heads": (int,), "depth": (int,), "embed_dim": (int,), "patch_size": (int,), "mlp_ratio": (int, float),
    "qkv_bias": (bool,), "class_token": (bool,), "global_pool": (str,),
}


def _checked_kwargs(name: str, extra: dict[str, Any]) -> dict[str, Any]:
    """``extra`` if every key is an allowed architecture setting of the right type, else a UserError."""
    for key, value in extra.items():
        types = ARCH_KWARGS.get(key)
        if types is None:
            raise UserError(f"backbone setting {key!r} for {name} is not accepted (allowed: "
                            f"{', '.join(sorted(ARCH_KWARGS))}); re-export the backbone with `moco export`")
        if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
            raise UserError(f"backbone setting {key}={value!r} for {name} must be "
                            f"{' or '.join(t.__name__ for t in types)}; re-export the backbone with `moco export`")
    return dict(extra)


def sincos_2d(grid_h: int, grid_w: int, dim: int, temperature: float = 10000.0) -> torch.Tensor:
    """Fixed 2-D sine-cosine position embedding (MoCo v3): (grid_h * grid_w) x dim, row-major patches.

    As vits.py lays it out on its square grids: sin, cos of the patch row, then sin, cos of its column.
    """
    if dim % 4:
        raise UserError(f"the ViT width {dim} must be a multiple of 4 for the 2-D sin-cos position embedding")
    y, x = torch.meshgrid(
        torch.arange(grid_h, dtype=torch.float32), torch.arange(grid_w, dtype=torch.float32), indexing="ij"
    )  # H x W each
    omega = 1.0 / temperature ** (torch.arange(dim // 4, dtype=torch.float32) / (dim // 4))  # dim/4
    oy = y.flatten()[:, None] * omega[None]  # HW x dim/4
    ox = x.flatten()[:, None] * omega[None]  # HW x dim/4
    return torch.cat([oy.sin(), oy.cos(), ox.sin(), ox.cos()], dim=1)  # HW x dim


def _moco_v3_vit(model: nn.Module) -> None:
    """MoCo v3's ViT (vits.py ``VisionTransformerMoCo``): its weight init, a fixed sin-cos position
    embedding and a frozen random patch projection."""
    with torch.no_grad():
        for name, m in model.named_modules():
            if isinstance(m, nn.Linear):
                if "qkv" in name:  # q, k and v initialized as three separate D x D matrices
                    bound = math.sqrt(6.0 / (m.weight.shape[0] // 3 + m.weight.shape[1]))
                    nn.init.uniform_(m.weight, -bound, bound)
                else:
                    nn.init.xavier_uniform_(m.weight)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
        if getattr(model, "cls_token", None) is not None:
            nn.init.normal_(model.cls_token, std=1e-6)
        proj = model.patch_embed.proj  # D x 3 x p x p: xavier with fan_out D (not D * p * p), as vits.py
        bound = math.sqrt(6.0 / (proj.weight[0].numel() + model.embed_dim))
        nn.init.uniform_(proj.weight, -bound, bound)
        if proj.bias is not None:
            nn.init.zeros_(proj.bias)

        grid_h, grid_w = model.patch_embed.grid_size
        pos = sincos_2d(grid_h, grid_w, model.embed_dim)  # HW x D
        prefix = model.pos_embed.shape[1] - grid_h * grid_w  # class/register tokens that carry a position
        model.pos_embed.copy_(torch.cat([torch.zeros(prefix, pos.shape[1]), pos])[None])  # 1 x (prefix+HW) x D
    model.pos_embed.requires_grad_(False)
    proj.requires_grad_(False)  # stop-gradient on the first layer


class SplitBatchNorm(nn.BatchNorm2d):
    """Batch norm over ``num_splits`` virtual devices (the MoCo CIFAR demo's Shuffle BN on one device).

    In training the batch is cut into ``num_splits`` consecutive chunks, as if each ran on its own
    GPU, and each chunk is normalized with its own statistics; the running statistics are the
    average over chunks. In eval mode it is a plain ``BatchNorm2d``, with the same state-dict keys.

    Consecutive chunks (not the demo's interleaved ``i, i + s, ...`` channel-group reshape) keep
    the input's memory layout: a ``channels_last`` batch stays ``channels_last`` end to end, which
    is what makes that layout the fast one on CPUs too (the reshape forced a layout copy per layer).
    """

    def __init__(self, num_features: int, num_splits: int, **kw) -> None:
        super().__init__(num_features, **kw)
        self.num_splits = num_splits

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.num_splits == 1:
            return super().forward(x)
        s = self.num_splits
        if x.shape[0] % s:
            raise ValueError(f"SplitBatchNorm: batch {x.shape[0]} is not divisible by bn_splits {s}")
        running_mean = self.running_mean.repeat(s).view(s, -1)  # s x C, one row per split
        running_var = self.running_var.repeat(s).view(s, -1)  # s x C
        y = torch.cat(
            [
                nn.functional.batch_norm(
                    chunk,  # N/s x C x H x W, a view in any memory format
                    running_mean[i],
                    running_var[i],
                    self.weight,
                    self.bias,
                    True,
                    self.momentum,
                    self.eps,
                )
                for i, chunk in enumerate(x.chunk(s))
            ]
        )  # N x C x H x W, the input's memory format
        self.running_mean.copy_(running_mean.mean(dim=0))
        self.running_var.copy_(running_var.mean(dim=0))
        self.num_batches_tracked.add_(1)
        return y


def convert_split_bn(module: nn.Module, num_splits: int) -> nn.Module:
    """Replace every plain ``nn.BatchNorm2d`` in ``module`` by a ``SplitBatchNorm`` (weights kept)."""
    if num_splits <= 1:
        return module
    if type(module) is nn.BatchNorm2d:
        new = SplitBatchNorm(
            module.num_features, num_splits, eps=module.eps, momentum=module.momentum, affine=module.affine
        )
        new.load_state_dict(module.state_dict())
        return new
    for name, child in module.named_children():
        setattr(module, name, convert_split_bn(child, num_splits))
    return module
