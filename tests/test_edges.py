"""The photos' edge layout (moco.edges) against a brute-force reference, its invariances (light and dark, brightness),
the space that weighs it against the network's features, and when a run takes it (issue 55)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from moco.edges import BINS, CELLS, DIM, LUMA, SIDE, WEIGHT, edge_layout
from moco.training.whitening import EDGE_PHOTOS, takes_edges
from moco.whiten import Whitening, features_text, fit_space, fit_whitening, with_edges

MEAN, STD = np.array([0.485, 0.456, 0.406]), np.array([0.229, 0.224, 0.225])


def _view(photo: np.ndarray) -> torch.Tensor:
    """A uint8 photo (s x s x 3) as the backbone's normalized input view (3 x s x s)."""
    return torch.from_numpy(((photo / 255.0 - MEAN) / STD).transpose(2, 0, 1).astype(np.float32))


def _photo(seed: int, s: int) -> np.ndarray:
    """A photo with edges at every orientation: a few bright ellipses and bars on a gradient, some noise."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:s, 0:s] / s
    img = 80 * x[..., None] + 40 * y[..., None] + rng.uniform(0, 20, (1, 1, 3))
    for _ in range(5):
        cy, cx, ry, rx = rng.uniform(0.2, 0.8, 2).tolist() + rng.uniform(0.08, 0.3, 2).tolist()
        img[((y - cy) / ry) ** 2 + ((x - cx) / rx) ** 2 < 1] += rng.uniform(40, 120, 3)
    a = rng.uniform(0, np.pi)
    img[np.abs(np.cos(a) * (x - 0.5) + np.sin(a) * (y - 0.5)) < 0.04] = rng.uniform(0, 255, 3)
    return np.clip(img + rng.normal(0, 3, img.shape), 0, 255).astype(np.uint8)


def _reference(view: np.ndarray) -> np.ndarray:
    """The edge layout of one view (3 x s x s), pixel by pixel: the grey's box-filtered pixels by their areas, the
    orientation by arctan2, each gradient shared between the two nearest bins by its angle's distance to them."""
    grey = sum(w * view[c].astype(np.float64) for c, w in enumerate(LUMA))  # s x s
    s, step = grey.shape[0], grey.shape[0] / SIDE
    small = np.zeros((SIDE, SIDE))
    for i in range(SIDE):
        for j in range(SIDE):
            y0, y1, x0, x1 = i * step, (i + 1) * step, j * step, (j + 1) * step
            total = 0.0
            for yy in range(int(y0), min(s, int(np.ceil(y1)))):
                for xx in range(int(x0), min(s, int(np.ceil(x1)))):
                    total += (min(yy + 1, y1) - max(yy, y0)) * (min(xx + 1, x1) - max(xx, x0)) * grey[yy, xx]
            small[i, j] = total / (step * step)
    gx, gy = np.zeros_like(small), np.zeros_like(small)
    gx[:, 1:-1] = small[:, 2:] - small[:, :-2]
    gy[1:-1] = small[2:] - small[:-2]
    hist = np.zeros((CELLS, CELLS, BINS))
    width = np.pi / BINS
    cell = SIDE // CELLS
    for i in range(SIDE):
        for j in range(SIDE):
            mag, angle = np.hypot(gx[i, j], gy[i, j]), np.arctan2(gy[i, j], gx[i, j]) % np.pi
            for b in range(BINS):
                d = abs(angle - (b + 0.5) * width)
                hist[i // cell, j // cell, b] += max(0.0, 1 - min(d, np.pi - d) / width) * mag / cell**2
    hist /= np.linalg.norm(hist, axis=2, keepdims=True) + 1e-6
    return np.sqrt(hist).ravel()


@pytest.mark.parametrize("side", [96, 40])  # shrunk (1.5 pixels a box) and enlarged (a box within a pixel or two)
def test_the_layout_equals_a_pixel_by_pixel_reference(side):
    views = torch.stack([_view(_photo(seed, side)) for seed in (0, 1)])  # 2 x 3 x s x s
    got = edge_layout(views).numpy()  # 2 x DIM
    assert got.shape == (2, DIM) == (2, CELLS * CELLS * BINS) and got.dtype == np.float32
    for n in range(2):
        np.testing.assert_allclose(got[n], _reference(views[n].numpy()), atol=2e-3)
    assert float(got[0] @ got[1]) / (np.linalg.norm(got[0]) * np.linalg.norm(got[1])) < 0.95  # two photos differ
    with torch.autocast("cpu", dtype=torch.bfloat16):  # the Embedder's autocast on a CPU leaves it in float32
        np.testing.assert_allclose(edge_layout(views).numpy(), got, atol=1e-6)


def test_light_and_dark_versions_and_a_brighter_copy_share_one_layout():
    photo = _photo(3, 64)
    layouts = edge_layout(torch.stack([_view(p) for p in (
        photo, 255 - photo,  # the dark version: every edge where it was, each gradient reversed
        np.clip(photo * 0.6 + 70, 0, 255).astype(np.uint8),  # less contrast, brighter
        _photo(4, 64))])).numpy()  # 4 x DIM
    np.testing.assert_allclose(layouts[1], layouts[0], atol=1e-4)  # (float32 rounding: the same to 1e-5)
    cos = layouts @ layouts[0] / (np.linalg.norm(layouts, axis=1) * np.linalg.norm(layouts[0]))  # 4
    assert cos[2] > 0.99 and cos[3] < 0.9, cos  # (rounding to 8 bits moves the weakest edges a little)
    flat = edge_layout(_view(np.full((48, 48, 3), 128, np.uint8))[None])
    assert not flat.any()  # no edges: all zeros (the space keeps such a photo's network part)


def _features(n: int, d: int, seed: int = 0) -> np.ndarray:
    """N x (d + DIM) rows as embedding_features makes them with the edges: each part unit-long, then the row."""
    rng = np.random.default_rng(seed)
    net = rng.normal(size=(n, d)) + 3.0  # a narrow cone, as pooled ReLU features
    edges = np.abs(rng.normal(size=(n, DIM))) + 1.0  # histograms: a narrower one
    rows = np.hstack([net / np.linalg.norm(net, axis=1, keepdims=True),
                      edges / np.linalg.norm(edges, axis=1, keepdims=True)])
    return (rows / np.sqrt(2)).astype(np.float32)


@pytest.mark.parametrize("how", ["centred", "whitened"])
def test_the_space_weighs_each_part_by_its_share_and_mixes_nothing(how):
    v, d = _features(60, 24), 24
    net_alone = fit_space(v[:, :d], how)
    space = with_edges(v, lambda vn: fit_space(vn, how))
    c = (v - space.mean) @ space.matrix  # N x (d + DIM)
    assert np.linalg.norm(c[:, :d], axis=1).mean() == pytest.approx(np.sqrt(1 - WEIGHT), rel=1e-4)
    assert np.linalg.norm(c[:, d:], axis=1).mean() == pytest.approx(np.sqrt(WEIGHT), rel=1e-4)
    assert not space.matrix[:d, d:].any() and not space.matrix[d:, :d].any()
    np.testing.assert_allclose(space.mean, v.mean(0), atol=1e-6)
    net_matrix = np.eye(d) if net_alone.matrix is None else net_alone.matrix  # the network's part: its own map
    ratio = space.matrix[:d, :d] / np.where(np.abs(net_matrix) > 1e-3, net_matrix, np.nan)
    assert np.nanstd(ratio) < 1e-3 * np.nanmean(np.abs(ratio))  # a multiple of it
    # an index's space over a base with the edges is the same (whatever the base's own scales)
    stages = (("layer3", 4), ("edges", DIM))
    base = Whitening(np.zeros(d + DIM, np.float32), None, 1.0, 0, True, stages)
    if how == "whitened":
        base = Whitening(np.zeros(d + DIM, np.float32), np.eye(d + DIM, dtype=np.float32) * 3, 0.5, 9, True, stages)
    again = fit_space(v, how, base)
    np.testing.assert_allclose(again.matrix, space.matrix, atol=1e-5)
    assert again.stages == stages and again.mirror and again.whitened == (how == "whitened")
    assert fit_space(v, how, base).without_edges().dim == d and again.without_edges().stages == (("layer3", 4),)


def test_a_whitening_fitted_with_the_edges_whitens_the_network_part_alone():
    v, d = _features(80, 16, seed=1), 16
    w = with_edges(v, lambda vn: fit_whitening(vn))
    alone = fit_whitening(v[:, :d])
    scale = w.matrix[0, 0] / alone.matrix[0, 0]
    np.testing.assert_allclose(w.matrix[:d, :d], alone.matrix * scale, rtol=1e-4, atol=1e-6)
    assert w.shrinkage == alone.shrinkage and w.whitened


def test_a_run_takes_the_edges_from_scratch_on_few_photos():
    assert takes_edges("auto", "", EDGE_PHOTOS - 1) and not takes_edges("auto", "", EDGE_PHOTOS)
    assert not takes_edges("auto", "moco_v2_800ep", 16)  # continued from a trained model: it has learned
    assert takes_edges("on", "moco_v2_800ep", 10**6) and not takes_edges("off", "", 16)
    assert features_text(("layer1", "layer2", "edges")) == " with the pooled layer1/layer2 and the photos' edge layout"
    assert features_text(("edges",)) == " with the photos' edge layout" and features_text(()) == ""
