"""Search with several photos through every door: `moco index search IDX a b --not c --id N`, the JSON API's
/search/multi (images, ids, negatives, a raw vector) on a real server, and `deduplicate` on the older routes; they give
the same ids, the query photos stay out of the results, and each bad field is that request's own error."""

from __future__ import annotations

import base64
import json
import shutil
from pathlib import Path

import httpx
import numpy as np
import pytest

from app.cli.commands import main
from app.server.launch import serve
from index.build.runner import build_index
from index.image_index import ImageIndex
from moco.data.sample import make_sample_collection

from .live import free_port


@pytest.fixture(scope="module")
def setup(tmp_path_factory, backbone) -> dict[str, object]:
    """Generated photos (6 families x 8, one byte-identical copy), indexed, served without a login."""
    tmp = tmp_path_factory.mktemp("multi")
    photos = tmp / "photos"
    make_sample_collection(photos, per_family=8, size=48, seed=7)
    families = sorted(p.name for p in photos.iterdir())
    first = sorted((photos / families[0]).glob("*.jpg"))[0]
    shutil.copyfile(first, first.with_name("copy_" + first.name))
    build_index(photos, backbone, tmp / "idx", progress=False, device="cpu", kind="flat")
    port = free_port()
    demo = serve(tmp / "idx", port=port, device="cpu", block=False)
    try:
        yield {"photos": photos, "idx": tmp / "idx", "families": families, "copy": first,
               "url": f"http://127.0.0.1:{port}/api/v1"}
    finally:
        demo.close()
        demo.api_service.close()


@pytest.fixture()
def http(setup):
    with httpx.Client(base_url=setup["url"], timeout=60) as client:
        yield client


def _b64(path: Path) -> dict[str, str]:
    return {"image_base64": base64.b64encode(path.read_bytes()).decode(), "filename": path.name}


def _cli(capsys, *args: str) -> list[dict]:
    assert main(["index", "search", *map(str, args), "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_the_api_and_the_cli_agree_and_leave_the_queries_out(setup, http, capsys):
    photos, idx_dir, fam = setup["photos"], setup["idx"], setup["families"]
    a = sorted((photos / fam[1]).glob("*.jpg"))[:2]
    c = sorted((photos / fam[2]).glob("*.jpg"))[0]
    idx = ImageIndex.open(idx_dir)
    rows = {r.path: r.id for r in idx.catalog.rows().values()}
    by_id = rows[f"{fam[1]}/" + sorted(p.name for p in (photos / fam[1]).glob("*.png"))[0]]
    not_id = rows[f"{fam[3]}/" + sorted(p.name for p in (photos / fam[3]).glob("*.jpg"))[0]]
    cli = _cli(capsys, idx_dir, *a, "--not", c, "--id", by_id, "--not-id", not_id, "-k", 10)
    api = http.post("/search/multi", json={"images": [_b64(p) for p in a], "ids": [by_id], "not_images": [_b64(c)],
                                           "not_ids": [not_id], "k": 10}).json()
    assert [h["id"] for h in api["results"]] == [h["id"] for h in cli] and len(cli) == 10
    assert [h["score"] for h in api["results"]] == pytest.approx([h["score"] for h in cli], abs=1e-5)
    queries = {rows[f"{fam[1]}/{p.name}"] for p in a} | {rows[f"{fam[2]}/{c.name}"], by_id, not_id}
    assert not queries & {h["id"] for h in cli}  # the query photos (found by their bytes, or by id) are left out
    # ... the same query from the library: features of the images, then of the ids, in the index's space
    emb = idx.load_embedder()
    pos = np.concatenate([idx.embed_queries(a, emb), idx.vectors(np.array([by_id]))])
    neg = np.concatenate([idx.embed_queries([c], emb), idx.vectors(np.array([not_id]))])
    hits = idx.search(idx.query_vector(pos, neg), k=10, centred=True, exclude_ids=sorted(queries))
    assert hits.ids[0].tolist() == [h["id"] for h in cli]
    # include_queries keeps them: the photos searched with come back among the best
    kept = http.post("/search/multi", json={"images": [_b64(p) for p in a], "ids": [by_id], "k": 5,
                                            "include_queries": True}).json()
    assert queries - {rows[f"{fam[2]}/{c.name}"], not_id} <= {h["id"] for h in kept["results"]}
    cli_kept = _cli(capsys, idx_dir, *a, "--id", by_id, "-k", 5, "--include-queries")
    assert [h["id"] for h in cli_kept] == [h["id"] for h in kept["results"]]


def test_one_image_alone_is_the_search_of_always(setup, http, capsys):
    q = sorted((setup["photos"] / setup["families"][4]).glob("*.jpg"))[2]
    old = http.post("/search/base64", json={**_b64(q), "k": 6}).json()["results"]
    multi = http.post("/search/multi", json={"images": [_b64(q)], "k": 6}).json()["results"]
    cli = _cli(capsys, setup["idx"], q, "-k", 6)
    assert [h["id"] for h in old] == [h["id"] for h in multi] == [h["id"] for h in cli]
    assert [h["score"] for h in multi] == pytest.approx([h["score"] for h in old], abs=1e-6)
    assert old[0]["score"] == pytest.approx(1.0, abs=1e-5)  # itself first, as always


def test_a_raw_vector_of_the_space(setup, http):
    idx = ImageIndex.open(setup["idx"])
    some = int(idx.catalog.ok_ids()[9])
    v = idx.center(idx.vectors(np.array([some])))[0] * 3.0  # any length: normalized by the API
    got = http.post("/search/multi", json={"vector": v.tolist(), "k": 7}).json()["results"]
    similar = http.get(f"/photos/{some}/similar", params={"k": 7}).json()["results"]
    assert [h["id"] for h in got] == [h["id"] for h in similar]
    assert [h["score"] for h in got] == pytest.approx([h["score"] for h in similar], abs=1e-5)


def test_deduplicate_on_every_route_hides_the_copy(setup, http, capsys):
    idx = ImageIndex.open(setup["idx"])
    copy = setup["copy"]
    twins = sorted(r.id for r in idx.catalog.rows().values() if r.path.endswith(copy.name))
    assert len(twins) == 2
    for dedup in (False, True):
        results = [http.post("/search/base64", json={**_b64(copy), "k": 8, "deduplicate": dedup}).json(),
                   http.post("/search", files={"image": (copy.name, copy.read_bytes())},
                             data={"k": "8", "deduplicate": str(dedup).lower()}).json(),
                   http.get(f"/photos/{twins[0]}/similar", params={"k": 8, "deduplicate": dedup}).json(),
                   http.post("/search/multi", json={"images": [_b64(copy)], "k": 8, "deduplicate": dedup}).json()]
        for r in results:
            ids = [h["id"] for h in r["results"]]
            assert len(ids) == 8 and len(set(twins) & set(ids)) == (1 if dedup else 2), (dedup, ids)
        cli = _cli(capsys, setup["idx"], copy, "-k", 8, *(["--deduplicate"] if dedup else []))
        assert [h["id"] for h in cli] == [h["id"] for h in results[-1]["results"]]


def test_bad_fields_are_each_requests_own_400_or_404(setup, http):
    q = _b64(sorted((setup["photos"] / setup["families"][0]).glob("*.jpg"))[1])
    dim = http.get("/stats").json()["dim"]
    for body, code, says in (
        ({"k": 5}, 400, "needs a photo to search with"),
        ({"not_ids": [0], "k": 5}, 400, "needs a photo to search with"),
        ({"ids": [999999], "k": 5}, 404, "999999"),
        ({"images": [q, {"image_base64": "***", "filename": "b.jpg"}]}, 400, "images"),
        ({"images": [q], "not_images": [{"image_base64": "QUJD", "filename": "n.jpg"}]}, 400, "n.jpg"),
        ({"vector": [0.0] * dim}, 400, "all zeros"),
        ({"vector": [1.0] * (dim - 1)}, 400, f"give {dim} numbers"),
        ({"vector": [1.0] * dim, "ids": [0]}, 400, "without images"),
        ({"ids": [-1]}, 400, "ids"),
        ({"images": [q], "k": 0}, 400, "k"),
        ({"images": [q], "folder": "no-such-folder"}, 404, "no-such-folder"),
    ):
        r = http.post("/search/multi", json=body)
        assert r.status_code == code and says in r.json()["detail"], (body, r.status_code, r.text)
    assert http.post("/search/multi", json={"images": [q], "k": 3}).status_code == 200  # the server still answers


def test_the_routes_are_in_the_schema(http):
    schema = http.get("/openapi.json").json()
    assert "/api/v1/search/multi" in schema["paths"]
    multi = schema["components"]["schemas"]["MultiQuery"]["properties"]
    assert {"images", "ids", "not_images", "not_ids", "vector", "k", "folder", "exclude_folders", "taken_from",
            "taken_to", "offset", "deduplicate", "include_queries"} == set(multi)
    assert "deduplicate" in schema["components"]["schemas"]["Base64Query"]["properties"]
    similar = {p["name"] for p in schema["paths"]["/api/v1/photos/{photo_id}/similar"]["get"]["parameters"]}
    assert "deduplicate" in similar
    assert "POST /api/v1/search/multi" in http.get("/docs").text


def test_the_cli_refuses_a_search_without_a_photo_or_with_an_unknown_id(setup, capsys):
    idx = str(setup["idx"])
    q = str(sorted((setup["photos"] / setup["families"][0]).glob("*.jpg"))[1])
    for args, says in (([idx], "give a photo to search with"), ([idx, "--not", q], "give a photo to search with"),
                       ([idx, q, "--id", "999999"], "--id/--not-id 999999: no indexed photo"),
                       ([idx, q, "--not", "missing.jpg"], "image not found: missing.jpg")):
        assert main(["index", "search", *args]) == 2
        assert says in capsys.readouterr().err
