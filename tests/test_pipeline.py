"""`moco run`: the whole job through the CLI on a generated collection, the reuse path, and a served page."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from app.cli import main
from index.image_index import ImageIndex
from moco.sample import make_sample_collection

from .live import chromium_page, free_port, search_in_page, wait_served

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("pipeline")
    photos = tmp / "photos"
    make_sample_collection(photos, per_family=8, size=48, seed=4)
    return {"photos": photos, "work": tmp / "work", "tmp": tmp}


def _run(work: dict[str, Path], capsys, *extra: str) -> str:
    code = main(["run", str(work["photos"]), "--work", str(work["work"]), "--no-serve", "--quiet", *extra])
    assert code == 0
    return capsys.readouterr().out


@pytest.mark.slow
def test_pipeline_then_reuse(work, capsys):
    out = _run(work, capsys, "--max-steps", "2")
    w = work["work"]
    for artifact in ("run/checkpoint.pt", "backbone.safetensors", "index/index.faiss", "index/index.json",
                     "index/catalog.sqlite"):  # fmt: skip
        assert (w / artifact).is_file(), artifact
    assert "training: MoCo cpu on 48 photos" in out and "48 photos searchable" in out
    query = sorted(work["photos"].rglob("*.jpg"))[5]
    assert main(["index", "search", str(w / "index"), str(query), "-k", "3", "--json"]) == 0
    hits = json.loads(capsys.readouterr().out)
    assert hits[0]["path"] == query.relative_to(work["photos"]).as_posix() and hits[0]["score"] > 0.999
    stamp = os.stat(w / "backbone.safetensors").st_mtime_ns
    again = _run(work, capsys, "--max-steps", "2")
    assert "done earlier" in again and "up to date" in again and "(0 new, 0 changed, 0 removed, 48 unchanged" in again
    assert os.stat(w / "backbone.safetensors").st_mtime_ns == stamp  # nothing re-exported or re-embedded


@pytest.mark.slow
def test_checkpoint_and_init_paths(work, capsys):
    ckpt = work["work"] / "run" / "checkpoint.pt"
    if not ckpt.is_file():
        _run(work, capsys, "--max-steps", "2")
    out = main(["run", str(work["photos"]), "--work", str(work["tmp"] / "given"), "--checkpoint", str(ckpt),
                "--no-serve", "--quiet"])  # fmt: skip
    assert out == 0 and "training: skipped" in capsys.readouterr().out
    assert len(ImageIndex.open(work["tmp"] / "given" / "index")) == 48
    assert main(["run", str(work["photos"]), "--work", str(work["tmp"] / "init"), "--init", str(ckpt),
                 "--max-steps", "2", "--no-serve", "--quiet"]) == 0  # fmt: skip
    assert "init=" in capsys.readouterr().out
    assert main(["run", str(work["photos"]), "--checkpoint", "nope.pth.tar", "--work", str(work["tmp"] / "x")]) == 2


@pytest.mark.slow
def test_run_reaches_a_served_page(work, capsys):
    if not (work["work"] / "index" / "index.json").is_file():
        _run(work, capsys, "--max-steps", "2")
    port = free_port()
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-m", "app.cli", "run", str(work["photos"]), "--work", str(work["work"]),
                             "--port", str(port), "--quiet", "--max-steps", "2"], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)  # fmt: skip
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
