"""Synchronized batch norm for MoCo v3 under torchrun: every process normalises with the whole global batch.

The official v3 converts the whole model (encoders, heads, momentum encoder) with
``nn.SyncBatchNorm.convert_sync_batchnorm``; ``convert_sync_bn`` does the same with torch's class on GPUs. torch's
``SyncBatchNorm`` refuses CPU tensors (and DDP refuses it on CPU), so CPU processes (gloo) get ``AllReduceBatchNorm``:
the same statistics from one all-reduce per layer that carries gradients.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

__all__ = ["AllReduceBatchNorm", "convert_sync_bn"]

logger = logging.getLogger(__name__)

_PLAIN_BN = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)


class _AllReduceSum(torch.autograd.Function):
    """Sum over processes. The loss is the sum of the processes' losses, so the gradient of each input
    is again the sum of the processes' output gradients."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class AllReduceBatchNorm(nn.modules.batchnorm._BatchNorm):
    """Batch norm synchronized over the default process group, for any input ``N x C x ...`` (BN1d, BN2d).

    In training within a process group, each process's count, mean and sum of squared deviations per channel
    are all-reduced and combined (Chan et al.), then its images are normalised with the statistics of all
    processes' images; the running statistics get the global mean and unbiased variance, as torch's
    ``SyncBatchNorm``. Otherwise (eval, one process) it is plain batch norm. The state-dict keys of a BN.
    """

    def _check_input_dim(self, x: torch.Tensor) -> None:
        if x.dim() < 2:
            raise ValueError(f"expected an input N x C x ..., got {x.dim()} dimensions")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not (self.training and dist.is_available() and dist.is_initialized()):
            return super().forward(x)
        self._check_input_dim(x)
        group = dist.group.WORLD
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        c = x.shape[1]
        dims = [0, *range(2, x.dim())]  # all but the channels
        shape = [1, c] + [1] * (x.dim() - 2)  # a C vector broadcast over x
        xf = x.to(torch.promote_types(x.dtype, torch.float32))  # statistics in fp32 at least (bf16 autocast)
        mean = xf.mean(dims)  # C
        m2 = (xf - mean.view(shape)).square().sum(dims)  # C: sum of squared deviations
        local = torch.cat([mean.new_full((1,), x.numel() // c), mean, m2])  # 1 + 2C
        rows = _AllReduceSum.apply(F.pad(local[None], (0, 0, rank, world - rank - 1)), group)  # W x (1 + 2C)
        counts, means, m2s = rows[:, :1], rows[:, 1 : 1 + c], rows[:, 1 + c :]  # W x 1, W x C, W x C
        total = counts.sum()
        mean = (counts * means).sum(0) / total  # C
        var = (m2s + counts * (means - mean).square()).sum(0) / total  # C, biased: used to normalise
        if self.track_running_stats:
            self.num_batches_tracked.add_(1)
            factor = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
            with torch.no_grad():
                self.running_mean.lerp_(mean.to(self.running_mean.dtype), factor)
                self.running_var.lerp_((var * total / (total - 1)).to(self.running_var.dtype), factor)
        y = (xf - mean.view(shape)) * torch.rsqrt(var + self.eps).view(shape)
        if self.affine:
            y = y * self.weight.view(shape) + self.bias.view(shape)
        return y.to(x.dtype)


def convert_sync_bn(module: nn.Module, device: torch.device) -> nn.Module:
    """Replace every plain ``nn.BatchNorm1d/2d/3d`` in ``module`` by synchronized BN sharing its parameters and
    statistics: torch's ``nn.SyncBatchNorm`` for a CUDA ``device`` (NCCL), else ``AllReduceBatchNorm`` (gloo).

    Unlike ``nn.SyncBatchNorm.convert_sync_batchnorm``, subclasses (``SplitBatchNorm``, timm's ``BatchNormAct2d``)
    are left as they are, with a warning, rather than losing what they add."""
    sync_bn = nn.SyncBatchNorm if device.type == "cuda" else AllReduceBatchNorm
    if type(module) in _PLAIN_BN:
        new = sync_bn(module.num_features, module.eps, module.momentum, module.affine, module.track_running_stats)
        if module.affine:
            new.weight, new.bias = module.weight, module.bias
        if module.track_running_stats:
            new.running_mean, new.running_var = module.running_mean, module.running_var
            new.num_batches_tracked = module.num_batches_tracked
        return new.train(module.training)
    if isinstance(module, nn.modules.batchnorm._BatchNorm) and not isinstance(module, (sync_bn, nn.SyncBatchNorm)):
        logger.warning("%s is not a plain batch norm: it stays per process, not synchronized", type(module).__name__)
    for name, child in module.named_children():
        setattr(module, name, convert_sync_bn(child, device))
    return module
