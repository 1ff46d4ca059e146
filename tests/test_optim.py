"""Optimizers and schedules: LARS against its formula, v3 weight-decay groups, lr as a pure function."""

import math

import numpy as np
import pytest
import torch
from torch import nn

from moco.config import resolve_config
from moco.training.optim import LARS, BudgetFit, build_optimizer, lr_at, lr_decay


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


@pytest.mark.parametrize("world", [1, 4])
def test_lr_decay_is_one_through_the_warmup_then_the_cosine_fraction_of_the_peak(world):
    cfg = resolve_config("v3", arch="resnet18", batch_size=512, warmup_epochs=2)  # warm-up: 20 steps of 100
    assert [lr_decay(s, cfg, 100, 10, world) for s in (0, 10, 19)] == [1.0, 1.0, 1.0]  # not the warm-up's ramp
    for s in (20, 45, 60, 99):
        assert lr_decay(s, cfg, 100, 10, world) == pytest.approx(0.5 * (1 + math.cos(math.pi * (s - 20) / 80)))
    assert lr_decay(100, cfg, 100, 10, world) == pytest.approx(0.0, abs=1e-12)
    v1 = resolve_config("v1", batch_size=256)  # no warm-up, step schedule: the milestones' tenths
    assert [lr_decay(s, v1, 100, 10, world) for s in (0, 59, 60, 80)] == pytest.approx([1.0, 1.0, 0.1, 0.01])


def _simulate(fit: BudgetFit, seconds_per_step, agree=lambda total: total) -> tuple[int, float]:
    """Run a schedule against a synthetic clock: (steps done, training seconds used)."""
    total, step, spent = fit.planned, 0, 0.0
    while step < total and spent < fit.budget_s:
        spent += seconds_per_step(step)
        step += 1
        total = fit.update(step, spent, agree) or total
    return step, spent


def test_budget_fit_recovers_from_slow_first_steps():
    """Slow first steps (one-off warm-up) must not make the run end long before its budget."""
    warm = lambda step: 1.0 if step < 10 else 0.1  # noqa: E731
    fit = BudgetFit(100.0, planned=100_000)
    steps, spent = _simulate(fit, warm)
    assert 97 <= spent <= 100.1 and 900 <= steps <= 911  # a fit from the first 10 steps alone: 100 steps
    assert fit.due == []  # fits at 10, then 10%, 25%, 50% of the first fit's length


def test_budget_fit_never_exceeds_the_planned_schedule_and_follows_a_slowdown():
    fit = BudgetFit(100.0, planned=50)
    assert _simulate(fit, lambda step: 0.1) == (50, pytest.approx(5.0))  # finishes early: the plan is shorter
    slow = lambda step: 0.1 if step < 300 else 0.4  # noqa: E731 - the machine gets busy mid-run
    steps, spent = _simulate(BudgetFit(100.0, planned=100_000), slow)
    assert 99.9 <= spent <= 100.4 and steps < 1000  # the budget stops it, not a schedule fitted to the old speed


def test_budget_fit_takes_the_agreed_length():
    fit = BudgetFit(1000.0, planned=100_000)
    assert fit.update(9, 9.0) is None  # not due before step 10
    assert fit.update(10, 10.0, agree=lambda total: total - 7) == 10 + 990 - 7
    assert fit.due == [99, 248, 496]  # from the agreed length, the same on every rank


# ------------------------------------------------------------------------------------ progressive resolution
def test_progressive_crop_sizes_rise_in_steps_of_8_to_the_full_size_at_75_percent():
    from moco.training.optim import crop_size_at

    cfg = resolve_config("v2", image_size=64, min_image_size=24)
    sizes = [crop_size_at(step, cfg, 1000) for step in range(1000)]
    assert sizes[0] == 24 and sizes[749] < 64 and set(sizes[750:]) == {64}
    assert sizes == sorted(sizes) and set(sizes) <= {24, 32, 40, 48, 56, 64}  # a few shapes, never shrinking
    assert all(crop_size_at(s, resolve_config("v2", image_size=64), 1000) == 64 for s in (0, 500, 999))  # off


def test_budget_fit_with_progressive_resolution_fills_the_budget():
    """Cheap low-resolution steps first: a fit from their speed alone would plan far too many steps (and end the
    run by the clock with the lr still high); per unit of cost, with late refits, the schedule ends on time."""
    from moco.training.optim import step_cost

    cfg = resolve_config("v2", image_size=32, min_image_size=16)
    cost = step_cost(cfg)
    assert step_cost(resolve_config("v2", image_size=32)) is None  # equal steps: the plain fit
    for overhead in (0.0, 0.01, 0.05):  # seconds per step that do not shrink with the pixels
        fit = BudgetFit(100.0, planned=100_000, cost=cost)
        total, step, spent = fit.planned, 0, 0.0
        while step < total and spent < fit.budget_s:
            spent += (1.0 if step < 10 else 0.0) + overhead + 0.09 * float(cost(np.array([step]), total)[0])
            step += 1
            total = fit.update(step, spent) or total
        assert step == total and 99.0 <= spent <= 100.1, (overhead, step, total, spent)  # annealed, on time
    plain = BudgetFit(100.0, planned=100_000)  # what the plain fit would do: plan by the cheap steps' speed
    assert plain.update(10, 10 * 0.09 / 4) > 2 * 100.0 / 0.09


def test_the_budget_clock_counts_training_time_only():
    """A synthetic clock: earlier sessions' seconds count, time inside paused() (evaluations) does not."""
    from moco.training.optim import BudgetClock

    t = [100.0]
    clock = BudgetClock(elapsed=30.0, budget_s=60.0, now=lambda: t[0])
    assert clock.seconds() == 30.0 and not clock.spent(t[0])
    t[0] += 20.0
    with clock.paused():
        t[0] += 500.0  # a long evaluation
    assert clock.seconds() == 50.0 and not clock.spent(t[0])
    t[0] += 10.0
    assert clock.seconds() == 60.0 and clock.spent(t[0]) and clock.at(t[0] - 5.0) == 55.0
    assert not BudgetClock(elapsed=1e9, budget_s=0.0, now=lambda: 0.0).spent(0.0)  # no budget: never spent
