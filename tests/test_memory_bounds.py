"""Memory is bounded by the output, not by the input: odd aspect ratios, huge images, huge k.

Each measurement runs in a process of its own, forked from one that imported torch and our modules once
(multiprocessing's forkserver: the imports are not paid again per measurement). It warms up, resets its peak
resident set to what it uses now (``/proc/self/clear_refs``), then reads the peak (VmHWM) after the call under
test: what the call added on top of the warmed-up process, whatever happened before. An address-space limit a few
GiB above the warmed-up process turns a runaway allocation into a MemoryError instead of a machine-wide
out-of-memory kill.
"""

from __future__ import annotations

import concurrent.futures
import multiprocessing
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from app.cli.commands import main
from moco.data.photos import load_rgb, load_square_u8, square_u8
from tests.conftest import random_backbone

ROOT = Path(__file__).resolve().parents[1]
LIMIT_MB = 300

_MEASURE = """
import json, re, resource

def _status(key):
    return int(re.search(key + r":\\s+(\\d+) kB", open("/proc/self/status").read()).group(1))

def measure(call):
    vm = _status("VmSize") * 1024 + (3 << 30)
    resource.setrlimit(resource.RLIMIT_AS, (vm, vm))  # never take the machine's memory, fail instead
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak so far (the warm-up's, the forkserver's) := the resident set now
    base = _status("VmHWM")
    try:
        result = call()
    except MemoryError:
        result = "MemoryError"
    return json.loads(json.dumps({"peak_mb": (_status("VmHWM") - base) / 1024, "result": result}))
"""
_PRELOAD = ["torch", "PIL.Image", "moco.embed", "moco.data", "app.cli", "index.search.image_index"]


def _run(code: str) -> dict:
    """In the forked process: run ``code``, which leaves its measurement in ``_measured``."""
    scope: dict = {}
    exec(compile(code, "<measure>", "exec"), scope)  # noqa: S102 - this file's own measurement code
    return scope["_measured"]


def _measure(setup: str, call: str) -> dict:
    """Run ``setup`` (imports, warm-up), then ``measure(lambda: CALL)`` in a process of its own."""
    code = _MEASURE + textwrap.dedent(setup) + f"\n_measured = measure(lambda: {call})\n"
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)  # read when the forkserver starts: the first measurement
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=ctx, max_tasks_per_child=1) as pool:
        return pool.submit(_run, code).result(timeout=600)


@pytest.fixture(scope="module")
def backbone224(tmp_path_factory) -> Path:
    """A backbone with the usual 224 px input (resize 256): the size at which odd shapes cost most."""
    return random_backbone(tmp_path_factory.mktemp("backbone224"), image_size=224)


def _png(path: Path, mode: str, size: tuple[int, int]) -> Path:
    if mode == "RGB":
        pixels = np.random.default_rng(0).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
        Image.fromarray(pixels).save(path)
    else:
        Image.new(mode, size, 1).save(path)
    return path


# ------------------------------------------------------------------------------------- images


@pytest.mark.parametrize(("mode", "size"), [
    ("RGB", (4000, 2)), ("RGB", (400000, 1)), ("RGB", (100000, 1)), ("RGB", (2, 30000)),
    ("L", (9000, 9000)), ("1", (9000, 9000)), ("P", (9000, 9000)),
])
def test_embedding_a_file_is_bounded_by_the_model_input(
    mode: str, size: tuple[int, int], backbone224: Path, tmp_path: Path
) -> None:
    path = _png(tmp_path / f"{mode}_{size[0]}x{size[1]}.png", mode, size)
    warm = _png(tmp_path / "warm.png", "RGB", (300, 200))
    got = _measure(f"""
        from moco.embed import Embedder
        emb = Embedder.load({str(backbone224)!r}, device="cpu")
        emb.embed([{str(warm)!r}, {str(warm)!r}])
    """, f"list(emb.embed({str(path)!r}).shape)")
    assert got["result"] == [1, 512], got
    assert got["peak_mb"] < LIMIT_MB, got


def test_load_square_is_bounded_for_a_huge_palette_image(tmp_path: Path) -> None:
    path = _png(tmp_path / "p.png", "P", (9000, 9000))
    got = _measure("""
        from moco.data import load_square_u8
    """, f"load_square_u8({str(path)!r}, 256).shape")
    assert got["result"] == [256, 256, 3], got
    assert got["peak_mb"] < LIMIT_MB, got


# ----------------------------------------------------------------------------- same pixels as before


def _old_square_u8(img: Image.Image, size: int) -> np.ndarray:
    """The reference: resize the whole image (short side -> size), then crop the centre."""
    w, h = img.size
    new = (size, max(size, round(h * size / w))) if w <= h else (max(size, round(w * size / h)), size)
    img = img.resize(new, Image.Resampling.BICUBIC, reducing_gap=3.0)
    left, top = (new[0] - size) // 2, (new[1] - size) // 2
    return np.asarray(img.crop((left, top, left + size, top + size)))


def _photo(size: tuple[int, int]) -> Image.Image:
    """Smooth gradients plus noise: closer to a photo than a solid colour."""
    w, h = size
    x, y = np.linspace(0, 1, w, dtype=np.float32)[None, :], np.linspace(0, 1, h, dtype=np.float32)[:, None]
    pixels = 12 * np.random.default_rng(0).standard_normal((h, w, 3), dtype=np.float32)  # H x W x 3 noise
    pixels[..., 0] += 255 * x  # float32 and in place: a 12 MP photo in a second, not in 13
    pixels[..., 1] += 255 * y
    pixels[..., 2] += 127 + 100 * np.sin(8 * x + 5 * y)
    return Image.fromarray(np.clip(pixels, 0, 255, out=pixels).astype(np.uint8))


@pytest.mark.parametrize("size", [(640, 480), (480, 640), (1200, 800), (333, 1000), (257, 256), (100, 60),
                                  (4000, 3000)])
def test_square_matches_resize_then_crop(size: tuple[int, int]) -> None:
    img = _photo(size)
    new, ref = square_u8(img, 224).astype(int), _old_square_u8(img, 224).astype(int)
    assert np.abs(new - ref).mean() <= 0.5  # rounding only: the same filter on the same pixels
    assert np.abs(new - ref).max() <= 3


@pytest.mark.parametrize(("fmt", "size"), [("PNG", (3000, 2000)), ("JPEG", (3000, 2000)), ("PNG", (1024, 768))])
def test_reduced_decode_matches_full_decode(fmt: str, size: tuple[int, int], tmp_path: Path) -> None:
    path = tmp_path / f"photo.{fmt.lower()}"
    _photo(size).save(path, fmt, quality=95)
    fast = load_square_u8(path, 256).astype(int)
    full = _old_square_u8(load_rgb(path), 256).astype(int)  # no draft, no reduce: every pixel decoded
    assert np.abs(fast - full).mean() <= 1.0


@pytest.mark.parametrize("mode", ["P", "P-alpha", "1", "I;16", "LA", "RGBA"])
def test_reducing_in_native_mode_matches_reducing_rgb(mode: str, tmp_path: Path) -> None:
    rgba = np.asarray(_photo((1500, 1100)).convert("RGBA")).copy()
    rgba[..., 3] = np.linspace(0, 255, 1500).astype(np.uint8)[None, :]  # alpha ramp
    img = Image.fromarray(rgba)
    if mode == "P":
        img = img.convert("RGB").quantize(64)
        img.info["transparency"] = 3
    elif mode == "P-alpha":  # a palette with an alpha per entry (PNG tRNS)
        img = img.convert("RGB").quantize(64)
        img.info["transparency"] = bytes(range(0, 256, 4))
    elif mode == "I;16":
        img = Image.fromarray(np.asarray(img.convert("L")).astype(np.uint16) * 257).convert("I;16")
    else:
        img = img.convert(mode)
    path = tmp_path / "x.png"
    img.save(path)
    reduced = load_rgb(path, min_short=128)  # short side 1100 -> reduced by 4 while decoding
    assert reduced.size == (375, 275)
    full = load_rgb(path).reduce(4)
    assert np.abs(np.asarray(reduced).astype(int) - np.asarray(full).astype(int)).max() <= 2


# ------------------------------------------------------------------------------------- search k


@pytest.fixture(scope="module")
def small_index(sample_photos: Path, backbone: Path, tmp_path_factory) -> Path:
    idx = tmp_path_factory.mktemp("memidx") / "idx"
    assert main(["index", "build", str(sample_photos), "--backbone", str(backbone), "-o", str(idx),
                 "--device", "cpu", "--quiet"]) == 0
    return idx


@pytest.mark.parametrize("k", [100_000_000, 1_000_000_000_000])
def test_search_with_a_huge_k_returns_the_whole_index(k: int, small_index: Path, sample_photos: Path) -> None:
    image = str(next(sample_photos.rglob("*.png")))
    args = ["index", "search", str(small_index), image, "--json", "--include-queries"]  # the photo itself too
    got = _measure(f"""
        import contextlib, io, json
        from app.cli import main

        def search(k):
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                rc = main({args!r} + ["-k", str(k)])
            return [rc, len(json.loads(out.getvalue()))]

        search(5)
    """, f"search({k})")
    n = len(list(sample_photos.rglob("*.png"))) + len(list(sample_photos.rglob("*.jpg")))
    assert got["result"] == [0, n], got
    assert got["peak_mb"] < LIMIT_MB, got


# ------------------------------------------------------------------------------------- UI upload


def _hwm_mb(pid: int) -> float:
    text = Path(f"/proc/{pid}/status").read_text()
    return int(text.split("VmHWM:")[1].split()[0]) / 1024


@pytest.mark.slow
def test_ui_upload_of_a_huge_image_is_bounded(small_index: Path, sample_photos: Path, tmp_path: Path) -> None:
    import os

    from gradio_client import Client, handle_file

    from tests.live import free_port, wait_served

    huge = _png(tmp_path / "huge.png", "L", (9000, 9000))  # 81 M pixels in a few KB
    port = free_port()
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-m", "app.cli", "serve", str(small_index), "--port", str(port),
                             "--device", "cpu"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_served(url + "/config", proc, timeout=300)
        client = Client(url, verbose=False)
        client.predict(handle_file(str(next(sample_photos.rglob("*.png")))), 3, "", api_name="/search")  # warm-up
        before = _hwm_mb(proc.pid)
        gallery, info = client.predict(handle_file(str(huge)), 3, "", api_name="/search")[:2]
        assert "3 results" in info, info
        assert _hwm_mb(proc.pid) - before < LIMIT_MB
    finally:
        proc.terminate()
        proc.wait(timeout=30)
