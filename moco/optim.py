"""Optimizers (SGD, LARS, AdamW) and the learning-rate schedule as a pure function of the step."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from moco.config import TrainConfig

__all__ = ["LARS", "BudgetFit", "build_optimizer", "lr_at", "warmup_steps"]


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
    base = cfg.lr * cfg.batch_size * world_size / 256
    warm = warmup_steps(cfg, steps_per_epoch, total_steps)
    if step < warm:
        return base * (step + 1) / warm
    if cfg.lr_schedule == "step":
        progress = step / max(total_steps, 1)
        return base * (0.1 ** sum(progress >= milestone for milestone in (0.6, 0.8)))
    progress = (step - warm) / max(total_steps - warm, 1)
    return base * 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))


class BudgetFit:
    """Fits the schedule's length to a time budget from the measured speed, a few times per run.

    First at step ``first`` (speed so far), then at 10%, 25% and 50% of that first fit with the speed
    since step ``first``: the first steps carry one-off costs (kernel selection, caches warming up),
    which alone made a 20-minute run end after 16. When fits happen depends on steps only, so every
    rank of a distributed run fits at the same steps (``agree`` then makes them take the same length).
    """

    def __init__(self, budget_s: float, planned: int, first: int = 10) -> None:
        self.budget_s, self.planned = budget_s, planned
        self.due: list[int] = [first]  # steps at which the next fits happen
        self.mark: tuple[int, float] | None = None  # (step, training seconds) at the first fit

    def update(self, step: int, spent: float, agree: Callable[[int], int] = lambda total: total) -> int | None:
        """The new schedule length if a fit is due at ``step`` (``spent`` training seconds so far), else None."""
        if not self.due or step < self.due[0]:
            return None
        if self.mark is None:
            rate = spent / step  # s/step
        else:
            rate = (spent - self.mark[1]) / (step - self.mark[0])  # s/step since the first fit
        total = agree(max(step + 1, min(self.planned, step + int((self.budget_s - spent) / rate))))
        if self.mark is None:
            self.mark = (step, spent)
            self.due = sorted({s for f in (0.1, 0.25, 0.5) if (s := int(f * total)) > step})
        else:
            self.due.pop(0)
        return total
