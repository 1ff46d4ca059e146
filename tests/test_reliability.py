"""What a user's disk or a crafted file can do to us: no downloads, right file modes, full disks, an index inside
the photo folder, no temporary files left after SIGTERM (login floods: test_throttle.py)."""

from __future__ import annotations

import json
import os
import threading
import urllib.parse
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch

from app.cli.commands import main
from moco.errors import StorageError, UserError
from moco.files import atomic_write
from moco.training.checkpoints import save_checkpoint
from moco.weights.layouts import load_checkpoint

from .conftest import TINY_CLI
from .live import free_port
from .mounts import tmpfs


# ------------------------------------------------------------------------------------ no downloads
@pytest.fixture
def http_log():
    """A real HTTP server on 127.0.0.1 that logs every request (and serves nothing)."""
    seen: list[str] = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            seen.append(self.path)
            self.send_response(404)
            self.end_headers()

        do_HEAD = do_GET

        def log_message(self, *args) -> None:
            """No request log on stderr."""

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}", seen
    server.shutdown()


def _crafted(backbone: Path, out: Path, **meta_changes: str) -> Path:
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(backbone), framework="pt") as f:
        meta, state = dict(f.metadata()), {k: f.get_tensor(k) for k in f.keys()}
    save_file(state, str(out), metadata={**meta, **meta_changes})
    return out


@pytest.mark.parametrize("kwargs", [
    {"pretrained": True, "pretrained_cfg_overlay": {"url": "URL"}},
    {"pretrained_cfg_overlay": {"url": "URL"}, "depth": 18},
    {"num_heads": "12; pretrained"},
])
def test_crafted_backbone_metadata_never_reaches_the_network(backbone, sample_photos, tmp_path, http_log,
                                                              monkeypatch, kwargs):
    from moco.embed import Embedder

    url, seen = http_log
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch_home"))  # nothing cached from an earlier run
    text = json.dumps(kwargs).replace("URL", f"{url}/{uuid.uuid4().hex}.pth")
    crafted = _crafted(backbone, tmp_path / "crafted.safetensors", arch_kwargs=text)
    with pytest.raises(UserError, match="re-export"):
        Embedder.load(crafted, device="cpu")
    assert main(["index", "build", str(sample_photos), "--backbone", str(crafted), "-o", str(tmp_path / "idx"),
                 "--quiet"]) == 2
    assert seen == []


def _vit_backbone(tmp_path: Path) -> Path:
    """A real exported ViT (2 blocks, 32 px): about 11 MB."""
    import timm

    from moco.export.exporter import export_backbone

    vit = timm.create_model("vit_tiny_patch16_224", pretrained=False, num_classes=0, img_size=32, depth=2)
    torch.save({"state_dict": {f"module.base_encoder.{k}": v for k, v in vit.state_dict().items()}},
               tmp_path / "vit.pth.tar")
    out = tmp_path / "vit.safetensors"
    export_backbone(tmp_path / "vit.pth.tar", out, arch="vit_tiny_patch16_224", image_size=32)
    return out


@pytest.mark.parametrize("changes, words", [
    ({"arch_kwargs": json.dumps({"depth": 2000})}, "asks for depth = 2000, but its weights hold 2"),
    ({"arch_kwargs": json.dumps({"embed_dim": 4096, "num_heads": 16})}, "asks for embed_dim = 4096, but its weights"),
    ({"arch": "timm/vit_gigantic_patch14_clip_224", "arch_kwargs": "{}"}, "its weights are not those of its"),
])
def test_metadata_asking_for_a_larger_model_is_refused_before_it_is_built(tmp_path, changes, words):
    """A small file whose metadata asks for thousands of blocks or a 1.8-billion-parameter model: refused, naming
    the key, in a process whose peak memory stays far under that model's 7 GB (a subprocess, measured)."""
    import subprocess
    import sys

    crafted = _crafted(_vit_backbone(tmp_path), tmp_path / "crafted.safetensors", **changes)
    code = ("import re, sys\nfrom moco.embed import Embedder\nfrom moco.errors import UserError\n"
            f"try:\n    Embedder.load({str(crafted)!r}, device='cpu')\nexcept UserError as e:\n    print(e)\n"
            "print('peak', re.search(r'VmHWM:\\s+(\\d+)', open('/proc/self/status').read())[1])")
    # (VmHWM: this process's own peak; ru_maxrss would carry over the forking test worker's, through exec)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                         env=dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1])))
    assert out.returncode == 0, out.stderr[-3000:]
    assert words in out.stdout and str(crafted) in out.stdout and "export the backbone again" in out.stdout
    peak_kb = int(out.stdout.split("peak ")[1])
    assert peak_kb < 2_500_000, peak_kb  # the gigantic model alone is 7.4 GB in float32


def test_allowed_architecture_settings_still_load(backbone, tmp_path):
    from moco.model.backbones import build_backbone

    model, dim = build_backbone("vit_tiny_patch16_224", image_size=32, num_heads=6, depth=2)
    assert len(model.blocks) == 2 and model.blocks[0].attn.num_heads == 6 and dim == 192


# ----------------------------------------------------------------------------------- file modes
@pytest.mark.parametrize("umask", [0o022, 0o077, 0o002])
def test_atomic_write_gives_the_mode_of_a_plain_open(tmp_path, umask):
    old = os.umask(umask)
    try:
        atomic_write(tmp_path / "ours.json", lambda f: f.write(b"{}"))
        (tmp_path / "plain.json").write_bytes(b"{}")
    finally:
        os.umask(old)
    ours, plain = (os.stat(tmp_path / n).st_mode & 0o777 for n in ("ours.json", "plain.json"))
    assert ours == plain == 0o666 & ~umask


@pytest.fixture()
def python_sigint():
    """SIGINT handled by Python's own handler (KeyboardInterrupt) for one test, whatever the worker had set."""
    import signal

    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, old)


def _interrupt_right_after(monkeypatch, name: str) -> None:
    """``tempfile.NAME`` makes its file, then a Ctrl+C lands at once: the moment a plain try/finally misses.

    ``signal.raise_signal`` delivers it to this very thread before it returns (``os.kill`` of the process may reach
    another thread, and a loaded machine runs that one later): Python then handles it at its next check, inside the
    code under test, on any machine."""
    import signal
    import tempfile

    real = getattr(tempfile, name)

    def made_then_interrupted(*args, **kwargs):
        made = real(*args, **kwargs)
        signal.raise_signal(signal.SIGINT)
        return made

    monkeypatch.setattr(tempfile, name, made_then_interrupted)


@pytest.mark.parametrize("where", ["atomic_write", "scratch_dir", "image cache"])
def test_an_interrupt_right_after_a_temp_file_is_made_leaves_nothing(tmp_path, monkeypatch, sample_photos, where,
                                                                      python_sigint):
    from moco.data.cache import build_cache
    from moco.files import scratch_dir

    (tmp_path / "out").mkdir()
    _interrupt_right_after(monkeypatch, "mkdtemp" if where == "scratch_dir" else "mkstemp")
    with pytest.raises(KeyboardInterrupt):
        if where == "atomic_write":
            atomic_write(tmp_path / "out" / "a.json", lambda f: f.write(b"{}"))
        elif where == "scratch_dir":
            with scratch_dir(".x.", tmp_path / "out") as d:
                (d / "inside").write_text("y")
        else:
            build_cache(sample_photos, 32, tmp_path / "out", progress=False)
    assert list((tmp_path / "out").iterdir()) == []


@pytest.mark.parametrize("umask", [0o022, 0o077, 0o002])
def test_the_image_cache_follows_the_umask_too(sample_photos, tmp_path, umask):
    from moco.data.cache import build_cache

    old = os.umask(umask)
    try:
        build_cache(sample_photos, 16, tmp_path / "cache")
    finally:
        os.umask(old)
    modes = {p.name: os.stat(p).st_mode & 0o777 for p in (tmp_path / "cache").iterdir()}
    assert modes == {"images-16.u8": 0o666 & ~umask, "images-16.json": 0o666 & ~umask}


def test_numbered_checkpoint_is_a_separate_copy(tmp_path):
    state = {"step": 7, "weights": torch.arange(1000.0)}
    save_checkpoint(state, tmp_path, keep=2)
    latest, numbered = tmp_path / "checkpoint.pt", tmp_path / "checkpoint-00000007.pt"
    assert not os.path.samefile(latest, numbered) and os.stat(latest).st_nlink == 1
    with open(latest, "r+b") as f:  # damage one of the two
        f.seek(100)
        f.write(b"\0" * 400)
    assert torch.equal(load_checkpoint(numbered)["weights"], state["weights"])


# ----------------------------------------------------------------------------------- full disks
def test_checkpoint_on_a_full_disk_names_the_cause_and_keeps_the_old_one(tmp_path):
    with tmpfs(tmp_path / "disk", "4m") as disk:
        save_checkpoint({"step": 1, "w": torch.zeros(100)}, disk, keep=0)
        with pytest.raises(StorageError, match="no space left on device .*checkpoint.pt: free space and run the "
                                               "same command"):
            save_checkpoint({"step": 2, "w": torch.zeros(2_000_000)}, disk, keep=0)  # 8 MB
        assert load_checkpoint(disk / "checkpoint.pt")["step"] == 1  # the previous one is intact
        assert sorted(p.name for p in disk.iterdir()) == ["checkpoint.pt"]  # no temporary file left


@pytest.mark.slow
def test_train_cli_on_a_full_disk_exits_1_with_the_cause(sample_photos, tmp_path, capsys):
    with tmpfs(tmp_path / "disk", "24m") as disk:  # room for the image cache, not for a ResNet-18 checkpoint
        code = main(["train", str(sample_photos), "--out", str(disk / "run"), *TINY_CLI, "--max-steps", "2",
                     "--precision", "fp32"])
        err = capsys.readouterr().err
    assert code == 1, err
    assert "no space left on device" in err and "free space and run the same command" in err
    assert "enforce fail" not in err and "Traceback" not in err


# ------------------------------------------------------------------------ index inside the photos
@pytest.mark.slow
def test_index_inside_the_photo_folder_serves_thumbs_not_originals(tmp_path, backbone):
    import shutil

    import httpx
    from gradio_client import Client, handle_file
    from PIL import Image

    from app.server.launch import launch_kwargs, make_demo
    from moco.data.sample import make_sample_collection

    photos = tmp_path / "photos"
    make_sample_collection(photos, per_family=3, size=48, seed=4)
    shutil.copy(next(photos.rglob("*.jpg")), photos / "top.jpg")  # an original beside the index folder
    odd = photos / os.fsdecode(b"caf\xe9 odd")  # a folder and a file whose names are not UTF-8
    odd.mkdir()
    shutil.copy(sorted(photos.glob("*/*.jpg"))[-1], odd / os.fsdecode(b"\xff.jpg"))
    assert main(["index", "build", str(photos), "--backbone", str(backbone), "-o", str(photos / ".index"),
                 "--quiet"]) == 0
    demo, app = make_demo(photos / ".index", device="cpu")
    port = free_port()
    demo.launch(prevent_thread_lock=True, **launch_kwargs(app.index, "127.0.0.1", port, None))
    try:
        url = f"http://127.0.0.1:{port}"
        query = photos / "top.jpg"
        gallery, info = Client(url, verbose=False).predict(handle_file(str(query)), 4, "", api_name="/search")[:2]
        assert "4 results" in info and len(gallery) == 4
        upload = tmp_path / "upload.png"  # the client needs UTF-8; other bytes: the photo itself would be left out
        with Image.open(odd / os.fsdecode(b"\xff.jpg")) as im:
            im.save(upload)
        gallery, info = Client(url, verbose=False).predict(handle_file(str(upload)), 3, "caf\\xe9 odd",
                                                           api_name="/search")[:2]
        assert gallery[0]["caption"].endswith("caf\\xe9 odd/\\xff.jpg") and "caf\\xe9 odd/" in info
        with httpx.Client(timeout=10) as http:
            thumb = next((photos / ".index" / "thumbs").iterdir())
            assert http.get(url + "/gradio_api/file=" + str(thumb)).status_code == 200
            originals = [query, sorted(photos.glob("*/*.jpg"))[0], photos / ".index" / "catalog.sqlite",
                         photos / ".index" / "index.json"]
            for f in originals:
                for route in ("/gradio_api/file=", "/file="):
                    r = http.get(url + route + urllib.parse.quote(str(f)))
                    assert r.status_code in (400, 403, 404, 405), (f, r.status_code)
    finally:
        demo.close()


# ------------------------------------------------------------------------------------ temporary files
@pytest.mark.slow
def test_a_served_page_leaves_no_result_files_after_sigterm(tmp_path, backbone, sample_photos):
    import signal
    import subprocess
    import sys

    from gradio_client import Client, handle_file

    from .live import wait_served

    assert main(["index", "build", str(sample_photos), "--backbone", str(backbone), "-o", str(tmp_path / "idx"),
                 "--quiet"]) == 0
    server_tmp = tmp_path / "server-tmp"  # the server's TMPDIR: what it leaves behind is all in here
    server_tmp.mkdir()
    env = dict(os.environ, TMPDIR=str(server_tmp), PYTHONPATH=str(Path(__file__).resolve().parents[1]),
               OMP_NUM_THREADS="1")
    env.pop("GRADIO_TEMP_DIR", None)
    port = free_port()
    with open(tmp_path / "serve.log", "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "app.cli", "serve", str(tmp_path / "idx"), "--port", str(port),
                                 "--device", "cpu"], env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_served(f"http://127.0.0.1:{port}/", proc, timeout=300)
        query = sorted(sample_photos.rglob("*.jpg"))[0]
        out = Client(f"http://127.0.0.1:{port}", verbose=False).predict(handle_file(str(query)), 4, "",
                                                                       api_name="/search")
        assert "4 results" in out[1]
        written = [p for p in server_tmp.rglob("*") if p.is_file()]
        assert [p for p in written if p.name == "results.csv"], written  # the export, before the end
        assert list(server_tmp.glob("moco-results-*"))
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, (tmp_path / "serve.log").read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert not list(server_tmp.glob("moco-results-*"))
    left = [p for p in server_tmp.rglob("*") if p.is_file()]
    assert not [p for p in left if p.name.startswith("results.") or p.suffix in (".jpg", ".png")], left


_SERVE = """
import asyncio, contextlib, pathlib, signal, sys, time
from starlette.applications import Starlette
from app.server.launch import Server

@contextlib.asynccontextmanager
async def lifespan(app):
    yield
    await asyncio.sleep(1)  # a shutdown that takes its time, as Gradio's (its temporary files deleted)
    pathlib.Path(sys.argv[2]).write_text("shut down")

class Demo:  # the Blocks' part Server uses
    def close(self, verbose=True):
        return None  # no queue to stop: this app is plain Starlette

signal.signal(signal.SIGTERM, signal.default_int_handler)  # as the CLI does
server = Server.start(Demo(), Starlette(lifespan=lifespan), "127.0.0.1", int(sys.argv[1]))
print("serving", flush=True)
server.block_thread()
print("closed", flush=True)
"""


def test_a_sigterm_while_the_server_waits_lets_the_apps_shutdown_finish(tmp_path):
    """SIGTERM (or Ctrl+C) interrupts ``block_thread``'s wait for the server's thread; the server must still run its
    app's shutdown (Gradio deletes its uploads there) before the process exits. A ``Thread.join`` interrupted so marks
    the running thread stopped (before Python 3.13): waiting on it again returned at once and the process exited
    before the shutdown ran."""
    import signal
    import subprocess
    import sys
    import time

    marker = tmp_path / "shutdown"
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    proc = subprocess.Popen([sys.executable, "-c", _SERVE, str(free_port()), str(marker)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert proc.stdout.readline() == "serving\n", proc.stdout.read()
        time.sleep(0.5)  # in block_thread's wait by now
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, out
    assert "interrupted: closing the server" in out and out.endswith("closed\n"), out
    assert marker.read_text() == "shut down", out


# ----------------------------------------------------------------------------------- the decoded cache
_BUILD = """
import signal, sys
from moco.data.cache import build_cache
signal.signal(signal.SIGTERM, signal.default_int_handler)  # as the CLI does
try:
    build_cache(sys.argv[1], int(sys.argv[2]), sys.argv[3], workers=2)
except KeyboardInterrupt:
    sys.exit(130)
"""


def _large_photos(root: Path, n: int) -> Path:
    """``n`` photos of 800 x 600 px (tens of ms each to decode and resize to 1024 px)."""
    import numpy as np
    from PIL import Image

    root.mkdir()
    rng = np.random.default_rng(0)
    for i in range(n):
        Image.fromarray(rng.integers(0, 256, (600, 800, 3), np.uint8)).save(root / f"p{i:03}.jpg", quality=90)
    return root


def _workers(pid: int) -> set[int]:
    """The multiprocessing workers whose parent is ``pid`` (not its resource tracker)."""
    out = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            cmdline = (stat.parent / "cmdline").read_bytes()
        except OSError:
            continue
        if int(fields[1]) == pid and b"spawn_main" in cmdline:
            out.add(int(stat.parent.name))
    return out


def _has_a_photo_open(pid: int, photos: Path) -> bool:
    try:
        return any(os.readlink(fd).startswith(str(photos)) for fd in Path(f"/proc/{pid}/fd").iterdir())
    except OSError:
        return False


@pytest.mark.slow
@pytest.mark.parametrize("sig", ["SIGTERM", "SIGKILL"])
def test_a_cache_build_stopped_midway_leaves_no_worker_and_no_partial_file(tmp_path, sig):
    """A build on two decoding workers, stopped once its partial file exists (its workers frozen by SIGSTOP first,
    so that none ends by itself): SIGTERM (as the CLI takes it) stops the workers, not waiting for them, and removes
    the file; SIGKILL leaves the file, but the workers die with their parent and the next build removes the file
    before it starts."""
    import signal
    import subprocess
    import sys
    import time

    photos = _large_photos(tmp_path / "photos", 120)
    cache = tmp_path / "cache"
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]), OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-c", _BUILD, str(photos), "1024", str(cache)], env=env,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300  # a guard against a hang, not a measurement
    workers: set[int] = set()
    decoding: set[int] = set()  # workers seen with a photo open: started, their first step done
    while not (list(cache.glob(".images-1024.u8.*.tmp")) and len(workers) >= 2 and decoding >= workers):
        assert proc.poll() is None, proc.stderr.read()[-3000:]
        assert time.monotonic() < deadline, "no partial file or workers seen"
        workers = _workers(proc.pid)
        decoding |= {w for w in workers if _has_a_photo_open(w, photos)}
        time.sleep(0.01)
    for w in workers:  # stopped: a worker that only ended by itself (after its photos) would stay forever
        os.kill(w, signal.SIGSTOP)
    proc.send_signal(getattr(signal, sig))
    code = proc.wait(timeout=300)
    assert code == (130 if sig == "SIGTERM" else -signal.SIGKILL), proc.stderr.read()[-3000:]
    while any(Path(f"/proc/{w}").exists() and "Z" not in Path(f"/proc/{w}/stat").read_text().split()[2]
              for w in workers):
        assert time.monotonic() < deadline, f"decoding workers {workers} outlived their parent"
        time.sleep(0.05)
    left = list(cache.glob(".*.tmp"))
    assert left == [] if sig == "SIGTERM" else len(left) == 1
    if sig == "SIGKILL":  # the next build removes what the killed one left, then builds
        from moco.data.cache import build_cache

        built = build_cache(photos, 32, cache, workers=0)
        assert len(built) == 120 and sorted(p.name for p in cache.iterdir()) == ["images-32.json", "images-32.u8"]


def test_a_cache_the_disk_cannot_hold_is_refused_before_decoding(sample_photos, tmp_path):
    from moco.data.cache import build_cache

    with tmpfs(tmp_path / "disk", "4m") as disk:
        with pytest.raises(UserError, match=r"the decoded cache of 48 photos at 512 px needs 38 MB in .*, where "
                                            r"4 MB are free: free space there, or make it smaller with --cache-size"):
            build_cache(sample_photos, 512, disk / "cache")
        assert list((disk / "cache").iterdir()) == []  # nothing written
