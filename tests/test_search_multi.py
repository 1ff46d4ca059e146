"""Search with several photos through every door: `moco index search IDX a b --not c --id N`, the JSON API's
/search/multi (images, ids, negatives, a raw vector) on a real server, and `deduplicate` on the older routes; they give
the same ids, the query photos stay out of the results (one photo as several: by its very bytes or its id, unless
include_queries; a near-copy with other bytes stays a result), and each bad field is that request's own error."""

from __future__ import annotations

import base64
import concurrent.futures
import json
import shutil
from pathlib import Path

import httpx
import numpy as np
import pytest
from PIL import Image

from app.cli.commands import main
from app.server.launch import serve
from index.building.plan import file_hash
from index.building.runner import build_index
from index.search.image_index import ImageIndex
from moco.data.sample import make_sample_collection

from .live import free_port


@pytest.fixture(scope="module")
def setup(tmp_path_factory, backbone) -> dict[str, object]:
    """Generated photos (6 families x 8, one byte-identical copy, one near-copy: the same pixels as a PNG), indexed,
    served without a login."""
    tmp = tmp_path_factory.mktemp("multi")
    photos = tmp / "photos"
    make_sample_collection(photos, per_family=8, size=48, seed=7)
    families = sorted(p.name for p in photos.iterdir())
    first = sorted((photos / families[0]).glob("*.jpg"))[0]
    shutil.copyfile(first, first.with_name("copy_" + first.name))
    near = first.with_name("near_" + first.stem + ".png")
    with Image.open(first) as im:
        im.convert("RGB").save(near)  # other bytes, the same pixels: a near-copy, not the photo itself
    build_index(photos, backbone, tmp / "idx", progress=False, device="cpu", kind="flat")
    port = free_port()
    demo = serve(tmp / "idx", port=port, device="cpu", block=False)
    try:
        yield {"photos": photos, "idx": tmp / "idx", "families": families, "copy": first, "near": near,
               "url": f"http://127.0.0.1:{port}/api/v1", "root": f"http://127.0.0.1:{port}",
               "app": demo.api_service.library, "service": demo.api_service}
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


def test_one_image_alone_is_the_search_of_base64(setup, http, capsys):
    q = sorted((setup["photos"] / setup["families"][4]).glob("*.jpg"))[2]
    for keep in (False, True):  # the photo itself left out at every door alike, or kept at every door alike
        old = http.post("/search/base64", json={**_b64(q), "k": 6, "include_queries": keep}).json()["results"]
        multi = http.post("/search/multi", json={"images": [_b64(q)], "k": 6,
                                                 "include_queries": keep}).json()["results"]
        cli = _cli(capsys, setup["idx"], q, "-k", 6, *(["--include-queries"] if keep else []))
        assert [h["id"] for h in old] == [h["id"] for h in multi] == [h["id"] for h in cli] and len(cli) == 6
        assert [h["score"] for h in multi] == pytest.approx([h["score"] for h in old], abs=1e-6)
        assert (old[0]["score"] == pytest.approx(1.0, abs=1e-5)) is keep  # itself first only when asked


def test_a_raw_vector_of_the_space(setup, http):
    idx = ImageIndex.open(setup["idx"])
    some = int(idx.catalog.ok_ids()[9])
    v = idx.to_space(idx.vectors(np.array([some])))[0] * 3.0  # any length: normalized by the API
    got = http.post("/search/multi", json={"vector": v.tolist(), "k": 7}).json()["results"]
    similar = http.get(f"/photos/{some}/similar", params={"k": 7, "include_queries": True}).json()["results"]
    assert [h["id"] for h in got] == [h["id"] for h in similar]
    assert [h["score"] for h in got] == pytest.approx([h["score"] for h in similar], abs=1e-5)


def test_deduplicate_on_every_route_hides_the_copy(setup, http, capsys):
    """With the query photos kept, the copies of the photo (its byte twin, its PNG near-copy) all come back; with
    deduplicate, one of the three alike (the same pixels), at every route."""
    idx = ImageIndex.open(setup["idx"])
    copy = setup["copy"]
    alike = sorted(r.id for r in idx.catalog.rows().values() if r.path.endswith((copy.name, setup["near"].name)))
    assert len(alike) == 3
    for dedup in (False, True):
        both = {"deduplicate": dedup, "include_queries": True}
        results = [http.post("/search/base64", json={**_b64(copy), "k": 8, **both}).json(),
                   http.post("/search", files={"image": (copy.name, copy.read_bytes())},
                             data={"k": "8", **{f: str(v).lower() for f, v in both.items()}}).json(),
                   http.get(f"/photos/{alike[0]}/similar", params={"k": 8, **both}).json(),
                   http.post("/search/multi", json={"images": [_b64(copy)], "k": 8, **both}).json()]
        for r in results:
            ids = [h["id"] for h in r["results"]]
            assert len(ids) == 8 and len(set(alike) & set(ids)) == (1 if dedup else 3), (dedup, ids)
        cli = _cli(capsys, setup["idx"], copy, "-k", 8, "--include-queries", *(["--deduplicate"] if dedup else []))
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
    base64_query = schema["components"]["schemas"]["Base64Query"]["properties"]
    assert {"deduplicate", "include_queries"} <= set(base64_query)
    similar = {p["name"]: p for p in schema["paths"]["/api/v1/photos/{photo_id}/similar"]["get"]["parameters"]}
    assert {"deduplicate", "include_queries"} <= set(similar)
    form = schema["paths"]["/api/v1/search"]["post"]["requestBody"]["content"]["multipart/form-data"]["schema"]
    form = schema["components"]["schemas"][form["$ref"].rsplit("/", 1)[-1]]["properties"] if "$ref" in form else form
    for described in (base64_query["include_queries"], similar["include_queries"], multi["include_queries"],
                      form["include_queries"]):
        assert "very bytes" in described["description"], described  # what "the query photo" is, documented
    assert "POST /api/v1/search/multi" in http.get("/docs").text


def test_the_cli_refuses_a_search_without_a_photo_or_with_an_unknown_id(setup, capsys):
    idx = str(setup["idx"])
    q = str(sorted((setup["photos"] / setup["families"][0]).glob("*.jpg"))[1])
    for args, says in (([idx], "give a photo to search with"), ([idx, "--not", q], "give a photo to search with"),
                       ([idx, q, "--id", "999999"], "--id/--not-id 999999: no indexed photo"),
                       ([idx, q, "--not", "missing.jpg"], "image not found: missing.jpg")):
        assert main(["index", "search", *args]) == 2
        assert says in capsys.readouterr().err


# ------------------------------------------------------------------------------ the query photo itself
def test_one_photo_is_left_out_at_every_door_unless_asked(setup, http, capsys):
    """An indexed photo searched with its own bytes (an upload, base64, /search/multi, the CLI) or its id (/similar,
    --id) is not among its k results; with include_queries (--include-queries) it is first, score 1."""
    idx = ImageIndex.open(setup["idx"])
    q = sorted((setup["photos"] / setup["families"][2]).glob("*.jpg"))[3]
    own = idx.ids_of_files([file_hash(q)])
    assert len(own) == 1  # a photo with no copy: "itself" is one photo
    qid = own[0]
    k = 7
    for keep in (False, True):
        flag = ["--include-queries"] if keep else []
        doors = {
            "POST /search": http.post("/search", files={"image": (q.name, q.read_bytes())},
                                      data={"k": str(k), "include_queries": str(keep).lower()}).json()["results"],
            "POST /search/base64": http.post("/search/base64", json={**_b64(q), "k": k,
                                                                      "include_queries": keep}).json()["results"],
            "POST /search/multi": http.post("/search/multi", json={"images": [_b64(q)], "k": k,
                                                                    "include_queries": keep}).json()["results"],
            "GET /photos/{id}/similar": http.get(f"/photos/{qid}/similar",
                                                 params={"k": k, "include_queries": keep}).json()["results"],
            "POST /search/multi ids": http.post("/search/multi", json={"ids": [qid], "k": k,
                                                                        "include_queries": keep}).json()["results"],
            "moco index search IMAGE": _cli(capsys, setup["idx"], q, "-k", k, *flag),
            "moco index search --id": _cli(capsys, setup["idx"], "--id", qid, "-k", k, *flag),
        }
        for door, hits in doors.items():
            ids = [h["id"] for h in hits]
            assert len(ids) == k, (door, keep, ids)  # k results still: the next photo takes its place
            if keep:
                assert ids[0] == qid and hits[0]["score"] == pytest.approx(1.0, abs=1e-4), (door, hits[0])
            else:
                assert qid not in ids, (door, ids)
        # the same photos at every door: by its bytes and by its id alike
        ranked = {door: [h["id"] for h in hits] for door, hits in doors.items()}
        assert len({tuple(r) for r in ranked.values()}) == 1, ranked
    kept = http.post("/search/base64", json={**_b64(q), "k": k + 1, "include_queries": True}).json()["results"]
    left = http.post("/search/base64", json={**_b64(q), "k": k}).json()["results"]
    assert [h["id"] for h in left] == [h["id"] for h in kept][1:]  # the ranking with it, less it
    page2 = http.post("/search/base64", json={**_b64(q), "k": 3, "offset": 3}).json()["results"]
    assert [h["id"] for h in page2] == [h["id"] for h in left][3:6] and page2[0]["rank"] == 4  # pages go on alike
    n = len(idx)
    for route, body in (("/search/base64", {**_b64(q)}), ("/search/multi", {"images": [_b64(q)]})):
        end = http.post(route, json={**body, "k": 5, "offset": n - 1 - 5}).json()  # the last page: n - 1 photos
        assert len(end["results"]) == 5 and end["next_offset"] is None, route
        assert http.post(route, json={**body, "k": 5, "offset": n - 5, "include_queries": True}).json()[
            "next_offset"] is None
    end = http.get(f"/photos/{qid}/similar", params={"k": 5, "offset": n - 1 - 5}).json()
    assert len(end["results"]) == 5 and end["next_offset"] is None


def test_only_the_very_bytes_or_the_id_are_the_query_photo(setup, http, capsys):
    """The upload's byte-identical files are all "the photo itself"; its near-copy (the same pixels, other bytes) is a
    result like any other, first now; by id only that id is left out, its byte twin stays."""
    idx = ImageIndex.open(setup["idx"])
    copy = setup["copy"]
    twins = idx.ids_of_files([file_hash(copy)])
    near = idx.ids_of_files([file_hash(setup["near"])])
    assert len(twins) == 2 and len(near) == 1
    k = 6
    by_bytes = [http.post("/search", files={"image": (copy.name, copy.read_bytes())}, data={"k": str(k)}).json(),
                http.post("/search/base64", json={**_b64(copy), "k": k}).json(),
                http.post("/search/multi", json={"images": [_b64(copy)], "k": k}).json()]
    cli = _cli(capsys, setup["idx"], copy, "-k", k)
    for hits in [r["results"] for r in by_bytes] + [cli]:
        ids = [h["id"] for h in hits]
        assert len(ids) == k and not set(twins) & set(ids), ids
        assert ids[0] == near[0] and hits[0]["score"] == pytest.approx(1.0, abs=1e-4)  # the near-copy: first
    for one, other in (twins, twins[::-1]):
        ids = [h["id"] for h in http.get(f"/photos/{one}/similar", params={"k": k}).json()["results"]]
        cli_ids = [h["id"] for h in _cli(capsys, setup["idx"], "--id", one, "-k", k)]
        assert ids == cli_ids and len(ids) == k and one not in ids
        assert set(ids[:2]) == {other, near[0]}  # its byte twin is another photo: a result, with the near-copy


def test_concurrent_searches_each_leave_out_their_own_photo(setup, http):
    """Searches by id sent at once share batches; each leaves out its own photo and no other's."""
    idx, service = ImageIndex.open(setup["idx"]), setup["service"]
    asked = [int(i) for i in idx.catalog.ok_ids()[10:34]]
    alone = {i: [h["id"] for h in http.get(f"/photos/{i}/similar", params={"k": 5}).json()["results"]] for i in asked}
    kept = {i: [h["id"] for h in http.get(f"/photos/{i}/similar", params={"k": 6, "include_queries": True}).json()[
        "results"]] for i in asked}
    before = len(service.search.batcher.batch_sizes)
    with httpx.Client(timeout=60) as client, concurrent.futures.ThreadPoolExecutor(len(asked)) as pool:
        replies = list(pool.map(lambda i: client.get(f"{setup['url']}/photos/{i}/similar", params={"k": 5}).json(),
                                asked))
    assert max(service.search.batcher.batch_sizes[before:]) > 1  # they were batched together
    for i, r in zip(asked, replies):
        ids = [h["id"] for h in r["results"]]
        assert ids == alone[i] and i not in ids and len(ids) == 5
        assert ids == [j for j in kept[i] if j != i][:5]  # only its own photo is gone


def test_the_page_leaves_the_photo_out_and_says_so(setup, tmp_path):
    """The page's Search (the handler, and through Gradio's API as a browser's upload goes, batched by the service),
    a click on a result and a search from a photo of the map leave the photo itself out, and say so."""
    from gradio_client import Client, handle_file

    app = setup["app"]
    idx = app.ready_index()
    q = sorted((setup["photos"] / setup["families"][3]).glob("*.jpg"))[1]
    qid = idx.ids_of_files([file_hash(q)])[0]
    left_out = "the photo itself is left out"
    _, info, state = app.search(str(q), k=6)
    assert len(state.ids) == 6 and qid not in state.ids and left_out in info
    _, _, further = app.more(state)  # More: still without it
    assert len(further.ids) == 12 and qid not in further.ids and further.ids[:6] == state.ids
    gallery, shown, *_ = Client(setup["root"], verbose=False, download_files=False).predict(
        handle_file(str(q)), 6, "", api_name="/search")
    assert [g["caption"] for g in gallery] == [c for _, c in app._gallery(state)] and left_out in shown
    rel = q.relative_to(setup["photos"]).as_posix()
    assert not [g for g in gallery if g["caption"].endswith(" · " + rel)]
    _, info, clicked = app.select(state, 0)  # a click on a result searches with it, without it
    assert state.ids[0] not in clicked.ids and len(clicked.ids) == 6 and left_out in info
    _, info, mapped = app.search_id(qid, k=6)  # a point of the map, a photo of a theme
    assert mapped.ids == state.ids and left_out in info  # its stored vector: the upload's ranking
    assert mapped.ids == idx.search(idx.vectors(np.array([qid])), k=6, exclude_ids=[qid]).ids[0].tolist()
    new = tmp_path / "new.png"  # a photo the collection does not hold: nothing to leave out, nothing said
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (64, 64, 3), np.uint8)).save(new)
    _, info, fresh = app.search(str(new), k=6)
    assert len(fresh.ids) == 6 and left_out not in info
