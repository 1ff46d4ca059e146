"""MoCo v1/v2/v3 two-view augmentation recipes as batched tensor ops.

Input is a batch of cached images, a uint8 tensor ``B x S x S x 3`` (HWC, square). Output is a
float32 tensor ``B x 3 x s x s`` normalized with the given mean/std. Every random number is drawn
from an explicit ``torch.Generator`` (never the global RNG) in a fixed order and a fixed amount per
call, whatever the probabilities come out as, so the same generator state gives bit-identical output
on the same device (exact training resume; checked for 1 vs 2 CPU threads, CPU and CUDA results
agree only to float rounding). Random numbers are drawn on the generator's device (normally CPU) and the
small parameter tensors are then moved to the images' device, so CUDA images work with a CPU
generator.

Per-view pipeline (as the torchvision pipelines of the official code):
random resized crop -> color jitter -> grayscale -> Gaussian blur -> solarize -> flip -> normalize.
(``ViewRecipe.gray_before_jitter`` swaps jitter and grayscale, as MoCo v1's official pipeline does.)

Simplifications against torchvision, all per batch rather than per image:
* ColorJitter applies its four ops in one random order drawn once per batch (torchvision draws one
  order per image); the factors themselves are per image.
* The Gaussian blur kernel size is fixed per call (``2 * ceil(3 * sigma_max) + 1``, capped below
  the output size); sigma is per image.

The recipes and their random draws come first; the batched image ops (crop+resize, the color ops, the Gaussian
blur) follow, each on a whole batch with per-sample parameters and no random numbers of their own, formulas as
torchvision's tensor kernels. Crop+resize is two batched matrix products with per-sample antialiased-bilinear
(triangle filter) resampling matrices, the same weights as torchvision's ``resized_crop(..., antialias=True)``, so
crops match torchvision to float rounding (``torchvision.ops.roi_align`` was measured to be slower on 2 CPU cores
for 32 px outputs and only approximates the antialiasing).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import numbers
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from moco.errors import UserError

__all__ = ["RECIPES", "ViewRecipe", "augment", "center_view", "two_views"]

logger = logging.getLogger(__name__)

_RRC_ATTEMPTS = 10  # torchvision RandomResizedCrop tries 10 boxes before falling back to a center crop
_BLUR_REFERENCE_SIZE = 224  # blur_sigma is given in pixels at this output size


@dataclass(frozen=True)
class ViewRecipe:
    """Parameters of one augmentation view (defaults: MoCo v2 "aug+")."""

    crop_scale: tuple[float, float] = (0.2, 1.0)  # RandomResizedCrop area fraction range
    crop_ratio: tuple[float, float] = (3 / 4, 4 / 3)  # RandomResizedCrop aspect ratio (w/h) range
    jitter: tuple[float, float, float, float] = (0.4, 0.4, 0.4, 0.1)  # brightness, contrast, saturation, hue
    jitter_p: float = 0.8
    gray_p: float = 0.2
    blur_p: float = 0.5
    blur_sigma: tuple[float, float] = (0.1, 2.0)  # in pixels at 224 px; scaled by s/224 for other sizes
    solarize_p: float = 0.0
    flip_p: float = 0.5
    gray_before_jitter: bool = False  # MoCo v1's official pipeline applies RandomGrayscale before ColorJitter

    def __post_init__(self) -> None:
        for name in ("jitter_p", "gray_p", "blur_p", "solarize_p", "flip_p"):
            p = getattr(self, name)
            if not 0.0 <= p <= 1.0:
                raise ValueError(f"ViewRecipe.{name} must be in [0, 1], got {p}")
        lo, hi = self.crop_scale
        if not 0.0 < lo <= hi <= 1.0:
            raise ValueError(f"ViewRecipe.crop_scale must satisfy 0 < lo <= hi <= 1, got {self.crop_scale}")
        lo, hi = self.crop_ratio
        if not 0.0 < lo <= hi:
            raise ValueError(f"ViewRecipe.crop_ratio must satisfy 0 < lo <= hi, got {self.crop_ratio}")
        if len(self.jitter) != 4 or min(self.jitter) < 0.0 or self.jitter[3] > 0.5:
            raise ValueError(f"ViewRecipe.jitter must be 4 values >= 0 with hue <= 0.5, got {self.jitter}")
        lo, hi = self.blur_sigma
        if not 0.0 < lo <= hi:
            raise ValueError(f"ViewRecipe.blur_sigma must satisfy 0 < lo <= hi, got {self.blur_sigma}")


_V1 = ViewRecipe(
    crop_scale=(0.2, 1.0),
    jitter=(0.4, 0.4, 0.4, 0.4),
    jitter_p=1.0,
    gray_p=0.2,
    blur_p=0.0,
    gray_before_jitter=True,
)
_V2 = ViewRecipe()
# MoCo v3: main_moco.py's --crop-min is 0.08 by default (its ViT commands) and 0.2 in CONFIG.md's ResNet-50 commands
_V3_Q = ViewRecipe(crop_scale=(0.2, 1.0), jitter=(0.4, 0.4, 0.2, 0.1), jitter_p=0.8, gray_p=0.2, blur_p=1.0)
_V3_K = dataclasses.replace(_V3_Q, blur_p=0.1, solarize_p=0.2)
_V3_VIT_Q, _V3_VIT_K = (dataclasses.replace(v, crop_scale=(0.08, 1.0)) for v in (_V3_Q, _V3_K))

RECIPES: dict[str, tuple[ViewRecipe, ViewRecipe]] = {
    "v1": (_V1, _V1),  # MoCo v1 (He et al. 2019; official main_moco.py without --aug-plus)
    "v2": (_V2, _V2),  # MoCo v2 "aug+" (Chen et al. 2020; official main_moco.py --aug-plus)
    "v3": (_V3_Q, _V3_K),  # MoCo v3 (Chen et al. 2021; official moco-v3): asymmetric BYOL-style views, ResNets
    "v3-vit": (_V3_VIT_Q, _V3_VIT_K),  # the same for ViTs, with the default --crop-min 0.08
}


# ----------------------------------------------------------------------------------------------
# validation and conversion


def _check_images(images: Tensor) -> None:
    if not isinstance(images, Tensor):
        raise ValueError(f"images must be a torch.Tensor, got {type(images).__name__}")
    if images.dtype != torch.uint8:
        raise ValueError(f"images must have dtype torch.uint8, got {images.dtype} (shape {tuple(images.shape)})")
    if images.ndim != 4 or images.shape[3] != 3 or images.shape[1] != images.shape[2]:
        raise ValueError(f"images must have shape [B, S, S, 3] (square HWC RGB), got {tuple(images.shape)}")


def _check_generator(generator: torch.Generator) -> None:
    if not isinstance(generator, torch.Generator):
        raise ValueError(f"generator must be a torch.Generator, got {type(generator).__name__}")


def _check_size(size: int) -> int:
    if isinstance(size, bool) or not isinstance(size, numbers.Integral) or size < 1:
        raise ValueError(f"size must be a positive int, got {size!r}")
    return int(size)


def _stats(values: Sequence[float], name: str, device: torch.device) -> Tensor:
    if len(values) != 3:
        raise ValueError(f"{name} must have 3 values (R, G, B), got {len(values)}")
    t = torch.tensor([float(v) for v in values], dtype=torch.float32)  # 3
    if name == "std" and bool((t == 0).any()):
        raise ValueError(f"std must be non-zero, got {list(values)}")
    return t.view(1, 3, 1, 1).to(device)  # 1 x 3 x 1 x 1


def _normalize_(x: Tensor, mean: Sequence[float], std: Sequence[float]) -> Tensor:
    m = _stats(mean, "mean", x.device)  # 1 x 3 x 1 x 1
    sd = _stats(std, "std", x.device)  # 1 x 3 x 1 x 1
    return x.sub_(m).div_(sd)  # B x 3 x s x s


# ----------------------------------------------------------------------------------------------
# random resized crop: its boxes (the crop itself: moco.data.augment)


def _sample_boxes(u_scale: Tensor, u_ratio: Tensor, u_pos: Tensor, height: int, width: int, view: ViewRecipe) -> Tensor:
    """Vectorized torchvision RandomResizedCrop.get_params.

    ``u_scale``, ``u_ratio``: B x 10 uniforms in [0, 1) (one per attempt); ``u_pos``: B x 2 uniforms.
    Returns float64 boxes B x 4 as (x1, y1, x2, y2) in pixels with x2 = x1 + w (integer valued).
    The first valid attempt is used; with none valid, a center crop with ratio clamped to crop_ratio.
    """
    area = float(height * width)
    s_lo, s_hi = view.crop_scale
    log_lo, log_hi = math.log(view.crop_ratio[0]), math.log(view.crop_ratio[1])
    target = area * (s_lo + (s_hi - s_lo) * u_scale.double())  # B x 10
    aspect = torch.exp(log_lo + (log_hi - log_lo) * u_ratio.double())  # B x 10
    w = torch.round(torch.sqrt(target * aspect))  # B x 10
    h = torch.round(torch.sqrt(target / aspect))  # B x 10
    valid = (w > 0) & (w <= width) & (h > 0) & (h <= height)  # B x 10
    first = valid.to(torch.uint8).argmax(dim=1, keepdim=True)  # B x 1 (first valid attempt)
    found = valid.any(dim=1)  # B
    w = w.gather(1, first).squeeze(1)  # B
    h = h.gather(1, first).squeeze(1)  # B

    # fallback: central crop with the aspect ratio clamped into crop_ratio
    in_ratio = width / height
    if in_ratio < view.crop_ratio[0]:
        fw, fh = width, int(round(width / view.crop_ratio[0]))
    elif in_ratio > view.crop_ratio[1]:
        fw, fh = int(round(height * view.crop_ratio[1])), height
    else:
        fw, fh = width, height
    w = torch.where(found, w, torch.full_like(w, fw))  # B
    h = torch.where(found, h, torch.full_like(h, fh))  # B

    u_pos = u_pos.double()
    top = torch.minimum(torch.floor(u_pos[:, 0] * (height - h + 1)), height - h)  # B
    left = torch.minimum(torch.floor(u_pos[:, 1] * (width - w + 1)), width - w)  # B
    top = torch.where(found, top, torch.full_like(top, (height - fh) // 2))  # B
    left = torch.where(found, left, torch.full_like(left, (width - fw) // 2))  # B
    return torch.stack([left, top, left + w, top + h], dim=1)  # B x 4


# ----------------------------------------------------------------------------------------------
# pipeline


def _apply_subset(x: Tensor, mask: Tensor, fn: Callable[[Tensor, Tensor], Tensor]) -> Tensor:
    """Replace ``x[i]`` by ``fn(x[idx], idx)[...]`` for the samples where ``mask`` (CPU, B) is true.

    ``fn`` gets the selected samples (K x 3 x s x s) and their indices (K, CPU long tensor).
    """
    idx = mask.nonzero().squeeze(1)  # K (CPU)
    if idx.numel() == 0:
        return x
    if idx.numel() == x.shape[0]:
        return fn(x, idx)
    dev_idx = idx.to(x.device)
    x[dev_idx] = fn(x[dev_idx], idx)  # K x 3 x s x s
    return x


def _augment_hwc(x: Tensor, view: ViewRecipe, size: int, generator: torch.Generator) -> Tensor:
    """Run one view on images ``x`` (B x S x S x 3, uint8 or float in [0, 255]); returns B x 3 x s x s in [0, 1]."""
    b, height, width, _ = x.shape
    dev = x.device
    gdev = generator.device

    # All random numbers for this call, drawn up front in one fixed layout.
    u = torch.rand(b, 2 * _RRC_ATTEMPTS + 13, generator=generator, device=gdev).cpu()  # B x 33
    perm = torch.randperm(4, generator=generator, device=gdev).tolist()  # jitter op order for the batch
    u_scale = u[:, :_RRC_ATTEMPTS]  # B x 10
    u_ratio = u[:, _RRC_ATTEMPTS : 2 * _RRC_ATTEMPTS]  # B x 10
    rest = u[:, 2 * _RRC_ATTEMPTS :]  # B x 13
    u_pos = rest[:, 0:2]  # B x 2
    jitter_mask = rest[:, 2] < view.jitter_p  # B
    u_jitter = rest[:, 3:7]  # B x 4
    gray_mask = rest[:, 7] < view.gray_p  # B
    blur_mask = rest[:, 8] < view.blur_p  # B
    u_sigma = rest[:, 9]  # B
    solarize_mask = rest[:, 10] < view.solarize_p  # B
    flip_mask = rest[:, 11] < view.flip_p  # B
    # rest[:, 12] is reserved (keeps the layout stable if another op is added)

    boxes = _sample_boxes(u_scale, u_ratio, u_pos, height, width, view)  # B x 4
    x = _crop_resize(x, boxes, size, scale=1.0 / 255.0)  # B x 3 x s x s

    # per-sample jitter factors: brightness/contrast/saturation in [max(0, 1-j), 1+j], hue in [-j, j]
    jb, jc, js, jh = view.jitter
    lo = torch.tensor([max(0.0, 1.0 - jb), max(0.0, 1.0 - jc), max(0.0, 1.0 - js), -jh])  # 4
    hi = torch.tensor([1.0 + jb, 1.0 + jc, 1.0 + js, jh])  # 4
    factors = (lo + (hi - lo) * u_jitter).to(dev)  # B x 4
    ops: list[Callable[[Tensor, Tensor], Tensor]] = [
        _adjust_brightness,
        _adjust_contrast,
        _adjust_saturation,
        _adjust_hue,
    ]
    active = [i for i in perm if view.jitter[i] > 0.0]

    def jitter_fn(sub: Tensor, idx: Tensor) -> Tensor:
        f = factors[idx.to(dev)]  # K x 4
        for i in active:
            sub = ops[i](sub, f[:, i].view(-1, 1, 1, 1))  # K x 3 x s x s
        return sub

    def gray_fn(sub: Tensor, idx: Tensor) -> Tensor:
        return _grayscale(sub).expand(-1, 3, -1, -1).contiguous()  # K x 3 x s x s

    if view.gray_before_jitter:
        x = _apply_subset(x, gray_mask, gray_fn)  # B x 3 x s x s
        x = _apply_subset(x, jitter_mask, jitter_fn)  # B x 3 x s x s
    else:
        x = _apply_subset(x, jitter_mask, jitter_fn)  # B x 3 x s x s
        x = _apply_subset(x, gray_mask, gray_fn)  # B x 3 x s x s

    scale = size / _BLUR_REFERENCE_SIZE
    s_lo, s_hi = view.blur_sigma[0] * scale, view.blur_sigma[1] * scale
    sigma = (s_lo + (s_hi - s_lo) * u_sigma).to(dev)  # B
    ksize = _blur_kernel_size(s_hi, size)
    x = _apply_subset(x, blur_mask, lambda sub, idx: _gaussian_blur(sub, sigma[idx.to(dev)], ksize))  # B x 3 x s x s

    x = _apply_subset(x, solarize_mask, lambda sub, idx: _solarize(sub))  # B x 3 x s x s

    x = _apply_subset(x, flip_mask, lambda sub, idx: sub.flip(-1))  # B x 3 x s x s
    return x


def augment(
    images: Tensor,
    view: ViewRecipe,
    size: int,
    mean: Sequence[float],
    std: Sequence[float],
    generator: torch.Generator,
    normalize: bool = True,
) -> Tensor:
    """One random view of each image: uint8 B x S x S x 3 -> float32 B x 3 x size x size.

    With ``normalize=False`` the output is in [0, 1]; otherwise ``(x - mean) / std`` per channel.
    """
    _check_images(images)
    size = _check_size(size)
    _check_generator(generator)
    if not isinstance(view, ViewRecipe):
        raise ValueError(f"view must be a ViewRecipe, got {type(view).__name__}")
    x = _augment_hwc(images, view, size, generator)  # B x 3 x s x s
    if normalize:
        x = _normalize_(x, mean, std)  # B x 3 x s x s
    return x.contiguous()


def two_views(
    images: Tensor,
    recipe: str,
    size: int,
    mean: Sequence[float],
    std: Sequence[float],
    generator: torch.Generator,
    crop_min: float = 0.0,
) -> tuple[Tensor, Tensor]:
    """The (query, key) views of a MoCo recipe ("v1", "v2", "v3", "v3-vit"), each float32 B x 3 x size x size.

    The query view is drawn first, then the key view, from the same generator. ``crop_min`` (0: the
    recipe's) replaces the smallest crop area fraction of both views, as moco-v3's ``--crop-min``.
    """
    if recipe not in RECIPES:
        raise UserError(f"unknown augmentation recipe {recipe!r}; valid recipes: {', '.join(sorted(RECIPES))}")
    _check_images(images)
    size = _check_size(size)
    _check_generator(generator)
    view_q, view_k = RECIPES[recipe]
    if crop_min:
        view_q, view_k = (dataclasses.replace(v, crop_scale=(crop_min, 1.0)) for v in (view_q, view_k))
    logger.debug("two_views: recipe %s, %s images %s -> size %d", recipe, images.device, tuple(images.shape), size)
    x = images.to(torch.float32)  # B x S x S x 3, converted once for both views
    q = _normalize_(_augment_hwc(x, view_q, size, generator), mean, std)  # B x 3 x s x s
    k = _normalize_(_augment_hwc(x, view_k, size, generator), mean, std)  # B x 3 x s x s
    return q.contiguous(), k.contiguous()


def center_view(images: Tensor, size: int, mean: Sequence[float], std: Sequence[float]) -> Tensor:
    """Deterministic eval view: uint8 B x S x S x 3 -> normalized float32 B x 3 x size x size.

    Takes the central square of side ``min(S, size)`` and, if that side differs from ``size``
    (only when S < size), resizes it to ``size`` (bilinear, antialiased). The cache stores images at
    S = round(size * 8 / 7) (256 for 224), so this is the standard "resize 256, center crop 224".
    """
    _check_images(images)
    size = _check_size(size)
    s_cache = images.shape[1]
    side = min(s_cache, size)
    top = int(round((s_cache - side) / 2.0))  # as torchvision center_crop
    crop = images[:, top : top + side, top : top + side, :]  # B x side x side x 3
    x = crop.permute(0, 3, 1, 2).to(torch.float32).contiguous().mul_(1.0 / 255.0)  # B x 3 x side x side
    if side != size:
        x = F.interpolate(x, size=(size, size), mode="bilinear", align_corners=False, antialias=True)  # B x 3 x s x s
    return _normalize_(x, mean, std).contiguous()  # B x 3 x s x s


# Luma weights exactly as torchvision's rgb_to_grayscale (ITU-R 601-2 with 0.2989 for red).
_GRAY_WEIGHTS = (0.2989, 0.587, 0.114)


# ----------------------------------------------------------------------------------------------
# crop and resize


def _resize_weights(start: Tensor, length: Tensor, in_size: int, out_size: int) -> Tensor:
    """Per-sample resampling matrices, B x out_size x in_size (float32, rows sum to 1).

    Row i resamples the crop ``[start, start + length)`` (B each, pixel units) of an axis of
    ``in_size`` pixels to ``out_size`` pixels exactly as ``interpolate(mode="bilinear",
    antialias=True, align_corners=False)`` of the cropped image: a triangle filter centered at
    ``start + (i + 0.5) * scale`` (``scale = length / out_size``) whose half-width is
    ``max(scale, 1)``, restricted to pixels inside the crop and normalized. For upscaling this is
    plain bilinear interpolation with edge clamping.
    """
    scale = length / out_size  # B
    support = scale.clamp(min=1.0)  # B
    i = torch.arange(out_size, dtype=torch.float32, device=start.device)  # out
    center = start.unsqueeze(1) + (i + 0.5) * scale.unsqueeze(1)  # B x out
    pix = torch.arange(in_size, dtype=torch.float32, device=start.device) + 0.5  # in (pixel centers)
    w = (pix - center.unsqueeze(2)).abs_().div_(support.view(-1, 1, 1)).neg_().add_(1.0).clamp_(min=0.0)  # B x out x in
    inside = (pix > start.unsqueeze(1)) & (pix < (start + length).unsqueeze(1))  # B x in
    w.mul_(inside.unsqueeze(1))  # B x out x in
    return w.div_(w.sum(dim=2, keepdim=True))  # B x out x in


def _crop_resize(images: Tensor, boxes: Tensor, size: int, scale: float = 1.0) -> Tensor:
    """Crop box ``b`` of image ``b`` and resize it to ``size x size`` (antialiased bilinear).

    ``images``: B x H x W x C, uint8 or float (HWC, as cached); ``boxes``: B x 4 (x1, y1, x2, y2)
    in pixel units, x2 = x1 + w. Returns float32 B x C x s x s, multiplied by ``scale``.
    Equals torchvision ``resized_crop(img, y1, x1, h, w, [s, s], antialias=True)`` up to float rounding.
    """
    b, height, width, c = images.shape
    boxes = boxes.to(device=images.device, dtype=torch.float32)  # B x 4
    x1, y1, x2, y2 = boxes.unbind(dim=1)  # B each
    wy = _resize_weights(y1, y2 - y1, height, size).mul_(scale)  # B x s x H
    wx = _resize_weights(x1, x2 - x1, width, size)  # B x s x W
    x = images.reshape(b, height, width * c).to(torch.float32)  # B x H x (W*C)
    t = torch.bmm(wy, x)  # B x s x (W*C)
    t = t.view(b, size, width, c).permute(0, 3, 1, 2).reshape(b, c * size, width)  # B x (C*s) x W
    out = torch.bmm(t, wx.transpose(1, 2))  # B x (C*s) x s
    return out.view(b, c, size, size)  # B x C x s x s


# ----------------------------------------------------------------------------------------------
# color ops (per-sample factors, formulas as torchvision's tensor kernels)


def _grayscale(x: Tensor) -> Tensor:
    """Luma of ``x`` (N x 3 x H x W) as N x 1 x H x W."""
    r, g, b = x.unbind(dim=1)  # N x H x W each
    gray = r.mul(_GRAY_WEIGHTS[0]).add_(g, alpha=_GRAY_WEIGHTS[1]).add_(b, alpha=_GRAY_WEIGHTS[2])  # N x H x W
    return gray.unsqueeze(1)  # N x 1 x H x W


def _blend(x: Tensor, other: Tensor, ratio: Tensor) -> Tensor:
    """torchvision ``_blend`` with a per-sample ratio (N x 1 x 1 x 1): ``ratio*x + (1-ratio)*other``."""
    return x.mul(ratio).add_(other * (1.0 - ratio)).clamp_(0.0, 1.0)  # N x 3 x H x W


def _adjust_brightness(x: Tensor, factor: Tensor) -> Tensor:
    return x.mul(factor).clamp_(0.0, 1.0)  # N x 3 x H x W


def _adjust_contrast(x: Tensor, factor: Tensor) -> Tensor:
    mean = _grayscale(x).mean(dim=(-3, -2, -1), keepdim=True)  # N x 1 x 1 x 1
    return _blend(x, mean, factor)  # N x 3 x H x W


def _adjust_saturation(x: Tensor, factor: Tensor) -> Tensor:
    return _blend(x, _grayscale(x), factor)  # N x 3 x H x W


def _adjust_hue(x: Tensor, factor: Tensor) -> Tensor:
    """Shift hue by ``factor`` (N x 1 x 1 x 1, in [-0.5, 0.5]) as torchvision's ``adjust_hue``.

    RGB -> HSV -> shift hue mod 1 -> RGB, fused: HSV keeps max (v) and max - min (v*s), so the
    output is ``c_n = max - (max - min) * clamp(min(k, 4 - k), 0, 1)`` with ``k = (n + 6h) mod 6``
    and n = 5, 3, 1 for R, G, B (closed-form HSV -> RGB); ``min(k, 4 - k) = 2 - |k - 2|``.
    Equal to torchvision up to float rounding. Uses arithmetic masks and ``floor`` instead of
    ``torch.where`` / ``torch.remainder``, which are several times slower on CPU.
    """
    r, g, b = x.unbind(dim=1)  # N x H x W each
    maxc = torch.maximum(torch.maximum(r, g), b)  # N x H x W
    minc = torch.minimum(torch.minimum(r, g), b)  # N x H x W
    delta = maxc - minc  # N x H x W
    inv = (delta + (delta == 0).to(x.dtype)).reciprocal_()  # N x H x W; gray pixels get hue 0 like torchvision
    is_r = (maxc == r).to(x.dtype)  # N x H x W; red is the max
    is_g = (maxc == g).to(x.dtype).sub_(is_r).clamp_(min=0.0)  # N x H x W; green is the max, red is not
    is_b = 1.0 - is_r - is_g  # N x H x W
    # 6 * hue in [-1, 5): red sector (g-b)/d, green sector 2 + (b-r)/d, blue sector 4 + (r-g)/d
    h6 = (g - b).mul_(is_r)  # N x H x W
    h6.addcmul_((b - r).add_(delta, alpha=2.0), is_g)
    h6.addcmul_((r - g).add_(delta, alpha=4.0), is_b)
    h6.mul_(inv).add_(factor.view(-1, 1, 1) * 6.0)  # N x H x W, shifted
    out = torch.empty_like(x)  # N x 3 x H x W
    for c, n in enumerate((5.0, 3.0, 1.0)):
        k = h6 + n  # N x H x W
        k.sub_(torch.floor(k * (1.0 / 6.0)), alpha=6.0)  # k mod 6, in [0, 6)
        t = k.sub_(2.0).abs_().neg_().add_(2.0).clamp_(0.0, 1.0)  # N x H x W
        torch.addcmul(maxc, delta, t, value=-1.0, out=out[:, c])  # N x H x W
    return out.clamp_(0.0, 1.0)  # N x 3 x H x W


def _solarize(x: Tensor) -> Tensor:
    """Invert pixels >= 0.5: ``where(x >= 0.5, 1 - x, x)``, which equals ``min(x, 1 - x)`` exactly."""
    return torch.minimum(x, 1.0 - x)  # N x 3 x H x W


# ----------------------------------------------------------------------------------------------
# Gaussian blur


def _blur_kernel_size(sigma_max: float, size: int) -> int:
    """Odd kernel size ``2*ceil(3*sigma_max)+1``, capped below the image size (at least 1)."""
    k = 2 * math.ceil(3.0 * sigma_max) + 1
    cap = size - 1 if size % 2 == 0 else size - 2  # largest odd number < size
    return max(1, min(k, cap))


def _gaussian_kernels(sigma: Tensor, kernel_size: int) -> Tensor:
    """Normalized 1-D Gaussian kernels, N x K, for per-sample sigmas (N), centered on K//2."""
    half = (kernel_size - 1) / 2.0
    t = torch.linspace(-half, half, kernel_size, dtype=torch.float32, device=sigma.device)  # K
    logits = -0.5 * (t.unsqueeze(0) / sigma.unsqueeze(1)) ** 2  # N x K
    return torch.softmax(logits, dim=1)  # N x K


def _gaussian_blur(x: Tensor, sigma: Tensor, kernel_size: int) -> Tensor:
    """Separable per-sample Gaussian blur with reflect padding (as torchvision's ``gaussian_blur``).

    ``x``: N x C x H x W; ``sigma``: N (on x's device). Returns N x C x H x W. Implemented as
    ``kernel_size`` shifted multiply-adds per axis, faster on CPU than a grouped convolution
    with per-sample kernels for the small kernels used here.
    """
    n, _, height, width = x.shape
    if kernel_size <= 1 or n == 0:
        return x
    pad = kernel_size // 2
    kern = _gaussian_kernels(sigma, kernel_size).view(n, kernel_size, 1, 1, 1)  # N x K x 1 x 1 x 1
    xp = F.pad(x, (pad, pad, pad, pad), mode="reflect")  # N x C x (H+2p) x (W+2p)
    rows = xp[..., 0:width] * kern[:, 0]  # N x C x (H+2p) x W
    for i in range(1, kernel_size):
        rows.addcmul_(xp[..., i : i + width], kern[:, i])
    out = rows[:, :, 0:height] * kern[:, 0]  # N x C x H x W
    for i in range(1, kernel_size):
        out.addcmul_(rows[:, :, i : i + height], kern[:, i])
    return out
