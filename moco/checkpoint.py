"""Training checkpoints: atomic save, ``weights_only`` load, the last N kept."""

from __future__ import annotations

import logging
import os
import tempfile
from pathlib import Path
from typing import Any

import torch

from moco.errors import UserError

__all__ = ["FORMAT", "VERSION", "save_checkpoint", "load_checkpoint", "atomic_write"]

logger = logging.getLogger(__name__)

FORMAT = "moco-retrieval/checkpoint"
VERSION = 1


def atomic_write(path: str | Path, write: Any) -> None:
    """Call ``write(file_object)`` on a temp file beside ``path``, fsync it, then rename it over ``path``.

    A crash at any moment leaves either the old file or the new one, never a partial file.
    """
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def save_checkpoint(state: dict[str, Any], run_dir: str | Path, keep: int = 2) -> Path:
    """Write ``state`` to ``run_dir/checkpoint.pt`` atomically; keep ``keep`` step-numbered copies."""
    run_dir = Path(run_dir)
    state = {"format": FORMAT, "version": VERSION, **state}
    path = run_dir / "checkpoint.pt"
    atomic_write(path, lambda f: torch.save(state, f))
    if keep > 0:
        numbered = run_dir / f"checkpoint-{int(state['step']):08d}.pt"
        if not numbered.exists():
            try:
                os.link(path, numbered)  # same bytes, no second write
            except OSError:
                atomic_write(numbered, lambda f: torch.save(state, f))
        for old in sorted(run_dir.glob("checkpoint-*.pt"))[:-keep]:
            old.unlink(missing_ok=True)
    logger.info("saved %s (step %d)", path, state["step"])
    return path


def load_checkpoint(path: str | Path, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """Load a checkpoint with ``torch.load(weights_only=True)``; never runs pickled code."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"checkpoint {path} does not exist: check the path, or train first with `moco train`")
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except Exception as e:  # noqa: BLE001 - any failure here means the file is not usable
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        if "Weights only load failed" in str(e) or "Unsupported global" in str(e):
            raise UserError(
                f"refusing to load {path}: it needs arbitrary pickled code to load ({msg[:200]}); "
                "only plain tensor checkpoints are accepted (re-save it with torch.save(state_dict))"
            ) from None
        raise UserError(
            f"cannot read checkpoint {path}: {msg[:300]}; the file may be truncated or not a PyTorch file"
        ) from None
