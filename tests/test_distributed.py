"""Real torchrun: 2 CPU processes on the gloo backend, identical queues, exact resume mid-epoch, one BN group
per process (v3: synchronized BN), each rank its own augmentations."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from moco.config import resolve_config
from moco.errors import UserError
from moco.model.backbones import build_backbone
from moco.model.builder import MoCo

from .live import run_tree

ROOT = Path(__file__).resolve().parents[1]


def _torchrun(
    data: Path, run: Path, *extra: str, max_steps: int = 8, probe: Path | None = None, clock: bool = False
) -> subprocess.CompletedProcess:
    """``python -m moco.training`` on 2 processes; with ``probe``, through tests/dist_probe.py writing there; with
    ``clock``, through tests/dist_clock.py (a synthetic budget clock, each rank at its own speed)."""
    entry = ["-m", "moco.training"] if probe is None else [str(ROOT / "tests" / "dist_probe.py"), str(probe)]
    if clock:
        entry = [str(ROOT / "tests" / "dist_clock.py")]
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        *entry,
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
    proc = run_tree(cmd, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


@pytest.mark.slow
def test_two_process_training_queues_agree_and_resume_is_exact(sample_photos, tmp_path):
    straight, probe = tmp_path / "straight", tmp_path / "probe"
    probe.mkdir()
    proc = _torchrun(sample_photos, straight, probe=probe)  # the v2 preset, no --bn-splits
    a = torch.load(straight / "checkpoint.pt", weights_only=True)
    assert a["step"] == 8
    # one BN group per process (Shuffle BN across ranks): every BN layer saw the per-process batch of 4
    for rank in (0, 1):
        assert json.loads((probe / f"rank{rank}.json").read_text())["bn_groups"] == [["BatchNorm2d", 4]]
    assert a["config"]["bn_splits"] == 1  # the resolved value is saved, and resumed below
    assert "4 images per batch-norm group" in proc.stderr and "fewer than 16" in proc.stderr
    # every rank enqueued the same all-gathered keys: the checksums of both ranks' queues agree
    sums = a["replica_queue_checksums"]
    assert len(sums) == 2 and sums[0] == sums[1]
    assert sums[0][2] == 8 * 2 * 4 % 40  # pointer after 8 steps of 2 ranks x 4 keys
    q = a["model"]["queue"]
    assert sums[0][0] == pytest.approx(q.double().sum().item(), rel=1e-12)
    # the queue ids are exactly the sampler's ids of both ranks, rank 0's then rank 1's, FIFO with wrap-around
    from moco.runtime import Dist as _Dist
    from moco.training.loop import _batch_ids

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
    """Each rank times its own steps; the fitted schedules must agree, or one rank would wait forever. The budget's
    clock is synthetic (tests/dist_clock.py: issue 39, a loaded machine gave too few steps to fit): rank 0 takes
    0.5 s a step, rank 1 0.7 s, 12 s of budget. At step 10 rank 0 fits 10 + 7 / 0.5 = 24 steps, rank 1
    10 + 5 / 0.7 = 17; both take 17 (and again at step 12), and end there together, rank 1 at 11.9 s."""
    run = tmp_path / "budget"
    _torchrun(sample_photos, run, "--time-budget", "0.2", "--epochs", "10000", max_steps=0, clock=True)
    ckpt = torch.load(run / "checkpoint.pt", weights_only=True)
    assert ckpt["step"] == ckpt["total_steps"] == 17 and "planned_steps" not in ckpt
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, ckpt["step"] + 1))
    assert ckpt["step"] > 10 and ckpt["step"] <= ckpt["total_steps"] < 10000 * 6  # fitted to the budget
    sums = ckpt["replica_queue_checksums"]
    assert len(sums) == 2 and sums[0] == sums[1]


def _copies_of_one_photo(folder: Path, source: Path, n: int) -> Path:
    """``n`` byte-identical photos: every rank then gets the same images, so only the augmentations differ."""
    folder.mkdir()
    photo = next(p for p in sorted(source.rglob("*.png")))
    for i in range(n):
        shutil.copyfile(photo, folder / f"copy{i:02d}.png")
    return folder


@pytest.mark.slow
def test_two_process_explicit_bn_splits_win_and_ranks_draw_their_own_views(sample_photos, tmp_path):
    data = _copies_of_one_photo(tmp_path / "same", sample_photos, 16)
    probe = tmp_path / "probe"
    probe.mkdir()
    proc = _torchrun(data, tmp_path / "run", "--bn-splits", "2", max_steps=3, probe=probe)
    ranks = [json.loads((probe / f"rank{r}.json").read_text()) for r in (0, 1)]
    for seen in ranks:  # --bn-splits 2 given: 2 split BN groups of 2 in each process of 4 images
        assert seen["bn_groups"] == [["SplitBatchNorm", 2]]
    assert torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=True)["config"]["bn_splits"] == 2
    assert "2 images per batch-norm group" in proc.stderr
    # the same images on both ranks, and each step's views differ: each rank draws its own crops, jitter, flips
    assert len(ranks[0]["views"]) == len(ranks[1]["views"]) == 3
    for step, (v0, v1) in enumerate(zip(ranks[0]["views"], ranks[1]["views"])):
        assert v0 != v1, f"rank 0 and rank 1 used the same augmentations at step {step}"


@pytest.mark.slow
def test_two_process_v3_synchronizes_batch_norm(sample_photos, tmp_path):
    """v3 under torchrun converts every BN (backbone, projector, predictor, momentum encoder) to synchronized BN."""
    probe = tmp_path / "probe"
    probe.mkdir()
    run = tmp_path / "v3"
    v3 = ["--preset", "v3", "--queue-size", "0", "--mlp-hidden", "32", "--dim", "16"]
    _torchrun(sample_photos, run, *v3, max_steps=2, probe=probe)
    plain = MoCo(*build_backbone("resnet18", True, 16), head="v3", dim=16, hidden=32, projector_layers=2, K=0)
    expected = sum(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in plain.modules())
    for rank in (0, 1):
        seen = json.loads((probe / f"rank{rank}.json").read_text())
        assert seen["bn_modules"] == ["AllReduceBatchNorm"] * expected, rank
    ckpt = torch.load(run / "checkpoint.pt", weights_only=True)
    assert ckpt["step"] == 2 and ckpt["config"]["bn_splits"] == 1
    assert ckpt["model"].keys() == plain.state_dict().keys()  # exports and --init read it like any v3 run
    # --bn-splits > 1 splits batch norm for Shuffle BN; v3 does not shuffle its keys: refused, naming the fix
    with pytest.raises(UserError, match="--bn-splits 1"):
        resolve_config("v3", arch="resnet18", bn_splits=2, batch_size=8, queue_size=0)
