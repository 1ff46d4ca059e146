"""Run ``python -m moco.training`` unchanged with the synthetic budget clock of tests/step_clock.py, each rank at its
own speed: rank R's steps take 0.5 + 0.2 R seconds of it (tests/test_distributed.py).

    python -m torch.distributed.run --standalone --nproc_per_node=2 tests/dist_clock.py TRAIN_ARGS...
"""

from __future__ import annotations

import os
import sys

from moco.training.command import main
from tests.step_clock import StepClock

if __name__ == "__main__":
    rank = int(os.environ.get("RANK", "0"))
    StepClock(lambda step: 0.5 + 0.2 * rank).install()
    raise SystemExit(main(sys.argv[1:]))
