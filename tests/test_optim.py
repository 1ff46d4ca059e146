"""Optimizers and schedules: LARS against its formula, v3 weight-decay groups, lr as a pure function."""

import math

import pytest
import torch
from torch import nn

from moco.config import resolve_config
from moco.optim import LARS, build_optimizer, lr_at


def test_lars_step_matches_formula():
    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(4, 3))
    b = nn.Parameter(torch.randn(4))
    w.grad, b.grad = torch.randn(4, 3), torch.randn(4)
    w0, b0, gw, gb = w.detach().clone(), b.detach().clone(), w.grad.clone(), b.grad.clone()
    opt = LARS([w, b], lr=0.5, weight_decay=0.1, momentum=0.9, trust_coefficient=0.001)
    opt.step()
    d = gw + 0.1 * w0
    trust = 0.001 * w0.norm() / d.norm()
    torch.testing.assert_close(w.detach(), w0 - 0.5 * trust * d)
    torch.testing.assert_close(b.detach(), b0 - 0.5 * gb)  # 1-D: no decay, no trust ratio
    # the second step adds momentum: mu = 0.9 * mu + trust' * d'
    w1, mu1 = w.detach().clone(), trust * d
    opt.step()
    d2 = gw + 0.1 * w1
    mu2 = 0.9 * mu1 + 0.001 * w1.norm() / d2.norm() * d2
    torch.testing.assert_close(w.detach(), w1 - 0.5 * mu2)


def test_v3_has_no_weight_decay_on_norms_and_biases():
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 2, bias=False))
    opt = build_optimizer(model, resolve_config("v3", arch="resnet18", batch_size=8))
    assert isinstance(opt, LARS)
    decay, no_decay = opt.param_groups
    assert all(p.ndim > 1 for p in decay["params"]) and decay["weight_decay"] == 1e-6
    assert all(p.ndim == 1 for p in no_decay["params"]) and no_decay["weight_decay"] == 0.0
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))
    sgd = build_optimizer(model, resolve_config("v2"))
    assert isinstance(sgd, torch.optim.SGD) and len(sgd.param_groups) == 1 and sgd.defaults["weight_decay"] == 1e-4
    vit = build_optimizer(model, resolve_config("v3", arch="vit_small_patch16_224", batch_size=8))
    assert isinstance(vit, torch.optim.AdamW)


def test_lr_schedule_warmup_cosine_and_step():
    cfg = resolve_config("v3", arch="resnet18", batch_size=512, warmup_epochs=2)  # base lr 0.6 x 512/256
    base, spe, total = 1.2, 10, 100
    assert lr_at(0, cfg, total, spe) == pytest.approx(base / 20)
    assert lr_at(19, cfg, total, spe) == pytest.approx(base)
    assert lr_at(20, cfg, total, spe) == pytest.approx(base)
    assert lr_at(60, cfg, total, spe) == pytest.approx(base * 0.5 * (1 + math.cos(math.pi * 40 / 80)))
    assert lr_at(100, cfg, total, spe) == pytest.approx(0.0, abs=1e-12)
    v1 = resolve_config("v1", batch_size=256)
    assert [lr_at(s, v1, 100, 10) for s in (0, 59, 60, 80)] == pytest.approx([0.03, 0.03, 0.003, 0.0003])
    assert lr_at(10, v1, 100, 10, world_size=4) == pytest.approx(0.12)  # scaled by the global batch
