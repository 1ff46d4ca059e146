"""A run is finished only once its checkpoint carries the whitening its config asks for: whatever stops the
end-of-run fit (SIGKILL, SIGTERM), the next `moco run` fits it alone, without a training step, and ends in the
same space as an uninterrupted run. A run ended by its time budget is finished too: the next one reuses it."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from app.cli.commands import main
from app.run.pipeline import collection_dir
from moco.embed import Embedder
from moco.training.checkpoints import resume_config, run_end, run_state, save_checkpoint
from moco.training.loop import train
from moco.weights.layouts import load_checkpoint

ROOT = Path(__file__).resolve().parents[1]
RUN = ["--no-serve", "--quiet", "--max-steps", "3"]  # the cpu preset (resnet10t, --whiten), 3 steps
FITTING = "training: finished earlier but its whitening was not fitted (interrupted): fitting it now"
IN_THE_FIT = "whitening: 48 photos are too few"  # logged as the fit starts (--whiten-stages auto, 48 photos)


def _moco_run(photos: Path, work: Path, capsys) -> str:
    """`moco run` of ``photos`` whose folder directory is ``work`` (``--work`` its parent)."""
    assert main(["run", str(photos), "--work", str(work.parent), *RUN]) == 0
    return capsys.readouterr().out


@pytest.fixture(scope="module")
def straight(sample_photos, tmp_path_factory) -> Path:
    """The folder directory of an uninterrupted `moco run`: the reference space."""
    work = collection_dir(tmp_path_factory.mktemp("straight") / "work", sample_photos)
    assert main(["run", str(sample_photos), "--work", str(work.parent), *RUN]) == 0
    assert run_state(load_checkpoint(work / "run" / "checkpoint.pt")) == "done"
    return work


def _steps(work: Path) -> list[int]:
    """The training steps metrics.jsonl records (one line each)."""
    records = [json.loads(line) for line in (work / "run" / "metrics.jsonl").read_text().splitlines()]
    return [r["step"] for r in records if "loss" in r]


def _assert_same_space(work: Path, ref: Path, photos: Path, exact: bool) -> None:
    """The same weights and whitening in the checkpoint, the same embeddings from the exported backbone."""
    a, b = load_checkpoint(work / "run" / "checkpoint.pt"), load_checkpoint(ref / "run" / "checkpoint.pt")
    assert (a["step"], a["total_steps"]) == (b["step"], b["total_steps"])
    same = torch.equal if exact else (lambda x, y: torch.allclose(x.float(), y.float(), rtol=1e-4, atol=1e-5))
    assert all(same(a["model"][k], b["model"][k]) for k in b["model"])
    wa, wb = a["whitening"], b["whitening"]
    assert {k: v for k, v in wa.items() if k not in ("mean", "matrix", "shrinkage")} == \
        {k: v for k, v in wb.items() if k not in ("mean", "matrix", "shrinkage")}
    assert same(wa["mean"], wb["mean"]) and same(wa["matrix"], wb["matrix"])
    assert wa["shrinkage"] == pytest.approx(wb["shrinkage"], abs=0 if exact else 1e-5)
    files = sorted(photos.rglob("*.png"))[:8]
    got, want = (Embedder.load(w / "backbone.safetensors", device="cpu").embed(files) for w in (work, ref))
    np.testing.assert_allclose(got, want, atol=0 if exact else 1e-4)


@pytest.mark.slow
def test_a_run_killed_in_its_fit_fits_it_alone_on_the_next_run(straight, sample_photos, tmp_path, capsys):
    """The state a kill during the fit leaves (exactly the checkpoint of the last step, saved before the fit,
    without the whitening) is refitted, saved and exported: the same space as the uninterrupted run's."""
    work = collection_dir(tmp_path / "work", sample_photos)  # the folder's own directory
    shutil.copytree(straight / "run", work / "run")
    ckpt = load_checkpoint(work / "run" / "checkpoint.pt")
    save_checkpoint({k: v for k, v in ckpt.items() if k not in ("format", "version", "whitening")}, work / "run",
                    keep=1, replace=True)
    assert run_state(load_checkpoint(work / "run" / "checkpoint.pt")) == "whitening"
    steps = _steps(work)
    out = _moco_run(sample_photos, work, capsys)
    assert FITTING in out and "resuming" not in out and "done earlier" not in out
    assert _steps(work) == steps == [1, 2, 3]  # no training step
    numbered = sorted((work / "run").glob("checkpoint-*.pt"))
    assert len(numbered) == 1 and "whitening" in load_checkpoint(numbered[0])  # the step's copy has it too
    _assert_same_space(work, straight, sample_photos, exact=True)  # the fit is a function of the weights
    again = _moco_run(sample_photos, work, capsys)
    assert "done earlier (3/3 steps)" in again and "up to date" in again and "48 unchanged" in again


def _killed_in_the_fit(photos: Path, work: Path, sig: int) -> tuple[int, str]:
    """A real `moco run` subprocess sent ``sig`` as its end-of-run fit starts; its exit code and output."""
    proc = subprocess.Popen([sys.executable, "-m", "app.cli", "run", str(photos), "--work", str(work.parent), *RUN],
                            env=dict(os.environ, PYTHONPATH=str(ROOT)), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if IN_THE_FIT in line:
                proc.send_signal(sig)
                break
        lines.append(proc.stdout.read())
        code = proc.wait(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = "".join(lines)
    assert IN_THE_FIT in text, text[-3000:]
    return code, text


@pytest.mark.slow
def test_sigkill_during_the_fit_then_the_next_run_ends_in_the_same_space(straight, sample_photos, tmp_path, capsys):
    work = collection_dir(tmp_path / "work", sample_photos)  # the folder's own directory
    code, text = _killed_in_the_fit(sample_photos, work, signal.SIGKILL)
    assert code == -signal.SIGKILL
    state = run_state(load_checkpoint(work / "run" / "checkpoint.pt"))
    assert state in ("whitening", "done"), text[-3000:]  # the fit lost (nearly always) or just saved: never steps
    assert not (work / "backbone.safetensors").exists()
    out = _moco_run(sample_photos, work, capsys)
    assert (FITTING if state == "whitening" else "done earlier") in out
    assert _steps(work) == [1, 2, 3]
    _assert_same_space(work, straight, sample_photos, exact=False)  # trained in another process: allclose


@pytest.mark.slow
def test_sigterm_during_the_fit_stops_before_export_and_the_next_run_fits_it(straight, sample_photos, tmp_path,
                                                                              capsys):
    work = collection_dir(tmp_path / "work", sample_photos)  # the folder's own directory
    code, text = _killed_in_the_fit(sample_photos, work, signal.SIGTERM)
    assert code == 130, text[-3000:]  # stopped by the signal, not killed by it: the pipeline ends there
    assert "stopped by SIGTERM at step 3/3" in text and not (work / "backbone.safetensors").exists()
    state = run_state(load_checkpoint(work / "run" / "checkpoint.pt"))
    if state == "whitening":  # the fit was dropped at once (a signal during the save lets it complete: "done")
        assert "received SIGTERM during the whitening's fit" in text
    assert state in ("whitening", "done")
    out = _moco_run(sample_photos, work, capsys)
    assert (FITTING if state == "whitening" else "done earlier") in out
    assert _steps(work) == [1, 2, 3]
    _assert_same_space(work, straight, sample_photos, exact=False)


@pytest.mark.slow
def test_a_run_ended_by_its_time_budget_is_finished_and_reused(sample_photos, tmp_path, capsys):
    """Issue 29: a budget spent before the schedule's fit (step 10) left step 3 of the 2,200 planned, and every
    rerun trained one more step. Whatever step the budget ends at, the run is finished there."""
    work = collection_dir(tmp_path / "work", sample_photos)  # the folder's own directory
    assert main(["run", str(sample_photos), "--work", str(work.parent), "--no-serve", "--quiet", "--minutes",
                 "0.001"]) == 0
    out = capsys.readouterr().out
    ckpt_path = work / "run" / "checkpoint.pt"
    ckpt = load_checkpoint(ckpt_path)
    assert ckpt["step"] == ckpt["total_steps"] == len(_steps(work)) and "whitening" in ckpt, out
    assert run_state(ckpt) == "done"
    stamps = {p: os.stat(work / p).st_mtime_ns for p in ("run/checkpoint.pt", "backbone.safetensors")}
    again = _moco_run(sample_photos, work, capsys)
    # issue 39: it was reported "done earlier (3/3 steps)", with no word that its budget cut it short
    cut = f"stopped by its time budget at {ckpt['step']} of {ckpt['planned_steps']} steps"
    assert ckpt["planned_steps"] > ckpt["step"] and f"training: {cut}" in out, out
    assert f"done earlier ({cut})" in again and "resuming" not in again
    assert "up to date" in again and "(0 new, 0 changed, 0 removed, 48 unchanged" in again  # not rebuilt
    assert {p: os.stat(work / p).st_mtime_ns for p in stamps} == stamps and len(_steps(work)) == ckpt["step"]

    # A checkpoint older versions left (the planned total kept, the budget spent) is finished as well: reused by
    # `moco run`, and `moco train --resume` takes no step (it refits the whitening, as for any finished run).
    old = {k: v for k, v in ckpt.items() if k not in ("format", "version", "planned_steps")}
    save_checkpoint({**old, "total_steps": 2200}, work / "run", keep=1, replace=True)
    assert run_state(load_checkpoint(ckpt_path)) == "done"
    assert run_end(load_checkpoint(ckpt_path)) == f"stopped by its time budget at {ckpt['step']} of 2200 steps"
    summary = train(resume_config(work / "run"), resume=True, progress=False)
    assert summary.steps == summary.total_steps == ckpt["step"] and summary.whitening is not None
    assert load_checkpoint(ckpt_path)["total_steps"] == ckpt["step"]
