"""Special files among photos (named pipes, devices, sockets, symlink loops, dangling links, huge files).

Each is refused before any byte is read, with a reason, and listed as skipped; none may block a job.
Everything that could block on the old code runs in a subprocess with a generous timeout, so a
regression fails the test instead of hanging the suite.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from tests.conftest import TINY_CLI

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT = 600  # seconds: far above the few seconds these take; only a hang reaches it

# file name -> what its reason must say
SPECIAL = {
    "fifo.jpg": "not a regular file (named pipe)",
    "zero.jpg": "not a regular file (character device)",
    "sock.png": "not a regular file (socket)",
    "loop_a.jpg": "symlink loop",
    "loop_b.jpg": "symlink loop",
    "dangling.jpg": "broken symlink",
}
# the index build stats each file before hashing it: the system's words are fine there too
STAT_SAYS = {"loop_a.jpg": "Too many levels of symbolic links", "loop_b.jpg": "Too many levels of symbolic links",
             "dangling.jpg": "No such file or directory"}


def _photos(root: Path, n: int = 10) -> list[str]:
    rng = np.random.default_rng(0)
    names = []
    for i in range(n):
        name = f"p{i}.{'jpg' if i % 2 else 'png'}"
        Image.fromarray(rng.integers(0, 256, (40, 48, 3), dtype=np.uint8)).save(root / name)
        names.append(name)
    return names


def _add_specials(root: Path) -> None:
    os.mkfifo(root / "fifo.jpg")
    os.symlink("/dev/zero", root / "zero.jpg")
    os.symlink("loop_b.jpg", root / "loop_a.jpg")
    os.symlink("loop_a.jpg", root / "loop_b.jpg")
    os.symlink("missing.jpg", root / "dangling.jpg")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(str(root / "sock.png"))  # the socket file stays after close
    sock.close()


@pytest.fixture()
def mixed(tmp_path: Path) -> tuple[Path, list[str]]:
    """A small photo folder with every kind of special file mixed in."""
    root = tmp_path / "photos"
    root.mkdir()
    names = _photos(root)
    _add_specials(root)
    return root, names


def _run(args: list[str], timeout: float = TIMEOUT) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as err:
        pytest.fail(f"{' '.join(map(str, args[:4]))} ... still running after {timeout} s (blocked on a special file?)"
                    f"\nstderr: {err.stderr!r}")


def _python(code: str) -> dict:
    """Run ``code`` in a fresh interpreter; it prints one JSON object as its last line."""
    proc = _run([sys.executable, "-c", textwrap.dedent(code)])
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return _run([sys.executable, "-m", "app.cli", *args])


# ------------------------------------------------------------------------------------ reasons


def test_reasons_from_decoder_and_hash(mixed: tuple[Path, list[str]]) -> None:
    root, _ = mixed
    out = _python(f"""
        import json
        from pathlib import Path
        from index.building.plan import file_hash
        from moco.data import ImageDecodeError, load_rgb
        out = {{}}
        for name in {sorted(SPECIAL)!r}:
            path = Path({str(root)!r}) / name
            try:
                load_rgb(path)
                decoded = "decoded"
            except ImageDecodeError as err:
                decoded = err.reason
            try:
                file_hash(path)
                hashed = "hashed"
            except OSError as err:
                hashed = err.strerror
            out[name] = [decoded, hashed]
        print(json.dumps(out))
    """)
    for name, want in SPECIAL.items():
        decoded, hashed = out[name]
        assert want in decoded and decoded.startswith("unreadable: "), (name, decoded)
        assert want in hashed, (name, hashed)


def test_file_over_the_byte_cap_is_refused_before_reading(tmp_path: Path) -> None:
    from index.building.plan import file_hash
    from moco.data.photos import MAX_FILE_BYTES, ImageDecodeError, load_rgb

    big = tmp_path / "big.png"
    Image.new("RGB", (8, 8)).save(big)
    with open(big, "r+b") as f:
        f.truncate(MAX_FILE_BYTES + 1)  # sparse: no disk used
    with pytest.raises(ImageDecodeError, match=r"too large.*1073741825 bytes"):
        load_rgb(big)
    with pytest.raises(OSError, match="too large"):
        file_hash(big)


# -------------------------------------------------------------------------------------- index


def test_index_build_and_update_list_special_files_as_errors(
    mixed: tuple[Path, list[str]], backbone: Path, tmp_path: Path
) -> None:
    root, names = mixed
    idx = tmp_path / "idx"
    build = _cli("index", "build", str(root), "--backbone", str(backbone), "-o", str(idx), "--device", "cpu",
                 "--quiet", "--workers", "2")
    assert build.returncode == 0, build.stderr
    stats = _cli("index", "stats", str(idx), "--json")
    assert stats.returncode == 0, stats.stderr
    st = json.loads(stats.stdout)
    errors = {e["path"]: e["reason"] for e in st["errors"]}
    assert set(errors) == set(SPECIAL), errors
    for name, want in SPECIAL.items():
        assert want in errors[name] or STAT_SAYS.get(name, want) in errors[name], (name, errors[name])
    assert st["vectors"] == len(names)

    # an update hashes new paths before planning them: a new pipe must not block that either
    os.mkfifo(root / "later.png")
    Image.new("RGB", (40, 40), (10, 200, 30)).save(root / "new.jpg")
    update = _cli("index", "update", str(idx), "--device", "cpu", "--quiet")
    assert update.returncode == 0, update.stderr
    st = json.loads(_cli("index", "stats", str(idx), "--json").stdout)
    errors = {e["path"]: e["reason"] for e in st["errors"]}
    assert "not a regular file (named pipe)" in errors["later.png"]
    assert set(errors) == {*SPECIAL, "later.png"}
    assert st["vectors"] == len(names) + 1


# ------------------------------------------------------------------------------------ embedder


def test_embedder_refuses_special_files(mixed: tuple[Path, list[str]], backbone: Path) -> None:
    root, names = mixed
    out = _python(f"""
        import json
        from moco.data import ImageDecodeError
        from moco.embed import Embedder
        root = {str(root)!r}
        emb = Embedder.load({str(backbone)!r}, device="cpu")
        try:
            emb.embed(root + "/fifo.jpg")
            direct = "embedded"
        except ImageDecodeError as err:
            direct = str(err)
        folders = {{}}
        for decoder in ("pil", "torchvision"):
            done, failed = [], {{}}
            for paths, vectors, failures in emb.embed_folder(root, progress=False, decoder=decoder, batch_size=4):
                assert len(paths) == len(vectors)
                done += paths
                failed.update(failures)
            folders[decoder] = [sorted(done), failed]
        print(json.dumps({{"direct": direct, "folders": folders}}))
    """)
    assert out["direct"] == f"{root}/fifo.jpg: unreadable: not a regular file (named pipe)"
    for decoder, (done, failed) in out["folders"].items():
        assert done == sorted(names), decoder
        assert set(failed) == set(SPECIAL), (decoder, failed)
        for name, want in SPECIAL.items():
            assert want in failed[name], (decoder, name, failed[name])


# -------------------------------------------------------------------------------------- train


def test_train_lists_special_files_in_skipped_txt(mixed: tuple[Path, list[str]], tmp_path: Path) -> None:
    root, names = mixed
    run = tmp_path / "run"
    proc = _cli("train", str(root), "--out", str(run), *TINY_CLI, "--max-steps", "1", "--device", "cpu")
    assert proc.returncode == 0, proc.stderr
    skipped = dict(line.split("\t", 1) for line in (run / "skipped.txt").read_text().splitlines())
    assert set(skipped) == set(SPECIAL), skipped
    for name, want in SPECIAL.items():
        assert want in skipped[name], (name, skipped[name])
