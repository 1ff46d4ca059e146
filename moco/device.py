"""Where and in what precision to run: device choice, precision choice, the autocast context."""

from __future__ import annotations

import logging
import os
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch

from moco.errors import UserError

__all__ = ["resolve_device", "resolve_precision", "autocast_for", "init_distributed", "Dist"]

logger = logging.getLogger(__name__)


def resolve_device(name: str) -> torch.device:
    """auto -> cuda (this rank's GPU under torchrun) when available, else cpu."""
    if name == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda was asked for but no CUDA GPU is visible: use --device cpu or auto")
    if name == "cpu" or (name == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))


def resolve_precision(name: str, device: torch.device) -> str:
    """auto -> bf16 where it runs fast (CPUs with AMX/avx512_bf16, GPUs with bf16), fp16 on older GPUs, else fp32."""
    if device.type == "cpu":
        if name == "fp16":  # runs (autocast + GradScaler on the CPU), e.g. to check the older-GPU path
            logger.warning("--precision fp16 on the CPU is slow (most CPUs have no fp16 arithmetic); it is the "
                           "path for GPUs without bf16: use bf16 or fp32 here unless you are checking it")  # fmt: skip
        if name == "auto":
            return "bf16" if _cpu_has_fast_bf16() else "fp32"
        return name
    if name == "auto":
        return "bf16" if torch.cuda.is_bf16_supported() else "fp16"
    return name


def _cpu_has_fast_bf16() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return any(f in flags for f in ("amx_bf16", "avx512_bf16"))


def autocast_for(device: torch.device, precision: str) -> AbstractContextManager:
    """``torch.autocast`` for bf16/fp16 on ``device``; a no-op context for fp32."""
    if precision not in ("bf16", "fp16"):
        return nullcontext()
    return torch.autocast(device.type, dtype=torch.bfloat16 if precision == "bf16" else torch.float16)


def init_distributed(device_name: str = "auto") -> tuple[int, int]:
    """Join the torchrun process group when launched by torchrun (WORLD_SIZE > 1): (rank, world).

    NCCL when this process uses a GPU (set to its LOCAL_RANK), gloo otherwise.
    """
    import torch.distributed as dist

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return 0, 1
    if not dist.is_initialized():
        use_cuda = device_name != "cpu" and torch.cuda.is_available()
        if use_cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group("nccl" if use_cuda else "gloo")
    return dist.get_rank(), dist.get_world_size()


@dataclass
class Dist:
    """This process's rank among ``world`` processes (one process: rank 0 of 1)."""

    rank: int = 0
    world: int = 1

    @property
    def main(self) -> bool:
        return self.rank == 0
