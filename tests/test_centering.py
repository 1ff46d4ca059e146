"""Centred scores: the index subtracts the collection's mean embedding, so unrelated photos score near 0."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from index.building.runner import build_index, update_index
from index.duplicates.dedup import find_duplicates
from index.search.image_index import ImageIndex
from index.search.store import VectorStore
from moco.data.sample import make_sample_collection
from moco.embed import Embedder, center


@pytest.fixture(scope="module")
def built(sample_photos, backbone, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("centred") / "idx"
    build_index(sample_photos, backbone, out, progress=False, device="cpu")
    return out


def _raw(idx: ImageIndex) -> tuple[np.ndarray, np.ndarray]:
    return idx.catalog.vectors(dim=idx.dim)  # N, N x D (raw, L2-normalized)


def test_median_cosine_drops_to_near_zero_and_top1_mostly_kept(built):
    idx = ImageIndex.open(built)
    ids, raw = _raw(idx)
    hits = idx.search(raw, k=len(ids))  # every query against the whole collection
    own = hits.ids == ids[:, None]
    centred_median = float(np.median(hits.scores[~own]))
    raw_cos = raw @ raw.T  # N x N
    raw_median = float(np.median(raw_cos[~np.eye(len(ids), dtype=bool)]))
    assert raw_median > 0.5  # the narrow cone of pooled ReLU features
    assert abs(centred_median) < 0.1
    np.fill_diagonal(raw_cos, -np.inf)
    raw_top1 = ids[raw_cos.argmax(1)]
    centred_top1 = np.array([row[row != i][0] for row, i in zip(hits.ids, ids)])
    assert (raw_top1 == centred_top1).mean() >= 0.5


def test_search_equals_brute_force_on_centred_vectors(built):
    idx = ImageIndex.open(built)
    ids, raw = _raw(idx)
    meta = json.loads((built / "index.json").read_text())
    assert meta["mean_count"] == len(ids)
    np.testing.assert_allclose(meta["mean"], raw.mean(0), atol=1e-6)
    c = center(raw, raw.mean(0))
    ref = c[:7] @ c.T  # 7 x N
    hits = idx.search(raw[:7], k=5)
    order = np.argsort(-ref, axis=1, kind="stable")[:, :5]
    np.testing.assert_allclose(hits.scores, np.take_along_axis(ref, order, 1), atol=1e-5)
    assert (hits.ids == ids[order]).mean() > 0.95  # ties aside
    # vectors() returns raw vectors, which search() accepts: re-searching with a result finds it first
    again = idx.search(idx.vectors(hits.ids[:, 0]), k=1)
    np.testing.assert_array_equal(again.ids[:, 0], hits.ids[:, 0])


def _copy_photos(src: Path, dst: Path, names: list[str]) -> None:
    for n in names:
        (dst / n).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(src / n, dst / n)


def test_mean_recomputed_on_rebuild_and_after_half_growth_only(sample_photos, backbone, tmp_path):
    names = sorted(str(p.relative_to(sample_photos)) for p in sample_photos.rglob("*") if p.is_file())
    photos, out = tmp_path / "photos", tmp_path / "idx"
    _copy_photos(sample_photos, photos, names[:20])
    build_index(photos, backbone, out, progress=False, device="cpu")
    meta = lambda: json.loads((out / "index.json").read_text())  # noqa: E731
    assert meta()["mean_count"] == 20
    first = meta()["mean"]
    _copy_photos(sample_photos, photos, names[20:22])  # +10%: the mean stays
    update_index(out, progress=False, device="cpu")
    assert meta()["mean_count"] == 20 and meta()["mean"] == first
    idx = ImageIndex.open(out)
    ids, raw = _raw(idx)
    c = center(raw, np.asarray(first, np.float32))
    hits = idx.search(raw, k=1)  # the added vectors are centred on the stored mean too
    np.testing.assert_allclose(hits.scores[:, 0], (c * c).sum(1), atol=1e-5)
    _copy_photos(sample_photos, photos, names[22:30])  # 30 >= 1.5 x 20: recomputed, every vector re-added
    update_index(out, progress=False, device="cpu")
    ids, raw = _raw(ImageIndex.open(out))
    assert meta()["mean_count"] == 30
    np.testing.assert_allclose(meta()["mean"], raw.mean(0), atol=1e-6)
    hits = ImageIndex.open(out).search(raw, k=1)
    np.testing.assert_array_equal(hits.ids[:, 0], ids)
    np.testing.assert_allclose(hits.scores[:, 0], 1.0, atol=1e-5)
    (out / "index.faiss").unlink()  # a rebuild from the catalog recomputes it
    _copy_photos(sample_photos, photos, names[30:33])
    update_index(out, progress=False, device="cpu")
    assert meta()["mean_count"] == 33


def test_an_update_killed_between_its_two_writes_stays_consistent_then_finishes(sample_photos, backbone, tmp_path):
    """index.faiss is replaced before index.json: a kill in between must not pair new vectors with the old mean."""
    names = sorted(str(p.relative_to(sample_photos)) for p in sample_photos.rglob("*") if p.is_file())
    photos, out = tmp_path / "photos", tmp_path / "idx"
    _copy_photos(sample_photos, photos, names[:20])
    build_index(photos, backbone, out, progress=False, device="cpu")
    old_json = (out / "index.json").read_bytes()
    _copy_photos(sample_photos, photos, names[20:32])  # grows by more than half: a new mean, all vectors re-added
    update_index(out, progress=False, device="cpu")
    new_mean = json.loads((out / "index.json").read_text())["mean"]
    (out / "index.json").write_bytes(old_json)  # as if killed after index.faiss was replaced
    idx = ImageIndex.open(out)  # still searchable, and consistent: the mean travels inside index.faiss
    np.testing.assert_allclose(idx.mean, new_mean, atol=1e-7)
    ids, raw = _raw(idx)
    np.testing.assert_allclose(idx.search(raw, k=1).scores[:, 0], 1.0, atol=1e-5)
    update_index(out, progress=False, device="cpu")  # the same command finishes it
    assert json.loads((out / "index.json").read_text())["mean"] == new_mean


def test_weak_below_in_index_json_stats_and_search_json(built, sample_photos, capsys):
    from app.cli.commands import main

    meta = json.loads((built / "index.json").read_text())
    assert isinstance(meta["weak_below"], float) and -1 < meta["weak_below"] < 1
    assert ImageIndex.open(built).stats()["weak_below"] == meta["weak_below"]
    assert main(["index", "stats", str(built), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["weak_below"] == meta["weak_below"]
    query = next(p for p in sorted(sample_photos.rglob("*.jpg")))
    assert main(["index", "search", str(built), str(query), "-k", "48", "--json", "--include-queries"]) == 0
    hits = json.loads(capsys.readouterr().out)
    assert [h["weak"] for h in hits] == [h["score"] < meta["weak_below"] for h in hits]
    assert not hits[0]["weak"] and hits[-1]["weak"]  # itself first; the far end of the collection is weak


def test_old_index_without_mean_opens_uncentred_until_update(sample_photos, backbone, tmp_path):
    out = tmp_path / "idx"
    build_index(sample_photos, backbone, out, progress=False, device="cpu")
    ids, raw = _raw(ImageIndex.open(out))
    meta = json.loads((out / "index.json").read_text())
    for key in ("mean", "mean_count", "weak_below"):
        meta.pop(key)
    (out / "index.json").write_text(json.dumps(meta))
    old = VectorStore.create("flat", raw.shape[1], len(ids), "no")  # what an index from before held: raw vectors
    old.add(ids, raw)
    old.save(out / "index.faiss", meta["index_id"])
    idx = ImageIndex.open(out)
    assert idx.mean is None and idx.stats()["centred"] is False and idx.weak_below is None
    hits = idx.search(raw[:3], k=3)
    np.testing.assert_allclose(hits.scores, np.sort(raw[:3] @ raw.T, axis=1)[:, ::-1][:, :3], atol=1e-5)
    update_index(out, progress=False, device="cpu")  # nothing changed on disk, yet it centres the index
    idx = ImageIndex.open(out)
    assert idx.stats()["centred"] is True and idx.stats()["mean_count"] == len(ids)
    c = center(raw, raw.mean(0))
    np.testing.assert_allclose(idx.search(raw[:3], k=3).scores, np.sort(c[:3] @ c.T, axis=1)[:, ::-1][:, :3],
                               atol=1e-5)


def test_embedder_takes_an_optional_mean(backbone, sample_photos):
    emb = Embedder.load(backbone, device="cpu")
    paths = sorted(sample_photos.rglob("*.jpg"))[:4]
    raw = emb.embed(paths)
    mean = raw.mean(0)
    np.testing.assert_allclose(emb.embed(paths, mean=mean), center(raw, mean), atol=1e-5)
    np.testing.assert_allclose(np.linalg.norm(raw, axis=1), 1.0, atol=1e-5)  # raw output by default


def test_dedup_groups_copies_but_not_a_family(backbone, tmp_path):
    photos = tmp_path / "photos"
    make_sample_collection(photos, per_family=8, size=96, seed=0)
    copies = {}
    for fam in ("mountains", "sunset"):
        src = photos / fam / f"{fam}_001.jpg"
        im = Image.open(src).convert("RGB")
        w, h = im.size
        im.resize((w // 2, h // 2)).save(photos / fam / "copy_small.jpg", quality=90)
        im.save(photos / fam / "copy_q60.jpg", quality=60)
        im.crop((w // 40, h // 40, w - w // 40, h - h // 40)).save(photos / fam / "copy_crop.jpg", quality=90)  # 95%
        copies[fam] = {f"{fam}/{fam}_001.jpg"} | {f"{fam}/copy_{n}.jpg" for n in ("small", "q60", "crop")}
    build_index(photos, backbone, tmp_path / "idx", progress=False, device="cpu")
    groups = [{m.path for m in g.members} for g in find_duplicates(ImageIndex.open(tmp_path / "idx"))]
    for fam, want in copies.items():
        assert want in groups, (fam, groups)  # exactly the photo and its copies, no other photo of the family


def test_page_marks_weak_matches_by_the_collections_threshold(built, sample_photos, tmp_path):
    from app.page.handlers import SearchApp

    idx = ImageIndex.open(built)
    app = SearchApp(idx, idx.load_embedder(device="cpu"))
    noise = tmp_path / "noise.png"
    Image.fromarray(np.random.default_rng(3).integers(0, 256, (64, 64, 3), dtype=np.uint8)).save(noise)
    for query in (next(sample_photos.rglob("*.jpg")), noise):
        gallery, info, state = app.search(str(query), k=12, folder="")
        weak = [s < idx.weak_below for s in state.scores]
        assert [" · weak match" in caption for _, caption in gallery] == weak
        assert ("no close match in the collection" in info) == weak[0]
    vector = app.embedder.embed(str(next(sample_photos.rglob("*.jpg"))))  # 1 x D
    scope = app.searcher.check(1, "")
    own = float(app.searcher.search(scope, vector).scores[0, 0])  # the page's ranking, itself not left out
    assert own == pytest.approx(1.0, abs=1e-5) and own >= idx.weak_below  # a photo of the collection finds itself


def test_chance_level_is_robust_to_related_pairs():
    """weak_below reads the unrelated pairs: related ones move a percentile, hardly median + 3 MAD."""
    from index.building.sync import chance_level

    rng = np.random.default_rng(1)
    unrelated = rng.normal(0.0, 0.2, 50_000)
    related = rng.normal(0.9, 0.03, 2_500)  # tight families: 1 pair in 21 related
    ref = np.median(unrelated) + 3 * 1.4826 * np.median(np.abs(unrelated - np.median(unrelated)))
    assert chance_level(unrelated) == pytest.approx(ref, abs=1e-9)
    assert chance_level(unrelated) == pytest.approx(0.6, abs=0.01)  # 3 sigma of N(0, 0.2)
    mixed = np.concatenate([unrelated, related])
    assert np.percentile(mixed, 99) > 0.9  # a plain percentile lands among the related pairs
    assert chance_level(mixed) < 0.66  # the robust level stays with the unrelated ones (0.6 without them)
