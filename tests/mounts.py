"""Real small file systems for tests of full and read-only disks (tmpfs; needs root, else the test skips)."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

__all__ = ["tmpfs", "remount_ro"]


@contextmanager
def tmpfs(where: Path, size: str) -> Iterator[Path]:
    """A fresh tmpfs of ``size`` (e.g. "8m") mounted at ``where``, unmounted afterwards."""
    where.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], capture_output=True,
                       text=True)
    if r.returncode:
        pytest.skip(f"cannot mount a tmpfs here ({r.stderr.strip() or r.returncode}): needs root")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def remount_ro(where: Path) -> None:
    """Make the tmpfs at ``where`` read-only (as a read-only mount or medium would be)."""
    subprocess.run(["mount", "-o", "remount,ro", str(where)], check=True)
