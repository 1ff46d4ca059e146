"""Where and how this process runs: its device and precision (the autocast context), its place among torchrun's
processes (:class:`Dist`) and its log (:func:`setup_logging`)."""

from __future__ import annotations

import logging
import os
import sys
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

import torch

from moco.errors import UserError

__all__ = ["resolve_device", "mps_available", "resolve_precision", "autocast_for", "init_distributed", "Dist",
           "setup_logging"]

logger = logging.getLogger(__name__)


def resolve_device(name: str) -> torch.device:
    """auto -> cuda (this rank's GPU under torchrun) when available, else Apple's mps when available, else cpu."""
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise UserError(f"--device {name} was asked for but no CUDA GPU is visible: use --device cpu or auto")
    if name == "mps" and not mps_available():
        raise UserError("--device mps was asked for but no Apple GPU (MPS) is available: use --device cpu or auto")
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "mps" if mps_available() else "cpu"
    if name == "cuda":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    try:
        return torch.device(name)
    except RuntimeError:
        raise UserError(f"--device {name!r} is not a device: use auto, cpu, cuda, cuda:N or mps") from None


def mps_available() -> bool:
    """Whether this torch runs on an Apple GPU (Metal Performance Shaders)."""
    backend = getattr(torch.backends, "mps", None)
    return bool(backend is not None and backend.is_available())


def resolve_precision(name: str, device: torch.device) -> str:
    """auto -> bf16 where it runs fast (CPUs with AMX/avx512_bf16, GPUs with bf16), fp16 on older GPUs, else fp32
    (Apple's GPU: fp32)."""
    if device.type == "cpu":
        if name == "fp16":  # runs (autocast + GradScaler on the CPU), e.g. to check the older-GPU path
            logger.warning("--precision fp16 on the CPU is slow (most CPUs have no fp16 arithmetic); it is the "
                           "path for GPUs without bf16: use bf16 or fp32 here unless you are checking it")
        if name == "auto":
            return "bf16" if _cpu_has_fast_bf16() else "fp32"
        return name
    if device.type == "mps":  # autocast runs there, but fp32 is the precision every op of the model supports
        return "fp32" if name == "auto" else name
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


class Dist:
    """This process's place among torchrun's processes (one process: rank 0 of 1) and the collectives the stages
    share: a number reduced on the device, Python objects broadcast from and gathered to rank 0 (over gloo, on any
    backend). Join the process group with :meth:`join`; :meth:`close` leaves it."""

    def __init__(self, rank: int = 0, world: int = 1) -> None:
        self.rank, self.world = rank, world
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        self._objects: Any = None  # the gloo group objects travel over, made when first needed (by every rank)

    @classmethod
    def join(cls, device: str = "auto") -> Dist:
        """This process in torchrun's process group (WORLD_SIZE > 1), else alone: see :func:`init_distributed`."""
        return cls(*init_distributed(device))

    @property
    def main(self) -> bool:
        return self.rank == 0

    def device(self, device: str) -> str:
        """``device`` for this rank: under torchrun, auto is this rank's GPU where there is one."""
        if device == "auto" and self.world > 1 and torch.cuda.is_available():
            return f"cuda:{self.local_rank}"
        return device

    def reduce(self, value: float, op: str, device: torch.device) -> float:
        """``value`` reduced over all ranks (``op``: "min" | "max"), on ``device`` (NCCL needs a GPU tensor)."""
        if self.world == 1:
            return value
        import torch.distributed as dist

        t = torch.tensor([value], dtype=torch.float64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN if op == "min" else dist.ReduceOp.MAX)
        return float(t.item())

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank."""
        if self.world == 1:
            return obj
        import torch.distributed as dist

        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self._objects_group())
        return box[0]

    def gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in rank order, on rank 0 (an empty list on the others)."""
        if self.world == 1:
            return [obj]
        import torch.distributed as dist

        out: list[Any] = [None] * self.world if self.rank == 0 else None  # type: ignore[assignment]
        dist.gather_object(obj, out, dst=0, group=self._objects_group())
        return out if self.rank == 0 else []

    def close(self) -> None:
        """Wait for every rank, then leave the process group."""
        if self.world > 1:
            import torch.distributed as dist

            dist.barrier(group=self._objects)
            dist.destroy_process_group()

    def _objects_group(self) -> Any:
        if self._objects is None:
            import torch.distributed as dist

            self._objects = dist.new_group(backend="gloo")
        return self._objects


def setup_logging(verbose: bool = False) -> None:
    """The log of a command: INFO on rank 0 (``verbose``: DEBUG, with times and logger names), WARNING on the other
    ranks, whose lines carry ``[rank N]``; on stderr."""
    rank = int(os.environ.get("RANK", "0"))
    level = logging.DEBUG if verbose else (logging.INFO if rank == 0 else logging.WARNING)
    fmt = "%(asctime)s %(levelname)s %(name)s: %(message)s" if verbose else "%(levelname)s: %(message)s"
    logging.basicConfig(level=level, format=f"[rank {rank}] {fmt}" if rank else fmt, stream=sys.stderr, force=True)
