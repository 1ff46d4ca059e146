"""`moco run`: the whole job through the CLI on a generated collection, the reuse path, and a served page."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from app.cli.commands import main
from app.run.pipeline import collection_dir, run_settings
from index.search.image_index import ImageIndex
from moco.data.sample import make_sample_collection

from .live import chromium_page, free_port, search_in_page, wait_served

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("pipeline")
    photos = tmp / "photos"
    make_sample_collection(photos, per_family=8, size=48, seed=4)
    return {"photos": photos, "work": tmp / "work", "tmp": tmp, "own": collection_dir(tmp / "work", photos)}


def _run(work: dict[str, Path], capsys, *extra: str) -> str:
    code = main(["run", str(work["photos"]), "--work", str(work["work"]), "--no-serve", "--quiet", *extra])
    assert code == 0
    out = capsys.readouterr()
    assert "batch-norm group" not in out.err, out.err  # `moco run` chose its settings: nothing to act on
    return out.out


def _files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_each_photo_folder_gets_its_own_directory(tmp_path, monkeypatch):
    work = tmp_path / "work"
    a, b = tmp_path / "a" / "Pictures", tmp_path / "b" / "Pictures"
    a.mkdir(parents=True)
    b.mkdir(parents=True)
    (tmp_path / "link").symlink_to(a)
    own = collection_dir(work, a)
    assert own.parent == work and own.name.startswith("Pictures-") and collection_dir(work, b) != own  # same name
    monkeypatch.chdir(tmp_path)
    assert collection_dir(work, "a/Pictures/") == collection_dir(work, tmp_path / "link") == own  # one folder
    assert collection_dir(work, None) == collection_dir(work, work / "sample" / "photos") == work / "sample"
    assert collection_dir(work, tmp_path / "my photos: 2024").name.startswith("my_photos_2024-")


@pytest.mark.parametrize("n", [16, 31, 60, 64, 100, 300, 5000])
def test_run_picks_a_batch_its_bn_groups_suit(n):
    """Shuffle BN over at least 2 groups, of 16 images where the batch allows (never a setting it warns about)."""
    preset, o = run_settings(n, cuda=False, minutes=None)
    assert preset == "cpu" and o["time_budget"] == 10.0
    batch, splits = o["batch_size"], o["bn_splits"]
    assert 16 <= batch <= n and splits >= 2 and batch % splits == 0
    assert batch // splits == (16 if batch >= 32 else batch // 2)


@pytest.mark.slow
def test_the_sample_and_another_folder_keep_their_own_model_and_index(tmp_path, capsys):
    """Issue 30: after the sample, another folder was indexed with the sample's model, over the sample's index."""
    work = tmp_path / "work"
    make_sample_collection(work / "sample" / "photos", per_family=3, size=32, seed=1)  # a small sample, made ahead
    (work / "run").mkdir(parents=True)
    (work / "run" / "checkpoint.pt").write_bytes(b"an earlier version's run")  # its layout: one folder per WORK
    other = tmp_path / "Pictures"
    make_sample_collection(other, per_family=4, size=32, seed=5)

    def run(*photos: Path) -> str:
        assert main(["run", *map(str, photos), "--work", str(work), "--no-serve", "--quiet", "--max-steps", "2"]) == 0
        out = capsys.readouterr()
        assert "batch-norm group" not in out.err, out.err
        return out.out

    sample, mine = collection_dir(work, None), collection_dir(work, other)
    first = run()
    assert f"work: {sample}, for {sample / 'photos'} alone (new" in first and "MoCo cpu on 18 photos" in first
    assert f"{work / 'run'} were left by an earlier version" in first
    kept = _files(sample)
    second = run(other)
    assert f"work: {mine}, for {other} alone (new" in second and "training: MoCo cpu on 24 photos" in second
    assert "done earlier" not in second and "up to date" not in second and "24 photos searchable" in second
    assert _files(sample) == kept  # nothing of the sample's run, backbone or index overwritten
    assert _files(mine / "run") != _files(sample / "run")
    assert (work / "run" / "checkpoint.pt").read_bytes() == b"an earlier version's run"  # left as it was
    third = run()
    assert f"work: {sample}, for {sample / 'photos'} alone: reusing what an earlier run of this folder left" in third
    assert "training: done earlier (2/2 steps)" in third and "up to date" in third
    assert "(0 new, 0 changed, 0 removed, 18 unchanged; 18 searchable)" in third
    assert (mine / "run" / "checkpoint.pt").read_bytes() != (sample / "run" / "checkpoint.pt").read_bytes()
    for own, n in ((sample, 18), (mine, 24)):
        assert len(ImageIndex.open(own / "index")) == n


@pytest.mark.slow
def test_pipeline_then_reuse(work, capsys):
    out = _run(work, capsys, "--max-steps", "2")
    w = work["own"]  # the photo folder's own directory in WORK
    for artifact in ("run/checkpoint.pt", "backbone.safetensors", "index/index.faiss", "index/index.json",
                     "index/catalog.sqlite"):
        assert (w / artifact).is_file(), artifact
    assert "training: MoCo cpu on 48 photos" in out and "48 photos searchable" in out
    query = sorted(work["photos"].rglob("*.jpg"))[5]
    assert main(["index", "search", str(w / "index"), str(query), "-k", "3", "--json", "--include-queries"]) == 0
    hits = json.loads(capsys.readouterr().out)
    assert hits[0]["path"] == query.relative_to(work["photos"]).as_posix() and hits[0]["score"] > 0.999
    stamp = os.stat(w / "backbone.safetensors").st_mtime_ns
    again = _run(work, capsys, "--max-steps", "2")
    assert "done earlier" in again and "up to date" in again and "(0 new, 0 changed, 0 removed, 48 unchanged" in again
    assert os.stat(w / "backbone.safetensors").st_mtime_ns == stamp  # nothing re-exported or re-embedded


@pytest.mark.slow
def test_checkpoint_and_init_paths(work, capsys):
    ckpt = work["own"] / "run" / "checkpoint.pt"
    if not ckpt.is_file():
        _run(work, capsys, "--max-steps", "2")
    out = main(["run", str(work["photos"]), "--work", str(work["tmp"] / "given"), "--checkpoint", str(ckpt),
                "--no-serve", "--quiet"])
    assert out == 0 and "training: skipped" in capsys.readouterr().out
    assert len(ImageIndex.open(collection_dir(work["tmp"] / "given", work["photos"]) / "index")) == 48
    assert main(["run", str(work["photos"]), "--work", str(work["tmp"] / "init"), "--init", str(ckpt),
                 "--max-steps", "2", "--no-serve", "--quiet"]) == 0
    assert "init=" in capsys.readouterr().out
    assert main(["run", str(work["photos"]), "--checkpoint", "nope.pth.tar", "--work", str(work["tmp"] / "x")]) == 2


@pytest.mark.slow
def test_run_reads_its_init_once(work, capsys, monkeypatch):
    """`moco run --init X` deserializes X once: the architecture, what else it fixes and the weights all come from
    that one read (it was read three times: the architecture, a ViT's heads in the config, the weights)."""
    import torch

    ckpt = work["own"] / "run" / "checkpoint.pt"
    if not ckpt.is_file():
        _run(work, capsys, "--max-steps", "2")
    reads, load = [], torch.load

    def counting_load(f, *args, **kwargs):
        if isinstance(f, (str, os.PathLike)) and Path(f).resolve() == ckpt.resolve():
            reads.append(f)
        return load(f, *args, **kwargs)

    monkeypatch.setattr(torch, "load", counting_load)
    assert main(["run", str(work["photos"]), "--work", str(work["tmp"] / "init-once"), "--init", str(ckpt),
                 "--max-steps", "2", "--no-serve", "--quiet"]) == 0
    assert "init=" in capsys.readouterr().out
    assert len(reads) == 1, reads


@pytest.mark.slow
def test_run_reaches_a_served_page(work, capsys):
    if not (work["own"] / "index" / "index.json").is_file():
        _run(work, capsys, "--max-steps", "2")
    port = free_port()
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-m", "app.cli", "run", str(work["photos"]), "--work", str(work["work"]),
                             "--port", str(port), "--quiet", "--max-steps", "2"], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        url = None
        t0 = time.time()
        while url is None and time.time() - t0 < 300:
            line = proc.stdout.readline()
            assert line or proc.poll() is None, "moco run exited before serving"
            if "serving on http://" in line:
                url = line.split("serving on ")[1].split()[0]
        assert url == f"http://127.0.0.1:{port}"
        assert wait_served(url, proc).status_code == 200  # the URL is printed just before it listens
        while "search is on" not in line:  # the page is served first; search turns on when the index is ready
            line = proc.stdout.readline()
            assert line or proc.poll() is None, "moco run exited before search was on"
        with chromium_page(url) as page:  # a page opened once search is on opens on the Search tab
            search_in_page(page, sorted(work["photos"].rglob("*.png"))[0], 5)
            assert "5 results" in page.locator("#search-info").inner_text()
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_a_failed_run_checks_first_and_leaves_nothing_behind(tmp_path, capsys):
    """Issue 39: `moco run --minutes -5` was accepted; a run that failed before its first checkpoint left its lock,
    config.json, cache/, the generated sample or an empty WORK behind. What existed before stays."""
    from app.run.pipeline import run_pipeline
    from moco.errors import UserError

    work = tmp_path / "work"
    for minutes in ("-5", "0", "nan", "inf"):
        assert main(["run", "--work", str(work), "--no-serve", "--quiet", "--minutes", minutes]) == 2
        assert "the training time budget is a positive number of minutes" in capsys.readouterr().err
    assert main(["run", "--work", str(work), "--no-serve", "--quiet", "--max-steps", "-5"]) == 2
    assert "--max-steps -5" in capsys.readouterr().err and not work.exists()
    few = tmp_path / "few"
    make_sample_collection(few, per_family=1, size=32, seed=0)  # 6 photos: too few to train on
    assert main(["run", str(few), "--work", str(work), "--no-serve", "--quiet", "--pretrained", "none"]) == 2
    assert "MoCo needs at least 16" in capsys.readouterr().err and not work.exists()
    with pytest.raises(UserError, match="unknown backbone"):  # the sample generated, then training refused
        run_pipeline(None, work, train_overrides={"arch": "no_such_net"}, say=lambda m: None, progress=False)
    assert not work.exists()
    (work / "sample").mkdir(parents=True)
    (work / "sample" / "notes.txt").write_text("mine")
    with pytest.raises(UserError, match="unknown backbone"):
        run_pipeline(None, work, train_overrides={"arch": "no_such_net"}, say=lambda m: None, progress=False)
    assert sorted(p.name for p in (work / "sample").iterdir()) == ["notes.txt"]


def test_serve_checks_its_index_before_saying_it_serves(tmp_path, capsys):
    """Issue 39: `moco serve nosuch.idx` printed "serving on ..." before its error."""
    assert main(["serve", str(tmp_path / "nosuch.idx"), "--port", str(free_port())]) == 2
    out = capsys.readouterr()
    assert "is not an index directory" in out.err and "serving on" not in out.out


def _stamps(folder: Path) -> dict[str, tuple[int, bytes]]:
    """Every file's time and bytes, but the lock's and SQLite's own -wal/-shm (there while a connection is open)."""
    return {str(p.relative_to(folder)): (p.stat().st_mtime_ns, p.read_bytes()) for p in sorted(folder.rglob("*"))
            if p.is_file() and p.name != ".moco.lock" and not p.name.endswith(("-wal", "-shm"))}


def _moco_run(work: dict[str, Path], *extra: str) -> list[str]:
    return [sys.executable, "-m", "app.cli", "run", str(work["photos"]), "--work", str(work["work"]), "--quiet",
            "--max-steps", "2", "--device", "cpu", *extra]


@pytest.mark.slow
def test_a_rerun_with_nothing_new_leaves_every_file_as_it_was(work, capsys):
    if not (work["own"] / "index" / "index.json").is_file():
        _run(work, capsys, "--max-steps", "2")
    before = _stamps(work["own"])
    assert {"index/index.faiss", "index/index.json", "index/catalog.sqlite", "backbone.safetensors"} <= set(before)
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    r = subprocess.run(_moco_run(work, "--no-serve"), env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "(0 new, 0 changed, 0 removed, 48 unchanged; 48 searchable)" in r.stdout, r.stdout
    after = _stamps(work["own"])
    assert [k for k in before if after.get(k) != before[k]] == [] and set(after) == set(before)  # bytes and times


@pytest.mark.slow
def test_a_second_run_of_one_folder_on_one_port_is_told_who_holds_it(work, capsys):
    if not (work["own"] / "index" / "index.json").is_file():
        _run(work, capsys, "--max-steps", "2")
    port = str(free_port())
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    first = subprocess.Popen(_moco_run(work, "--port", port), env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
    try:
        line = ""
        while "serving on http://" not in line:
            line = first.stdout.readline()
            assert line or first.poll() is None, "the first moco run exited before serving"
        second = subprocess.run(_moco_run(work, "--port", port), env=env, capture_output=True, text=True, timeout=300)
        assert second.returncode == 2, second.stderr[-3000:]
        assert f"{work['own']} is in use by another moco run (PID {first.pid})" in second.stderr, second.stderr[-3000:]
        assert "--work" in second.stderr and "Cannot find empty port" not in second.stderr
        assert "serving on" not in second.stdout  # refused before it serves anything
    finally:
        first.terminate()
        first.wait(timeout=60)
