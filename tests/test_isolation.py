"""One request never harms another, on real servers over loopback: a poisoned search among concurrent ones, many
concurrent downloads of large originals, what errors and logs repeat of a request, malformed bodies, a damaged
dedup.json, slow clients (half-sent requests under a low open-files limit) and a schemathesis run of the API."""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import logging
import os
import re
import resource
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
from PIL import Image

from app.guard.access import ApiSettings
from app.guard.log_limits import LogLimits
from app.server.launch import serve
from index.building.runner import build_index
from index.search.image_index import ImageIndex
from moco.data.sample import make_sample_collection

from .live import free_port, wait_served

ROOT = Path(__file__).resolve().parents[1]
BIG = 3  # large originals, of random noise (JPEG cannot shrink it: about 4 MB each)


@pytest.fixture(scope="module")
def idx(backbone, tmp_path_factory) -> Path:
    photos = tmp_path_factory.mktemp("iso") / "photos"
    make_sample_collection(photos, per_family=2, size=48, seed=3)
    (photos / "big").mkdir()
    rng = np.random.default_rng(0)
    for n in range(BIG):
        Image.fromarray(rng.integers(0, 256, (1600, 1800, 3), np.uint8)).save(photos / "big" / f"noise{n}.jpg",
                                                                             quality=95)
    out = photos.parent / "idx"
    build_index(photos, backbone, out, progress=False)
    return out


@pytest.fixture(scope="module")
def server(idx):
    """A live server in this process whose batches wait 200 ms for company: (base url of the API, its service)."""
    port = free_port()
    demo = serve(idx, port=port, device="cpu", block=False, api=ApiSettings(window_ms=200, max_batch=64))
    try:
        yield f"http://127.0.0.1:{port}/api/v1", demo.api_service
    finally:
        demo.close()
        demo.api_service.close()


def _ids(idx: Path) -> list[int]:
    index = ImageIndex.open(idx)
    return sorted(r.id for r in index.catalog.rows_by_id(range(200)).values() if r.status == "ok")


# ---------------------------------------------------------------------------------------------- batches
def test_a_poisoned_search_fails_alone_among_concurrent_ones(server, idx):
    """Searches by id 2^63 (SQLite's OverflowError: a 500 that failed every search batched with it), 2^64, an unknown
    id and -1, among 24 good ones sent at once: each bad one gets its own 4xx, every good one its own results."""
    url, service = server
    ids = _ids(idx)
    good = [ids[n % len(ids)] for n in range(24)]
    bad = {2**63: 400, 2**64: 400, 10**12: 404, -1: 400}
    asked = good[:12] + list(bad) + good[12:]
    alone = {i: httpx.get(f"{url}/photos/{i}/similar", params={"k": 4}, timeout=60).json() for i in set(good)}
    before = len(service.search.batcher.batch_sizes)
    with httpx.Client(timeout=60) as client, concurrent.futures.ThreadPoolExecutor(len(asked)) as pool:
        replies = list(pool.map(lambda i: client.get(f"{url}/photos/{i}/similar", params={"k": 4}), asked))
    assert max(service.search.batcher.batch_sizes[before:]) > 1  # they were batched together
    for i, r in zip(asked, replies):
        if i in bad:
            assert r.status_code == bad[i], (i, r.text)
            assert "photo" in r.json()["detail"] and "Error" not in r.json()["detail"]
        else:
            assert r.status_code == 200, (i, r.text)
            assert [h["id"] for h in r.json()["results"]] == [h["id"] for h in alone[i]["results"]]


# ---------------------------------------------------------------------------------------------- originals
def test_concurrent_downloads_of_large_originals_all_get_their_bytes(server, idx, monkeypatch):
    """18 downloads at once of 3 originals of about 4 MB, the result files' cache cut to nothing (it evicted copies
    before their responses opened them: 500 "File at path ... does not exist"): every one gets the file's bytes."""
    import app.page.handlers

    monkeypatch.setattr(app.page.handlers, "_KEEP_BYTES", 1)
    url, _ = server
    index = ImageIndex.open(idx)
    big = {r.id: index.root / r.path for r in index.catalog.rows_by_id(_ids(idx)).values() if r.path.startswith("big/")}
    assert len(big) == BIG and all(p.stat().st_size > 2_000_000 for p in big.values())
    asked = [i for i in big for _ in range(6)]
    with httpx.Client(timeout=120) as client, concurrent.futures.ThreadPoolExecutor(len(asked)) as pool:
        replies = list(pool.map(lambda i: client.get(f"{url}/photos/{i}/original"), asked))
    for i, r in zip(asked, replies):
        assert r.status_code == 200, r.text[:300]
        want = big[i].read_bytes()
        assert int(r.headers["content-length"]) == len(want) and r.content == want
        assert r.headers["content-type"] == "image/jpeg" and big[i].name in r.headers["content-disposition"]


# ------------------------------------------------------------------------------------------------ echoes
def test_errors_and_log_lines_repeat_a_few_hundred_characters_of_a_request(server, sample_photos, caplog):
    """A 5 MB folder (a well-formed name: 404; with `..`: 400) comes back in a short message, and adds little to the
    log (three of them added 15 MB)."""
    import base64

    url, _ = server
    image = base64.b64encode(sorted(sample_photos.rglob("*.jpg"))[0].read_bytes()).decode()
    caplog.set_level(logging.INFO)
    for folder, code in [("y" * 5_000_000, 404), ("../" + "y" * 5_000_000, 400)] * 2:
        r = httpx.post(f"{url}/search/base64", json={"image_base64": image, "folder": folder}, timeout=120)
        assert r.status_code == code and len(r.content) < 1500, (r.status_code, len(r.content))
        assert r.json()["detail"].startswith("no sub-folder '") and "(5000" in r.json()["detail"]
    r = httpx.post(f"{url}/search", files={"image": ("q.jpg", base64.b64decode(image))}, data={"folder": "z" * 900_000},
                   timeout=120)
    assert r.status_code == 404 and len(r.content) < 1500
    assert sum(len(rec.getMessage()) for rec in caplog.records) < 20_000


def test_log_lines_are_capped_and_repeats_rate_limited():
    now = [0.0]
    limits = LogLimits(max_chars=100, burst=3, period_s=60, clock=lambda: now[0])
    records = [logging.LogRecord("asyncio", logging.ERROR, __file__, 1, "socket.accept() out of system resource",
                                 None, None) for _ in range(2000)]
    assert [limits.filter(r) for r in records].count(True) == 3  # 2,000 in a second: 3 kept
    now[0] = 61.0
    later = logging.LogRecord("asyncio", logging.ERROR, __file__, 1, "socket.accept() out of system resource", None,
                              None)
    assert limits.filter(later) and "1997 more like it left out in the last 60 s" in later.getMessage()
    long = logging.LogRecord("app.api", logging.WARNING, __file__, 1, "%s", ("x" * 10**6,), None)
    assert limits.filter(long) and len(long.getMessage()) < 200


# ----------------------------------------------------------------------------------------- bad bodies
def test_malformed_bodies_get_a_clean_400(server, sample_photos):
    url, _ = server
    photo = sorted(sample_photos.rglob("*.jpg"))[0].read_bytes()
    json_type = {"content-type": "application/json"}
    with httpx.Client(base_url=url, timeout=60) as c:
        replies = [c.post("/search/base64", content=b'{"image_base64": "\xff\xfe\xfd"}', headers=json_type),
                   c.post("/search/base64", content=b"[" * 100_000 + b"]" * 100_000, headers=json_type),
                   c.post("/search", files={"image": ("q.jpg", photo)}, data={f"f{i}": "1" for i in range(1100)})]
        for r in replies:
            assert r.status_code == 400, r.text
            detail = r.json()["detail"]
            assert "HTTPException" not in detail and "Error" not in detail and "/api/v1/docs" in detail or \
                "send image, k, folder and offset" in detail
        emoji = "😀" * 120
        r = c.post("/search", files={"image": (emoji + ".jpg", photo)}, data={"k": "3"})
        assert r.status_code == 200 and len(r.json()["results"]) == 3  # 480 bytes: too long for a file name
        r = c.post("/search", files={"image": (emoji + ".jpg", b"not an image")})
        assert r.status_code == 400 and "/tmp" not in r.text and "moco-api" not in r.text
        assert r.json()["detail"].startswith(emoji[:50]) and "not an image" in r.json()["detail"]


@pytest.mark.parametrize("doc", [{"groups": []}, {"threshold": "high", "groups": []}, {"threshold": 0.9},
                                 {"threshold": 0.9, "groups": [{"size": 2}]},
                                 {"threshold": 0.9, "groups": [{"size": 2, "members": [{"id": "one", "path": 1}]}]},
                                 [1, 2], "not json"])
def test_a_damaged_dedup_json_is_a_clear_404(server, idx, doc):
    url, _ = server
    (idx / "dedup.json").write_text(doc if isinstance(doc, str) else json.dumps(doc))
    try:
        r = httpx.get(f"{url}/duplicates", timeout=60)
    finally:
        (idx / "dedup.json").unlink()
    assert r.status_code == 404, r.text
    assert "dedup.json is damaged" in r.json()["detail"] and "moco index dedup" in r.json()["detail"]


# ---------------------------------------------------------------------------------- a real `moco serve`
@pytest.fixture(scope="module")
def moco_serve(idx, tmp_path_factory):
    """`moco serve` in a process of its own, with 256 open files at most and a 2 s request timeout: (port, log)."""
    port = free_port()
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")

    def low_limit() -> None:
        os.setpgrp()
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))

    with log.open("w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "app.cli", "serve", str(idx), "--port", str(port), "--device",
                                 "cpu", "--request-timeout", "2"], env=env, stdout=err, stderr=err,
                                preexec_fn=low_limit)
    try:
        wait_served(f"http://127.0.0.1:{port}/api/v1/stats", proc)
        yield port, log
    finally:
        proc.terminate()
        proc.wait(30)


SERVER_HOLDS = {"01": "established", "03": "handshake", "08": "closed by the client"}  # /proc/net/tcp's st


def _server_side(port: int) -> dict[int, str]:
    """The server's side of each connection to ``port`` on this machine (the client's port -> its state), from the
    kernel's table: accepted ones, those waiting in the listening queue and handshakes not yet done."""
    held: dict[int, str] = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(FileNotFoundError), open(table) as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                local, remote, state, queues, inode = fields[1], fields[2], fields[3], fields[4], fields[9]
                if int(local.rsplit(":", 1)[1], 16) == port and state in SERVER_HOLDS:
                    # for a failure's message: accepted by the server (a socket of a process) or still queued, and
                    # the bytes it has received that the server has not read
                    where = "accepted" if inode != "0" else "queued"
                    held[int(remote.rsplit(":", 1)[1], 16)] = f"{SERVER_HOLDS[state]}, {where}, " \
                                                               f"{int(queues.split(':')[1], 16)} B unread"
    return held


def test_half_sent_requests_are_closed_and_normal_ones_answered(moco_serve):
    """200 connections that send half a request head and 20 that send nothing, under a 256 open-files limit (it
    was: all still open after 90 s, normal requests timed out, "Too many open files" logged in a loop).

    Judged by what the server holds: within 4 minutes no connection to it is left open on its side (a handshake
    the kernel dropped while the listening queue was full may leave a silent client believing it is connected,
    with nothing held for it by the server: the kernel's doing, and no cost to the server), and every answer a
    client got is a 408."""
    port, log = moco_serve
    half: list[socket.socket] = []
    for n in range(220):
        s = socket.create_connection(("127.0.0.1", port), timeout=30)
        if n < 200:
            s.sendall(b"GET /api/v1/stats HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
        half.append(s)
    try:
        r = httpx.get(f"http://127.0.0.1:{port}/api/v1/stats", timeout=60)
        assert r.status_code == 200 and r.json()["images"] > 0
        mine = {s.getsockname()[1]: n for n, s in enumerate(half)}
        deadline = time.monotonic() + 240  # a handshake's last retry comes after 63 s; the timeout is 2 s
        while (held := {p: st for p, st in _server_side(port).items() if p in mine}) and time.monotonic() < deadline:
            time.sleep(0.5)
        if held:  # every one named (an assert's message is cut short)
            pytest.fail(f"{len(held)} connections still held by the server after 240 s: "
                        + "; ".join(f"#{mine[p]} {st}" for p, st in sorted(held.items()))
                        + f"\nthe server's log: {log.read_text()[-3000:]}")
        answered = 0
        for s in half:  # each one closed by the server (its 408 first, or at once to make room) or never accepted
            s.setblocking(False)
            got = b""
            try:
                while chunk := s.recv(65536):
                    got += chunk
                answered += 1
            except BlockingIOError:  # nothing came: the server never held it (checked above)
                pass
            except ConnectionResetError:  # refused by the kernel when its accept queue overflowed
                answered += 1
            assert got == b"" or got.startswith(b"HTTP/1.1 408 Request Timeout"), got[:100]
        assert answered >= 1
    finally:
        for s in half:
            s.close()
    assert httpx.get(f"http://127.0.0.1:{port}/api/v1/stats", timeout=60).status_code == 200
    time.sleep(0.5)
    text = log.read_text()
    assert text.count("Too many open files") <= 6 and len(text) < 50_000, text[-3000:]


def test_the_connection_guard_is_uvicorns_configuration():
    """The guarded protocol and the listening queue are given to uvicorn through its public ``Config``, which loads
    them as they are: nothing is patched on a running server."""
    import uvicorn

    from app.guard.connections import ConnectionLimits, connection_settings

    settings, opened = connection_settings(ConnectionLimits(request_timeout_s=2.0, max_connections=40))
    config = uvicorn.Config(lambda scope, receive, send: None, lifespan="off", **settings)
    config.load()
    assert config.http_protocol_class is settings["http"] and config.backlog == settings["backlog"] == 10
    assert opened.max == 40 and opened.timeout == 2.0


def test_the_first_connection_of_a_new_server_is_timed(idx):
    """A connection made the moment the server has started, half a request head sent, gets its 408: the guard is the
    server's protocol from its first connection (it was installed on a running server, and a connection accepted
    as it came in was never timed)."""
    from app.guard.connections import ConnectionLimits

    port = free_port()
    demo = serve(idx, port=port, device="cpu", block=False, limits=ConnectionLimits(request_timeout_s=1.0))
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=60) as s:
            s.sendall(b"GET /api/v1/stats HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
            got = b""
            while chunk := s.recv(65536):
                got += chunk
        assert got.startswith(b"HTTP/1.1 408 Request Timeout"), got[:100]
        assert demo.connections.closed_late >= 1
    finally:
        demo.close()
        demo.api_service.close()


def test_schemathesis_finds_nothing(moco_serve, idx, tmp_path):
    """schemathesis (every check, bounded examples) against `moco serve`: 0 failures. What the schema says is
    checked as the schema: a list that must not be empty has minItems (a vector, the groups or kinds to move, the
    photos to search with). For schema-valid data, a search's (or an embedding's) 400 is allowed where a schema cannot
    say it: bytes that are not an image of at least 16 px, a vector of another width than the index's, a day that
    does not exist (2024-02-30); and 404 where the request names what is not there: a photo id, a group or an action
    (no search for duplicates has been saved here)."""
    pytest.importorskip("schemathesis")
    port, _ = moco_serve
    config = tmp_path / "schemathesis.toml"
    config.write_text(f"""[parameters]
photo_id = {_ids(idx)[0]}

[[operations]]
include-path-regex = "^/api/v1/(search|embed|knn-service)"
checks.positive_data_acceptance.expected-statuses = ["2xx", "400", "404"]

[[operations]]
include-path-regex = "^/api/v1/duplicates"
checks.positive_data_acceptance.expected-statuses = ["2xx", "404"]

[[operations]]
include-path-regex = "/similar$"
checks.positive_data_acceptance.expected-statuses = ["2xx", "400", "404"]
""")
    st = Path(sys.executable).parent / "st"
    r = subprocess.run([str(st), "--config-file", str(config), "run", f"http://127.0.0.1:{port}/api/v1/openapi.json",
                        "--checks", "all", "--max-examples", "10", "--seed", "1", "--workers", "1"], cwd=tmp_path,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-6000:]
    assert " passed" in r.stdout and "failed" not in r.stdout.split("SUMMARY")[-1], r.stdout[-3000:]


def test_values_the_page_refuses_cost_one_log_line_each_and_no_traceback(moco_serve, idx):
    """40 page events with values Gradio's inputs refuse (k past its slider's maximum, a folder mode not among the
    choices): each client told why; the server's log gets one line per input, the same words whatever the value
    (so the log's rate limit holds them), never a traceback (Gradio's queue printed one per request)."""
    from gradio_client import Client, handle_file

    port, log = moco_serve
    before = len(log.read_text())
    photo = next(p for p in sorted((idx.parent / "photos").rglob("*.jpg")) if "big" not in p.parts)
    client = Client(f"http://127.0.0.1:{port}/", verbose=False)
    refused = 0
    for n in range(40):
        with pytest.raises(Exception, match="greater than maximum value 100|not in the list of choices"):
            if n % 2:
                client.predict(handle_file(str(photo)), 1000 + n, api_name="/search")
            else:
                client.predict(handle_file(str(photo)), 10, "", "x" * 5000, api_name="/search")
        refused += 1
    hits = client.predict(handle_file(str(photo)), 5, api_name="/search")  # the same door still searches
    assert refused == 40 and hits[0]
    time.sleep(0.5)
    text = log.read_text()[before:]
    assert "Traceback" not in text, text[-3000:]
    lines = {re.sub(r" \(\d+ more like it left out in the last \d+ s\)$", "", line.split("WARNING: ", 1)[-1])
             for line in text.splitlines() if "refused" in line}
    assert lines == {"a page event's input 'k (results)' refused a value sent to it (the client is told why)",
                     "a page event's input 'Radio' refused a value sent to it (the client is told why)"}, lines
    # the same words for every value: LogLimits lets 5 a minute through (its own test, on a synthetic clock)
