"""InfoNCE and the v3 in-batch loss against hand-written references (plain loops in float64)."""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from moco.loss import in_batch_loss, info_nce


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
