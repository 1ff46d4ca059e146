"""Synchronized batch norm (MoCo v3 under torchrun): 2 real gloo processes equal one BN over both batches."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from moco.model.sync_bn import AllReduceBatchNorm, convert_sync_bn

from .live import run_tree

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_two_processes_equal_one_batch_norm_over_the_concatenated_batch(tmp_path):
    """Outputs, input and weight gradients, running statistics (BN2d, BN2d channels_last, BN1d): a reference test."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(ROOT / "tests" / "dist_bn_check.py"), str(tmp_path)]
    proc = run_tree(cmd, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for rank in (0, 1):
        results = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert set(results) == {"bn2d", "bn2d_channels_last", "bn1d", "bn1d_no_affine"}
        for case, diffs in results.items():
            assert diffs["num_batches_tracked"] == 0 and diffs["output_layout_kept"] == 1, (rank, case)
            assert ("step1_weight_grad" in diffs) == (case != "bn1d_no_affine"), (rank, case)
            for name, value in diffs.items():
                if name not in ("num_batches_tracked", "output_layout_kept"):
                    assert value < 1e-4, (rank, case, name, value)


def test_convert_keeps_weights_and_statistics_and_runs_alone():
    """One process (no torchrun): the converted model is the same function, state-dict keys unchanged."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Flatten(), nn.LazyLinear(5), nn.BatchNorm1d(5))
    model(torch.randn(4, 3, 6, 6))  # materialize the lazy layer, move the running statistics
    x = torch.randn(6, 3, 6, 6)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    expected = model(x)
    reference_after = {k: v.clone() for k, v in model.state_dict().items()}
    model.load_state_dict(before)
    converted = convert_sync_bn(model, torch.device("cpu"))
    assert [type(m) for m in converted.modules()].count(AllReduceBatchNorm) == 2
    assert converted.state_dict().keys() == before.keys()
    torch.testing.assert_close(converted(x), expected)
    for k, v in converted.state_dict().items():
        torch.testing.assert_close(v, reference_after[k], msg=k)
