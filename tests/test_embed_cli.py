"""`moco embed PHOTOS --backbone B -o FILE.npy`: the index's vectors in a file, with their paths beside them;
resumable after a kill; bad input exits 2 naming the value and the fix."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from app.cli.commands import main
from index.building.runner import build_index
from index.search.image_index import ImageIndex
from moco.config import resolve_config
from moco.data.photos import scan_images
from moco.data.sample import make_sample_collection
from moco.embed import Embedder
from moco.export.exporter import export_backbone
from moco.training.loop import train
from tests.conftest import random_backbone

ROOT = Path(__file__).resolve().parents[1]
ODD = os.fsdecode(b"caf\xe9 \xff.jpg")  # a name that is not UTF-8: its bytes must survive the paths file


@pytest.fixture(scope="module")
def white(tmp_path_factory, sample_photos) -> Path:
    """An export that carries its own space (a cpu-preset run whitens its features): default and --features
    differ."""
    tmp = tmp_path_factory.mktemp("white")
    cfg = resolve_config("cpu", data_dir=str(sample_photos), out=str(tmp / "run"), image_size=32, batch_size=8,
                         bn_splits=2, queue_size=16, workers=0, max_steps=2, precision="fp32",
                         save_every_minutes=1000.0)
    train(cfg, progress=False)
    export_backbone(tmp / "run" / "checkpoint.pt", tmp / "white.safetensors")
    assert Embedder.load(tmp / "white.safetensors", device="cpu").space is not None
    return tmp / "white.safetensors"


@pytest.fixture(scope="module")
def photos(tmp_path_factory, sample_photos) -> Path:
    """The sample photos, one of them under a name that is not UTF-8, and one file that is not an image."""
    root = tmp_path_factory.mktemp("embed") / "photos"
    shutil.copytree(sample_photos, root)
    first = sorted(root.rglob("*.jpg"))[0]
    shutil.copy(first, os.path.join(os.fsencode(root), os.fsencode(ODD)))
    (root / "broken.jpg").write_bytes(b"not a JPEG")
    return root


def _paths(out: Path) -> list[str]:
    with open(out.with_name(out.stem + ".paths.txt"), encoding="utf-8", errors="surrogateescape") as f:
        return f.read().splitlines()


def _embed(*args: str) -> int:
    return main(["embed", *args, "--quiet"])


@pytest.mark.parametrize("how", ["default", "features"])
def test_vectors_equal_the_embedders_in_the_order_of_the_paths(photos, white, tmp_path, capsys, how):
    out = tmp_path / "sub" / "vectors.npy"  # a folder that does not exist yet is made
    flags = ["--features"] if how == "features" else []
    assert _embed(str(photos), "--backbone", str(white), "-o", str(out), "--chunk-size", "7", *flags) == 0
    said = capsys.readouterr()
    vectors, paths = np.load(out), _paths(out)
    readable = [p for p in scan_images(photos) if p != "broken.jpg"]
    assert paths == readable and ODD in paths  # every readable photo, in the scan's order; the odd name's bytes
    emb = Embedder.load(white, device="cpu", space="features" if how == "features" else None)
    want = emb.embed([photos / p for p in paths])
    assert vectors.dtype == np.float32 and vectors.shape == want.shape
    assert np.allclose(vectors, want, atol=1e-5)
    other = Embedder.load(white, device="cpu", space=None if how == "features" else "features")
    assert not np.allclose(vectors[:4], other.embed([photos / p for p in paths[:4]]), atol=1e-3)  # the flag matters
    assert "skipped 1 unreadable (e.g. broken.jpg" in said.out and f"{len(paths)} x {emb.dim} float32" in said.out
    assert not (tmp_path / "sub" / "vectors.npy.parts").exists()  # complete: the chunks are gone


def test_space_gives_the_index_vectors(photos, white, tmp_path):
    build_index(photos, white, tmp_path / "idx", progress=False, device="cpu")
    out = tmp_path / "v.npy"
    assert _embed(str(photos), "--backbone", str(white), "-o", str(out), "--space", str(tmp_path / "idx")) == 0
    idx = ImageIndex.open(tmp_path / "idx")
    paths = _paths(out)
    want = idx.to_space(idx.load_embedder(device="cpu").embed([photos / p for p in paths]))  # what search compares
    assert np.allclose(np.load(out), want, atol=1e-5)


def _chunks(parts: Path) -> list[Path]:
    return sorted(parts.glob("chunk-*.npz"))


def test_a_killed_run_resumes_without_embedding_its_finished_chunks(tmp_path, capsys):
    photos = tmp_path / "photos"
    make_sample_collection(photos, per_family=6, size=48, seed=3)  # 36 photos
    backbone = random_backbone(tmp_path, image_size=224)  # slow enough on a CPU to be killed midway
    out = tmp_path / "v.npy"
    parts = tmp_path / "v.npy.parts"
    argv = ["embed", str(photos), "--backbone", str(backbone), "-o", str(out), "--chunk-size", "2", "--batch-size",
            "2", "--device", "cpu", "--quiet"]
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-m", "app.cli", *argv], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    deadline = time.monotonic() + 300
    while len(_chunks(parts)) < 3 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.002)
    proc.send_signal(signal.SIGKILL)  # no chance to clean up: as a power cut or the OOM killer
    proc.communicate()
    done = _chunks(parts)
    assert proc.returncode == -signal.SIGKILL and 3 <= len(done) < 18 and not out.exists()

    # Mark the finished chunks' vectors (negated: still unit vectors): a run that embedded them again would
    # write the true ones; one that resumes reads them as they are.
    for chunk in done:
        with np.load(chunk) as z:
            arrays = {k: z[k] for k in z.files}
        np.savez(chunk, **{**arrays, "vectors": -arrays["vectors"]})
    assert main(argv) == 0
    assert f"{len(done)} of 18 chunks came from the interrupted run" in capsys.readouterr().out
    paths = _paths(out)
    assert paths == scan_images(photos)
    want = Embedder.load(backbone, device="cpu").embed([photos / p for p in paths])
    cosine = np.sum(np.load(out) * want, axis=1)  # two processes, other thread counts: bf16 differs in the last bits
    marked = 2 * len(done)  # the finished chunks hold the first rows
    assert np.all(cosine[:marked] < -0.999) and np.all(cosine[marked:] > 0.999), cosine
    assert not parts.exists()


def test_an_unfinished_run_with_another_backbone_is_not_mixed_in(photos, backbone, tmp_path, capsys):
    out, parts = tmp_path / "v.npy", tmp_path / "v.npy.parts"
    other = random_backbone(tmp_path, image_size=224, seed=1)  # slow: killed long before it ends
    argv = ["embed", str(photos), "--backbone", str(other), "-o", str(out), "--chunk-size", "2", "--quiet"]
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-m", "app.cli", *argv], cwd=ROOT, env=env)
    deadline = time.monotonic() + 300
    while not _chunks(parts) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.002)
    proc.kill()
    proc.wait()
    assert _chunks(parts) and not out.exists()
    assert _embed(str(photos), "--backbone", str(backbone), "-o", str(out)) == 2
    err = capsys.readouterr().err
    assert f"{parts} holds an unfinished run with another backbone" in err and "delete" in err
    assert not out.exists() and _chunks(parts)  # nothing mixed, nothing lost


def test_a_second_run_on_the_same_output_is_told_who_holds_it(photos, backbone, tmp_path, capsys):
    from moco.files import lock_dir

    parts = tmp_path / "v.npy.parts"
    parts.mkdir()
    with lock_dir(parts, "-o"):  # a run in progress on this output
        assert _embed(str(photos), "--backbone", str(backbone), "-o", str(tmp_path / "v.npy")) == 2
    err = capsys.readouterr().err
    assert f"{parts} is in use by another moco run (PID {os.getpid()})" in err and "another -o" in err


def _index_of(backbone: Path, tmp: Path) -> Path:
    photos = tmp / "few"
    make_sample_collection(photos, per_family=2, size=48, seed=1)
    build_index(photos, backbone, tmp / "other_idx", progress=False, device="cpu")
    return tmp / "other_idx"


@pytest.mark.parametrize("case", ["no folder", "a file", "no photos", "suffix", "out is a folder", "no backbone",
                                  "space not an index", "space of another backbone", "chunk size", "both spaces",
                                  "parquet without pyarrow", "line break"])
def test_bad_input_exits_2_naming_the_value(photos, backbone, tmp_path, capsys, monkeypatch, case):
    out = tmp_path / "v.npy"
    folder, flags, needle = str(photos), [], None
    if case == "no folder":
        folder, needle = str(tmp_path / "nowhere"), "no such folder"
    elif case == "a file":
        folder, needle = str(backbone), "not a folder"
    elif case == "no photos":
        (tmp_path / "empty").mkdir()
        folder, needle = str(tmp_path / "empty"), "no photos in"
    elif case == "suffix":
        out, needle = tmp_path / "v.txt", "name the output FILE.npy"
    elif case == "out is a folder":
        out = tmp_path / "d.npy"
        out.mkdir()
        needle = "is a folder: give a file name"
    elif case == "no backbone":
        flags, needle = ["--backbone", str(tmp_path / "missing.safetensors")], "file not found"
    elif case == "space not an index":
        flags, needle = ["--space", str(photos)], "no space.safetensors there"
    elif case == "space of another backbone":
        flags, needle = ["--space", str(_index_of(random_backbone(tmp_path, seed=2), tmp_path))], "load the backbone"
    elif case == "chunk size":
        flags, needle = ["--chunk-size", "0"], "--chunk-size 0"
    elif case == "both spaces":
        flags, needle = ["--space", str(tmp_path), "--features"], "not allowed with argument"
    elif case == "parquet without pyarrow":
        monkeypatch.setitem(sys.modules, "pyarrow", None)  # as on a machine without it: its import fails
        out, needle = tmp_path / "v.parquet", "pip install pyarrow"
    elif case == "line break":
        odd = tmp_path / "odd"
        odd.mkdir()
        shutil.copy(sorted(photos.rglob("*.png"))[0], odd / "two\nlines.png")
        folder, needle = str(odd), "rename the file"
    if "--backbone" not in flags:
        flags = ["--backbone", str(backbone), *flags]
    try:
        code = _embed(folder, *flags, "-o", str(out))
    except SystemExit as e:  # argparse's own refusals
        code = e.code
    err = capsys.readouterr().err
    assert code == 2, err
    assert needle in err and "Traceback" not in err, err
    assert not (tmp_path / "v.npy").exists() and not (tmp_path / "v.npy.parts" / "chunk-0000000.npz").exists()


def test_parquet_holds_paths_and_vectors(photos, backbone, tmp_path):
    pq = pytest.importorskip("pyarrow.parquet")
    assert _embed(str(photos), "--backbone", str(backbone), "-o", str(tmp_path / "v.parquet")) == 2  # the odd name
    clean = tmp_path / "clean"
    shutil.copytree(photos, clean, ignore=lambda d, names: [n for n in names if n == ODD])
    assert _embed(str(clean), "--backbone", str(backbone), "-o", str(tmp_path / "v.parquet")) == 0
    table = pq.read_table(tmp_path / "v.parquet")
    paths = table.column("path").to_pylist()
    vectors = np.stack(table.column("vector").to_numpy(zero_copy_only=False))
    assert paths == [p for p in scan_images(clean) if p != "broken.jpg"]
    want = Embedder.load(backbone, device="cpu").embed([clean / p for p in paths])
    assert np.allclose(vectors, want, atol=1e-5)


def test_a_resumed_run_embeds_again_the_photos_that_changed_since(sample_photos, backbone, tmp_path, capsys):
    photos = tmp_path / "photos"
    shutil.copytree(sample_photos, photos)
    out = tmp_path / "v.npy"
    argv = ["embed", str(photos), "--backbone", str(backbone), "-o", str(out), "--chunk-size", "8", "--device",
            "cpu", "--quiet"]
    in_the_way = tmp_path / "v.paths.txt"
    in_the_way.mkdir()  # every chunk is embedded, then writing the output fails: the run is unfinished
    assert main(argv) == 1
    assert len(_chunks(tmp_path / "v.npy.parts")) == 6 and not out.exists()
    in_the_way.rmdir()
    names = scan_images(photos)
    changed = photos / names[1]  # in the first chunk: new pixels under the same name
    other = next(photos / n for n in names[8:] if Path(n).suffix == changed.suffix)
    shutil.copy(other, changed)
    os.utime(changed, ns=(time.time_ns(), time.time_ns() + 10**9))
    capsys.readouterr()
    assert main(argv) == 0
    assert "5 of 6 chunks came from the interrupted run" in capsys.readouterr().out
    assert _paths(out) == names
    fresh = Embedder.load(backbone, device="cpu").embed([photos / p for p in names])
    assert np.allclose(np.load(out), fresh, atol=1e-5)  # what a fresh run gives, the changed photo's row too
