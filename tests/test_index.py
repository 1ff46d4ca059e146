"""Index build/update/search/stats/dedup through the real CLI, on generated photos with a real backbone."""

from __future__ import annotations

import json
import shutil
import sqlite3
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from app.cli.commands import main
from index.building.plan import file_hash
from index.search.image_index import ImageIndex
from moco.data.sample import make_sample_collection
from moco.embed import Embedder, center

from .conftest import random_backbone


@pytest.fixture()
def photos(tmp_path) -> Path:
    root = tmp_path / "photos"
    make_sample_collection(root, per_family=6, size=48, seed=3)
    (root / "broken.jpg").write_bytes(b"\xff\xd8\xff\xe0 not really a jpeg")
    (root / "empty.png").write_bytes(b"")
    (root / "notes.txt").write_text("not an image: ignored, not an error")
    return root


def _build(photos: Path, backbone: Path, out: Path, *extra: str) -> int:
    return main(["index", "build", str(photos), "--backbone", str(backbone), "-o", str(out), "--quiet",
                 "--batch-size", "8", *extra])


def _catalog(index_dir: Path) -> dict[str, tuple[int, np.ndarray | None, str, str | None]]:
    """path -> (id, vector, status, error), read straight from the SQLite file."""
    db = sqlite3.connect(index_dir / "catalog.sqlite")
    rows = db.execute("SELECT i.path, i.id, v.vector, i.status, i.error FROM images i "
                      "LEFT JOIN vectors v ON v.id = i.id WHERE i.deleted = 0").fetchall()
    db.close()
    return {p: (i, None if v is None else np.frombuffer(v, np.float32), s, e) for p, i, v, s, e in rows}


def _json_out(capsys) -> object:
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_build_search_stats_against_numpy(photos, backbone, tmp_path, capsys):
    out = tmp_path / "idx"
    assert _build(photos, backbone, out, "--json") == 0
    summary = _json_out(capsys)
    assert summary["embedded"] == 36 and summary["vectors"] == 36 and summary["kind"] == "flat"
    reasons = {e["path"]: e["reason"] for e in summary["errors"]}
    assert set(reasons) == {"broken.jpg", "empty.png"}, reasons
    assert "empty" in reasons["empty.png"] and reasons["broken.jpg"]
    meta = json.loads((out / "index.json").read_text())
    emb = Embedder.load(backbone, device="cpu")
    assert meta["backbone_sha256"] == emb.sha256 and meta["dim"] == 512 and meta["recall_at_10"] == 1.0
    cat = _catalog(out)
    assert cat["broken.jpg"][2] == "error" and cat["broken.jpg"][1] is None
    ok = {p: v for p, (_, v, s, _) in cat.items() if s == "ok"}
    # the stored vector is exactly what the library's Embedder gives for that file
    some = sorted(ok)[5]
    np.testing.assert_allclose(ok[some], emb.embed(photos / some)[0], atol=1e-5)
    # thumbnails: one per indexed image, at most 256 px, inside thumbs/
    idx = ImageIndex.open(out)
    for row in idx.catalog.rows().values():
        if row.status == "ok":
            with Image.open(idx.thumb_path(row)) as im:
                assert max(im.size) <= 256 and idx.thumb_path(row).parent == out / "thumbs"
    # search equals numpy brute force over the catalog's vectors, centred on the stored collection mean
    ids = np.array([cat[p][0] for p in sorted(ok)])
    mean = np.array(meta["mean"], np.float32)  # D
    mat = center(np.stack([ok[p] for p in sorted(ok)]), mean)  # N x D
    q = emb.embed([photos / sorted(ok)[0], photos / sorted(ok)[20]])  # 2 x D, raw: search centres them
    hits = idx.search(q, k=7)
    sim = center(q, mean) @ mat.T  # 2 x N
    ref = np.argsort(-sim, axis=1, kind="stable")[:, :7]
    np.testing.assert_allclose(hits.scores, np.take_along_axis(sim, ref, 1), atol=1e-5)
    assert [set(r) for r in hits.ids] == [set(r) for r in ids[ref]]
    assert hits.paths[0][0] == sorted(ok)[0] and hits.scores[0, 0] == pytest.approx(1.0, abs=1e-5)
    # paging and the sub-folder filter
    page2 = idx.search(q[:1], k=3, offset=3)
    np.testing.assert_array_equal(page2.ids[0], hits.ids[0, 3:6])
    family = sorted(ok)[30].split("/")[0]
    only = idx.search(q[:1], k=50, folder=family)
    assert only.paths[0] and all(p.startswith(family + "/") for p in only.paths[0])
    assert len(only.paths[0]) == sum(p.startswith(family + "/") for p in ok)
    # the CLI search and stats
    assert main(["index", "search", str(out), str(photos / sorted(ok)[0]), "-k", "3", "--json",
                 "--include-queries"]) == 0
    res = _json_out(capsys)
    assert [r["path"] for r in res] == hits.paths[0][:3] and res[0]["rank"] == 1
    assert main(["index", "search", str(out), str(photos / sorted(ok)[0]), "-k", "3", "--json"]) == 0
    itself = set(idx.ids_of_files([file_hash(photos / sorted(ok)[0])]))  # the photo (and its byte twins): left out
    res = _json_out(capsys)
    assert [r["path"] for r in res] == [p for i, p in zip(hits.ids[0], hits.paths[0]) if i not in itself][:3]
    assert itself and res[0]["rank"] == 1 and not itself & {r["id"] for r in res}
    assert main(["index", "stats", str(out), "--json"]) == 0
    st = _json_out(capsys)
    assert st["vectors"] == 36 and st["error"] == 2 and st["backbone_sha256"] == emb.sha256
    assert st["size_on_disk_bytes"] > 0 and len(st["errors"]) == 2


def _state(index_dir: Path) -> dict[str, np.ndarray]:
    return {p: v for p, (_, v, s, _) in _catalog(index_dir).items() if s == "ok"}


def test_update_add_modify_delete_rename_copy(photos, backbone, tmp_path, capsys):
    out = tmp_path / "idx"
    assert _build(photos, backbone, out) == 0
    before = _catalog(out)
    names = sorted(p for p, r in before.items() if r[2] == "ok")
    moved_from, changed, deleted, copied = names[0], names[1], names[2], names[3]
    (photos / "trips").mkdir()
    shutil.move(photos / moved_from, photos / "trips" / Path(moved_from).name)
    with Image.open(photos / changed) as im:
        im.transpose(Image.Transpose.FLIP_TOP_BOTTOM).save(photos / changed)
    (photos / deleted).unlink()
    shutil.copyfile(photos / copied, photos / "trips" / ("copy_" + Path(copied).name))
    Image.new("RGB", (40, 30), (200, 30, 30)).save(photos / "trips" / "red.png")
    capsys.readouterr()
    assert main(["index", "update", str(out), "--quiet", "--json"]) == 0
    s = _json_out(capsys)
    assert (s["embedded"], s["reembedded"], s["moved"], s["copied"], s["removed"]) == (1, 1, 1, 1, 1), s
    after = _catalog(out)
    moved_to = "trips/" + Path(moved_from).name
    assert after[moved_to][0] == before[moved_from][0]  # a move keeps its id and vector
    np.testing.assert_array_equal(after[moved_to][1], before[moved_from][1])
    assert after[changed][0] == before[changed][0]  # a changed file keeps its id, with a new vector
    assert not np.allclose(after[changed][1], before[changed][1])
    assert deleted not in after and moved_from not in after
    assert after["trips/copy_" + Path(copied).name][0] not in {r[0] for r in before.values()}  # new id
    assert not (out / "thumbs" / f"{before[deleted][0]}.jpg").exists()
    # the result equals a clean build of the final folder
    assert _build(photos, backbone, tmp_path / "clean") == 0
    clean, updated = _state(tmp_path / "clean"), _state(out)
    assert set(clean) == set(updated)
    for p in clean:
        np.testing.assert_allclose(updated[p], clean[p], atol=1e-5)
    q = Embedder.load(backbone, device="cpu").embed(photos / changed)
    for folder in (out, tmp_path / "clean"):  # an update keeps its mean until the collection grows by half
        hits, state = ImageIndex.open(folder).search(q, k=10), _state(folder)
        mean = np.array(json.loads((folder / "index.json").read_text())["mean"], np.float32)
        paths = sorted(state)
        sim = (center(q, mean) @ center(np.stack([state[p] for p in paths]), mean).T)[0]  # N
        order = np.argsort(-sim, kind="stable")[:10]
        np.testing.assert_allclose(hits.scores[0], sim[order], atol=1e-5)
        assert hits.paths[0][0] == changed  # (identical copies tie, so only the scores are compared below it)
    # nothing changed: nothing embedded
    assert main(["index", "update", str(out), "--quiet", "--json"]) == 0
    s = _json_out(capsys)
    assert s["embedded"] + s["reembedded"] + s["moved"] + s["removed"] == 0 and s["unchanged"] == 39


@pytest.mark.parametrize("kind", ["ivf", "hnsw", "ivfpq"])
def test_approximate_kinds_build_and_update(photos, backbone, tmp_path, capsys, kind):
    out = tmp_path / "idx"
    assert _build(photos, backbone, out, "--kind", kind) == 0
    meta = json.loads((out / "index.json").read_text())
    assert meta["kind"] == kind and meta["params"] and 0 <= meta["recall_at_10"] <= 1
    victim = sorted(_state(out))[4]
    (photos / victim).unlink()  # hnsw and ivfpq cannot remove in place: the update rebuilds them
    assert main(["index", "update", str(out), "--quiet", "--json"]) == 0
    assert _json_out(capsys)["vectors"] == 35
    idx = ImageIndex.open(out)
    assert idx.store.kind == kind and len(idx) == 35
    hits = idx.search(idx.vectors(np.array([idx.catalog.rows()[sorted(_state(out))[0]].id])), k=35)
    assert victim not in hits.paths[0]


def test_backbone_mismatch_and_bad_input_are_refused(photos, backbone, tmp_path, capsys):
    out = tmp_path / "idx"
    assert _build(photos, backbone, out) == 0
    other = random_backbone(tmp_path, seed=1)
    capsys.readouterr()
    assert main(["index", "update", str(out), "--backbone", str(other)]) == 2
    assert "rebuild" in capsys.readouterr().err
    img = str(photos / sorted(_state(out))[0])
    assert main(["index", "search", str(out), img, "--backbone", str(other)]) == 2
    assert "rebuild" in capsys.readouterr().err
    other_photos = tmp_path / "other_photos"
    make_sample_collection(other_photos, per_family=1, size=32)
    assert _build(other_photos, backbone, out) == 2  # another collection into the same directory
    assert "already indexes" in capsys.readouterr().err
    assert _build(photos, backbone, photos / "idx") == 2  # inside the photos: would index its own thumbnails
    assert main(["index", "search", str(tmp_path / "nothing"), img]) == 2
    assert "not an index directory" in capsys.readouterr().err
    missing = tmp_path / "missing"
    assert main(["index", "build", str(missing), "--backbone", str(backbone), "-o", str(tmp_path / "x")]) == 2
    assert main(["index", "build", str(photos), "--backbone", str(tmp_path / "nope.safetensors"), "-o",
                 str(tmp_path / "y")]) == 2
    assert "not found" in capsys.readouterr().err
    assert main(["index", "search", str(out), img, "-k", "0"]) == 2


def test_dedup_finds_planted_duplicates(photos, backbone, tmp_path, capsys):
    names = sorted(p.relative_to(photos).as_posix() for p in photos.rglob("*.jpg") if p.name != "broken.jpg")
    a, b = names[0], names[10]
    shutil.copyfile(photos / a, photos / "dup_exact.jpg")
    with Image.open(photos / b) as im:
        im.resize((96, 96), Image.Resampling.BICUBIC).save(photos / "dup_resized.png")  # same scene, other size
    out = tmp_path / "idx"
    assert _build(photos, backbone, out) == 0
    capsys.readouterr()
    assert main(["index", "dedup", str(out), "--threshold", "0.995", "--json"]) == 0
    groups = _json_out(capsys)
    sets = [{m["path"] for m in g["members"]} for g in groups]
    assert {a, "dup_exact.jpg"} in [s & {a, "dup_exact.jpg"} for s in sets]
    assert any({b, "dup_resized.png"} <= s for s in sets)
    saved = json.loads((out / "dedup.json").read_text())
    assert saved["threshold"] == 0.995 and saved["groups"] == groups
    # brute-force reference: every member within the threshold of its group's representative, and no pair at
    # >= threshold left with both photos ungrouped
    state = _state(out)
    paths = sorted(state)
    mat = center(np.stack([state[p] for p in paths]), json.loads((out / "index.json").read_text())["mean"])
    sim = mat @ mat.T  # centred cosines, as dedup uses
    pos = {p: n for n, p in enumerate(paths)}
    for g in groups:
        rep = pos[g["representative"]["path"]]
        assert g["members"][0]["path"] == paths[rep]
        assert all(sim[rep, pos[m["path"]]] >= 0.995 - 1e-5 for m in g["members"])
    group_of = {p: n for n, s in enumerate(sets) for p in s}
    for i, j in zip(*np.nonzero(np.triu(sim, 1) >= 0.995)):
        assert paths[i] in group_of or paths[j] in group_of


def test_auto_falls_back_to_flat_when_vectors_do_not_cluster(tmp_path, monkeypatch):
    """auto picks IVF above EXACT_UP_TO; on uniform noise IVF must scan most lists, so flat is kept instead."""
    from index.building.sync import sync_store as _sync_store
    from index.catalog import Catalog, Row, catalog_meta
    from index.search import store as store_mod

    monkeypatch.setattr(store_mod, "EXACT_UP_TO", 1000)
    out = tmp_path / "idx"
    out.mkdir()
    cat = Catalog(out / "catalog.sqlite", create=True)
    rng = np.random.default_rng(0)
    vecs = rng.standard_normal((4000, 64)).astype(np.float32)
    vecs /= np.linalg.norm(vecs, axis=1, keepdims=True)
    with cat.transaction() as db:
        for i, v in enumerate(vecs):
            cat.put(db, Row(i, f"{i}.jpg", 1, 1, str(i), "ok"), v)
    for key, value in dict(root=str(tmp_path), backbone_path="b", backbone_sha256="s", backbone={}, dim=64,
                           kind="auto", memory_budget=1 << 30).items():
        cat.set_meta(key, json.dumps(value))
    store = _sync_store(out, cat, catalog_meta(cat), "no")
    assert store.kind == "flat" and store.ntotal == 4000
    assert catalog_meta(cat)["flat_until"] == 8000
    assert json.loads((out / "index.json").read_text())["kind"] == "flat"
    assert _sync_store(out, cat, catalog_meta(cat), "no").kind == "flat"  # remembered: no IVF attempt again


def test_search_in_an_unknown_folder_is_refused_as_the_api_refuses_it(photos, backbone, tmp_path, capsys):
    """Issue 39: `moco index search --folder nosuch` exited 0 with "no results" where the API answers 400."""
    out = tmp_path / "idx"
    assert _build(photos, backbone, out) == 0
    img = str(photos / sorted(_state(out))[0])
    family = sorted(_state(out))[0].split("/")[0]
    capsys.readouterr()
    assert main(["index", "search", str(out), img, "--folder", "nosuch"]) == 2
    err = capsys.readouterr().err
    assert "no sub-folder 'nosuch' in the collection" in err and family in err  # the API's words, and what exists
    assert main(["index", "search", str(out), img, "--folder", f"/{family}/", "--json"]) == 0  # as the API strips it
    hits = _json_out(capsys)
    assert hits and all(h["path"].startswith(f"{family}/") for h in hits)
