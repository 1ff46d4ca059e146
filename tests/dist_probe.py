"""Run ``python -m moco.training`` unchanged and record what its layers receive (tests/test_distributed.py).

    python -m torch.distributed.run --standalone --nproc_per_node=2 tests/dist_probe.py OUT_DIR TRAIN_ARGS...

Global forward pre-hooks observe every module of the training (nothing is replaced) and write, per rank,
OUT_DIR/rank{R}.json:
  bn_groups: the distinct [class name, images per BN group] of the batch norm layers in training mode,
      with the momentum encoder's (SplitBatchNorm: the batch over its splits)
  bn_modules: the class name of every module that holds batch statistics (running_mean), once per instance
  views: per step, the SHA-1 of the query view the model received
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

from torch import nn

from moco.training.command import main

seen = {"bn_groups": set(), "bn_modules": {}, "views": []}


def _record(module: nn.Module, args: tuple) -> None:
    if isinstance(module, nn.modules.batchnorm._BatchNorm) and module.training:
        group = args[0].shape[0] // getattr(module, "num_splits", 1)
        seen["bn_groups"].add((type(module).__name__, group))
        seen["bn_modules"][id(module)] = type(module).__name__
    elif type(module).__name__ == "MoCo" and module.training:
        x1 = args[0].detach().float().contiguous().cpu()
        seen["views"].append(hashlib.sha1(x1.numpy().tobytes()).hexdigest())


if __name__ == "__main__":
    out = Path(sys.argv[1])
    handle = nn.modules.module.register_module_forward_pre_hook(_record)
    code = main(sys.argv[2:])
    handle.remove()
    record = {
        "bn_groups": sorted(seen["bn_groups"]),
        "bn_modules": sorted(seen["bn_modules"].values()),
        "views": seen["views"],
    }
    (out / f"rank{os.environ.get('RANK', '0')}.json").write_text(json.dumps(record))
    raise SystemExit(code)
