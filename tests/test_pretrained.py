"""Official checkpoints by name: download, cache, resume, checksums, offline, and every place a NAME is accepted.

A real HTTP server on 127.0.0.1 (Range requests, a connection it can drop mid-file) serves a small checkpoint in
the official MoCo v2 layout; every test points MOCO_HOME at a temporary folder and the download host at that
server (or at a refused port), so no test reaches the internet.
"""

from __future__ import annotations

import hashlib
import io
import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch

from app.cli.commands import main
from moco.errors import UserError
from moco.weights import pretrained
from moco.weights.pretrained import Pretrained

FILE = "test/r18/r18_pretrain.pth.tar"


class _Handler(BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        srv: _Server = self.server.owner  # type: ignore[attr-defined]
        srv.requests.append((self.path, self.headers.get("Range")))
        data = srv.files.get(self.path.lstrip("/"))
        if data is None:
            self.send_error(404)
            return
        start = 0
        if self.headers.get("Range"):
            start = int(self.headers["Range"].removeprefix("bytes=").split("-")[0])
            if start >= len(data):
                self.send_error(416)
                return
            self.send_response(206)
            self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        else:
            self.send_response(200)
        body = data[start:]
        if not srv.no_length:
            self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if srv.drop_after is not None:  # send part of the file, then drop the connection
            n, srv.drop_after = srv.drop_after, None
            self.wfile.write(body[:n])
            self.wfile.flush()
            self.close_connection = True
            self.connection.shutdown(socket.SHUT_RDWR)
            return
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        """No request log on stderr."""


class _Server:
    """http.server in a thread: serves ``files``, records (path, Range) of each request, can drop mid-file."""

    def __init__(self, files: dict[str, bytes]) -> None:
        self.files, self.requests, self.drop_after, self.no_length = files, [], None, False
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
        self.httpd.owner = self  # type: ignore[attr-defined]
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()


def _official_v2_checkpoint() -> bytes:
    """A ResNet-18 in the official MoCo v2 layout: encoder_q (+ MLP head fc.0/fc.2), encoder_k, queue."""
    import torchvision

    torch.manual_seed(0)
    net = torchvision.models.resnet18(weights=None)
    sd = {k: v for k, v in net.state_dict().items() if not k.startswith("fc.")}
    head = {"fc.0.weight": torch.randn(512, 512), "fc.0.bias": torch.zeros(512), "fc.2.weight": torch.randn(128, 512),
            "fc.2.bias": torch.zeros(128)}
    state = {f"module.encoder_q.{k}": v for k, v in {**sd, **head}.items()}
    state |= {f"module.encoder_k.{k}": v.clone() for k, v in {**sd, **head}.items()}
    state |= {"module.queue": torch.randn(128, 64), "module.queue_ptr": torch.zeros(1, dtype=torch.long)}
    buf = io.BytesIO()
    torch.save({"epoch": 200, "arch": "resnet18", "state_dict": state,
                "optimizer": {"state": {}, "param_groups": [{"lr": 0.03, "params": [0]}]}}, buf)
    return buf.getvalue()


@pytest.fixture(scope="module")
def data() -> bytes:
    return _official_v2_checkpoint()


@pytest.fixture(scope="module")
def server(data) -> _Server:
    return _Server({FILE: data, "test/bad/bad_pretrain.pth.tar": data, "test/nosum/nosum.pth.tar": data})


def _refused_url() -> str:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now: connections are refused
    return f"http://127.0.0.1:{port}"


@pytest.fixture(autouse=True)
def home(tmp_path, monkeypatch, server, data) -> Path:
    """MOCO_HOME in tmp, the download host on 127.0.0.1, and three test names in the registry."""
    monkeypatch.setenv("MOCO_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("MOCO_PRETRAINED_URL", server.url)
    md5 = hashlib.md5(data).hexdigest()[:8]
    monkeypatch.setitem(pretrained.REGISTRY, "test_r18", Pretrained("test_r18", FILE, "resnet18", "v2", 1.0, md5))
    monkeypatch.setitem(pretrained.REGISTRY, "test_bad",
                        Pretrained("test_bad", "test/bad/bad_pretrain.pth.tar", "resnet18", "v2", 1.0, "00000000"))
    monkeypatch.setitem(pretrained.REGISTRY, "test_nosum",
                        Pretrained("test_nosum", "test/nosum/nosum.pth.tar", "resnet18", "v3", 1.0))
    server.requests.clear()
    server.drop_after = None
    return tmp_path / "home"


def _cached(home: Path) -> list[str]:
    return sorted(p.name for p in (home / "checkpoints").glob("*") if not p.name.endswith(".lock"))


def test_download_then_cache_hit(server, data, home):
    path = pretrained.fetch("test_r18", progress=False)
    assert path == home / "checkpoints" / "r18_pretrain.pth.tar" and path.read_bytes() == data
    assert server.requests == [(f"/{FILE}", None)]
    assert pretrained.fetch("test_r18", progress=False) == path
    assert len(server.requests) == 1  # the cache answered: no second request
    assert _cached(home) == ["r18_pretrain.pth.tar", "r18_pretrain.pth.tar.sha256"]  # no .part left


def test_interrupted_download_resumes_with_range(server, data, home):
    cut = len(data) // 3
    server.drop_after = cut
    path = pretrained.fetch("test_r18", progress=False)
    assert server.requests == [(f"/{FILE}", None), (f"/{FILE}", f"bytes={cut}-")]
    assert hashlib.sha256(path.read_bytes()).hexdigest() == hashlib.sha256(data).hexdigest()
    # A partial file left by an earlier process (killed mid-download) is resumed too.
    path.unlink()
    (path.parent / "r18_pretrain.pth.tar.part").write_bytes(data[:1000])
    server.requests.clear()
    assert pretrained.fetch("test_r18", progress=False).read_bytes() == data
    assert server.requests == [(f"/{FILE}", "bytes=1000-")]


def test_wrong_checksum_deletes_the_file(home):
    with pytest.raises(UserError, match=r"wrong checksum.*md5 starts .*00000000.*was deleted") as e:
        pretrained.fetch("test_bad", progress=False)
    assert str(home / "checkpoints" / "bad_pretrain.pth.tar") in str(e.value)
    assert _cached(home) == []


def test_no_published_checksum_records_sha256_and_checks_it(data, home, caplog):
    with caplog.at_level("WARNING"):
        path = pretrained.fetch("test_nosum", progress=False)
    sha = hashlib.sha256(data).hexdigest()
    assert (home / "checkpoints" / "nosum.pth.tar.sha256").read_text().split()[0] == sha
    assert "publishes no checksum" in caplog.text and sha in caplog.text
    with path.open("r+b") as f:  # the cached file gets damaged later
        f.seek(100)
        f.write(b"\0" * 8)
    with pytest.raises(UserError, match="sha256 .* differs from the one recorded .* was deleted"):
        pretrained.fetch("test_nosum", progress=False)
    assert _cached(home) == []


def test_a_truncated_file_without_a_published_checksum_is_never_recorded(data, home):
    cached = home / "checkpoints" / "nosum.pth.tar"
    cached.parent.mkdir(parents=True)
    cached.write_bytes(data[: len(data) // 2])  # put there by hand, or a download cut short without a length
    with pytest.raises(UserError, match="incomplete.*was deleted") as e:
        pretrained.fetch("test_nosum", progress=False)
    assert str(cached) in str(e.value) and _cached(home) == []  # no sha256 recorded from the broken file
    path = pretrained.fetch("test_nosum", progress=False)  # the next good download is accepted
    assert path.read_bytes() == data
    assert (home / "checkpoints" / "nosum.pth.tar.sha256").read_text().split()[0] == hashlib.sha256(data).hexdigest()


def test_a_download_cut_short_without_a_length_is_not_recorded(server, data, home):
    server.no_length, server.drop_after = True, len(data) // 2  # the connection closes early; no Content-Length
    try:
        with pytest.raises(UserError, match="incomplete"):
            pretrained.fetch("test_nosum", progress=False)
    finally:
        server.no_length = False
    assert _cached(home) == []
    assert pretrained.fetch("test_nosum", progress=False).read_bytes() == data


class _SyntheticClock:
    """time.monotonic and time.sleep for moco.weights.pretrained: sleeping advances the clock at once; ``on_sleep`` runs
    after each sleep (a holder releasing its lock)."""

    def __init__(self, monkeypatch) -> None:
        self.now, self.sleeps, self.on_sleep = 0.0, 0, None
        monkeypatch.setattr(pretrained, "_clock", lambda: self.now)
        monkeypatch.setattr(pretrained, "_sleep", self.sleep)

    def sleep(self, seconds: float) -> None:
        self.now += seconds
        self.sleeps += 1
        if self.on_sleep is not None:
            self.on_sleep()


def test_a_held_download_lock_is_waited_for_visibly_and_with_a_bound(monkeypatch, home, caplog):
    import os

    clock = _SyntheticClock(monkeypatch)
    path = home / "checkpoints" / "r18_pretrain.pth.tar"
    with pretrained._locked(path, "test_r18"), caplog.at_level("INFO"):  # another process's download (flock: per open)
        with pytest.raises(UserError, match="has not grown") as e:
            pretrained.fetch("test_r18", progress=False)
    assert f"pid {os.getpid()}" in str(e.value) and str(path) in str(e.value)
    assert clock.now >= pretrained.LOCK_STALL_S and clock.now < pretrained.LOCK_STALL_S + 60
    waiting = [r.getMessage() for r in caplog.records if "waiting" in r.getMessage()]
    assert waiting and f"pid {os.getpid()}" in waiting[0] and "test_r18" in waiting[0]
    assert len(waiting) < 30  # said now and then, not on every poll


def test_a_download_lock_released_while_waiting_is_taken(monkeypatch, server, data, home, caplog):
    import contextlib

    clock = _SyntheticClock(monkeypatch)
    path = home / "checkpoints" / "r18_pretrain.pth.tar"
    holder = contextlib.ExitStack()
    holder.enter_context(pretrained._locked(path, "test_r18"))
    part = path.with_name(path.name + ".part")

    def other_process_progresses() -> None:
        if clock.now < pretrained.LOCK_STALL_S + 60:  # its .part grows for longer than the bound on no progress ...
            with part.open("ab") as f:
                done = f.tell()  # the bytes it has so far (read whole, a 100 MB file per poll took 20 s)
                f.write(data[done:done + 100])
        else:  # ... then it stops: its lock is free
            holder.close()

    clock.on_sleep = other_process_progresses
    with caplog.at_level("INFO"):
        assert pretrained.fetch("test_r18", progress=False).read_bytes() == data  # resumed from the other's .part
    assert clock.now >= pretrained.LOCK_STALL_S + 60
    assert any("waiting" in r.getMessage() for r in caplog.records)


def test_moco_home_that_is_not_a_folder_says_so(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("MOCO_HOME", "/dev/null/x")
    assert main(["export", "test_r18", "-o", str(tmp_path / "b.safetensors")]) == 2
    err = capsys.readouterr().err
    assert "MOCO_HOME=/dev/null/x" in err and "not a usable folder" in err and "check the disk" not in err


def test_server_down_is_one_clear_message(monkeypatch, home, tmp_path, capsys):
    url = _refused_url()
    monkeypatch.setenv("MOCO_PRETRAINED_URL", url)
    assert main(["export", "test_r18", "-o", str(tmp_path / "b.safetensors")]) == 1  # a network failure: not bad input
    err = capsys.readouterr().err
    assert f"{url}/{FILE}" in err and str(home / "checkpoints" / "r18_pretrain.pth.tar") in err
    assert "by hand" in err and err.count("error:") == 1
    assert _cached(home) == [] and not (tmp_path / "b.safetensors").exists()
    from moco.training.command import (
        main as train_main,  # python -m moco.training (torchrun's entry point) says the same
    )

    assert train_main([str(tmp_path), "--out", str(tmp_path / "run"), "--preset", "v3", "--arch",
                       "vit_small_patch16_224", "--init", "test_r18"]) == 1
    assert f"{url}/{FILE}" in capsys.readouterr().err


def test_pretrained_lists_names_cached_or_not(data, capsys):
    assert main(["pretrained"]) == 0
    out = capsys.readouterr().out
    for name in ("moco_v1_200ep", "moco_v2_200ep", "moco_v2_800ep", "r-50-100ep", "r-50-300ep", "r-50-1000ep",
                 "vit-s-300ep", "vit-b-300ep"):
        assert name in out
    line = next(ln for ln in out.splitlines() if ln.startswith("test_r18 "))
    assert "resnet18" in line and line.split()[-1] == "no"
    pretrained.fetch("test_r18", progress=False)
    assert main(["pretrained", "--json"]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    assert rows["test_r18"]["cached"] and rows["test_r18"]["size"] == len(data)
    assert not rows["moco_v2_800ep"]["cached"] and rows["moco_v2_800ep"]["size"] is None
    assert rows["moco_v2_800ep"]["md5"] == "a04e12f8" and rows["moco_v2_800ep"]["top1"] == 71.1


def test_init_by_name(server, data):
    from moco.config import resolve_config
    from moco.training.setup import build_model
    from moco.weights.layouts import load_init

    cfg = resolve_config("v2", init="test_r18", arch="resnet18", image_size=32, batch_size=8, bn_splits=1,
                         queue_size=16)
    assert cfg.init == "test_r18"
    model = build_model(cfg)
    report = load_init(model, cfg.init)
    assert report["loaded"][0].startswith("backbone: loaded")
    source = torch.load(io.BytesIO(data), weights_only=True)["state_dict"]
    assert torch.equal(model.backbone.state_dict()["layer4.1.conv2.weight"],
                       source["module.encoder_q.layer4.1.conv2.weight"])
    assert len(server.requests) == 1  # fetched once, then read from the cache


def test_a_config_reads_nothing_and_the_train_command_fetches_an_init_name_once(server, tmp_path):
    from moco.config import resolve_config
    from moco.training.command import main as train_main

    resolve_config("v3", init="test_r18", arch="vit_small_patch16_224", image_size=32)  # data: nothing read
    assert server.requests == []
    # The command fetches the name, reads the file once (a ViT's head count, then its weights): a ResNet's weights
    # do not fit a ViT, which is said before any photo is decoded.
    assert train_main([str(tmp_path), "--out", str(tmp_path / "run"), "--preset", "v3", "--arch",
                       "vit_small_patch16_224", "--image-size", "32", "--init", "test_r18"]) == 2
    assert [p for p, _ in server.requests] == [f"/{FILE}"]


def test_export_by_name_and_a_path_wins(server, data, home, tmp_path, monkeypatch, capsys):
    from moco.export.reader import load_exported

    out = tmp_path / "x.safetensors"
    assert main(["export", "test_r18", "-o", str(out)]) == 0, capsys.readouterr().err
    _, meta = load_exported(out)
    assert meta.arch == "resnet18" and meta.source_format == "moco-v1/v2 (official)"
    assert meta.source_file == "r18_pretrain.pth.tar"
    assert meta.source_sha256 == hashlib.sha256(data).hexdigest()
    # A file of that name in the working directory is used instead, and nothing is fetched.
    import torchvision

    monkeypatch.chdir(tmp_path)
    torch.save(torchvision.models.resnet18(weights=None).state_dict(), tmp_path / "test_r18")
    server.requests.clear()
    assert main(["export", "test_r18", "-o", str(tmp_path / "y.safetensors")]) == 0
    assert load_exported(tmp_path / "y.safetensors")[1].source_format == "plain" and server.requests == []


def test_unknown_bare_name_lists_the_names(tmp_path, capsys):
    assert main(["export", "moco_v2_800", "-o", str(tmp_path / "x.safetensors")]) == 2
    err = capsys.readouterr().err
    assert "neither a file nor a pretrained name" in err and "did you mean 'moco_v2_800ep'" in err


def test_embedder_load_by_name(data):
    import numpy as np

    from moco.embed import Embedder

    emb = Embedder.load("test_r18", device="cpu", precision="fp32")
    assert emb.dim == 512 and emb.sha256 == hashlib.sha256(data).hexdigest()
    v = emb.embed(np.zeros((40, 40, 3), dtype=np.uint8))
    assert v.shape[-1] == 512 and np.isclose(np.linalg.norm(v), 1.0, atol=1e-3)


def test_serve_checkpoint_name_is_fetched_first(monkeypatch, tmp_path, capsys):
    url = _refused_url()
    monkeypatch.setenv("MOCO_PRETRAINED_URL", url)
    assert main(["serve", str(tmp_path / "idx"), "--checkpoint", "test_r18"]) == 1
    assert f"{url}/{FILE}" in capsys.readouterr().err


@pytest.fixture(scope="module")
def few_photos(tmp_path_factory) -> Path:
    """18 small photos: enough for `moco run` to train a couple of steps."""
    from moco.data.sample import make_sample_collection

    root = tmp_path_factory.mktemp("few")
    make_sample_collection(root, per_family=3, size=32, seed=1)
    return root


@pytest.mark.slow
def test_run_uses_the_default_pretrained_model_and_names_as_checkpoints(server, few_photos, tmp_path, capsys):
    from app.run.pipeline import collection_dir
    from index.search.image_index import ImageIndex

    work = tmp_path / "w"
    assert main(["run", str(few_photos), "--work", str(work), "--no-serve", "--quiet", "--pretrained", "test_r18"]) == 0
    out = capsys.readouterr().out
    assert "model: test_r18 (official MoCo v2, resnet18" in out and "training: skipped, using" in out
    own = collection_dir(work, few_photos)  # the folder's own directory in WORK
    assert not (own / "run").exists() and len(ImageIndex.open(own / "index")) == 18
    assert [p for p, _ in server.requests] == [f"/{FILE}"]
    # --checkpoint NAME: the cached file, no second download.
    assert main(["run", str(few_photos), "--work", str(tmp_path / "c"), "--no-serve", "--quiet", "--checkpoint",
                 "test_r18"]) == 0
    assert "training: skipped" in capsys.readouterr().out and len(server.requests) == 1


@pytest.mark.slow
def test_run_offline_falls_back_to_training_and_says_why(monkeypatch, few_photos, tmp_path):
    from app.run.pipeline import collection_dir, run_pipeline

    url = _refused_url()
    monkeypatch.setenv("MOCO_PRETRAINED_URL", url)
    said: list[str] = []
    out = run_pipeline(few_photos, tmp_path / "w", train_overrides={"max_steps": 1}, say=said.append, progress=False,
                       pretrained="test_r18")
    text = "\n".join(said)
    assert "training from scratch instead" in text and url in text and "training: MoCo cpu on 18 photos" in text
    assert out["trained"] and (collection_dir(tmp_path / "w", few_photos) / "run" / "checkpoint.pt").is_file()


@pytest.mark.slow
def test_run_init_name_and_no_fetch_without_photos_or_when_training_is_asked(server, few_photos, tmp_path, capsys):
    import shutil

    from app.run.pipeline import run_pipeline

    # --init NAME: fetched, then MoCo training continues from it (its architecture).
    assert main(["run", str(few_photos), "--work", str(tmp_path / "i"), "--init", "test_r18", "--max-steps", "1",
                 "--no-serve", "--quiet"]) == 0
    assert "init=test_r18, arch=resnet18" in capsys.readouterr().out and len(server.requests) == 1
    server.requests.clear()
    # --max-steps (or --minutes) asks for training: the default model is not fetched.
    assert main(["run", str(few_photos), "--work", str(tmp_path / "t"), "--max-steps", "1", "--no-serve", "--quiet",
                 "--pretrained", "test_r18"]) == 0
    assert "training: MoCo cpu on 18 photos" in capsys.readouterr().out and server.requests == []
    # No PHOTOS (the sample, here a small one already generated): never fetched.
    shutil.copytree(few_photos, tmp_path / "s" / "sample" / "photos")
    said: list[str] = []
    run_pipeline(None, tmp_path / "s", train_overrides={"max_steps": 1}, say=said.append, progress=False,
                 pretrained="test_r18")
    assert "training: MoCo cpu on 18 photos" in "\n".join(said) and server.requests == []
