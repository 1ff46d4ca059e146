"""Whitening against brute-force references: the Ledoit-Wolf paper's formula and the Mahalanobis cosine."""

from __future__ import annotations

import numpy as np
import pytest

from moco.whiten import fit_whitening, ledoit_wolf_shrinkage


def _paper_shrinkage(x: np.ndarray) -> float:
    """Ledoit & Wolf (2004), Lemma 3.2-3.4 with the scaled Frobenius norm ||A||^2 = tr(A A^T) / p, term by term."""
    xc = x - x.mean(0)
    n, p = xc.shape
    s = xc.T @ xc / n
    mu = np.trace(s) / p
    d2 = np.sum((s - mu * np.eye(p)) ** 2) / p
    b2 = sum(np.sum((np.outer(r, r) - s) ** 2) / p for r in xc) / n**2
    return min(b2, d2) / d2


@pytest.mark.parametrize("n,d", [(50, 8), (12, 30), (400, 5)])
def test_shrinkage_matches_the_papers_formula(n, d):
    x = np.random.default_rng(n).normal(size=(n, d)) * np.linspace(0.2, 3, d)
    assert ledoit_wolf_shrinkage(x - x.mean(0)) == pytest.approx(_paper_shrinkage(x), rel=1e-9)


def test_shrinkage_small_for_many_anisotropic_vectors_large_for_isotropic_ones():
    rng = np.random.default_rng(0)
    aniso = rng.normal(size=(5000, 6)) * np.array([10, 5, 2, 1, 0.5, 0.1])
    iso = rng.normal(size=(5000, 6))
    assert ledoit_wolf_shrinkage(aniso - aniso.mean(0)) < 0.01
    assert ledoit_wolf_shrinkage(iso - iso.mean(0)) > 0.5


@pytest.mark.parametrize("n,d", [(300, 16), (20, 64)])  # more vectors than dimensions, and fewer
def test_whitened_cosines_equal_the_mahalanobis_cosine_of_the_shrunk_covariance(n, d):
    rng = np.random.default_rng(d)
    x = (rng.normal(size=(n, d)) @ rng.normal(size=(d, d))).astype(np.float32)  # correlated dimensions
    w = fit_whitening(x)
    got = w(x) @ w(x).T  # N x N
    # reference: x_c^T C^-1 y_c / sqrt(...) with the shrunk covariance inverted directly
    xc = x.astype(np.float64) - x.mean(0, dtype=np.float64)
    s = xc.T @ xc / n
    a = _paper_shrinkage(x.astype(np.float64))
    inv = np.linalg.inv((1 - a) * s + a * np.trace(s) / d * np.eye(d))  # D x D
    g = xc @ inv @ xc.T  # N x N
    ref = g / np.sqrt(np.outer(np.diag(g), np.diag(g)))
    assert w.shrinkage == pytest.approx(a, rel=1e-9) and w.count == n
    np.testing.assert_allclose(got, ref, atol=2e-4)


def test_whitened_training_vectors_have_unit_covariance_before_normalizing():
    x = np.random.default_rng(1).normal(size=(20000, 4)) * np.array([5, 2, 1, 0.3])
    w = fit_whitening(x)
    z = (x - w.mean) @ w.matrix  # N x D, not normalized
    np.testing.assert_allclose(np.cov(z.T, bias=True), np.eye(4), atol=0.02)


def test_identical_vectors_and_the_mean_itself_stay_finite():
    x = np.ones((5, 3), np.float32) / np.sqrt(3)
    w = fit_whitening(x)
    out = w(x)
    assert np.isfinite(out).all()  # rows equal to the mean keep their own direction: never zero
    np.testing.assert_allclose(np.linalg.norm(out, axis=1), 1.0, atol=1e-6)
    np.testing.assert_allclose(out, x, atol=1e-6)


def test_degenerate_collection_falls_back_to_centring_with_a_warning(caplog):
    """20 identical photos: no whitening with entries of 1e21, no zero vector, every score 1 (issue 28, 3)."""
    from moco.whiten import fit_space

    feats = np.tile(np.random.default_rng(0).normal(size=(1, 16)).astype(np.float32), (20, 1))  # 20 x 16
    feats /= np.linalg.norm(feats, axis=1, keepdims=True)
    with caplog.at_level("WARNING", logger="moco.whiten"):
        space = fit_space(feats, "whitened")
    assert space.matrix is None and "all alike" in caplog.text
    out = space(feats)  # 20 x 16
    assert np.isfinite(out).all() and (np.linalg.norm(out, axis=1) > 0.99).all()
    np.testing.assert_allclose(out @ out.T, 1.0, atol=1e-5)  # identical photos score 1 with each other


def test_fit_space_kinds_against_by_hand_maps():
    from moco.whiten import fit_space

    rng = np.random.default_rng(1)
    feats = rng.normal(size=(300, 8)).astype(np.float32) * np.arange(1, 9, dtype=np.float32)  # 300 x 8
    feats /= np.linalg.norm(feats, axis=1, keepdims=True)
    base = fit_whitening(rng.normal(size=(100, 8)).astype(np.float32))
    c = feats - feats.mean(0)  # 300 x 8
    for how, ref in (("centred", c), ("training", c @ base.matrix),
                     ("whitened", c @ fit_whitening(feats).matrix)):
        got = fit_space(feats, how, base)(feats)  # 300 x 8
        want = ref / np.linalg.norm(ref, axis=1, keepdims=True)
        np.testing.assert_allclose(got, want, atol=1e-4)


def test_one_vector_is_refused():
    with pytest.raises(ValueError, match="at least 2 vectors"):
        fit_whitening(np.ones((1, 4)))


def test_a_given_shrinkage_is_used_and_one_means_plain_centring():
    x = np.random.default_rng(2).normal(size=(40, 5)) * np.array([4, 2, 1, 0.5, 0.1])
    assert fit_whitening(x, shrinkage=0.3).shrinkage == 0.3
    c = x - x.mean(0)
    c /= np.linalg.norm(c, axis=1, keepdims=True)
    w = fit_whitening(x, shrinkage=1.0)  # a multiple of the identity: the cosines of the centred vectors
    np.testing.assert_allclose(w(x) @ w(x).T, c @ c.T, atol=1e-5)
    with pytest.raises(ValueError, match="shrinkage must be in"):
        fit_whitening(x, shrinkage=1.5)


def test_a_large_collection_is_fitted_on_a_seeded_sample_of_max_rows():
    x = np.random.default_rng(3).normal(size=(500, 6)) * np.array([3, 2, 1, 1, 0.5, 0.2])
    a, b = fit_whitening(x, max_rows=100), fit_whitening(x, max_rows=100)
    assert a.count == 100 and np.array_equal(a.matrix, b.matrix)  # the same rows every time
    rows = x[np.sort(np.random.default_rng(0).choice(500, 100, replace=False))]
    ref = fit_whitening(rows)  # the sample fitted by hand
    np.testing.assert_allclose(a.mean, ref.mean, atol=1e-6)
    np.testing.assert_allclose(a(x) @ a(x).T, ref(x) @ ref(x).T, atol=1e-5)
    assert fit_whitening(x, max_rows=1000).count == 500  # fewer rows than max_rows: all of them


def test_state_round_trips_and_a_damaged_one_is_refused_with_the_file_named():
    import torch

    from moco.whiten import Whitening

    x = np.random.default_rng(3).normal(size=(40, 6)).astype(np.float32)
    w = fit_whitening(x)
    back = Whitening.from_state(w.state(), 6, "run/checkpoint.pt")
    assert np.array_equal(back.mean, w.mean) and np.array_equal(back.matrix, w.matrix)
    assert (back.shrinkage, back.count, back.mirror) == (w.shrinkage, 40, False) and np.array_equal(back(x), w(x))
    from dataclasses import replace

    assert Whitening.from_state(replace(w, mirror=True).state(), 6, "ckpt").mirror  # a run's whitening says so
    old = {k: v for k, v in w.state().items() if k != "mirror"}  # written before mirror averaging: plain features
    assert Whitening.from_state(old, 6, "ckpt").mirror is False
    assert all(isinstance(v, torch.Tensor) for k, v in w.state().items() if k in ("mean", "matrix"))
    with pytest.raises(ValueError, match="run/checkpoint.pt.*embeds 8-d"):
        Whitening.from_state(w.state(), 8, "run/checkpoint.pt")
    bad = {**w.state(), "matrix": torch.full((6, 6), float("nan"))}
    with pytest.raises(ValueError, match="non-finite"):
        Whitening.from_state(bad, 6, "run/checkpoint.pt")
    with pytest.raises(ValueError, match="damaged"):
        Whitening.from_state({"mean": w.state()["mean"]}, 6, "run/checkpoint.pt")


def test_mirror_features_sum_the_normalized_features_of_each_view_and_its_mirror_image():
    import torch

    from moco.whiten import mirror_features

    torch.manual_seed(0)
    nn = torch.nn
    net = nn.Sequential(nn.Conv2d(3, 5, 3), nn.ReLU(), nn.Flatten(), nn.Linear(5 * 6 * 6, 4))
    x = torch.randn(3, 3, 8, 8)
    want = torch.stack([torch.nn.functional.normalize(net(v[None]), dim=1)[0]
                        + torch.nn.functional.normalize(net(v[None].flip(3)), dim=1)[0] for v in x])  # by hand
    got = mirror_features(net, x)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(mirror_features(net, x.flip(3)), got, atol=1e-5, rtol=1e-5)  # mirror-invariant
    assert (net(x.flip(3)) - net(x)).abs().max() > 1e-2  # where the network itself is not
    cl = x.contiguous(memory_format=torch.channels_last)
    seen = []
    net[0].register_forward_pre_hook(lambda m, a: seen.append(a[0].is_contiguous(memory_format=torch.channels_last)))
    torch.testing.assert_close(mirror_features(net, cl), got, atol=1e-5, rtol=1e-5)
    assert seen == [True]  # the 2N views keep the caller's channels_last layout


def _stage_net():
    """A small network with ResNet's stage names: layer1 (4 ch), layer2 (6 ch), layer3 (8 ch), then pooled."""
    import torch

    nn = torch.nn

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.layer1 = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU())
            self.layer2 = nn.Sequential(nn.Conv2d(4, 6, 3, stride=2, padding=1), nn.ReLU())
            self.layer3 = nn.Sequential(nn.Conv2d(6, 8, 3, stride=2, padding=1), nn.ReLU())
            self.head = nn.Linear(8, 5)

        def forward(self, x):
            return self.head(self.layer3(self.layer2(self.layer1(x))).mean((2, 3)))

    torch.manual_seed(0)
    return Net()


def test_embedding_features_pool_the_named_stages_before_the_backbones_output():
    import torch
    import torch.nn.functional as F

    from moco.whiten import STAGES, embedding_features, feature_widths, resnet_stages

    net, x = _stage_net(), torch.randn(3, 3, 8, 8)
    h1 = net.layer1(x)  # 3 x 4 x 8 x 8, by hand
    h2 = net.layer2(h1)  # 3 x 6 x 4 x 4
    h3 = net.layer3(h2)  # 3 x 8 x 2 x 2
    want = torch.cat([h1.mean((2, 3)), h2.mean((2, 3)), h3.mean((2, 3)), net(x)], 1)  # 3 x 23
    torch.testing.assert_close(embedding_features(net, x, stages=STAGES), want)
    torch.testing.assert_close(embedding_features(net, x, stages=("layer2",)), torch.cat([h2.mean((2, 3)), net(x)], 1))
    torch.testing.assert_close(embedding_features(net, x), net(x))  # no stages: the backbone's output
    flipped = embedding_features(net, x.flip(3), stages=STAGES)
    mirrored = embedding_features(net, x, mirror=True, stages=STAGES)
    torch.testing.assert_close(mirrored, F.normalize(want, dim=1) + F.normalize(flipped, dim=1))
    assert not net.layer1._forward_hooks and not net.layer3._forward_hooks  # the taps are removed after each call
    assert resnet_stages(net) == STAGES and resnet_stages(torch.nn.Linear(2, 2)) == ()
    net.train()
    assert feature_widths(net, STAGES, 8) == ((4, 6, 8), 5) and net.training  # the mode is restored
    from moco.model.backbones import build_backbone

    resnet, width = build_backbone("resnet10t", False, 32)
    assert resnet_stages(resnet) == STAGES and feature_widths(resnet, STAGES, 32) == ((64, 128, 256), 512) == (
        (64, 128, 256), width)


def test_auto_stages_need_twice_as_many_photos_as_dimensions(caplog):
    import logging

    import torch

    from moco.model.backbones import build_backbone
    from moco.training.whitening import STAGE_ROWS_PER_DIM, whitening_stages

    resnet, _ = build_backbone("resnet10t", False, 32)
    staged = (("layer1", "layer2", "layer3"), (64, 128, 256))
    need = STAGE_ROWS_PER_DIM * (512 + 64 + 128 + 256)  # 1,920 photos for resnet10t's 960-d features
    assert whitening_stages(resnet, "auto", need, 32) == staged
    with caplog.at_level(logging.INFO, logger="moco.training"):
        assert whitening_stages(resnet, "auto", need - 1, 32) == ((), ())
    assert f"{need - 1} photos are too few to whiten 960-d features" in caplog.text
    assert "--whiten-stages on forces them" in caplog.text
    assert whitening_stages(resnet, "on", 10, 32) == staged  # forced
    assert whitening_stages(resnet, "off", 10**6, 32) == ((), ())
    assert whitening_stages(torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.AdaptiveAvgPool2d(1),
                                                torch.nn.Flatten()), "on", 10**6, 32) == ((), ())  # no ResNet stages


def test_a_whitening_with_stages_checks_and_keeps_them():
    from dataclasses import replace

    import torch

    from moco.whiten import STAGES, Whitening

    net, x = _stage_net(), torch.randn(10, 3, 8, 8)
    stages = tuple(zip(STAGES, (4, 6, 8)))
    from moco.whiten import embedding_features

    feats = embedding_features(net, x, mirror=True, stages=STAGES)  # 10 x 23
    w = replace(fit_whitening(feats.detach().numpy()), mirror=True, stages=stages)
    assert w.dim == 23 and w.stage_names == STAGES
    torch.testing.assert_close(w.features(net, x), feats)
    back = Whitening.from_state(w.state(), 5, "run/checkpoint.pt")  # the backbone's own width: 5
    assert back.stages == stages and back.mirror and np.array_equal(back.matrix, w.matrix)
    with pytest.raises(ValueError, match="run/checkpoint.pt.*embeds 6-d and its stages 24-d"):
        Whitening.from_state(w.state(), 6, "run/checkpoint.pt")
    with pytest.raises(ValueError, match="damaged"):
        Whitening.from_state({**w.state(), "stages": [["layer1"]]}, 5, "run/checkpoint.pt")
    other = replace(w, stages=(("layer1", 4), ("layer2", 6)))  # claims fewer stages than it was fitted on
    with pytest.raises(ValueError, match="15-d, the whitening's 23-d"):
        other.features(net, x)


def test_both_whitening_entry_points_take_the_same_input():
    """Whitening.__call__ (numpy) and whiten_features (torch, inside programs) on one L2-normalized input agree,
    also for a row at the mean (which keeps its own direction in both)."""
    import torch

    from moco.whiten import Whitening, fit_whitening, whiten_features

    rng = np.random.default_rng(0)
    feats = rng.normal(size=(300, 16)).astype(np.float32)
    v = feats / np.linalg.norm(feats, axis=1, keepdims=True)  # 300 x 16
    w = fit_whitening(v)
    v[0] = w.mean / np.linalg.norm(w.mean)  # not at the mean exactly: normalized; the next row is
    v[1] = w.mean
    got = torch.nn.functional.normalize(whiten_features(torch.from_numpy(v), torch.from_numpy(w.mean),
                                                        torch.from_numpy(w.matrix)), dim=1).numpy()
    np.testing.assert_allclose(got, w(v), atol=1e-5)
    centred = Whitening(w.mean, None, w.shrinkage, w.count)  # centring only: matrix None on both sides
    got = torch.nn.functional.normalize(whiten_features(torch.from_numpy(v), torch.from_numpy(w.mean), None), dim=1)
    np.testing.assert_allclose(got.numpy(), centred(v), atol=1e-5)
