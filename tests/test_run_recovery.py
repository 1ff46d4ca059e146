"""Runs that cannot continue (issue 29): a file name that is not UTF-8, a metrics.jsonl cut off by a kill, and two
runs on one directory. Each must leave a run that the same command continues, or refuse with the reason."""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from app.cli.commands import main
from app.run.status import RunStatus
from moco.data.cache import read_skipped
from moco.data.sample import make_sample_collection
from moco.training.metrics import read_metrics
from moco.weights.layouts import load_checkpoint

from .conftest import TINY_CLI

ROOT = Path(__file__).resolve().parents[1]
BROKEN = b"broken \xe9.jpg"  # latin-1 "broken é.jpg": not UTF-8, and not an image
GOOD = b"good \xe9\tname\n.png"  # a readable photo whose name is not UTF-8 and holds a tab and a newline


def _moco(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "app.cli", *args], cwd=ROOT, capture_output=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})})


@pytest.fixture(scope="module")
def odd_photos(tmp_path_factory) -> Path:
    """24 generated photos, one more under a non-UTF-8 name, and an unreadable file under another."""
    root = tmp_path_factory.mktemp("odd")
    make_sample_collection(root / "photos", per_family=4, size=32, seed=1)
    photos = root / "photos"
    shutil.copyfile(sorted(photos.rglob("*.png"))[0], photos / os.fsdecode(GOOD))
    (photos / os.fsdecode(BROKEN)).write_bytes(b"x")
    return photos


def test_run_with_a_non_utf8_name_succeeds_twice_and_names_it(odd_photos, tmp_path):
    """The issue's command, run twice."""
    work = tmp_path / "work"
    for attempt in (1, 2):
        proc = _moco("run", str(odd_photos), "--work", str(work), "--max-steps", "2", "--no-serve", "--quiet")
        assert proc.returncode == 0, (attempt, proc.stderr.decode(errors="replace")[-3000:])
        if attempt == 1:  # issue 39: one count, said with the skipped (the Status tab names them)
            assert b"training: on 25 of the 26 photos, 1 skipped as unreadable" in proc.stdout, proc.stdout
    assert b"done earlier" in proc.stdout
    from app.run.pipeline import collection_dir

    run = collection_dir(work, odd_photos) / "run"  # the photo folder's own directory under WORK
    skipped = read_skipped(run / "skipped.txt")
    assert [p for p, _ in skipped] == [os.fsdecode(BROKEN)]
    assert BROKEN in (run / "skipped.txt").read_bytes()  # the name's own bytes
    assert os.fsdecode(GOOD) in load_checkpoint(run / "checkpoint.pt")["files"]


def test_resume_reads_back_the_same_non_utf8_names(odd_photos, tmp_path):
    """A run directory not named in UTF-8 either; stdout strict UTF-8, as in an en_US.UTF-8 terminal."""
    run = tmp_path / os.fsdecode(b"run \xff")
    assert main(["train", str(odd_photos), "--out", str(run), *TINY_CLI, "--max-steps", "3", "--stop-after", "1"]) == 0
    files = load_checkpoint(run / "checkpoint.pt")["files"]
    assert os.fsdecode(GOOD) in files
    proc = _moco("train", "--out", str(run), "--resume", "--quiet", env={"PYTHONIOENCODING": "utf-8"})
    assert proc.returncode == 0, proc.stderr.decode(errors="replace")[-3000:]  # every recorded name found again
    assert os.fsencode(run / "checkpoint.pt") in proc.stdout  # the path's own bytes, as ls prints them
    ckpt = load_checkpoint(run / "checkpoint.pt")
    assert ckpt["step"] == 3 and ckpt["files"] == files
    assert [p for p, _ in read_skipped(run / "skipped.txt")] == [os.fsdecode(BROKEN)]  # kept on resume
    text = (run / "skipped.txt").read_bytes()
    assert text.startswith(BROKEN + b"\t") and text.endswith(b"\n") and text.count(b"\n") == 1


def test_skipped_txt_round_trips_any_name(tmp_path):
    from moco.data.cache import write_skipped

    names = [os.fsdecode(b"a\\b\t\n\r\xe9\xff.jpg"), "plain.jpg", "caf\u00e9 \u6f22.png"]
    entries = [(n, f"reason of {n}\nsecond line") for n in names]
    write_skipped(tmp_path / "skipped.txt", entries)
    assert read_skipped(tmp_path / "skipped.txt") == entries
    assert len((tmp_path / "skipped.txt").read_bytes().splitlines()) == 3


@pytest.fixture(scope="module")
def stopped_run(sample_photos, tmp_path_factory) -> Path:
    """A tiny run stopped at step 2 of 4 (a checkpoint to resume)."""
    run = tmp_path_factory.mktemp("stopped") / "run"
    assert main(["train", str(sample_photos), "--out", str(run), *TINY_CLI, "--max-steps", "4",
                 "--stop-after", "2"]) == 0
    return run


def test_resume_drops_a_torn_last_line_and_says_so_once(stopped_run, tmp_path, capfd):
    run = tmp_path / "run"
    shutil.copytree(stopped_run, run)
    metrics = run / "metrics.jsonl"
    lines = metrics.read_text().splitlines()
    assert len(lines) == 2
    # a damaged line in the middle (a crash that left zeros), and the last one cut off by a kill mid-write
    metrics.write_text(lines[0] + "\n" + "\0" * 20 + "\n" + lines[1] + "\n" + lines[1][:17])
    assert main(["train", "--out", str(run), "--resume", "--quiet"]) == 0
    records = [json.loads(line) for line in metrics.read_text().splitlines()]  # every line whole again
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    warned = [line for line in capfd.readouterr().err.splitlines() if str(metrics) in line]
    assert len(warned) == 1 and "torn last line 4" in warned[0] and "damaged line 2" in warned[0], warned


def test_readers_skip_a_torn_last_line_and_name_a_damaged_one(tmp_path, caplog):
    metrics = tmp_path / "run" / "metrics.jsonl"
    metrics.parent.mkdir()
    good = [json.dumps({"step": s, "loss": 1.0 / s}) for s in (1, 2, 3)]
    metrics.write_text(good[0] + "\n[1, 2]\n" + good[1] + "\n" + good[2] + "\n" + good[2][:9])
    caplog.set_level(logging.WARNING)
    assert [r["step"] for r in read_metrics(metrics)] == [1, 2, 3]
    assert any("torn last line 5" in m and str(metrics) in m for m in caplog.messages), caplog.messages
    assert any("damaged line 2" in m and str(metrics) in m for m in caplog.messages), caplog.messages
    caplog.clear()
    snap = RunStatus(tmp_path).snapshot()  # the Status tab: the same records; the last line may still be written
    assert [s for s, _ in snap["loss"]] == [1, 2, 3]
    assert any("damaged line 2" in m and str(metrics) in m for m in caplog.messages), caplog.messages
    assert not any("torn last line" in m for m in caplog.messages), caplog.messages


_HOLDER = """
import sys, time
from moco.files import lock_dir
with lock_dir(sys.argv[1], "--out"):
    print("locked", flush=True)
    time.sleep(600)
"""


def _hold(directory: Path) -> subprocess.Popen:
    """Another process holding ``directory``'s lock (through our own function) until killed."""
    directory.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen([sys.executable, "-c", _HOLDER, str(directory)], cwd=ROOT, stdout=subprocess.PIPE,
                            env={**os.environ, "PYTHONPATH": str(ROOT)}, text=True)
    assert proc.stdout is not None and proc.stdout.readline() == "locked\n"
    return proc


def test_a_second_run_on_one_directory_refuses_naming_the_first(sample_photos, tmp_path, capsys):
    from app.run.pipeline import collection_dir

    work, run = tmp_path / "work", tmp_path / "run"
    own = collection_dir(work, sample_photos)  # the lock is the photo folder's own directory's
    own.mkdir(parents=True)
    holders = [_hold(own), _hold(run)]
    try:
        assert main(["run", str(sample_photos), "--work", str(work), "--max-steps", "2", "--no-serve",
                     "--quiet"]) == 2
        err = capsys.readouterr().err
        assert f"{own} is in use by another moco run (PID {holders[0].pid})" in err and "--work" in err, err
        assert main(["train", str(sample_photos), "--out", str(run), *TINY_CLI, "--max-steps", "2"]) == 2
        err = capsys.readouterr().err
        assert f"{run} is in use by another moco run (PID {holders[1].pid})" in err and "--out" in err, err
        assert not (run / "metrics.jsonl").exists() and not (own / "run").exists()
    finally:
        for proc in holders:
            proc.send_signal(signal.SIGKILL)  # the OS releases a killed holder's lock: nothing stale is left
            proc.wait()
    assert main(["train", str(sample_photos), "--out", str(run), *TINY_CLI, "--max-steps", "2"]) == 0
    assert [r["step"] for r in read_metrics(run / "metrics.jsonl")] == [1, 2]


def test_a_backbone_and_an_index_in_a_non_utf8_folder_load(backbone, sample_photos, tmp_path):
    """safetensors' own loader refuses such a path: ours reads the bytes through Python (issue 29, 1)."""
    from index.building.runner import build_index
    from index.search.image_index import ImageIndex
    from moco.embed import Embedder
    from moco.whiten import SPACE_FILE, load_space

    odd = tmp_path / os.fsdecode(b"caf\xe9")
    odd.mkdir()
    shutil.copy(backbone, odd / "b.safetensors")
    emb = Embedder.load(odd / "b.safetensors", device="cpu")
    build_index(sample_photos, odd / "b.safetensors", odd / "idx", progress=False, device="cpu")
    space, meta = load_space(odd / "idx" / SPACE_FILE)
    assert meta["backbone_sha256"] == emb.sha256 and space.dim == emb.dim
    assert ImageIndex.open(odd / "idx").load_embedder(device="cpu").sha256 == emb.sha256


def test_resume_of_a_finished_run_ignores_values_of_the_wrong_type(sample_photos, tmp_path, capfd):
    run = tmp_path / "run"
    assert main(["train", str(sample_photos), "--out", str(run), *TINY_CLI, "--max-steps", "2"]) == 0
    precision = re.search(r" on cpu (\w+);", capfd.readouterr().out).group(1)  # the machine's: bf16 or fp32
    metrics = run / "metrics.jsonl"
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    records[-1].update(loss="abc", lr=[1], total_steps="2")  # valid JSON, at the checkpoint's step, wrong types
    metrics.write_text("".join(json.dumps(r) + "\n" for r in records))
    capfd.readouterr()
    assert main(["train", "--out", str(run), "--resume", "--quiet"]) == 0  # was: TypeError in round()
    out, err = capfd.readouterr()
    loss = round(records[0]["loss"], 4)
    assert f"trained 2/2 steps on 48 images (0 skipped) on cpu {precision}; final loss {loss};" in out
    warned = [line for line in err.splitlines() if str(metrics) in line]
    assert len(warned) == 1 and "line 2 (step 2)" in warned[0] and "'loss' = 'abc'" in warned[0], warned
    assert read_metrics(metrics) == [records[0], {k: v for k, v in records[1].items()
                                                  if k not in ("loss", "lr", "total_steps")}]


def test_a_deeply_nested_line_is_a_damaged_line_for_every_reader(tmp_path, caplog):
    metrics = tmp_path / "run" / "metrics.jsonl"
    metrics.parent.mkdir()
    good = [json.dumps({"step": s, "loss": 1.0 / s}) for s in (1, 2)]
    metrics.write_text(good[0] + "\n" + "[" * 100000 + "\n" + good[1] + "\n")  # past the JSON parser's recursion
    caplog.set_level(logging.WARNING)
    assert [r["step"] for r in read_metrics(metrics)] == [1, 2]
    assert any("damaged line 2" in m and str(metrics) in m for m in caplog.messages), caplog.messages
    caplog.clear()
    snap = RunStatus(tmp_path).snapshot()  # the Status tab: was RecursionError
    assert [s for s, _ in snap["loss"]] == [1, 2]
    assert sum("damaged line 2" in m and str(metrics) in m for m in caplog.messages) == 1, caplog.messages
