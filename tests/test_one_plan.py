"""Issue 53, one plan per command: `moco run` lists its photo folder once and reads a resumed checkpoint once for
its plan (both handed on from there), and `moco train` and `moco run` work out a new run's settings in one function,
so the same ``--init`` checkpoint gives both the same architecture, stem and crop."""

from __future__ import annotations

import json
import os
import traceback
from pathlib import Path

import pytest
import torch

import moco.data.photos
from app.cli.commands import main
from app.run.pipeline import collection_dir, run_pipeline
from app.run.status import RunStatus
from moco.data.sample import make_sample_collection

from .conftest import TINY_CLI


@pytest.fixture(scope="module")
def photos(tmp_path_factory) -> Path:
    """18 small photos (6 families x 3, 32 px): enough to train on, quick to index."""
    root = tmp_path_factory.mktemp("one-plan") / "photos"
    make_sample_collection(root, per_family=3, size=32, seed=2)
    return root


def _count_scans(monkeypatch, folder: Path) -> list[str]:
    """The listings of ``folder`` made for a run's plan through :func:`moco.data.photos.scan_photos` (the real one
    runs), not inside train() (its whitening's photos) nor the index's build, which list the folder themselves."""
    scans, scan = [], moco.data.photos.scan_photos

    def counting_scan(root, *args, **kwargs):
        callers = [f"{Path(f.filename).parent.name}/{Path(f.filename).name}" for f in traceback.extract_stack()]
        if Path(root).resolve() == folder.resolve() and not {"training/loop.py", "building/runner.py"} & set(callers):
            scans.append(callers[-2])
        return scan(root, *args, **kwargs)

    monkeypatch.setattr(moco.data.photos, "scan_photos", counting_scan)
    return scans


@pytest.mark.slow
def test_a_run_lists_its_folder_once_and_reads_a_resumed_checkpoint_once_for_its_plan(photos, tmp_path,
                                                                                      monkeypatch):
    """`moco run` listed the folder 3 times (the photos' notes, the photo count, the crop's sample of sizes) and read a
    resumed run's checkpoint.pt 3 times (where it stands, its config, train()'s restore). Now one listing and one
    read make the plan, and train() restores its state from that same read; its data cache and the index list the
    folder themselves."""
    scans = _count_scans(monkeypatch, photos)
    said: list[str] = []
    fresh = run_pipeline(photos, tmp_path / "fresh", train_overrides={"max_steps": 1, "workers": 0}, say=said.append,
                         progress=False)
    assert fresh["trained"] and "training: MoCo cpu on 18 photos" in "\n".join(said)
    assert len(scans) == 1, scans

    own = collection_dir(tmp_path / "work", photos)  # a run stopped after its first step, for `moco run` to resume
    assert main(["train", str(photos), "--out", str(own / "run"), "--preset", "cpu", "--max-steps", "2",
                 "--stop-after", "1", "--batch-size", "8", "--bn-splits", "2", "--queue-size", "16", "--workers",
                 "0", "--quiet"]) == 0
    ckpt = own / "run" / "checkpoint.pt"
    status, reads, load = RunStatus(own), [], torch.load

    def counting_load(f, *args, **kwargs):
        if isinstance(f, str | os.PathLike) and Path(f).resolve() == ckpt.resolve():
            reads.append(status.history[-1])  # the stage reading it
        return load(f, *args, **kwargs)

    monkeypatch.setattr(torch, "load", counting_load)
    scans.clear()
    said.clear()
    run_pipeline(photos, tmp_path / "work", say=said.append, progress=False, status=status)
    assert f"training: resuming {ckpt} at step 1/2" in said
    assert len(scans) == 1, scans
    assert reads.count("training") == 1, reads  # read once: the plan and train()'s restore take the same

    reads.clear()  # `moco train --resume` too: its config and its state from one read (it was two)
    status.history.append("training")
    assert main(["train", "--resume", "--out", str(own / "run"), "--quiet"]) == 0
    assert reads == ["training"], reads


@pytest.mark.slow
def test_train_and_run_take_the_same_settings_from_an_init_checkpoint(photos, tmp_path, capsys):
    """`moco run --init` took the architecture, stem and crop from the weights; `moco train --init` took the
    preset's network, and refused weights of another. Both now work them out in one function."""
    init = tmp_path / "init"
    assert main(["train", str(photos), "--out", str(init), *TINY_CLI, "--max-steps", "1"]) == 0  # ResNet-18, 16 px
    ckpt = str(init / "checkpoint.pt")
    assert main(["train", str(photos), "--out", str(tmp_path / "train"), "--init", ckpt, "--time-budget", "1",
                 "--max-steps", "1", "--batch-size", "8", "--bn-splits", "2", "--queue-size", "16", "--workers", "0",
                 "--quiet"]) == 0, capsys.readouterr().err
    work = tmp_path / "work"
    assert main(["run", str(photos), "--work", str(work), "--init", ckpt, "--max-steps", "1", "--no-serve",
                 "--quiet"]) == 0, capsys.readouterr().err
    assert f"init={ckpt}, arch=resnet18, small_stem=True, image_size=16" in capsys.readouterr().out
    trained = json.loads((tmp_path / "train" / "config.json").read_text())
    ran = json.loads((collection_dir(work, photos) / "run" / "config.json").read_text())
    fixed = ("preset", "init", "arch", "small_stem", "image_size", "num_heads")
    assert {k: trained[k] for k in fixed} == {k: ran[k] for k in fixed}
    assert (trained["arch"], trained["small_stem"], trained["image_size"]) == ("resnet18", True, 16)
