"""Catalog safety through the real CLI: undecodable file names, read-only and full file systems, damaged index.json.

Read-only and full disks are real file systems (a tmpfs mounted inside the test's tmp dir, remounted
read-only or filled up); those tests skip, saying why, where mounting is not allowed.
"""

from __future__ import annotations

import contextlib
import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from app.cli.commands import main
from index.catalog import display_path
from moco.data.sample import make_sample_collection

from .mounts import remount_ro, tmpfs

ROOT = Path(__file__).resolve().parents[1]
BAD = os.fsdecode(b"caf\xe9.jpg")  # latin-1 "café.jpg": not valid UTF-8, a surrogateescape str in Python
RENAMED = os.fsdecode(b"na\xefve-\xff.jpg")


@pytest.fixture()
def photos(tmp_path) -> Path:
    root = tmp_path / "photos"
    make_sample_collection(root, per_family=2, size=32, seed=5)
    return root


def _noise(path: Path, seed: int) -> None:
    """A photo unlike every other one (its own nearest neighbour)."""
    rng = np.random.default_rng(seed)
    Image.fromarray(rng.integers(0, 256, (40, 40, 3), dtype=np.uint8)).save(path, "JPEG")


def _build(photos: Path, backbone: Path, out: Path, *extra: str) -> int:
    return main(["index", "build", str(photos), "--backbone", str(backbone), "-o", str(out), "--quiet", *extra])


def _last_json(capsys) -> object:
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def _clean_err(capsys, *words: str) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err and all(w in err for w in words), err
    return err


# ------------------------------------------------------------------------------- undecodable names
def test_undecodable_file_name_is_indexed_searched_and_moved(photos, backbone, tmp_path, capsys):
    _noise(photos / BAD, seed=1)
    out = tmp_path / "idx"
    assert _build(photos, backbone, out, "--json") == 0, capsys.readouterr().err
    assert _last_json(capsys)["embedded"] == 13
    db = sqlite3.connect(out / "catalog.sqlite")
    kinds = dict(db.execute("SELECT typeof(path), COUNT(*) FROM images GROUP BY 1").fetchall())
    stored = db.execute("SELECT path FROM images WHERE typeof(path) = 'blob'").fetchone()[0]
    db.close()
    assert kinds == {"text": 12, "blob": 1} and stored == b"caf\xe9.jpg"  # the exact bytes; valid names unchanged
    # search with it (itself kept): rank 1 is itself, with its exact original path, which opens from the root
    assert main(["index", "search", str(out), str(photos / BAD), "-k", "3", "--json", "--include-queries"]) == 0
    hits = _last_json(capsys)
    assert hits[0]["path"] == BAD and hits[0]["rank"] == 1
    root = Path(json.loads((out / "index.json").read_text())["root"])
    assert (root / hits[0]["path"]).read_bytes() == (photos / BAD).read_bytes()
    # plain output shows the undecodable byte escaped
    assert main(["index", "search", str(out), str(photos / BAD), "-k", "1", "--include-queries"]) == 0
    assert capsys.readouterr().out.split()[-1] == "caf\\xe9.jpg" == display_path(BAD)
    # and so does a real process writing to a pipe
    cmd = [sys.executable, "-m", "app.cli", "index", "search", os.fsencode(out), os.fsencode(photos / BAD), "-k", "1",
           "--include-queries"]
    proc = subprocess.run(cmd, capture_output=True, cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert proc.returncode == 0 and proc.stdout.split()[-1] == b"caf\\xe9.jpg", proc.stderr.decode()
    # an update sees it unchanged; a rename of it is a move (same id, nothing embedded)
    assert main(["index", "update", str(out), "--quiet", "--json"]) == 0
    s = _last_json(capsys)
    assert (s["unchanged"], s["embedded"], s["reembedded"], s["removed"]) == (13, 0, 0, 0), s
    (photos / BAD).rename(photos / RENAMED)
    assert main(["index", "update", str(out), "--quiet", "--json"]) == 0
    s = _last_json(capsys)
    assert (s["moved"], s["embedded"], s["removed"]) == (1, 0, 0), s
    assert main(["index", "search", str(out), str(photos / RENAMED), "-k", "1", "--json", "--include-queries"]) == 0
    hit = _last_json(capsys)[0]
    assert hit["path"] == RENAMED and hit["id"] == hits[0]["id"]
    assert main(["index", "stats", str(out)]) == 0 and main(["index", "dedup", str(out)]) == 0


def test_display_path_escapes_only_undecodable_bytes():
    assert display_path("fotos/été.jpg") == "fotos/été.jpg"
    assert display_path(os.fsdecode(b"a/\xff\xfe.png")) == "a/\\xff\\xfe.png"


# ------------------------------------------------------------------------------- real file systems
def test_read_only_index_searches_and_refuses_writes_clearly(photos, backbone, tmp_path, capsys):
    with tmpfs(tmp_path / "mnt", "16m") as mnt:
        out = mnt / "idx"
        assert _build(photos, backbone, out) == 0
        remount_ro(mnt)
        one = sorted(photos.rglob("*.jpg"))[0]
        capsys.readouterr()
        assert main(["index", "search", str(out), str(one), "-k", "2", "--json", "--include-queries"]) == 0, \
            capsys.readouterr().err
        assert _last_json(capsys)[0]["path"] == one.relative_to(photos).as_posix()
        assert main(["index", "stats", str(out), "--json"]) == 0
        assert _last_json(capsys)["vectors"] == 12
        for argv in (["index", "update", str(out), "--quiet"], ["index", "dedup", str(out)],
                     ["index", "build", str(photos), "--backbone", str(backbone), "-o", str(out), "--quiet"]):
            assert main(argv) == 2, argv
            _clean_err(capsys, f"{out} is read-only", "search works", "make it writable or copy it")


def _fill(folder: Path) -> Path:
    """Write a file in ``folder`` until the file system is full."""
    filler = folder / "filler"
    with open(filler, "wb", buffering=0) as f:
        with contextlib.suppress(OSError):
            while True:
                f.write(b"\0" * 4096)
    with contextlib.suppress(OSError), open(folder / "filler2", "wb", buffering=0) as f:
        while True:
            f.write(b"\0")  # the last partial page
    return filler


def _snapshot(index_dir: Path) -> dict[str, bytes]:
    return {n: (index_dir / n).read_bytes() for n in ("index.faiss", "index.json", "catalog.sqlite")}


@pytest.mark.parametrize("reader_open", [False, True], ids=["alone", "while-serving"])
def test_full_disk_says_so_and_keeps_the_index(photos, backbone, tmp_path, capsys, reader_open):
    from index.search.image_index import ImageIndex

    with tmpfs(tmp_path / "mnt", "16m") as mnt:
        out = mnt / "idx"
        assert _build(photos, backbone, out) == 0
        before = _snapshot(out)
        reader = ImageIndex.open(out) if reader_open else None  # a server keeps the WAL files open
        _noise(photos / "new.jpg", seed=2)
        _fill(mnt)
        capsys.readouterr()
        assert main(["index", "update", str(out), "--quiet"]) == 1  # a StorageError: not bad input
        _clean_err(capsys, f"no space left on device while writing {out / 'catalog.sqlite'}",
                   "free space and run the same command", "the index is unchanged")
        if reader is not None:
            reader.catalog.close()
        for name in ("filler", "filler2"):
            (mnt / name).unlink()
        assert _snapshot(out) == before
        assert main(["index", "update", str(out), "--quiet", "--json"]) == 0
        s = _last_json(capsys)
        assert (s["embedded"], s["vectors"]) == (1, 13), s


def test_write_error_that_is_not_a_full_disk_says_io_error(photos, backbone, tmp_path):
    """A write the OS refuses with space left (here EFBIG, from a file size limit) is an I/O error."""
    out = tmp_path / "idx"
    assert _build(photos, backbone, out) == 0
    _noise(photos / "new.jpg", seed=2)
    code = ("import resource, signal, sys; from app.cli import main; signal.signal(signal.SIGXFSZ, signal.SIG_IGN); "
            "resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096)); sys.exit(main(sys.argv[1:]))")
    proc = subprocess.run([sys.executable, "-c", code, "index", "update", str(out), "--quiet"], capture_output=True,
                          text=True, cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert f"I/O error writing {out / 'catalog.sqlite'}" in proc.stderr and "check the disk" in proc.stderr
    assert "no space" not in proc.stderr


# ------------------------------------------------------------------------------ damaged index.json
@pytest.mark.parametrize("damage", ["no-backbone_sha256", "wrong-dim", "index.faiss-of-another-dim"])
def test_damaged_index_json_names_the_file_and_the_fix(photos, backbone, tmp_path, capsys, damage):
    from index.search.store import VectorStore
    from index.search.trailer import read_index_id

    out = tmp_path / "idx"
    assert _build(photos, backbone, out) == 0
    meta = json.loads((out / "index.json").read_text())
    if damage == "no-backbone_sha256":
        del meta["backbone_sha256"]
        expect = [str(out / "index.json"), "lacks backbone_sha256"]
    else:
        meta["dim"] = 256
        expect = [str(out / "index.json"), "dim 256"]
    if damage == "index.faiss-of-another-dim":  # index.json agrees with it, the catalog does not
        VectorStore.create("flat", 256, 1, "no").save(out / "index.faiss", read_index_id(out / "index.faiss"))
        expect = [f"{out / 'index.faiss'} holds 256-d vectors, the catalog 512-d", "delete index.faiss"]
    (out / "index.json").write_text(json.dumps(meta))
    one = str(sorted(photos.rglob("*.jpg"))[0])
    capsys.readouterr()
    assert main(["index", "search", str(out), one]) == 2
    _clean_err(capsys, *expect, f"moco index update {out}")
    assert main(["index", "stats", str(out)]) == 2
    # the fix the message gives works
    if damage == "index.faiss-of-another-dim":
        (out / "index.faiss").unlink()
    assert main(["index", "update", str(out), "--quiet"]) == 0
    assert main(["index", "search", str(out), one, "--json"]) == 0
    assert _last_json(capsys)[0]["rank"] == 1
