"""Tests for moco.data.augment: batched MoCo augmentations against torchvision references."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch
import torch.nn.functional as F
import torchvision.transforms.v2.functional as TF
from torchvision.transforms import RandomResizedCrop

from moco.data import augment as A
from moco.data.augment import RECIPES, ViewRecipe, augment, center_view, two_views

MEAN = (0.485, 0.456, 0.406)
STD = (0.229, 0.224, 0.225)
ZERO = (0.0, 0.0, 0.0)
ONE = (1.0, 1.0, 1.0)

# A view that does nothing but crop the whole image (and resizes it to the requested size).
IDENTITY = ViewRecipe(
    crop_scale=(1.0, 1.0),
    crop_ratio=(1.0, 1.0),
    jitter_p=0.0,
    gray_p=0.0,
    blur_p=0.0,
    solarize_p=0.0,
    flip_p=0.0,
)


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def random_images(b: int, s: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (b, s, s, 3), dtype=torch.uint8, generator=g)  # B x S x S x 3


def smooth_image(s: int) -> torch.Tensor:
    """Smooth colorful float image 3 x s x s in [0, 1]."""
    yy, xx = torch.meshgrid(torch.linspace(0, 1, s), torch.linspace(0, 1, s), indexing="ij")
    return torch.stack(
        [0.5 + 0.5 * torch.sin(6 * xx + 2 * yy), 0.5 + 0.5 * torch.cos(5 * yy - 3 * xx), xx * yy]
    )  # 3 x s x s


def color_image(seed: int = 0, s: int = 16) -> torch.Tensor:
    """Random float image 3 x s x s in [0, 1] with gray pixels and channel ties mixed in."""
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(3, s, s, generator=g)  # 3 x s x s
    x[:, 0, :] = x[0:1, 0, :]  # a gray row
    x[1, 1, :] = x[0, 1, :]  # r == g ties
    x[2, 2, :] = x[1, 2, :]  # g == b ties
    x[:, 3, :4] = torch.tensor([1.0, 0.0, 0.0]).view(3, 1)  # saturated red
    return x


# ----------------------------------------------------------------------------------------------
# recipes end to end


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_two_views_shapes_dtype_finite(recipe: str) -> None:
    images = random_images(6, 37)
    q, k = two_views(images, recipe, 32, MEAN, STD, gen())
    for v in (q, k):
        assert v.shape == (6, 3, 32, 32)
        assert v.dtype == torch.float32
        assert v.is_contiguous()
        assert torch.isfinite(v).all()
    assert not torch.equal(q, k)


@pytest.mark.parametrize("recipe", sorted(RECIPES))
@pytest.mark.parametrize(("s_cache", "size"), [(37, 32), (20, 32), (64, 24)])
def test_unnormalized_views_in_unit_range(recipe: str, s_cache: int, size: int) -> None:
    images = random_images(8, s_cache, seed=1)
    g = gen(3)
    for view in RECIPES[recipe]:
        x = augment(images, view, size, MEAN, STD, g, normalize=False)
        assert x.shape == (8, 3, size, size)
        assert x.dtype == torch.float32
        assert x.min() >= 0.0 and x.max() <= 1.0


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_same_seed_bit_identical_different_seed_differs(recipe: str) -> None:
    images = random_images(8, 37, seed=2)
    q1, k1 = two_views(images, recipe, 32, MEAN, STD, gen(7))
    q2, k2 = two_views(images, recipe, 32, MEAN, STD, gen(7))
    q3, k3 = two_views(images, recipe, 32, MEAN, STD, gen(8))
    assert torch.equal(q1, q2) and torch.equal(k1, k2)
    assert not torch.equal(q1, q3)
    assert not torch.equal(k1, k3)


@pytest.mark.parametrize("recipe", ["v2", "v3"])
def test_crop_min_replaces_the_smallest_crop_of_both_views(recipe: str) -> None:
    images = random_images(8, 37, seed=9)
    q, k = two_views(images, recipe, 32, MEAN, STD, gen(4), crop_min=0.6)
    g = gen(4)  # the same draws, made by hand: each view of the recipe with crop_scale (0.6, 1)
    view_q, view_k = (dataclasses.replace(v, crop_scale=(0.6, 1.0)) for v in RECIPES[recipe])
    assert torch.equal(q, augment(images, view_q, 32, MEAN, STD, g))
    assert torch.equal(k, augment(images, view_k, 32, MEAN, STD, g))
    q0, k0 = two_views(images, recipe, 32, MEAN, STD, gen(4))  # 0: the recipe's own 0.2
    assert not torch.equal(q, q0) and not torch.equal(k, k0)


def test_generator_state_resume_and_global_rng_untouched() -> None:
    images = random_images(4, 37, seed=3)
    g = gen(11)
    two_views(images, "v2", 32, MEAN, STD, g)  # advance the generator
    state = g.get_state()
    torch.manual_seed(123)
    global_state = torch.get_rng_state()
    a = two_views(images, "v2", 32, MEAN, STD, g)
    assert torch.equal(torch.get_rng_state(), global_state)
    g2 = torch.Generator()
    g2.set_state(state)
    b = two_views(images, "v2", 32, MEAN, STD, g2)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_normalize_applies_mean_std() -> None:
    images = random_images(4, 37, seed=4)
    raw = augment(images, RECIPES["v2"][0], 32, MEAN, STD, gen(5), normalize=False)
    norm = augment(images, RECIPES["v2"][0], 32, MEAN, STD, gen(5), normalize=True)
    expected = (raw - torch.tensor(MEAN).view(1, 3, 1, 1)) / torch.tensor(STD).view(1, 3, 1, 1)
    torch.testing.assert_close(norm, expected, rtol=0, atol=1e-5)


def test_recipe_parameters_follow_papers() -> None:
    v1q, v1k = RECIPES["v1"]
    assert v1q == v1k and v1q.jitter == (0.4, 0.4, 0.4, 0.4) and v1q.jitter_p == 1.0
    assert v1q.blur_p == 0.0 and v1q.crop_scale == (0.2, 1.0) and v1q.gray_before_jitter
    v2q, v2k = RECIPES["v2"]
    assert v2q == v2k == ViewRecipe()
    assert v2q.jitter == (0.4, 0.4, 0.4, 0.1) and v2q.jitter_p == 0.8 and v2q.blur_p == 0.5
    v3q, v3k = RECIPES["v3"]
    assert v3q.crop_scale == v3k.crop_scale == (0.2, 1.0)  # ResNets (CONFIG.md --crop-min=.2); ViTs: "v3-vit"
    assert RECIPES["v3-vit"] == tuple(dataclasses.replace(v, crop_scale=(0.08, 1.0)) for v in (v3q, v3k))
    assert v3q.jitter == v3k.jitter == (0.4, 0.4, 0.2, 0.1)
    assert (v3q.blur_p, v3q.solarize_p) == (1.0, 0.0)
    assert (v3k.blur_p, v3k.solarize_p) == (0.1, 0.2)


def test_v3_solarizes_only_the_key_view() -> None:
    # White images: jitter (brightness >= 0.6; contrast/saturation/hue leave a constant gray image
    # unchanged), grayscale, blur and flip keep every pixel >= 0.6; only solarize maps them to <= 0.4.
    images = torch.full((2000, 8, 8, 3), 255, dtype=torch.uint8)
    g = gen(12)
    view_q, view_k = RECIPES["v3"]
    q = augment(images, view_q, 8, ZERO, ONE, g, normalize=False)
    k = augment(images, view_k, 8, ZERO, ONE, g, normalize=False)
    assert (q.amin(dim=(1, 2, 3)) >= 0.6 - 1e-6).all()
    solarized = k.amax(dim=(1, 2, 3)) <= 0.4 + 1e-6
    assert abs(solarized.float().mean().item() - 0.2) < 0.05
    assert ((k.amin(dim=(1, 2, 3)) >= 0.6 - 1e-6) | solarized).all()


def test_identity_view_reproduces_input() -> None:
    images = random_images(5, 16, seed=5)
    x = augment(images, IDENTITY, 16, ZERO, ONE, gen(), normalize=False)
    torch.testing.assert_close(x, images.permute(0, 3, 1, 2).float() / 255, rtol=0, atol=1e-6)


def test_empty_batch() -> None:
    images = torch.zeros((0, 16, 16, 3), dtype=torch.uint8)
    q, k = two_views(images, "v3", 8, MEAN, STD, gen())
    assert q.shape == k.shape == (0, 3, 8, 8)


# ----------------------------------------------------------------------------------------------
# random resized crop


@pytest.mark.parametrize(
    ("s_cache", "box", "size"),
    [
        (37, (3, 5, 17, 20), 32),  # upscale (left, top, width, height)
        (37, (0, 0, 37, 37), 32),  # mild downscale of the whole image
        (64, (4, 10, 50, 40), 24),  # stronger downscale
        (40, (10, 3, 30, 36), 40),  # mixed
        (256, (20, 7, 200, 230), 224),  # the ImageNet configuration
    ],
)
@pytest.mark.parametrize("content", ["smooth", "noise"])
def test_crop_resize_matches_torchvision(s_cache: int, box: tuple[int, int, int, int], size: int, content: str) -> None:
    img = smooth_image(s_cache) if content == "smooth" else torch.rand(3, s_cache, s_cache, generator=gen(1))
    left, top, w, h = box
    boxes = torch.tensor([[left, top, left + w, top + h]], dtype=torch.float64)  # 1 x 4
    ours = A._crop_resize(img.permute(1, 2, 0).unsqueeze(0), boxes, size)[0]  # 3 x s x s
    ref = TF.resized_crop(img, top, left, h, w, [size, size], antialias=True)  # 3 x s x s
    assert ours.shape == ref.shape
    diff = (ours - ref).abs()
    assert diff.mean() < 1e-5
    assert diff.max() < 1e-4


def test_crop_resize_batch_uses_own_box_and_scale() -> None:
    x = torch.stack([smooth_image(20), smooth_image(20).flip(-1)])  # 2 x 3 x 20 x 20
    boxes = torch.tensor([[0, 0, 10, 10], [5, 5, 20, 20]], dtype=torch.float64)
    out = A._crop_resize((x * 255).permute(0, 2, 3, 1), boxes, 10, scale=1 / 255)  # 2 x 3 x 10 x 10
    torch.testing.assert_close(out[0], x[0, :, 0:10, 0:10], rtol=0, atol=1e-5)
    ref = TF.resized_crop(x[1], 5, 5, 15, 15, [10, 10], antialias=True)
    assert (out[1] - ref).abs().max() < 1e-4
    as_uint8 = A._crop_resize(torch.full((1, 4, 4, 3), 255, dtype=torch.uint8), boxes[:1] / 5 * 2, 3, 1 / 255)
    torch.testing.assert_close(as_uint8, torch.ones(1, 3, 3, 3))


@pytest.mark.parametrize("view", [RECIPES["v2"][0], RECIPES["v3"][0]])
def test_sampled_boxes_inside_image_and_area_in_range(view: ViewRecipe) -> None:
    b, s = 4000, 256
    g = gen(21)
    u = torch.rand(b, 22, generator=g)
    boxes = A._sample_boxes(u[:, :10], u[:, 10:20], u[:, 20:22], s, s, view)  # B x 4
    x1, y1, x2, y2 = boxes.unbind(1)
    assert torch.equal(boxes, boxes.round())
    assert (x1 >= 0).all() and (y1 >= 0).all() and (x2 <= s).all() and (y2 <= s).all()
    w, h = x2 - x1, y2 - y1
    assert (w >= 1).all() and (h >= 1).all()
    frac = w * h / (s * s)
    lo, hi = view.crop_scale
    assert frac.min() >= lo * 0.97 and frac.max() <= hi
    ratio = w / h
    assert ratio.min() >= view.crop_ratio[0] * 0.97 and ratio.max() <= view.crop_ratio[1] * 1.03
    # positions are spread over the free range, not pinned to a corner or the center
    assert (x1 == 0).float().mean() < 0.5 and ((x1 + x2) / 2 != s / 2).float().mean() > 0.5
    # same distribution as torchvision's RandomResizedCrop.get_params (large crops with extreme
    # ratios are rejected there too, which lowers the mean area below (lo + hi) / 2)
    torch.manual_seed(0)
    img = torch.zeros(3, s, s)
    ref = torch.tensor(
        [RandomResizedCrop.get_params(img, list(view.crop_scale), list(view.crop_ratio))[2:] for _ in range(2000)],
        dtype=torch.float64,
    )  # 2000 x 2 (h, w)
    ref_frac = ref[:, 0] * ref[:, 1] / (s * s)
    assert abs(frac.mean().item() - ref_frac.mean().item()) < 0.02
    assert abs(frac.std().item() - ref_frac.std().item()) < 0.02
    assert abs(torch.log(ratio).std().item() - torch.log(ref[:, 1] / ref[:, 0]).std().item()) < 0.02


def test_sampled_boxes_fallback_is_center_crop_with_clamped_ratio() -> None:
    # Aspect ratios 2..3 at full area never fit a square image: torchvision falls back to a center
    # crop with the ratio clamped to 2: w = S, h = round(S / 2).
    view = dataclasses.replace(IDENTITY, crop_ratio=(2.0, 3.0))
    u = torch.rand(5, 22, generator=gen(1))
    boxes = A._sample_boxes(u[:, :10], u[:, 10:20], u[:, 20:22], 21, 21, view)
    expected = torch.tensor([[0.0, 5.0, 21.0, 15.0]], dtype=torch.float64).expand(5, 4)  # h = round(10.5) = 10
    torch.testing.assert_close(boxes, expected)


def test_sampled_boxes_first_valid_attempt_is_used() -> None:
    # S = 16, target area 64. Attempt 0: ratio ~16 -> w = 32 > 16, invalid. Attempt 1: ratio 1 ->
    # 8 x 8, valid. Attempts 2..9: ratio 4 -> 16 x 4, also valid but later.
    view = ViewRecipe(crop_scale=(0.25, 0.25), crop_ratio=(1.0, 16.0))
    u_ratio = torch.full((1, 10), 0.5)
    u_ratio[0, 0] = 0.999
    u_ratio[0, 1] = 0.0
    boxes = A._sample_boxes(torch.zeros(1, 10), u_ratio, torch.zeros(1, 2), 16, 16, view)
    torch.testing.assert_close(boxes, torch.tensor([[0.0, 0.0, 8.0, 8.0]], dtype=torch.float64))
    u_ratio[0, 1] = 0.5
    boxes = A._sample_boxes(torch.zeros(1, 10), u_ratio, torch.full((1, 2), 0.999), 16, 16, view)
    torch.testing.assert_close(boxes, torch.tensor([[0.0, 12.0, 16.0, 16.0]], dtype=torch.float64))


# ----------------------------------------------------------------------------------------------
# color ops against torchvision


@pytest.mark.parametrize("factor", [0.0, 0.6, 1.0, 1.4])
def test_brightness_contrast_saturation_match_torchvision(factor: float) -> None:
    img = color_image(1)  # 3 x s x s
    f = torch.tensor([factor]).view(1, 1, 1, 1)
    x = img.unsqueeze(0)  # 1 x 3 x s x s
    pairs = [
        (A._adjust_brightness(x, f)[0], TF.adjust_brightness(img, factor)),
        (A._adjust_contrast(x, f)[0], TF.adjust_contrast(img, factor)),
        (A._adjust_saturation(x, f)[0], TF.adjust_saturation(img, factor)),
    ]
    for ours, ref in pairs:
        assert (ours - ref).abs().max() < 1e-5


@pytest.mark.parametrize("factor", [-0.5, -0.37, -0.1, 0.0, 0.05, 0.25, 0.4, 0.5])
def test_hue_matches_torchvision(factor: float) -> None:
    img = color_image(2)
    ours = A._adjust_hue(img.unsqueeze(0), torch.tensor([factor]).view(1, 1, 1, 1))[0]
    ref = TF.adjust_hue(img, factor)
    assert (ours - ref).abs().max() < 1e-4


def test_color_ops_use_per_sample_factors() -> None:
    imgs = torch.stack([color_image(3), color_image(4)])  # 2 x 3 x s x s
    factors = [-0.3, 0.2]
    ours = A._adjust_hue(imgs, torch.tensor(factors).view(2, 1, 1, 1))
    for i, f in enumerate(factors):
        assert (ours[i] - TF.adjust_hue(imgs[i], f)).abs().max() < 1e-4
    ours = A._adjust_contrast(imgs, torch.tensor([0.5, 1.3]).view(2, 1, 1, 1))
    assert (ours[0] - TF.adjust_contrast(imgs[0], 0.5)).abs().max() < 1e-5
    assert (ours[1] - TF.adjust_contrast(imgs[1], 1.3)).abs().max() < 1e-5


def test_grayscale_matches_torchvision() -> None:
    img = color_image(5)
    ours = A._grayscale(img.unsqueeze(0))[0]  # 1 x s x s
    assert (ours - TF.rgb_to_grayscale(img)).abs().max() < 1e-6


def test_jitter_only_brightness_matches_torchvision_per_sample() -> None:
    # End to end: with only brightness jitter, each output is torchvision's adjust_brightness of the
    # input with some factor in [0.6, 1.4]; recover it from the ratio and check it.
    images = random_images(16, 12, seed=6)
    view = dataclasses.replace(IDENTITY, jitter=(0.4, 0.0, 0.0, 0.0), jitter_p=1.0)
    out = augment(images, view, 12, ZERO, ONE, gen(2), normalize=False)
    src = images.permute(0, 3, 1, 2).float() / 255
    for i in range(16):
        unclipped = (out[i] < 1.0) & (src[i] > 0.05)
        f = (out[i][unclipped] / src[i][unclipped]).median().item()
        assert 0.6 - 1e-4 <= f <= 1.4 + 1e-4
        assert (out[i] - TF.adjust_brightness(src[i], f)).abs().max() < 1e-4


# ----------------------------------------------------------------------------------------------
# blur, solarize, flip


def test_blur_kernel_size() -> None:
    assert A._blur_kernel_size(2.0, 224) == 13
    assert A._blur_kernel_size(2.0 * 32 / 224, 32) == 3
    assert A._blur_kernel_size(10.0, 16) == 15  # capped below the image size, odd
    assert A._blur_kernel_size(10.0, 15) == 13
    assert A._blur_kernel_size(1.0, 2) == 1


def test_blur_constant_image_stays_constant() -> None:
    x = torch.full((2, 3, 20, 20), 0.3)
    y = A._gaussian_blur(x, torch.tensor([0.5, 2.0]), 7)
    torch.testing.assert_close(y, x, rtol=0, atol=1e-6)


def test_blur_reduces_noise_variance_more_for_larger_sigma() -> None:
    x = torch.rand(2, 3, 32, 32, generator=gen(9))
    y = A._gaussian_blur(x, torch.tensor([0.8, 2.0]), 13)
    assert y[0].var() < 0.5 * x[0].var()
    assert y[1].var() < y[0].var()
    torch.testing.assert_close(y.mean(dim=(1, 2, 3)), x.mean(dim=(1, 2, 3)), rtol=0, atol=0.02)


@pytest.mark.parametrize(("sigma", "ksize"), [(0.5, 3), (1.3, 9), (2.0, 13)])
def test_blur_matches_torchvision(sigma: float, ksize: int) -> None:
    img = color_image(7, s=24)
    ours = A._gaussian_blur(img.unsqueeze(0), torch.tensor([sigma]), ksize)[0]
    ref = TF.gaussian_blur(img, kernel_size=[ksize, ksize], sigma=[sigma, sigma])
    assert (ours - ref).abs().max() < 1e-5


def test_blur_per_sample_sigma() -> None:
    imgs = torch.stack([color_image(8), color_image(9)])
    ours = A._gaussian_blur(imgs, torch.tensor([0.4, 1.5]), 5)
    for i, sigma in enumerate((0.4, 1.5)):
        ref = TF.gaussian_blur(imgs[i], kernel_size=[5, 5], sigma=[sigma, sigma])
        assert (ours[i] - ref).abs().max() < 1e-5


def test_solarize_tiny_input() -> None:
    x = torch.tensor([0.0, 0.25, 0.49, 0.5, 0.75, 1.0]).view(1, 1, 1, 6)
    expected = torch.tensor([0.0, 0.25, 0.49, 0.5, 0.25, 0.0]).view(1, 1, 1, 6)
    torch.testing.assert_close(A._solarize(x), expected)
    ref = TF.solarize(x, 0.5)
    torch.testing.assert_close(A._solarize(x), ref)


def test_solarize_view_bounds_values() -> None:
    images = random_images(8, 16, seed=10)
    view = dataclasses.replace(IDENTITY, solarize_p=1.0)
    x = augment(images, view, 16, ZERO, ONE, gen(), normalize=False)
    src = images.permute(0, 3, 1, 2).float() / 255
    torch.testing.assert_close(x, torch.minimum(src, 1 - src), rtol=0, atol=1e-6)
    assert x.max() <= 0.5


def test_flip_tiny_input() -> None:
    images = torch.arange(2 * 3 * 3 * 3, dtype=torch.uint8).view(2, 3, 3, 3)  # B x S x S x 3
    view = dataclasses.replace(IDENTITY, flip_p=1.0)
    x = augment(images, view, 3, ZERO, ONE, gen(), normalize=False)  # 2 x 3 x 3 x 3
    expected = images.permute(0, 3, 1, 2).float().flip(-1) / 255
    torch.testing.assert_close(x, expected, rtol=0, atol=1e-6)
    assert x[0, 0, 0, 0] == pytest.approx(images[0, 0, 2, 0].item() / 255)


# ----------------------------------------------------------------------------------------------
# probabilities


def test_flip_and_gray_probabilities() -> None:
    b = 2000
    images = torch.zeros((b, 8, 8, 3), dtype=torch.uint8)
    images[:, :, 4:, 0] = 255  # red right half, black left half
    view = dataclasses.replace(IDENTITY, flip_p=0.5, gray_p=0.2)
    x = augment(images, view, 8, ZERO, ONE, gen(13), normalize=False)  # B x 3 x 8 x 8
    flipped = x[:, 0, :, :4].mean(dim=(1, 2)) > x[:, 0, :, 4:].mean(dim=(1, 2))
    gray = (x[:, 0] == x[:, 1]).all(dim=(1, 2)) & (x[:, 1] == x[:, 2]).all(dim=(1, 2))
    assert abs(flipped.float().mean().item() - 0.5) < 0.05
    assert abs(gray.float().mean().item() - 0.2) < 0.05
    # gray samples are exactly the luma of red: 0.2989
    assert torch.allclose(x[gray].amax(dim=(1, 2, 3)), torch.tensor(0.2989), atol=1e-6)


def test_jitter_blur_solarize_probabilities() -> None:
    b = 2000
    images = random_images(b, 8, seed=14)
    src = images.permute(0, 3, 1, 2).float() / 255
    g = gen(15)
    cases = [
        (dataclasses.replace(IDENTITY, jitter=(0.4, 0.0, 0.0, 0.0), jitter_p=0.8), 0.8),
        (dataclasses.replace(IDENTITY, blur_p=0.3, blur_sigma=(20.0, 30.0)), 0.3),  # sigma 0.7..1.1 px at 8 px
        (dataclasses.replace(IDENTITY, solarize_p=0.2), 0.2),
    ]
    for view, p in cases:
        x = augment(images, view, 8, ZERO, ONE, g, normalize=False)
        changed = (x - src).abs().amax(dim=(1, 2, 3)) > 1e-5
        assert abs(changed.float().mean().item() - p) < 0.05, view


def test_v2_jitter_probability_end_to_end() -> None:
    # v2 with only ColorJitter kept: about 80 % of constant mid-gray images change brightness.
    images = torch.full((2000, 8, 8, 3), 100, dtype=torch.uint8)
    view = dataclasses.replace(RECIPES["v2"][0], gray_p=0.0, blur_p=0.0, flip_p=0.0)
    x = augment(images, view, 8, ZERO, ONE, gen(16), normalize=False)
    changed = (x - 100 / 255).abs().amax(dim=(1, 2, 3)) > 1e-5
    assert abs(changed.float().mean().item() - 0.8) < 0.05


# ----------------------------------------------------------------------------------------------
# center view


def test_center_view_is_center_crop() -> None:
    images = random_images(2, 256, seed=17)
    x = center_view(images, 224, MEAN, STD)
    assert x.shape == (2, 3, 224, 224) and x.dtype == torch.float32 and x.is_contiguous()
    crop = images[:, 16:240, 16:240].permute(0, 3, 1, 2).float() / 255
    expected = (crop - torch.tensor(MEAN).view(1, 3, 1, 1)) / torch.tensor(STD).view(1, 3, 1, 1)
    torch.testing.assert_close(x, expected, rtol=0, atol=1e-5)
    images37 = random_images(2, 37, seed=18)
    x37 = center_view(images37, 32, ZERO, ONE)
    torch.testing.assert_close(x37, images37[:, 2:34, 2:34].permute(0, 3, 1, 2).float() / 255, rtol=0, atol=1e-6)


def test_center_view_upscales_small_cache() -> None:
    images = random_images(2, 20, seed=19)
    x = center_view(images, 32, ZERO, ONE)
    src = images.permute(0, 3, 1, 2).float() / 255
    ref = F.interpolate(src, size=(32, 32), mode="bilinear", align_corners=False, antialias=True)
    torch.testing.assert_close(x, ref, rtol=0, atol=1e-5)
    assert torch.equal(x, center_view(images, 32, ZERO, ONE))


# ----------------------------------------------------------------------------------------------
# input validation


def test_bad_dtype_raises() -> None:
    with pytest.raises(ValueError, match=r"uint8.*float32"):
        two_views(torch.zeros(2, 8, 8, 3), "v2", 8, MEAN, STD, gen())
    with pytest.raises(ValueError, match="uint8"):
        center_view(torch.zeros(2, 8, 8, 3, dtype=torch.int32), 8, MEAN, STD)


@pytest.mark.parametrize("shape", [(8, 8, 3), (2, 3, 8, 8), (2, 8, 9, 3), (2, 8, 8, 4), (1, 2, 8, 8, 3)])
def test_bad_shape_raises(shape: tuple[int, ...]) -> None:
    images = torch.zeros(shape, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"\[B, S, S, 3\].*" + re.escape(str(tuple(shape)))):
        augment(images, ViewRecipe(), 8, MEAN, STD, gen())


def test_unknown_recipe_lists_valid_names() -> None:
    with pytest.raises(ValueError, match=r"v4.*v1, v2, v3"):
        two_views(random_images(1, 8), "v4", 8, MEAN, STD, gen())


def test_other_bad_arguments_raise() -> None:
    images = random_images(1, 8)
    with pytest.raises(ValueError, match="size"):
        augment(images, ViewRecipe(), 0, MEAN, STD, gen())
    with pytest.raises(ValueError, match="generator"):
        augment(images, ViewRecipe(), 8, MEAN, STD, 0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="mean"):
        augment(images, ViewRecipe(), 8, (0.5, 0.5), STD, gen())
    with pytest.raises(ValueError, match="solarize_p"):
        ViewRecipe(solarize_p=1.5)
    with pytest.raises(ValueError, match="crop_scale"):
        ViewRecipe(crop_scale=(0.0, 1.0))


# ----------------------------------------------------------------------------------------------
# device


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_images_with_cpu_generator_match_cpu() -> None:
    images = random_images(16, 37, seed=20)
    for recipe in sorted(RECIPES):
        q_cpu, k_cpu = two_views(images, recipe, 32, MEAN, STD, gen(4))
        q_gpu, k_gpu = two_views(images.cuda(), recipe, 32, MEAN, STD, gen(4))
        assert q_gpu.is_cuda and k_gpu.is_cuda
        assert (q_gpu.cpu() - q_cpu).abs().max() < 1e-3
        assert (k_gpu.cpu() - k_cpu).abs().max() < 1e-3
    x = center_view(images.cuda(), 32, MEAN, STD)
    torch.testing.assert_close(x.cpu(), center_view(images, 32, MEAN, STD), rtol=0, atol=1e-5)
