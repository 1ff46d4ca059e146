"""Optimizers (SGD, LARS, AdamW), the learning-rate schedule as a pure function of the step, and the time budget:
its clock (:class:`BudgetClock`) and the schedule's length fitted to it (:class:`BudgetFit`)."""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterator

import numpy as np
import torch
from torch import nn

from moco.config import TrainConfig

__all__ = ["LARS", "BudgetFit", "build_optimizer", "crop_size_at", "lr_at", "lr_decay", "step_cost", "warmup_steps"]

PROGRESSIVE_END = 0.75  # progressive resolution reaches the full crop size at this fraction of training


class LARS(torch.optim.Optimizer):
    """LARS (You et al., 2017) as used by MoCo v3 for ResNets.

    Parameters with ``ndim > 1`` get weight decay and the layer-wise trust ratio
    ``eta * ||w|| / ||g + wd * w||``; 1-D parameters (norms, biases) get plain momentum SGD.
    """

    def __init__(
        self,
        params,
        lr: float = 0.0,
        weight_decay: float = 0.0,
        momentum: float = 0.9,
        trust_coefficient: float = 0.001,
    ) -> None:
        defaults = dict(lr=lr, weight_decay=weight_decay, momentum=momentum, trust_coefficient=trust_coefficient)
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure=None):  # noqa: D102 - torch.optim.Optimizer API
        loss = closure() if closure is not None else None
        for g in self.param_groups:
            for p in g["params"]:
                if p.grad is None:
                    continue
                d_p = p.grad
                if p.ndim > 1:
                    d_p = d_p.add(p, alpha=g["weight_decay"])
                    w_norm, u_norm = torch.linalg.vector_norm(p), torch.linalg.vector_norm(d_p)
                    one = torch.ones_like(w_norm)
                    trust = torch.where(
                        w_norm > 0, torch.where(u_norm > 0, g["trust_coefficient"] * w_norm / u_norm, one), one
                    )
                    d_p = d_p.mul(trust)
                state = self.state[p]
                if "mu" not in state:
                    state["mu"] = torch.zeros_like(p)
                mu = state["mu"]
                mu.mul_(g["momentum"]).add_(d_p)
                p.add_(mu, alpha=-g["lr"])
        return loss


def build_optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    """The preset's optimizer over the trainable parameters (the key encoder has none).

    v3 with LARS: no weight decay on norms and biases (1-D parameters), as the official LARS; v3 with
    AdamW (ViT): weight decay on every parameter, as the official ``main_moco.py``.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    if cfg.head == "v3" and cfg.optimizer != "adamw":
        decay = [p for p in params if p.ndim > 1]
        no_decay = [p for p in params if p.ndim <= 1]
        groups = [{"params": decay}, {"params": no_decay, "weight_decay": 0.0}]
    else:
        groups = [{"params": params}]
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.sgd_momentum, weight_decay=cfg.weight_decay)
    if cfg.optimizer == "lars":
        return LARS(groups, lr=cfg.lr, weight_decay=cfg.weight_decay, momentum=cfg.sgd_momentum)
    return torch.optim.AdamW(groups, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(cfg.sgd_momentum, 0.999))


def warmup_steps(cfg: TrainConfig, steps_per_epoch: int, total_steps: int) -> int:
    """Warm-up length in steps: ``warmup_epochs`` epochs, at most a quarter of training."""
    return min(round(cfg.warmup_epochs * steps_per_epoch), total_steps // 4)


def lr_at(step: int, cfg: TrainConfig, total_steps: int, steps_per_epoch: int, world_size: int = 1) -> float:
    """Learning rate at ``step``: base lr x global batch / 256, linear warm-up, then cosine or step decay."""
    base = _peak_lr(cfg, world_size)
    warm = warmup_steps(cfg, steps_per_epoch, total_steps)
    if step < warm:
        return base * (step + 1) / warm
    if cfg.lr_schedule == "step":
        progress = step / max(total_steps, 1)
        return base * (0.1 ** sum(progress >= milestone for milestone in (0.6, 0.8)))
    progress = (step - warm) / max(total_steps - warm, 1)
    return base * 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))


def lr_decay(step: int, cfg: TrainConfig, total_steps: int, steps_per_epoch: int, world_size: int = 1) -> float:
    """How far the learning rate has decayed at ``step``: 1 until the end of the warm-up, then lr / peak lr."""
    if step < warmup_steps(cfg, steps_per_epoch, total_steps):
        return 1.0
    return lr_at(step, cfg, total_steps, steps_per_epoch, world_size) / _peak_lr(cfg, world_size)


def _peak_lr(cfg: TrainConfig, world_size: int) -> float:
    return cfg.lr * cfg.batch_size * world_size / 256  # the linear scaling rule: lr is given for a batch of 256


def crop_size_at(step: int, cfg: TrainConfig, total_steps: int) -> int:
    """Training crop size at ``step``: ``image_size``; with ``min_image_size``, a linear rise from it to
    ``image_size`` over the first 75% of the steps, in whole multiples of 8 px (few distinct shapes)."""
    if not cfg.min_image_size:  # the usual case, every step: no array work
        return cfg.image_size
    return int(_crop_sizes(np.array([step]), cfg, total_steps)[0])


def _crop_sizes(steps: np.ndarray, cfg: TrainConfig, total_steps: int) -> np.ndarray:
    low, high = cfg.min_image_size, cfg.image_size
    if not low or low >= high:
        return np.full(len(steps), high)
    progress = np.minimum(steps / max(total_steps, 1) / PROGRESSIVE_END, 1.0)  # N
    sizes = (low + (high - low) * progress).astype(np.int64) // 8 * 8  # N
    return np.where(progress >= 1.0, high, np.clip(sizes, low, high))


def step_cost(cfg: TrainConfig) -> Callable[[np.ndarray, int], np.ndarray] | None:
    """Relative compute of the given steps in a schedule of ``total`` steps (pixels of their crops against
    full-size ones), for fitting a time budget; None when every step costs the same."""
    if not cfg.min_image_size or cfg.min_image_size >= cfg.image_size:
        return None
    return lambda steps, total: (_crop_sizes(steps, cfg, total) / cfg.image_size) ** 2


class BudgetClock:
    """Training seconds so far, against a time budget of ``budget_s`` seconds (0: none). ``elapsed``: those of
    earlier sessions (a resumed run); time inside :meth:`paused` (evaluations) does not count. ``now``: the
    monotonic clock (a test passes its own)."""

    def __init__(self, elapsed: float, budget_s: float, now: Callable[[], float] = time.monotonic) -> None:
        self.now, self.budget_s = now, budget_s
        self._start = now() - elapsed

    def at(self, t: float) -> float:
        """Training seconds at the clock's time ``t``."""
        return t - self._start

    def seconds(self) -> float:
        """Training seconds now."""
        return self.at(self.now())

    def spent(self, t: float) -> bool:
        """Whether the budget (if any) is spent at the clock's time ``t``."""
        return bool(self.budget_s) and self.at(t) >= self.budget_s

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """The time spent in this block is not training time."""
        t = self.now()
        try:
            yield
        finally:
            self._start += self.now() - t


class BudgetFit:
    """Fits the schedule's length to a time budget from the measured speed, a few times per run.

    First at step ``first`` (speed so far), then at 10%, 25% and 50% of that first fit with the speed
    since step ``first``: the first steps carry one-off costs (kernel selection, caches warming up),
    which alone made a 20-minute run end after 16. When fits happen depends on steps only, so every
    rank of a distributed run fits at the same steps (``agree`` then makes them take the same length).

    ``cost(steps, total)``: the relative compute of each of ``steps`` in a schedule of ``total`` steps, when they differ
    (progressive resolution): speed is then measured per unit of cost, the length solved so that the
    remaining steps' cost fits the remaining time with the speed since the previous fit, and two more fits at
    80% and 90% (the full-size steps' own speed: not all of a step's time grows with its pixels).
    """

    def __init__(self, budget_s: float, planned: int, first: int = 10,
                 cost: Callable[[np.ndarray, int], np.ndarray] | None = None) -> None:
        self.budget_s, self.planned, self.cost = budget_s, planned, cost
        self.due: list[int] = [first]  # steps at which the next fits happen
        self.mark: tuple[int, float] | None = None  # (step, training seconds) at the first fit
        self.total = planned  # the latest fit
        self.fractions = [0.1, 0.25, 0.5] + ([0.8, 0.9] if cost else [])  # of the schedule, where fits follow

    def update(self, step: int, spent: float, agree: Callable[[int], int] = lambda total: total) -> int | None:
        """The new schedule length if a fit is due at ``step`` (``spent`` training seconds so far), else None."""
        if not self.due or step < self.due[0]:
            return None
        start, start_s = self.mark or (0, 0.0)
        if self.cost is None:
            rate = (spent - start_s) / (step - start)  # s/step (since the first fit, after it)
            total = step + int((self.budget_s - spent) / rate)
        else:
            total = self._fit_with_cost(step, spent, start, start_s)
        total = agree(max(step + 1, min(self.planned, total)))
        self.total = total
        if self.mark is None:  # fits at fractions of the first fit's length
            self.due = sorted({s for f in self.fractions if (s := int(f * total)) > step})
        elif self.cost is None:
            self.due.pop(0)
        else:  # costs differ: fractions of the latest length, speed since this fit
            self.due = sorted({s for f in self.fractions if (s := int(f * total)) > step})
        if self.mark is None or self.cost is not None:
            self.mark = (step, spent)
        return total

    def _work(self, a: int, b: int, total: int) -> float:
        return float(self.cost(np.arange(a, b), total).sum()) if b > a else 0.0  # type: ignore[misc]

    def _fit_with_cost(self, step: int, spent: float, start: int, start_s: float) -> int:
        """The largest length whose remaining steps fit the remaining time at the measured s per unit of cost."""
        total = self.total
        for _ in range(4):  # the steps' costs depend on the length: a few rounds settle it
            rate = (spent - start_s) / max(self._work(start, step, total), 1e-9)  # s per unit of cost
            left = (self.budget_s - spent) / rate  # units of cost still to spend
            low, high = step + 1, max(step + 1, self.planned)
            while low < high:  # bisection: the remaining cost grows with the length
                mid = (low + high + 1) // 2
                low, high = (mid, high) if self._work(step, mid, mid) <= left else (low, mid - 1)
            if low == total:
                break
            total = low
        return total
