"""Run by torchrun for tests/test_sync_bn.py: synchronized BN on W processes vs one plain BN over all W x N images.

    python -m torch.distributed.run --standalone --nproc_per_node=2 tests/dist_bn_check.py OUT_DIR

Each rank normalises its own N images with ``moco.model.sync_bn.AllReduceBatchNorm`` (made by ``convert_sync_bn`` from a
plain BN); every rank also runs the plain BN on the concatenated W x N images. Two training steps, then one
eval step. Writes OUT_DIR/rank{R}.json: the largest absolute difference of each compared quantity, per case.
"""

from __future__ import annotations

import copy
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from moco.model.sync_bn import AllReduceBatchNorm, convert_sync_bn

N = 3  # images per rank
CASES = {  # name: (plain BN, shape of one rank's batch, memory format)
    "bn2d": (lambda: nn.BatchNorm2d(4), (N, 4, 5, 5), torch.contiguous_format),
    "bn2d_channels_last": (lambda: nn.BatchNorm2d(4), (N, 4, 5, 5), torch.channels_last),
    "bn1d": (lambda: nn.BatchNorm1d(6), (N, 6), torch.contiguous_format),
    "bn1d_no_affine": (lambda: nn.BatchNorm1d(6, affine=False), (N, 6), torch.contiguous_format),
}


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max())


def check(make_bn, shape: tuple[int, ...], fmt: torch.memory_format, rank: int, world: int) -> dict[str, float]:
    """Largest differences between this rank's synchronized BN and the plain BN on all ranks' images."""
    g = torch.Generator().manual_seed(0)  # the same data and weights on every rank
    plain = make_bn().train()
    if plain.affine:
        with torch.no_grad():
            plain.weight.copy_(torch.rand(plain.num_features, generator=g) + 0.5)
            plain.bias.copy_(torch.randn(plain.num_features, generator=g))
    sync = convert_sync_bn(copy.deepcopy(plain), torch.device("cpu"))
    assert type(sync) is AllReduceBatchNorm, type(sync)
    out: dict[str, float] = {}
    for step in range(2):
        x_all = torch.randn(world * shape[0], *shape[1:], generator=g) * 3 + 1  # W N x C (x H x W)
        dy_all = torch.randn(x_all.shape, generator=g)  # the upstream gradient: loss = sum(y * dy)
        if x_all.dim() == 4:
            x_all = x_all.contiguous(memory_format=fmt)
        x_ref = x_all.clone().requires_grad_()
        y_ref = plain(x_ref)
        (y_ref * dy_all).sum().backward()

        rows = slice(rank * shape[0], (rank + 1) * shape[0])
        x = x_all[rows].clone().requires_grad_()  # this rank's N images
        y = sync(x)
        (y * dy_all[rows]).sum().backward()
        out[f"step{step}_output"] = _max_diff(y, y_ref[rows])
        out[f"step{step}_input_grad"] = _max_diff(x.grad, x_ref.grad[rows])
        if plain.affine:
            for name in ("weight", "bias"):
                grad = getattr(sync, name).grad.clone()
                dist.all_reduce(grad)  # the loss is the sum of the ranks' losses
                out[f"step{step}_{name}_grad"] = _max_diff(grad, getattr(plain, name).grad)
                getattr(sync, name).grad, getattr(plain, name).grad = None, None
    out["running_mean"] = _max_diff(sync.running_mean, plain.running_mean)
    out["running_var"] = _max_diff(sync.running_var, plain.running_var)
    out["num_batches_tracked"] = float(sync.num_batches_tracked - plain.num_batches_tracked)
    out["output_layout_kept"] = float(y.is_contiguous(memory_format=fmt))
    x_eval = torch.randn(shape, generator=g)
    with torch.no_grad():
        out["eval_output"] = _max_diff(sync.eval()(x_eval), plain.eval()(x_eval))
    return out


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    results = {name: check(*case, rank, world) for name, case in CASES.items()}
    Path(sys.argv[1], f"rank{rank}.json").write_text(json.dumps(results, indent=1))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
