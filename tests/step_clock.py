"""A synthetic clock for the time budget of ``moco.training.loop``: each training step takes ``seconds(step)`` of it,
however loaded the machine is (tests/test_train.py; tests/dist_clock.py under torchrun).

The budget's clock is ``moco.training.loop._clock``; each call of ``moco.training.loop._train_step`` (which still
runs) advances it by its step's seconds first, so the step's record and everything after it see the time it took.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any


class StepClock:
    """Training time that advances only with the steps: ``seconds(step)`` for the 0-based ``step``."""

    def __init__(self, seconds: Callable[[int], float]) -> None:
        self.seconds, self.now = seconds, 0.0

    def install(self, setattr_: Callable[[Any, str, Any], None] = setattr) -> None:
        """Put this clock into ``moco.training.loop`` (``setattr_``: pytest's ``monkeypatch.setattr`` to undo it after
        the test; plain ``setattr`` in a process of its own)."""
        import moco.training.loop  # noqa: F401

        module = sys.modules["moco.training.loop"]
        real = module._train_step

        def timed_step(loop: Any, step: int, *rest: Any) -> dict[str, Any]:
            self.now += self.seconds(step)
            return real(loop, step, *rest)

        setattr_(module, "_clock", lambda: self.now)
        setattr_(module, "_train_step", timed_step)
