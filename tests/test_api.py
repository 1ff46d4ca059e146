"""The JSON API (app.api) on a real server over real HTTP: agreement with the page and `moco index search --json`,
pagination and folders, the page's error messages, caps, auth (login, Basic, token, throttle), 503 shedding, the
schema and docs page, the README example; and two `moco serve` processes on one index during `moco index update`."""

from __future__ import annotations

import base64
import concurrent.futures
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from PIL import Image

from app.guard.access import MAX_BODY_BYTES, ApiSettings
from app.page.blocks import _safe
from app.server.launch import serve
from index.building.plan import file_hash
from index.building.runner import build_index
from index.duplicates.dedup import find_duplicates, load_duplicates
from index.search.image_index import ImageIndex
from moco.data.sample import make_sample_collection

from .live import free_port, wait_served

ROOT = Path(__file__).resolve().parents[1]
TOKEN = "test-token-0123456789abcdef"
AUTH = ("alice", "right-pass-123")


@pytest.fixture(scope="module")
def idx(sample_photos, backbone, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("api") / "idx"
    build_index(sample_photos, backbone, out, progress=False)
    return out


@pytest.fixture(scope="module")
def server(idx):
    """A live server with the page's --auth and an --api-token: (base url, its SearchApp)."""
    port = free_port()
    demo = serve(idx, port=port, auth=AUTH, device="cpu", block=False, api=ApiSettings(token=TOKEN))
    try:
        yield f"http://127.0.0.1:{port}", demo.api_service.library, demo.api_service
    finally:
        demo.close()
        demo.api_service.close()


@pytest.fixture()
def http(server):
    with httpx.Client(base_url=server[0] + "/api/v1", headers={"Authorization": f"Bearer {TOKEN}"},
                      timeout=60) as client:
        yield client


def _query(sample_photos: Path, n: int = 3) -> Path:
    return sorted(sample_photos.rglob("*.jpg"))[n]


def _upload(http: httpx.Client, path: Path, name: str | None = None, **form) -> httpx.Response:
    return http.post("/search", files={"image": (name or path.name, path.read_bytes())},
                     data={k: str(v) for k, v in form.items()})


# ------------------------------------------------------------------------------------------- agreement
def test_api_results_equal_the_page_and_the_cli(http, server, idx, sample_photos, capsys):
    from app.cli.commands import main

    q = _query(sample_photos)
    by_upload = _upload(http, q, k=8).json()
    by_b64 = http.post("/search/base64", json={"image_base64": base64.b64encode(q.read_bytes()).decode(),
                                                "filename": q.name, "k": 8}).json()
    assert main(["index", "search", str(idx), str(q), "-k", "8", "--json"]) == 0
    cli = json.loads(capsys.readouterr().out)
    _, _, page = server[1].search(str(q), k=8)  # the page's handler
    index = ImageIndex.open(idx)
    weak = index.weak_below
    assert index.ids_of_files([file_hash(q)])[0] not in page.ids  # the photo itself left out at every door alike
    for got in (by_upload["results"], by_b64["results"]):
        assert [h["id"] for h in got] == [h["id"] for h in cli] == page.ids
        assert [h["path"] for h in got] == [h["path"] for h in cli] == page.paths
        assert [h["rank"] for h in got] == [h["rank"] for h in cli] == list(range(1, 9))
        assert [h["weak"] for h in got] == [h["weak"] for h in cli] == [s < weak for s in page.scores]
        assert [h["score"] for h in got] == pytest.approx([h["score"] for h in cli], abs=1e-5)
        assert [h["score"] for h in got] == pytest.approx(page.scores, abs=1e-6)
    first = by_upload["results"][0]
    similar = http.get(f"/photos/{first['id']}/similar", params={"k": 8}).json()  # the page's click on a result
    _, _, clicked = server[1].select(page, 0)
    assert [h["id"] for h in similar["results"]] == clicked.ids
    assert [h["score"] for h in similar["results"]] == pytest.approx(clicked.scores, abs=1e-6)


def test_the_page_search_goes_through_the_batcher_and_equals_the_handler(server, sample_photos):
    from gradio_client import Client, handle_file

    url, app, service = server
    q = _query(sample_photos)
    before = len(service.search.batcher.batch_sizes)
    client = Client(url, auth=AUTH, verbose=False, download_files=False)
    gallery, info, *_ = client.predict(handle_file(str(q)), 6, "", api_name="/search")
    assert len(service.search.batcher.batch_sizes) == before + 1  # the page's Search ran as a batch of the service
    want, want_info, _ = app.search(str(q), k=6)  # the handler, unbatched
    assert "6 results" in info and "6 results" in want_info
    assert [g["caption"] for g in gallery] == [caption for _, caption in want]  # ranks, names, scores
    assert all(g["image"]["url"] for g in gallery)  # thumbnails served (from thumbs/ as they are)


def _browser_search(url: str, photo: Path, k: int) -> tuple[httpx.Client, list[dict]]:
    """The page's Search as a browser makes it (log in, upload, join the queue, read the event's stream): the
    logged-in client and the gallery's items."""
    http = httpx.Client(base_url=url, timeout=60)
    http.post("/login", data={"username": AUTH[0], "password": AUTH[1]}).raise_for_status()
    config = http.get("/config").json()
    search = next(d for d in config["dependencies"] if d.get("api_name") == "search")
    up = http.post("/gradio_api/upload", files={"files": (photo.name, photo.read_bytes())}).json()
    image = {"path": up[0], "orig_name": photo.name, "meta": {"_type": "gradio.FileData"}}
    http.post("/gradio_api/queue/join", json={"data": [image, k, "", "only this folder", "", ""],  # + the filters
                                              "fn_index": search["id"],
                                              "trigger_id": search["targets"][0][0], "session_hash": "b0",
                                              "event_data": None}).raise_for_status()
    with http.stream("GET", "/gradio_api/queue/data", params={"session_hash": "b0"}) as r:
        for line in r.iter_lines():
            msg = json.loads(line[5:]) if line.startswith("data:") else {}
            if msg.get("msg") == "process_completed":
                assert msg["success"], msg
                return http, msg["output"]["data"][0]
    raise AssertionError("the event's stream ended without its result")


def test_a_browser_gets_thumbnails_as_file_route_urls_that_serve_them(server, idx, sample_photos):
    """A browser's gallery carries absolute URLs of the file route (Gradio checks nothing per search, the route
    checks each fetch); Gradio's own clients get the paths they download (the test above)."""
    url, app, _ = server
    q = _query(sample_photos)
    http, gallery = _browser_search(url, q, 6)
    _, _, want = app.search(str(q), k=6)
    assert [g["caption"] for g in gallery] == [c for _, c in app._gallery(want)]
    for item, thumb in zip(gallery, want.thumbs):
        assert item["image"]["url"].startswith(f"{url}/gradio_api/file=")
        assert item["image"]["path"] == item["image"]["url"]  # sent as a URL: not resolved against static paths
        got = http.get(item["image"]["url"])
        assert got.status_code == 200 and got.content == Path(thumb).read_bytes()
    assert httpx.get(gallery[0]["image"]["url"]).status_code in (401, 403)  # not without the login
    blocked = http.get(gallery[0]["image"]["url"].replace(Path(want.thumbs[0]).name, "../catalog.sqlite"))
    assert blocked.status_code in (403, 404)  # the route's checks still hold for what a URL names


def test_an_idle_keep_alive_connection_outlives_uvicorns_default(server):
    """A connection idle past uvicorn's default 5 s still answers: clients and proxies close theirs first."""
    import socket

    host, port = server[0].removeprefix("http://").split(":")
    request = f"GET /api/v1/openapi.json HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {TOKEN}\r\n\r\n".encode()

    def answer(sock: socket.socket) -> bytes:
        sock.sendall(request)
        head = b""
        while b"\r\n\r\n" not in head:
            chunk = sock.recv(65536)
            assert chunk, "the server closed the connection"
            head += chunk
        length = int(re.search(rb"content-length: (\d+)", head.lower()).group(1))
        body = head.split(b"\r\n\r\n", 1)[1]
        while len(body) < length:
            body += sock.recv(65536)
        return head.split(b"\r\n", 1)[0]

    with socket.create_connection((host, int(port)), timeout=30) as sock:
        assert answer(sock) == b"HTTP/1.1 200 OK"
        time.sleep(6)  # past uvicorn's 5 s
        assert answer(sock) == b"HTTP/1.1 200 OK"


def test_concurrent_uploads_are_batched_and_each_gets_its_own_results(http, server, sample_photos):
    photos = sorted(sample_photos.rglob("*.jpg"))[:12]
    with concurrent.futures.ThreadPoolExecutor(12) as pool:
        got = list(pool.map(lambda p: _upload(http, p, k=5).json(), photos))
    for p, g in zip(photos, got):
        _, _, page = server[1].search(str(p), k=5)
        assert [h["id"] for h in g["results"]] == page.ids
        assert [h["score"] for h in g["results"]] == pytest.approx(page.scores, abs=1e-5)


def test_pages_and_folders(http, sample_photos):
    q = _query(sample_photos)
    ten = _upload(http, q, k=10).json()
    second = _upload(http, q, k=5, offset=5).json()
    assert [h["id"] for h in second["results"]] == [h["id"] for h in ten["results"][5:]]
    assert [h["rank"] for h in second["results"]] == [6, 7, 8, 9, 10] and second["offset"] == 5
    assert ten["next_offset"] == 10 and ten["images"] == len(list(sample_photos.rglob("*.*")))
    last = _upload(http, q, k=10, offset=ten["images"] - 4).json()  # the photo itself is left out: one less
    assert len(last["results"]) == 3 and last["next_offset"] is None
    family = ten["results"][0]["path"].split("/")[0]
    only = _upload(http, q, k=50, folder=family).json()
    assert only["results"] and all(h["path"].startswith(family + "/") for h in only["results"])
    assert only["folder"] == family
    assert family in http.get("/stats").json()["folders"]


def test_an_api_search_checks_once_and_never_goes_through_the_page(http, server, sample_photos, monkeypatch):
    """Each search route checks its values once (one refresh of the index, one scope) and answers from the search
    room: no method of the page's SearchApp runs (it was: the page's private _query, twice, and three refreshes)."""
    _, app, service = server
    index = app.ready_index()
    counts = {"refresh": 0, "check": 0, "page": 0}

    def counted(name, real):
        def call(*args, **kwargs):
            counts[name] += 1
            return real(*args, **kwargs)
        return call

    monkeypatch.setattr(index, "refresh", counted("refresh", index.refresh))
    monkeypatch.setattr(service.search.searcher, "check", counted("check", service.search.searcher.check))
    for name in ("search", "from_vector", "search_with", "rerun", "upload_twins", "folders"):
        monkeypatch.setattr(app, name, counted("page", getattr(app, name)))
    q = _query(sample_photos)
    one = http.post("/search/base64", json={"image_base64": base64.b64encode(q.read_bytes()).decode(), "k": 5})
    some_id = one.json()["results"][0]["id"]
    two = http.get(f"/photos/{some_id}/similar", params={"k": 5})
    three = http.post("/search/multi", json={"ids": [some_id], "k": 5})
    assert [r.status_code for r in (one, two, three)] == [200, 200, 200]
    assert counts == {"refresh": 3, "check": 3, "page": 0}, counts


# ---------------------------------------------------------------------------------------------- errors
def test_an_image_too_small_to_search_with_is_refused_alike_at_every_door(http, server, idx, tmp_path, capsys):
    from app.cli.commands import main
    from moco.errors import UserError

    tiny = tmp_path / "tiny.png"
    Image.new("RGB", (1, 1), (200, 40, 40)).save(tiny)
    words = ("tiny.png is 1 x 1 pixels: too small to search with (at least 16 px on each side): upload a larger "
             "photo (or give one to `moco index search`)")
    assert main(["index", "search", str(idx), str(tiny)]) == 2  # the CLI: bad input, no results
    out = capsys.readouterr()
    assert words in out.err and out.out == "", out
    r = _upload(http, tiny, k=5)  # the JSON API, both ways
    assert r.status_code == 400 and r.json()["detail"] == words
    r = http.post("/search/base64", json={"image_base64": base64.b64encode(tiny.read_bytes()).decode(),
                                          "filename": "tiny.png", "k": 3})
    assert r.status_code == 400 and r.json()["detail"] == words
    with pytest.raises(UserError) as e:  # the page's handler
        server[1].search(str(tiny), k=3)
    assert str(e.value) == words
    index = ImageIndex.open(idx)  # the library's search by image
    with pytest.raises(UserError) as e:
        index.search_image(tiny, index.load_embedder(device="cpu"), k=3)
    assert str(e.value) == str(tiny).removesuffix("tiny.png") + words


def test_errors_are_the_pages_one_line_messages(http, server, sample_photos, tmp_path):
    page = _safe(3, 1)(server[1].search)
    bad = tmp_path / "upload.jpg"
    bad.write_bytes(b"\xff\xd8\xff not an image")
    tiny = tmp_path / "tiny.png"
    Image.new("RGB", (8, 8)).save(tiny)
    for path, folder, words in [(bad, "", "upload.jpg"), (tiny, "", "too small"),
                                (_query(sample_photos), "../etc", "no sub-folder")]:
        r = _upload(http, path, k=5, folder=folder)
        assert r.status_code == 400 and words in r.json()["detail"]
        assert page(str(path), 5, folder)[1] == "**Error:** " + r.json()["detail"]  # word for word
    from PIL import features

    from moco.data.photos import enable_formats
    formats = _upload(http, bad, k=5).json()["detail"].rsplit("upload a photo (", 1)[1]  # what this server reads
    assert ("AVIF" in formats) == features.check("avif") and ("HEIC" in formats) == enable_formats()
    assert formats.startswith("JPEG, PNG, WebP")
    r = _upload(http, tiny, k=0)
    assert r.status_code == 400 and r.json()["detail"].startswith("k: Input should be greater than or equal to 1")
    r = http.post("/search/base64", json={"image_base64": "not base64!", "k": 3})
    assert r.status_code == 400 and "image_base64 is not base64" in r.json()["detail"]
    r = http.get("/photos/999999/similar")
    assert r.status_code == 404 and "photo id 999999 is not an indexed photo" in r.json()["detail"]
    assert http.get("/photos/999999/thumbnail").status_code == 404
    assert http.get("/photos/999999/original").status_code == 404


def test_uploads_over_the_cap_get_413_or_the_pages_message(http, tmp_path):
    r = http.post("/search", content=b"x" * (MAX_BODY_BYTES + 1),
                  headers={"content-type": "multipart/form-data; boundary=zz"})
    assert r.status_code == 413 and "over the 25 MB upload limit" in r.json()["detail"]
    big = tmp_path / "big.jpg"
    big.write_bytes(b"\xff\xd8\xff" + b"\0" * (26 * 1024 * 1024))  # over the page's cap, under the body cap
    r = _upload(http, big, k=3)
    assert r.status_code == 400
    assert r.json()["detail"].startswith("big.jpg is 27.3 MB, over the 25 MB upload limit: upload a smaller copy")


# ------------------------------------------------------------------------------------ files and stats
def test_thumbnail_original_stats_and_duplicates(http, server, idx, sample_photos):
    index = ImageIndex.open(idx)
    row = next(r for r in index.catalog.rows_by_id(list(range(1, 40))).values() if r.thumb)
    r = http.get(f"/photos/{row.id}/thumbnail")
    assert r.status_code == 200 and r.headers["content-type"] == "image/jpeg"
    assert r.content == (idx / row.thumb).read_bytes()
    r = http.get(f"/photos/{row.id}/original")
    assert r.status_code == 200 and r.content == (sample_photos / row.path).read_bytes()
    st = http.get("/stats").json()
    assert st["images"] == len(index) and st["weak_below"] == index.weak_below and st["kind"] == "flat"
    assert http.get("/duplicates").status_code in (200, 404)
    find_duplicates(index, 0.5)
    dup = http.get("/duplicates").json()
    saved = load_duplicates(idx)
    assert dup["threshold"] == saved.threshold and len(dup["groups"]) == len(saved.groups)
    assert [[m["id"] for m in g["members"]] for g in dup["groups"]] == [g.ids for g in saved.groups]


def test_the_api_filters_folders_and_dates_as_the_page(http, server, sample_photos):
    import datetime

    q = _query(sample_photos)
    family = q.parent.name
    r = http.post("/search", files={"image": (q.name, q.read_bytes())}, data={"k": "10", "exclude_folders": [family]})
    assert r.status_code == 200, r.text
    got = r.json()
    _, _, page = server[1].search(str(q), k=10, exclude_folders=[family])
    assert [h["id"] for h in got["results"]] == page.ids and got["exclude_folders"] == [family]
    assert got["results"] and not [h for h in got["results"] if h["path"].startswith(family + "/")]
    day = got["results"][0]["taken"][:10]  # the sample has no EXIF: the files' date, on this machine's clock
    before = (datetime.date.fromisoformat(day) - datetime.timedelta(days=1)).isoformat()
    b64 = base64.b64encode(q.read_bytes()).decode()
    same = http.post("/search/base64", json={"image_base64": b64, "k": 10, "exclude_folders": [family],
                                             "taken_from": before, "taken_to": day}).json()
    assert [h["id"] for h in same["results"]] == page.ids and same["taken_to"] == day
    none = http.get(f"/photos/{page.ids[0]}/similar", params={"k": 5, "taken_to": before}).json()
    assert none["results"] == [] and none["next_offset"] is None
    for bad in ({"taken_from": "2024-02-30"}, {"taken_from": day, "taken_to": before}):
        r = http.get(f"/photos/{page.ids[0]}/similar", params=bad)
        assert r.status_code == 400 and "taken_" in r.json()["detail"]
    r = http.get(f"/photos/{page.ids[0]}/similar", params={"exclude_folders": ["nosuch"]})
    assert r.status_code == 404 and "nosuch" in r.json()["detail"]


def test_schema_and_docs_page_work_offline(http):
    schema = http.get("/openapi.json").json()
    assert {"/api/v1/search", "/api/v1/search/base64", "/api/v1/photos/{photo_id}/similar", "/api/v1/stats",
            "/api/v1/duplicates", "/api/v1/photos/{photo_id}/thumbnail",
            "/api/v1/photos/{photo_id}/original"} <= set(schema["paths"])
    hit = schema["components"]["schemas"]["Hit"]["properties"]
    assert set(hit) == {"rank", "id", "path", "score", "weak", "taken"}
    query = schema["components"]["schemas"]["Base64Query"]["properties"]
    assert {"exclude_folders", "taken_from", "taken_to", "include_queries"} <= set(query) and "YYYY-MM-DD" in query[
        "taken_from"]["description"]
    similar = {p["name"] for p in schema["paths"]["/api/v1/photos/{photo_id}/similar"]["get"]["parameters"]}
    assert {"exclude_folders", "taken_from", "taken_to", "include_queries"} <= similar
    assert "multipart/form-data" in schema["paths"]["/api/v1/search"]["post"]["requestBody"]["content"]
    docs = http.get("/docs")
    assert docs.status_code == 200 and "POST /api/v1/search" in docs.text and "image_base64" in docs.text
    assert "<script" not in docs.text and "://" not in docs.text.replace("http://", "")  # nothing fetched


def test_every_route_is_named_and_described_by_its_function(http):
    """Each documented operation comes from its module's route function (put on its router with the Api bound):
    its id starts with the function's name and its description is the function's docstring, not the binding's;
    no operation asks for the Api itself."""
    import inspect

    from app.api import collection, duplicates, knn, photos, search

    schema = http.get("/openapi.json").json()
    ops = {(path, method): op for path, item in schema["paths"].items() for method, op in item.items()}
    functions = {n: f for m in (search, photos, duplicates, collection, knn) for n, f in vars(m).items()
                 if inspect.isfunction(f) and f.__module__ == m.__name__ and not n.startswith("_")
                 and not n.endswith("_router") and list(inspect.signature(f).parameters)[:1] == ["api"]}  # the routes
    assert len(functions) == len(ops) == 21, (sorted(functions), sorted(ops))
    named = set()
    for (path, method), op in ops.items():
        name = next(n for n in functions if op["operationId"].startswith(n + "_api_v1"))
        named.add(name)
        assert op["description"] == inspect.getdoc(functions[name]), (path, method)
        assert "api" not in {p["name"] for p in op.get("parameters", [])}, (path, method)
    assert named == set(functions)


# ----------------------------------------------------------------------------------------------- access
def test_access_needs_the_token_the_basic_login_or_the_page_cookie(server):
    url = server[0] + "/api/v1/stats"
    with httpx.Client(timeout=30) as c:
        r = c.get(url)
        assert r.status_code == 401 and "needs a login" in r.json()["detail"] and "www-authenticate" in r.headers
        assert c.get(url, headers={"Authorization": f"Bearer {TOKEN}"}).status_code == 200
        assert c.get(url, auth=AUTH).status_code == 200  # HTTP Basic with the page's login
        assert c.get(url, headers={"Origin": "http://evil.example", "Authorization": f"Bearer {TOKEN}"}
                     ).headers.get("access-control-allow-origin") is None  # no CORS
        assert c.post(server[0] + "/login", data={"username": AUTH[0], "password": AUTH[1]}).status_code == 200
        assert c.get(url).status_code == 200  # the page's login cookie


@pytest.mark.slow
def test_wrong_tokens_are_throttled_like_page_logins(idx):
    port = free_port()
    demo = serve(idx, port=port, device="cpu", block=False, api=ApiSettings(token=TOKEN))  # no --auth: token only
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}/api/v1", timeout=30) as c:
            codes = [c.get("/stats", headers={"Authorization": f"Bearer wrong-{i}"}).status_code for i in range(8)]
            assert codes == [401] * 5 + [429] * 3, codes
            locked = c.get("/stats", headers={"Authorization": f"Bearer {TOKEN}"})  # even the right one waits
            assert locked.status_code == 429 and int(locked.headers["retry-after"]) >= 1
            assert "too many failed logins" in locked.json()["detail"]
    finally:
        demo.close()
        demo.api_service.close()


@pytest.mark.slow
def test_overload_is_shed_with_503_and_retry_after(idx, sample_photos):
    port = free_port()
    demo = serve(idx, port=port, device="cpu", block=False, api=ApiSettings(max_pending=1, max_batch=1))
    photo = _query(sample_photos).read_bytes()
    try:
        def one(_: int) -> httpx.Response:
            return httpx.post(f"http://127.0.0.1:{port}/api/v1/search", files={"image": ("q.jpg", photo)},
                              data={"k": "3"}, timeout=60)

        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            replies = list(pool.map(one, range(32)))
        codes = [r.status_code for r in replies]
        assert set(codes) <= {200, 503} and 200 in codes and 503 in codes, codes
        shed = next(r for r in replies if r.status_code == 503)
        assert int(shed.headers["retry-after"]) >= 1 and "the server is busy" in shed.json()["detail"]
    finally:
        demo.close()
        demo.api_service.close()


def test_token_flag_is_checked(capsys):
    from app.cli.commands import main

    assert main(["serve", "no-such-idx", "--api-token", "short"]) == 2
    assert "--api-token: 5 characters; use at least 16" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------ the README
def _doc_example() -> str:
    text = (ROOT / "docs" / "api.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    assert len(blocks) == 1, "docs/api.md has one Python example"
    return blocks[0]


def test_the_docs_example_runs_against_a_live_server(server, sample_photos, tmp_path):
    shutil.copy(_query(sample_photos), tmp_path / "query.jpg")
    (tmp_path / "example.py").write_text(_doc_example())
    env = dict(os.environ, MOCO_URL=server[0], MOCO_API_TOKEN=TOKEN, PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, "example.py"], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert [line.split()[0] for line in lines] == ["1", "2", "3", "4", "5"]
    assert all(line.split()[2].endswith((".jpg", ".png")) for line in lines)
    itself = _query(sample_photos).relative_to(sample_photos).as_posix()
    assert itself not in [line.split()[2] for line in lines]  # query.jpg is a photo of the collection: left out
    r = subprocess.run([sys.executable, "example.py"], cwd=tmp_path, env={**env, "MOCO_API_TOKEN": "wrong-token"},
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "401: wrong token" in r.stderr


# --------------------------------------------------------------------------------- two servers, one index
@pytest.mark.slow
def test_two_servers_on_one_index_keep_answering_through_an_update(backbone, tmp_path):
    photos = tmp_path / "photos"
    make_sample_collection(photos, per_family=5, size=48, seed=4)
    idx = tmp_path / "idx"
    build_index(photos, backbone, idx, progress=False)
    before = len(ImageIndex.open(idx))
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    ports = [free_port(), free_port()]
    logs = [tmp_path / "serve0.log", tmp_path / "serve1.log"]
    procs = []
    for p, log in zip(ports, logs):
        with log.open("w") as err:  # the child keeps its own copy of the file
            procs.append(subprocess.Popen([sys.executable, "-m", "app.cli", "--verbose", "serve", str(idx), "--port",
                                           str(p), "--device", "cpu"], env=env, stdout=subprocess.DEVNULL, stderr=err))
    query = sorted(photos.rglob("*.jpg"))[0].read_bytes()
    failures: list[str] = []
    answered = [0, 0]
    stop = threading.Event()

    def hammer(n: int) -> None:
        with httpx.Client(base_url=f"http://127.0.0.1:{ports[n]}/api/v1", timeout=60) as c:
            while not stop.is_set():
                try:
                    r = c.post("/search", files={"image": ("q.jpg", query)}, data={"k": "3"})
                    if r.status_code != 200 or len(r.json()["results"]) != 3:
                        failures.append(f"server {n}: {r.status_code} {r.text[:200]}")
                    answered[n] += 1
                except httpx.HTTPError as e:
                    failures.append(f"server {n}: {type(e).__name__}: {e}")
                stop.wait(0.05)  # a steady stream, not a flood: the update beside it keeps a core

    try:
        for p, proc in zip(ports, procs):
            wait_served(f"http://127.0.0.1:{p}/api/v1/stats", proc)
        threads = [threading.Thread(target=hammer, args=(n,)) for n in (0, 1)]
        for t in threads:
            t.start()
        make_sample_collection(photos / "new", per_family=2, size=48, seed=9)  # 12 more photos
        for f in sorted(photos.rglob("*.*"))[:3]:
            if "new" not in f.parts:
                f.unlink()  # and 3 fewer
        seen = list(answered)
        r = subprocess.run([sys.executable, "-m", "app.cli", "index", "update", str(idx), "--device", "cpu"],
                           env=env, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr
        after = len(ImageIndex.open(idx))
        assert after == before + 12 - 3
        new = sorted((photos / "new").rglob("*.jpg"))[0]
        deadline = time.time() + 60
        switched = [False, False]
        while time.time() < deadline and not all(switched):
            for n, p in enumerate(ports):
                hits = httpx.post(f"http://127.0.0.1:{p}/api/v1/search", files={"image": (new.name, new.read_bytes())},
                                  data={"k": "1", "include_queries": "true"}, timeout=60).json()["results"]
                switched[n] = hits[0]["path"] == str(new.relative_to(photos)) and httpx.get(
                    f"http://127.0.0.1:{p}/api/v1/stats", timeout=60).json()["images"] == after
            time.sleep(0.2)
        time.sleep(1.0)  # a while on the new index too
    finally:
        stop.set()
        for t in threads if "threads" in locals() else []:
            t.join(60)
        for proc in procs:
            proc.terminate()
            proc.wait(30)
    assert switched == [True, True]
    assert not failures, failures[:5]
    assert all(a > s for a, s in zip(answered, seen)), (answered, seen)  # both answered during the update
    for log in logs:  # each server's startup heap was out of the collector's way (app/heap.py) while it served
        assert "app.server.heap: heap frozen: " in log.read_text(), log.read_text()[-2000:]


def test_embed_returns_the_embedders_vector_and_a_search_with_it_is_the_photos(http, idx, backbone, sample_photos):
    import numpy as np

    from moco.embed import Embedder

    q = _query(sample_photos, 5)
    r = http.post("/embed", files={"image": (q.name, q.read_bytes())})
    assert r.status_code == 200, r.text
    got = np.asarray(r.json()["vector"], np.float32)  # D
    ref = Embedder.load(backbone, device="cpu", space=idx).embed([q])[0]  # D: the library's, in the index's space
    assert r.json()["dim"] == len(ref) == len(got)
    assert float(got @ ref) / float(np.linalg.norm(got) * np.linalg.norm(ref)) >= 0.9999
    by_vector = http.post("/search/multi", json={"vector": got.tolist(), "k": 6, "include_queries": True}).json()
    by_photo = _upload(http, q, k=6, include_queries=True).json()
    assert [h["id"] for h in by_vector["results"]] == [h["id"] for h in by_photo["results"]]
    bad = http.post("/embed", files={"image": ("notes.jpg", b"\xff\xd8\xff not an image")})
    assert bad.status_code == 400 and "notes.jpg" in bad.json()["detail"]
    assert httpx.post(str(http.base_url) + "/embed", files={"image": (q.name, q.read_bytes())}).status_code == 401


def _clip_client_body(indice_name: str, num_images: int, **query) -> str:
    """A request as clip-retrieval's ClipClient sends it: every field, unused ones null, JSON text with no
    content-type (``requests.post(url, data=json.dumps(...))``)."""
    body = {"text": None, "image": None, "image_url": None, "embedding_input": None, "deduplicate": True,
            "use_safety_model": True, "use_violence_detector": True, "indice_name": indice_name, "use_mclip": False,
            "aesthetic_score": 9, "aesthetic_weight": 0.5, "modality": "image", "num_images": num_images,
            "num_result_ids": num_images, "verbose": False}
    return json.dumps(body | query)


def test_a_clip_retrieval_client_searches_by_image_and_by_embedding(http, idx, sample_photos):
    names = http.get("/indices-list").json()
    assert names == [idx.name]
    q = _query(sample_photos, 4)
    image = base64.b64encode(q.read_bytes()).decode()
    r = http.post("/knn-service", content=_clip_client_body(names[0], 5, image=image))
    assert r.status_code == 200, r.text
    got = r.json()
    ours = _upload(http, q, k=5, deduplicate=True, include_queries=True).json()["results"]
    assert [(h["id"], h["image_path"]) for h in got] == [(h["id"], h["path"]) for h in ours]
    assert [round(h["similarity"], 5) for h in got] == [round(h["score"], 5) for h in ours]
    assert got[0]["url"].endswith(f"/api/v1/photos/{got[0]['id']}/thumbnail")
    assert http.get(got[0]["url"]).status_code == 200  # the thumbnail a front shows
    vector = http.post("/embed", files={"image": (q.name, q.read_bytes())}).json()["vector"]
    by_vector = http.post("/knn-service", content=_clip_client_body(names[0], 5, embedding_input=vector)).json()
    assert [h["id"] for h in by_vector] == [h["id"] for h in got]
    for fields, status, words in [({"text": "a cat"}, 400, "no text encoder"),
                                  ({"image_url": "http://example.com/a.jpg"}, 400, "fetches no URL"),
                                  ({"image": image, "modality": "text"}, 400, "image embeddings only"),
                                  ({}, 400, "one of image (base64) and embedding_input"),
                                  ({"image": image, "indice_name": "laion5B"}, 404, f"'{idx.name}'"),
                                  ({"image": "not base64!"}, 400, "not base64")]:
        r = http.post("/knn-service", content=_clip_client_body(fields.pop("indice_name", names[0]), 5, **fields))
        assert r.status_code == status and words in r.json()["detail"], (fields, r.text)
    r = http.post("/knn-service", content=b"{not json")
    assert r.status_code == 400 and "send clip-retrieval's JSON" in r.json()["detail"]
