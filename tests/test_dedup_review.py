"""The review of duplicates through the JSON API and the page's handlers, on a live `moco serve` (in this process) over
real HTTP: the POST routes behind the token and in the schema, a page of 10,000 groups, a keeper chosen, a move and
its undo (the files on disk checked), "not duplicates", and a server that follows a move made by the CLI."""

from __future__ import annotations

import json
import shutil
import sqlite3

import httpx
import pytest

from app.cli.commands import main
from app.collection.review import PAGE_SIZE
from app.guard.access import ApiSettings
from app.page.views import review_outputs
from app.server.launch import serve
from index.building.plan import file_hash
from index.building.runner import build_index
from index.duplicates.dedup import load_duplicates, write_duplicates
from index.duplicates.groups import SavedSearch, group_id
from index.duplicates.resolve.actions import DUPLICATES_DIR
from index.search.image_index import ImageIndex

from .live import free_port
from .test_dedup_actions import _bytes, _collection, _where, forge

TOKEN = "review-token-0123456789abcdef"
ROUTES = [("POST", "/duplicates/move", {"groups": ["x"]}), ("POST", "/duplicates/undo", {}),
          ("POST", "/duplicates/x/keeper", {"photo_id": 1}), ("POST", "/duplicates/x/not-duplicates", None),
          ("GET", "/duplicates", None)]


@pytest.fixture(scope="module")
def served(backbone, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("review")
    photos = tmp / "photos"
    expected = _collection(photos)
    build_index(photos, backbone, tmp / "idx", progress=False, device="cpu")
    port = free_port()
    demo = serve(tmp / "idx", port=port, device="cpu", block=False, api=ApiSettings(token=TOKEN))
    try:
        yield {"url": f"http://127.0.0.1:{port}", "app": demo.api_service.library, "photos": photos, "idx": tmp / "idx",
               "expected": expected, "before": _bytes(photos), "tmp": tmp}
    finally:
        demo.close()
        demo.api_service.close()


@pytest.fixture()
def http(served):
    with httpx.Client(base_url=served["url"] + "/api/v1", headers={"Authorization": f"Bearer {TOKEN}"},
                      timeout=120) as client:
        yield client


def test_the_routes_need_the_token_and_are_in_the_schema(served, http):
    with httpx.Client(base_url=served["url"] + "/api/v1", timeout=30) as anonymous:
        for method, path, body in ROUTES:
            r = anonymous.request(method, path, json=body)
            assert r.status_code == 401, (method, path, r.status_code)
        wrong = anonymous.post("/duplicates/undo", json={}, headers={"Authorization": "Bearer wrong-token-000000000"})
        assert wrong.status_code == 401
    assert served["app"].duplicates.moved() == 0 and not (served["photos"] / DUPLICATES_DIR).exists()
    paths = http.get("/openapi.json").json()["paths"]
    assert {"/api/v1/duplicates", "/api/v1/duplicates/move", "/api/v1/duplicates/undo",
            "/api/v1/duplicates/{group_id}/keeper", "/api/v1/duplicates/{group_id}/not-duplicates"} <= set(paths)
    assert all("post" in paths[p] for p in ("/api/v1/duplicates/move", "/api/v1/duplicates/undo"))
    r = http.get("/duplicates")
    assert r.status_code == 404 and "no search for duplicates yet" in r.json()["detail"]
    r = http.post("/duplicates/move", json={"kinds": ["blurry"]})
    assert r.status_code == 400 and "kinds" in r.json()["detail"]


def test_a_page_of_ten_thousand_groups(served, http):
    """Pages of a saved search of 10,000 groups: every group once, in order, each page small; the page's review
    shows one page of PAGE_SIZE groups, never all of them."""
    index = ImageIndex.open(served["idx"])
    ids = sorted(index.catalog.rows_by_id(range(100)))
    groups = []
    for n in range(10_000):
        a, b = ids[n % len(ids)], ids[(n + 1) % len(ids)]
        kind = "exact" if n < 3000 else "near"
        members = [{"id": i, "path": f"g{n}/{i}.jpg", "thumb": None, "hash": None, "similarity": 1.0,
                    "best_similarity": 1.0, "width": 8, "height": 8, "bytes": 10, "taken": None, "mtime": 0.0}
                   for i in (a, b)]
        groups.append({"id": f"{group_id(kind, [a, b])}-{n}", "kind": kind, "size": 2,
                       "representative": {"id": a, "path": members[0]["path"]}, "tightest": 1.0, "loosest": 1.0,
                       "keep": members[0]["path"], "keep_id": a, "reason": "most pixels (8 x 8)", "members": members})
    write_duplicates(served["idx"], SavedSearch.from_json({
        "threshold": 0.9, "similar_threshold": 0.8, "rule": "given", "kinds": ["exact", "near"], "groups": groups,
        "images": len(ids), "created": "now"}))
    seen, offset, sizes = [], 0, []
    while offset is not None:
        r = http.get("/duplicates", params={"offset": offset, "limit": 500})
        assert r.status_code == 200
        page = r.json()
        assert page["total"] == 10_000 and page["offset"] == offset and page["rule"] == "given"
        seen += [g["id"] for g in page["groups"]]
        sizes.append(len(r.content))
        offset = page["next_offset"]
    assert seen == [g["id"] for g in groups] and max(sizes) < 2_000_000
    near = http.get("/duplicates", params={"kind": "near", "offset": 6990, "limit": 50}).json()
    assert near["total"] == 7000 and [g["id"] for g in near["groups"]] == [g["id"] for g in groups[-10:]]
    assert near["next_offset"] is None and near["groups"][0]["keep"]["id"] == groups[-10]["keep_id"]
    assert http.get("/duplicates", params={"limit": 501}).status_code == 400
    html, where, *_ = review_outputs(served["app"], "exact and near", 9990)
    assert html.count('class="dup-group"') == PAGE_SIZE and "Groups 9991–10000 of **10000**" in where
    html, where, *_ = review_outputs(served["app"], "exact", 10**6)  # past the end: the last page
    assert "Groups 2991–3000 of **3000**" in where
    (served["idx"] / "dedup.json").unlink()


def test_keep_move_and_undo_through_the_api(served, http):
    photos, dups = served["photos"], served["photos"] / DUPLICATES_DIR
    assert main(["index", "dedup", str(served["idx"])]) == 0
    page = http.get("/duplicates").json()
    assert [g["kind"] for g in page["groups"]] == ["exact", "near"] and page["total"] == 2
    exact, near = page["groups"]
    assert exact["reason"].startswith("oldest file") and near["reason"] == "most pixels (64 x 64)"
    assert [m["identical"] for m in exact["members"] if m["id"] != exact["keep"]["id"]] == [True]
    other = next(m for m in near["members"] if m["id"] != near["keep"]["id"])
    r = http.post(f"/duplicates/{near['id']}/keeper", json={"photo_id": other["id"]})
    assert r.status_code == 200 and r.json()["keep"]["id"] == other["id"] and r.json()["reason"] == "chosen by you"
    assert http.post(f"/duplicates/{near['id']}/keeper", json={"photo_id": 10**6}).status_code == 400
    dry = http.post("/duplicates/move", json={"kinds": ["exact", "near"], "dry_run": True}).json()
    assert sorted(d["from"] for d in dry["done"]) == sorted([served["expected"]["exact"][1],
                                                              served["expected"]["near"][0]])
    assert _bytes(photos) == served["before"]
    r = http.post("/duplicates/move", json={"groups": [exact["id"], near["id"]]})
    assert r.status_code == 200, r.text
    out = r.json()
    assert len(out["done"]) == 2 and out["updated"] and out["groups"] == 0 and out["batch"]
    where = _where(served["before"], photos, dups)  # inside the collection's hidden folder, each at one place
    assert sorted(p for p, w in where.items() if w == "dest") == sorted(d["from"] for d in dry["done"])
    stats = http.get("/stats").json()
    assert stats["images"] == len(served["before"]) - 2 and stats["dedup_rule"] in ("calibrated", "crowd")
    assert http.get("/duplicates").json()["total"] == 0
    r = http.post("/duplicates/undo", json={"batch": out["batch"]})
    assert r.status_code == 200 and len(r.json()["done"]) == 2
    assert set(_where(served["before"], photos, dups).values()) == {"root"}
    assert http.get("/stats").json()["images"] == len(served["before"])
    again = {g["kind"]: g for g in http.get("/duplicates").json()["groups"]}
    assert again["near"]["keep"]["path"] == other["path"]  # the chosen keeper holds in the search made again
    r = http.post(f"/duplicates/{again['near']['id']}/not-duplicates")
    assert r.status_code == 200 and [g["kind"] for g in http.get("/duplicates").json()["groups"]] == ["exact"]
    assert http.post("/duplicates/move", json={"kinds": ["similar"]}).status_code == 400


def test_a_running_server_follows_a_move_made_by_the_cli(served, http, capsys):
    photos, dest = served["photos"], served["tmp"] / "moved"
    query = photos / served["expected"]["exact"][1]
    hits = http.post("/search", files={"image": (query.name, query.read_bytes())},
                     data={"k": "40", "include_queries": "true"}).json()  # the copies of its bytes kept
    assert served["expected"]["exact"][1] in [h["path"] for h in hits["results"]]
    assert main(["index", "dedup", str(served["idx"]), "--move-to", str(dest), "--kind", "exact", "--json"]) == 0
    moved = json.loads(capsys.readouterr().out)
    assert [d["from"] for d in moved["done"]] == [served["expected"]["exact"][1]]
    hits = http.post("/search", files={"image": (query.name, (dest / moved["done"][0]["from"]).read_bytes())},
                     data={"k": "40", "include_queries": "true"}).json()
    assert served["expected"]["exact"][1] not in [h["path"] for h in hits["results"]]  # the server reloaded
    assert hits["images"] == len(served["before"]) - 1
    assert main(["index", "dedup", str(served["idx"]), "--undo"]) == 0
    assert set(_where(served["before"], photos, dest).values()) == {"root"}
    assert http.get("/stats").json()["images"] == len(served["before"])
    saved = load_duplicates(served["idx"])
    assert [g.kind for g in saved.groups] == ["exact"]  # the near group stays marked not duplicates


def test_an_undo_through_the_api_never_pulls_in_a_file_a_changed_journal_names(served, http):
    """A row made up in the catalog's journal naming an outside JPEG (its hash and size matching): the API's undo
    refuses it; the file stays outside, unindexed and unserved."""
    outside = served["tmp"] / "outside"
    outside.mkdir(exist_ok=True)
    secret = outside / "secret.jpg"
    shutil.copyfile(served["photos"] / sorted(served["before"])[1], secret)
    images = http.get("/stats").json()["images"]
    seq = forge(served["idx"], "secret.jpg", secret, file_hash(secret), secret.stat().st_size)
    try:
        r = http.post("/duplicates/undo", json={})
        assert r.status_code == 200, r.text
        assert [s["reason"].startswith(f"the journal's entry {seq} is refused") for s in r.json()["skipped"]] == [True]
        assert secret.is_file() and not (served["photos"] / "secret.jpg").exists()
        assert http.get("/stats").json()["images"] == images and _bytes(served["photos"]) == served["before"]
    finally:
        with sqlite3.connect(served["idx"] / "catalog.sqlite") as db:
            db.execute("DELETE FROM dedup_moves WHERE seq = ?", (seq,))


def test_what_the_request_names_but_is_not_there_is_404_and_what_the_schema_says_is_400(served, http):
    assert main(["index", "dedup", str(served["idx"])]) == 0
    for method, path, body in (("POST", "/duplicates/nope/keeper", {"photo_id": 1}),
                               ("POST", "/duplicates/nope/not-duplicates", None),
                               ("POST", "/duplicates/move", {"groups": ["nope"]}),
                               ("POST", "/duplicates/undo", {"batch": "20990101T000000Z-abcdef"})):
        r = http.request(method, path, json=body)
        assert r.status_code == 404, (path, r.status_code, r.text)
    for body in ({}, {"groups": [], "kinds": []}, {"kinds": ["similar"]}):
        r = http.post("/duplicates/move", json=body)
        assert r.status_code == 400, (body, r.text)
    r = http.post("/search/multi", json={"vector": []})
    assert r.status_code == 400 and "vector" in r.json()["detail"]
    schema = http.get("/openapi.json").json()["components"]["schemas"]
    assert {"required": ["groups"], "properties": {"groups": {"minItems": 1}}} in schema["MoveRequest"]["anyOf"]
    assert schema["MoveRequest"]["properties"]["kinds"]["items"]["enum"] == ["exact", "near"]
