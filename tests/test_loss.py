"""InfoNCE, the v3 in-batch loss and the decorrelation term against hand-written references (float64)."""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from moco.model.loss import decorrelation, in_batch_loss, info_nce


def _unit(*shape, dim=-1, seed=0):
    g = torch.Generator().manual_seed(seed)
    return F.normalize(torch.randn(*shape, generator=g), dim=dim)


def _reference_info_nce(q, k, queue, T, mask=None):
    """-log( exp(q.k/T) / (exp(q.k/T) + sum_j exp(q.n_j/T)) ), averaged, one query at a time."""
    q, k, queue = (np.asarray(t, dtype=np.float64) for t in (q, k, queue))
    total = 0.0
    for i in range(q.shape[0]):
        pos = math.exp(q[i] @ k[i] / T)
        neg = sum(math.exp(q[i] @ queue[:, j] / T) for j in range(queue.shape[1]) if mask is None or not mask[i, j])
        total += -math.log(pos / (pos + neg))
    return total / q.shape[0]


@pytest.mark.parametrize("n,c,K,T", [(4, 8, 16, 0.07), (8, 16, 32, 0.2), (3, 5, 7, 1.0)])
def test_info_nce_matches_reference(n, c, K, T):
    q, k, queue = _unit(n, c, seed=1), _unit(n, c, seed=2), _unit(c, K, dim=0, seed=3)
    got = info_nce(q, k, queue, T).item()
    assert got == pytest.approx(_reference_info_nce(q, k, queue, T), rel=1e-5)


def test_info_nce_mask_removes_negatives():
    n, c, K, T = 4, 8, 12, 0.2
    q, k, queue = _unit(n, c, seed=4), _unit(n, c, seed=5), _unit(c, K, dim=0, seed=6)
    mask = torch.zeros(n, K, dtype=torch.bool)
    mask[0, :3] = True
    mask[2, 5] = True
    got = info_nce(q, k, queue, T, mask).item()
    assert got == pytest.approx(_reference_info_nce(q, k, queue, T, mask.numpy()), rel=1e-5)
    assert got != pytest.approx(info_nce(q, k, queue, T).item(), rel=1e-5)


def test_info_nce_perfect_positive_is_small_and_reaches_q():
    q = _unit(4, 8, seed=7).detach().requires_grad_(True)
    queue = -q.detach().t().clone()  # negatives point away
    loss = info_nce(q, q.detach(), queue, 0.07)
    assert loss.item() < 1e-3
    loss.backward()
    assert q.grad is not None and q.grad.abs().sum() > 0


def _reference_in_batch(q, k, T):
    q, k = np.asarray(q, dtype=np.float64), np.asarray(k, dtype=np.float64)
    total = 0.0
    for i in range(q.shape[0]):
        logits = [q[i] @ k[j] / T for j in range(k.shape[0])]
        total += -(logits[i] - math.log(sum(math.exp(v) for v in logits)))
    return total / q.shape[0] * 2 * T


@pytest.mark.parametrize("n,c,T", [(4, 8, 1.0), (6, 16, 0.2)])
def test_in_batch_loss_matches_reference(n, c, T):
    q, k = _unit(n, c, seed=8), _unit(n, c, seed=9)
    assert in_batch_loss(q, k, T).item() == pytest.approx(_reference_in_batch(q, k, T), rel=1e-5)


def test_in_batch_loss_with_gathered_keys_uses_offset():
    # rank 1 of 2: its keys are rows 3..5 of the gathered keys
    q, k_all = _unit(3, 8, seed=10), _unit(6, 8, seed=11)
    T = 0.5
    got = in_batch_loss(q, k_all, T, offset=3).item()
    qn, kn = q.double().numpy(), k_all.double().numpy()
    ref = 0.0
    for i in range(3):
        logits = kn @ qn[i] / T
        ref += -(logits[3 + i] - math.log(np.exp(logits).sum()))
    assert got == pytest.approx(ref / 3 * 2 * T, rel=1e-5)


def _reference_decorrelation(h):
    """Sum over pairs i != j of corr(feature i, feature j)^2, divided by the number of features (numpy's corrcoef)."""
    r = np.corrcoef(np.asarray(h, dtype=np.float64), rowvar=False)  # D x D
    d = r.shape[0]
    return sum(r[i, j] ** 2 for i in range(d) for j in range(d) if i != j) / d


@pytest.mark.parametrize("n,d,seed", [(16, 4, 0), (64, 12, 1), (8, 20, 2)])  # the last: fewer images than features
def test_decorrelation_matches_reference(n, d, seed):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, d, generator=g) @ torch.randn(d, d, generator=g)  # N x D, correlated features
    assert decorrelation(h).item() == pytest.approx(_reference_decorrelation(h), rel=1e-3)


def test_decorrelation_is_zero_for_uncorrelated_features_and_grows_with_redundancy():
    a = torch.randn(32, 6, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    q, _ = torch.linalg.qr(a - a.mean(0))  # orthonormal columns in the span of centred ones: zero mean, uncorrelated
    assert decorrelation(q * torch.arange(1.0, 7.0, dtype=torch.float64)).item() == pytest.approx(0.0, abs=1e-6)
    x = torch.randn(32, 1, generator=torch.Generator().manual_seed(4))
    copies = torch.cat([x, 3 * x, -x, 0.5 * x], dim=1)  # 4 copies of one feature: every pair correlates +-1
    assert decorrelation(copies).item() == pytest.approx(3.0, rel=1e-3)  # D(D-1) / D


def test_decorrelation_is_scale_free_and_has_gradients():
    g = torch.Generator().manual_seed(5)
    h = torch.randn(16, 5, generator=g) @ torch.randn(5, 5, generator=g)  # N x D, correlated features
    scaled = h * torch.tensor([1.0, 10.0, 0.5, 3.0, 7.0]) + 4.0  # per-feature scales and a shift
    assert decorrelation(scaled).item() == pytest.approx(decorrelation(h).item(), rel=1e-3)
    h.requires_grad_(True)
    decorrelation(h).backward()
    assert torch.isfinite(h.grad).all() and h.grad.abs().sum() > 0
