"""The machine a benchmark ran on, as its results state it beside every figure."""

from __future__ import annotations

import contextlib
import platform
import subprocess
from pathlib import Path


def cpu_model() -> str:
    """The CPU model as ``lscpu`` names it (``Model name``), else /proc/cpuinfo's, else the platform's."""
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        for line in subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    with contextlib.suppress(OSError):  # not Linux's lscpu
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine() or "unknown CPU"
