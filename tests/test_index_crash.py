"""Crash safety and scale-out of `moco index`: real SIGKILLs mid-way, and a real 2-process torchrun build."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import faiss
import numpy as np
import pytest

from app.cli.commands import main
from index.search.image_index import ImageIndex
from moco.data.sample import make_sample_collection
from moco.embed import center

from .live import run_tree

ROOT = Path(__file__).resolve().parents[1]
ENV = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")


def _cli(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "app.cli", *args], env=ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _rows(index_dir: Path) -> int:
    try:
        db = sqlite3.connect(f"file:{index_dir / 'catalog.sqlite'}?mode=ro", uri=True, timeout=5)
        n = db.execute("SELECT COUNT(*) FROM images").fetchone()[0]
        db.close()
        return int(n)
    except sqlite3.Error:
        return 0


def _state(index_dir: Path) -> dict[str, np.ndarray]:
    db = sqlite3.connect(index_dir / "catalog.sqlite")
    rows = db.execute("SELECT i.path, v.vector FROM images i JOIN vectors v ON v.id = i.id "
                      "WHERE i.deleted = 0 AND i.status = 'ok'").fetchall()
    db.close()
    return {p: np.frombuffer(v, np.float32) for p, v in rows}


def _check_consistent(index_dir: Path) -> ImageIndex:
    """Readable; every id FAISS holds once; every hit is a catalog row whose stored vector gives its (centred) score."""
    idx = ImageIndex.open(index_dir)
    held = faiss.vector_to_array(faiss.downcast_index(idx.store._cpu).id_map)
    assert len(held) == len(np.unique(held)), "an id is in the index twice"
    ids, vecs = idx.catalog.vectors()
    if len(ids):
        hits = idx.search(vecs[:3], k=5)
        for q, (row_ids, row_scores) in enumerate(zip(hits.ids, hits.scores)):
            for i, s in zip(row_ids[row_ids >= 0], row_scores):
                ref = center(vecs[q], idx.mean) @ center(idx.vectors(np.array([i])), idx.mean).T  # 1 x 1, centred
                assert s == pytest.approx(float(ref[0, 0]), abs=1e-4)
    return idx


def _assert_same(a: Path, b: Path) -> None:
    sa, sb = _state(a), _state(b)
    assert set(sa) == set(sb)
    for p in sa:
        np.testing.assert_allclose(sa[p], sb[p], atol=1e-5)
    ia, ib = _check_consistent(a), _check_consistent(b)
    assert len(ia) == len(ib) == len(sa)
    held = faiss.vector_to_array(faiss.downcast_index(ia.store._cpu).id_map)
    assert set(held) == set(ia.catalog.vectors()[0])  # FAISS holds exactly the catalog's ok rows


def _kill_when(proc: subprocess.Popen, ready, timeout: float = 240) -> None:
    t0 = time.time()
    while not ready():
        assert proc.poll() is None, f"finished before the kill point: {proc.stderr.read()[-2000:]}"
        assert time.time() - t0 < timeout
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()


@pytest.fixture()
def photos(tmp_path) -> Path:
    root = tmp_path / "photos"
    make_sample_collection(root, per_family=40, size=64, seed=1)
    return root


@pytest.mark.slow
def test_build_killed_mid_embedding_then_rerun_equals_clean_build(photos, backbone, tmp_path):
    out = tmp_path / "idx"
    args = ["index", "build", str(photos), "--backbone", str(backbone), "-o", str(out), "--quiet", "--batch-size", "4"]
    proc = _cli(*args)
    _kill_when(proc, lambda: _rows(out) >= 40)
    assert 40 <= _rows(out) < 240
    assert main(args) == 0  # the re-run completes the build
    assert main(["index", "build", str(photos), "--backbone", str(backbone), "-o", str(tmp_path / "clean"),
                 "--quiet"]) == 0
    _assert_same(out, tmp_path / "clean")


@pytest.mark.slow
@pytest.mark.parametrize("moment", ["embedding", "index-written"])
def test_update_killed_leaves_previous_index_readable_and_rerun_completes(photos, backbone, tmp_path, moment):
    out = tmp_path / "idx"
    assert main(["index", "build", str(photos), "--backbone", str(backbone), "-o", str(out), "--quiet"]) == 0
    before = len(ImageIndex.open(out))
    extra = tmp_path / "extra"
    make_sample_collection(extra, per_family=30, size=64, seed=9)
    os.rename(extra, photos / "new")  # 180 new photos
    for p in sorted((photos / "bubbles").iterdir())[:5]:
        p.unlink()  # and 5 deleted
    stamp = os.stat(out / "index.faiss").st_mtime_ns
    proc = _cli("index", "update", str(out), "--quiet", "--batch-size", "4")
    if moment == "embedding":
        _kill_when(proc, lambda: _rows(out) >= 240 + 20)
    else:
        _kill_when(proc, lambda: os.stat(out / "index.faiss").st_mtime_ns != stamp)
    idx = _check_consistent(out)  # the previous (or the new) index, searchable and consistent
    assert len(idx) in (before, before + 180 - 5)
    assert main(["index", "update", str(out), "--quiet"]) == 0
    assert main(["index", "build", str(photos), "--backbone", str(backbone), "-o", str(tmp_path / "clean"),
                 "--quiet"]) == 0
    _assert_same(out, tmp_path / "clean")


@pytest.mark.slow
def test_torchrun_sharded_build_equals_single_process(photos, backbone, tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "index.building",
           str(photos), "--backbone", str(backbone), "-o", str(tmp_path / "dist"), "--quiet", "--batch-size", "8",
           "--device", "cpu", "--workers", "1"]
    proc = run_tree(cmd, env=ENV, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert main(["index", "build", str(photos), "--backbone", str(backbone), "-o", str(tmp_path / "single"),
                 "--quiet"]) == 0
    _assert_same(tmp_path / "dist", tmp_path / "single")
    a, b = ImageIndex.open(tmp_path / "dist"), ImageIndex.open(tmp_path / "single")
    assert {r.path: r.id for r in a.catalog.rows().values()} == {r.path: r.id for r in b.catalog.rows().values()}
    q = a.catalog.vectors()[1][:4]
    ra, rb = a.search(q, k=8), b.search(q, k=8)
    np.testing.assert_allclose(ra.scores, rb.scores, atol=1e-5)
    # and the sharded update path: nothing to do on either
    proc = run_tree([*cmd[:7], "update", str(tmp_path / "dist"), "--quiet", "--device", "cpu"], env=ENV, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
