"""The batched image ops of the augmentation recipes (:mod:`moco.augment`): crop+resize, the color ops and the
Gaussian blur, each on a whole batch with per-sample parameters (no random numbers of their own), formulas as
torchvision's tensor kernels. Internal to :mod:`moco.augment`, which imports them by their names.

Crop+resize is two batched matrix products with per-sample antialiased-bilinear (triangle filter)
resampling matrices, the same weights as torchvision's ``resized_crop(..., antialias=True)``, so
crops match torchvision to float rounding (``torchvision.ops.roi_align`` was measured to be slower on
2 CPU cores for 32 px outputs and only approximates the antialiasing).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

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
