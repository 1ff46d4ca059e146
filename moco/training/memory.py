"""What a run will hold in memory, estimated from its config before anything is allocated or decoded, against what
the machine has: the queue, the logits against it, a batch of views with their activations, the photos being
decoded. A config that cannot fit is refused at once (:func:`check_memory`), naming the flag, the estimate and the
fix, instead of failing in the allocator or being killed for memory minutes later.

The estimate is a lower bound (the model's own weights and most activations are left out): what it refuses cannot
run here; what it passes may still need more.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path

from moco.config import TrainConfig, default_workers, flag_name
from moco.data.cache import cache_size_for
from moco.errors import UserError

__all__ = ["Part", "estimate_memory", "machine_memory", "check_memory"]

ACTIVATIONS = 8  # what a backbone keeps for backward, in multiples of its input: a floor (ResNet-50 keeps ~100x)
DECODING = 4  # a photo being decoded and resized to the cache's side: at least 4x the uint8 result (draft + resize)
_CGROUP_LIMITS = ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes")  # v2, v1


@dataclass(frozen=True)
class Part:
    """One thing a run holds: what it is, its bytes, the fields that size it, and whether it lives on the device."""

    what: str
    nbytes: int
    fields: tuple[str, ...]  # the TrainConfig fields a smaller value of which shrinks it, the first first
    on_device: bool


def estimate_memory(cfg: TrainConfig) -> list[Part]:
    """The memory ``cfg``'s run holds at once, part by part (a lower bound; see the module's docstring)."""
    views = 2 if cfg.symmetric else 1  # v2 symmetric / v3: both views are queries, one queue per view
    K, C, N, s = cfg.queue_size, cfg.dim, cfg.batch_size, cfg.image_size
    side = cache_size_for(cfg.image_size, cfg.cache_size)
    workers = max(1, default_workers(cfg.workers))
    pixels = 3 * s * s * 4  # one float32 view
    return [
        Part(f"the queue of {K} keys of {C} dims{' per view' if views > 1 else ''}", views * K * (C * 4 + 8),
             ("queue_size", "dim"), True),  # V x C x K float32 + V x K int64 ids
        Part(f"the logits of {N} queries against {K} keys", views * N * (K + 1) * (3 * 4 + 1),
             ("queue_size", "batch_size"), True),  # N x (1+K) float32 logits, softmax, gradient; a bool mask
        Part(f"a batch of {N} x 2 views of {s} px with their activations", N * (2 + views * ACTIVATIONS) * pixels,
             ("batch_size", "image_size"), True),
        Part(f"{N} cached photos of {side} px for a batch", N * side * side * 3,
             ("batch_size", "cache_size" if cfg.cache_size else "image_size"), False),
        Part(f"{workers} photo{'s' * (workers > 1)} of {side} px being decoded", workers * side * side * 3 * DECODING,
             ("cache_size" if cfg.cache_size else "image_size", "workers"), False),
    ]


def machine_memory(device_type: str = "cpu", device_index: int = 0) -> tuple[int, str] | None:
    """(bytes, its name) of the memory a run on this device has: the GPU's, or this machine's RAM (within the
    container's limit); None when it cannot be read."""
    if device_type == "cuda":
        import torch

        return torch.cuda.get_device_properties(device_index).total_memory, f"the GPU cuda:{device_index}'s memory"
    total = None
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        total = _meminfo_total()
    if not total:
        return None
    for path in _CGROUP_LIMITS:
        try:
            limit = Path(path).read_text().strip()
        except OSError:
            continue
        if limit.isdigit() and 0 < int(limit) < total:
            return int(limit), "this container's memory limit"
    return total, "this machine's memory"


def _meminfo_total() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None  # unreadable: the caller says the memory is unknown
    return None


def check_memory(cfg: TrainConfig, device_type: str = "cpu", device_index: int = 0,
                 memory: dict[str, tuple[int, str]] | None = None) -> None:
    """Refuse (UserError) a ``cfg`` whose run cannot fit in memory, naming the flag and value of its largest part,
    the estimate, the memory there is and a value of that flag that fits. ``memory``: the bytes and name of the
    ``"host"``'s and (on a GPU) the ``"device"``'s memory; default: read from this machine (:func:`machine_memory`)."""
    if memory is None:
        found = {"host": machine_memory(), "device": machine_memory(device_type, device_index)
                 if device_type == "cuda" else None}
        memory = {k: v for k, v in found.items() if v is not None}
    parts = estimate_memory(cfg)
    for where, (nbytes, name) in memory.items():
        held = _held(parts, where, device_type)
        need = sum(p.nbytes for p in held)
        if not held or need <= nbytes:
            continue
        big = max(held, key=lambda p: p.nbytes)
        flags = ", ".join(f"--{flag_name(f)} {getattr(cfg, f)}" for f in big.fields)
        fixes = [fix for f in big.fields if (fix := _fix(cfg, f, where, device_type, nbytes))]
        raise UserError(f"{flags}: the run needs at least {_size(need)} of memory, more than {name} "
                        f"({_size(nbytes)}), {_size(big.nbytes)} of it for {big.what}: use "
                        f"{' or '.join(fixes) or 'smaller values'}, or a machine with more memory")


def _held(parts: list[Part], where: str, device_type: str) -> list[Part]:
    """The parts ``where`` ("host" or "device") holds: on a CPU the host holds all; on a GPU the device its own."""
    if device_type != "cuda":
        return parts if where == "host" else []
    return [p for p in parts if p.on_device == (where == "device")]


def _fix(cfg: TrainConfig, field: str, where: str, device_type: str, nbytes: int) -> str | None:
    """``--flag V or less``: the largest value V of ``field`` (halving it, the others kept) with which the parts held
    ``where`` fit; None when none does."""
    smallest = {"queue_size": cfg.batch_size, "batch_size": 2, "workers": 1}.get(field, 16)
    value = default_workers(cfg.workers) if field == "workers" else getattr(cfg, field)
    while value > smallest:
        value = max(smallest, value // 2)
        if sum(p.nbytes for p in _held(estimate_memory(replace(cfg, **{field: value})), where, device_type)) <= nbytes:
            return f"--{flag_name(field)} {value} or less"
    return None


def _size(nbytes: int) -> str:
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes} bytes"
