"""Real torchrun: 2 CPU processes on the gloo backend, identical queues, exact resume mid-epoch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def _torchrun(data: Path, run: Path, *extra: str, max_steps: int = 8) -> subprocess.CompletedProcess:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        "-m",
        "moco.train",
        str(data),
        "--out",
        str(run),
        "--arch",
        "resnet18",
        "--small-stem",
        "--image-size",
        "16",
        "--batch-size",
        "4",
        "--bn-splits",
        "1",
        "--queue-size",
        "40",
        "--max-steps",
        str(max_steps),
        "--workers",
        "0",
        "--precision",
        "fp32",
        "--quiet",
        *extra,
    ]
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


@pytest.mark.slow
def test_two_process_training_queues_agree_and_resume_is_exact(sample_photos, tmp_path):
    straight = tmp_path / "straight"
    _torchrun(sample_photos, straight)
    a = torch.load(straight / "checkpoint.pt", weights_only=True)
    assert a["step"] == 8
    # every rank enqueued the same all-gathered keys: the checksums of both ranks' queues agree
    sums = a["replica_queue_checksums"]
    assert len(sums) == 2 and sums[0] == sums[1]
    assert sums[0][2] == 8 * 2 * 4 % 40  # pointer after 8 steps of 2 ranks x 4 keys
    q = a["model"]["queue"]
    assert sums[0][0] == pytest.approx(q.double().sum().item(), rel=1e-12)
    # the queue ids are exactly the sampler's ids of both ranks, rank 0's then rank 1's, FIFO with wrap-around
    from moco.train import _batch_ids, _Dist

    expected, ptr = [-1] * 40, 0
    for step in range(8):
        epoch, index = divmod(step, 6)
        ids = [i for r in (0, 1) for i in _batch_ids(epoch, index, 48, 4, 0, _Dist(r, 2)).tolist()]
        for i in ids:
            expected[ptr] = i
            ptr = (ptr + 1) % 40
    assert a["model"]["queue_ids"][0].tolist() == expected
    # 48 images / (2 x 4) = 6 steps per epoch: stopping at 3 and resuming crosses the epoch boundary
    split = tmp_path / "split"
    _torchrun(sample_photos, split, "--stop-after", "3")
    assert torch.load(split / "checkpoint.pt", weights_only=True)["step"] == 3
    _torchrun(sample_photos, split, "--resume")
    b = torch.load(split / "checkpoint.pt", weights_only=True)
    assert b["step"] == 8
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k


@pytest.mark.slow
def test_two_process_time_budget_ends_together(sample_photos, tmp_path):
    """Each rank times its own steps; the fitted schedules must agree, or one rank would wait forever."""
    run = tmp_path / "budget"
    _torchrun(sample_photos, run, "--time-budget", "0.15", "--epochs", "10000", max_steps=0)
    ckpt = torch.load(run / "checkpoint.pt", weights_only=True)
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, ckpt["step"] + 1))
    assert ckpt["step"] > 10 and ckpt["step"] <= ckpt["total_steps"] < 10000 * 6  # fitted to the budget
    sums = ckpt["replica_queue_checksums"]
    assert len(sums) == 2 and sums[0] == sums[1]
