"""The whole collection through the JSON API on a real server over real HTTP: /map, /themes, /themes/{id},
/unusual and /photos agree with `moco index map|themes|unusual|browse --json`, are in the OpenAPI schema, page
as they say, answer bad input with 400/404 and follow an update of the index."""

from __future__ import annotations

import json
import shutil

import httpx
import numpy as np
import pytest
from PIL import Image

from app.cli.commands import main
from app.guard.access import ApiSettings
from app.server.launch import serve
from index.building.runner import build_index, update_index
from moco.extras import install_hint

from .live import free_port

TOKEN = "test-token-overview-0123456789"


@pytest.fixture(scope="module")
def idx(sample_photos, backbone, tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("api-overview")
    photos = tmp / "photos"
    shutil.copytree(sample_photos, photos)
    build_index(photos, backbone, tmp / "idx", progress=False, device="cpu")
    return {"idx": tmp / "idx", "photos": photos}


@pytest.fixture(scope="module")
def http(idx):
    port = free_port()
    demo = serve(idx["idx"], port=port, device="cpu", block=False, api=ApiSettings(token=TOKEN))
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}/api/v1", timeout=120,
                          headers={"Authorization": f"Bearer {TOKEN}"}) as client:
            yield client
    finally:
        demo.close()
        demo.api_service.close()


def _cli(capsys, *argv: str) -> object:
    capsys.readouterr()
    assert main(["index", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_the_routes_are_in_the_schema(http):
    schema = http.get("/openapi.json").json()
    assert {"/api/v1/map", "/api/v1/themes", "/api/v1/themes/{theme_id}", "/api/v1/unusual",
            "/api/v1/photos"} <= set(schema["paths"])
    photos = {p["name"] for p in schema["paths"]["/api/v1/photos"]["get"]["parameters"]}
    assert photos == {"folder", "theme", "sort", "offset", "limit"}
    assert set(schema["components"]["schemas"]["CollectionMap"]["properties"]) == {
        "method", "version", "count", "ids", "x", "y", "theme"}
    assert http.get("/map", headers={"Authorization": "Bearer wrong"}).status_code == 401


def test_the_map_and_the_themes_agree_with_the_cli(http, idx, capsys):
    m = http.get("/map").json()
    rows = _cli(capsys, "map", str(idx["idx"]))
    assert m["count"] == len(rows) == len(set(m["ids"])) and m["method"] == "pca"
    assert [{"id": i, "x": x, "y": y, "theme": t} for i, x, y, t in zip(m["ids"], m["x"], m["y"], m["theme"])] == [
        {k: r[k] for k in ("id", "x", "y", "theme")} for r in rows]
    themes = http.get("/themes").json()
    assert themes == _cli(capsys, "themes", str(idx["idx"]))
    assert sum(t["size"] for t in themes["themes"]) == m["count"] and themes["version"] == m["version"]
    assert sorted(set(m["theme"])) == list(range(themes["k"]))
    assert http.get("/themes", params={"k": 3}).json()["k"] == 3
    one = http.get("/themes/0", params={"limit": 4}).json()
    assert one["size"] == themes["themes"][0]["size"] and [p["id"] for p in one["photos"]] == [
        c["id"] for c in themes["themes"][0]["central"][:4]]
    rest = http.get("/themes/0", params={"offset": one["next_offset"], "limit": 500}).json()
    assert len(one["photos"]) + len(rest["photos"]) == one["size"] and rest["next_offset"] is None
    members = {p["id"] for p in one["photos"] + rest["photos"]}
    assert members == {i for i, t in zip(m["ids"], m["theme"]) if t == 0}
    r = http.get(f"/themes/{themes['k']}")
    assert r.status_code == 404 and "themes 0 to" in r.json()["detail"]
    assert http.get("/map", params={"method": "tsne"}).status_code == 400
    try:
        import umap  # noqa: F401
    except ImportError:  # the server says which extra brings it
        r = http.get("/map", params={"method": "umap"})
        assert r.status_code == 404 and install_hint("map") in r.json()["detail"]


def test_unusual_and_browse_agree_with_the_cli(http, idx, capsys):
    page = http.get("/unusual", params={"limit": 7}).json()
    assert page == _cli(capsys, "unusual", str(idx["idx"]), "-n", "7")
    closest = [p["closest"] for p in page["photos"]]
    assert closest == sorted(closest) and page["next_offset"] == 7
    for params, argv in [({"sort": "name"}, []), ({"sort": "-date", "limit": 5, "offset": 2},
                                                  ["--sort=-date", "-n", "5", "--offset", "2"]),
                         ({"theme": 1}, ["--theme", "1"]), ({"folder": "waves"}, ["--folder", "waves"])]:
        got = http.get("/photos", params=params).json()
        assert got == _cli(capsys, "browse", str(idx["idx"]), *argv), params
    by_folder = http.get("/photos", params={"folder": "waves", "limit": 500}).json()
    assert by_folder["total"] and all(p["path"].startswith("waves/") for p in by_folder["photos"])
    r = http.get("/photos", params={"folder": "nosuch"})
    assert r.status_code == 404 and "nosuch" in r.json()["detail"]
    assert http.get("/photos", params={"sort": "size"}).status_code == 400
    r = http.get("/photos", params={"theme": 999})  # a theme the collection lacks, as GET /themes/999
    assert r.status_code == 404 and "themes 0 to" in r.json()["detail"]
    assert http.get("/unusual", params={"limit": 0}).status_code == 400


def test_the_views_follow_an_update(http, idx):
    before = http.get("/map").json()
    Image.new("RGB", (48, 48), (20, 200, 30)).save(idx["photos"] / "green.png")
    update_index(idx["idx"], progress=False, device="cpu")
    after = http.get("/map").json()
    assert after["version"] != before["version"] and after["count"] == before["count"] + 1
    new = (set(after["ids"]) - set(before["ids"])).pop()
    assert http.get("/photos", params={"limit": 500}).json()["total"] == after["count"]
    themes = http.get("/themes").json()
    assert themes["version"] == after["version"] and sum(t["size"] for t in themes["themes"]) == after["count"]
    assert new in {p["id"] for p in http.get("/unusual", params={"limit": 500}).json()["photos"]}
    assert np.allclose(np.ptp(np.array([after["x"], after["y"]]), axis=1).max(), 1.0, atol=1e-4)
