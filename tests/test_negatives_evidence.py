"""The Negatives tab flags a negative only on evidence (same photo, near-duplicate, as close as two views of one
photo), counts over all K negatives, and can inspect any indexed photo by id: checked against numpy by hand."""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from app.page.negatives.from_index import IndexNegatives
from app.page.negatives.from_queue import QueueNegatives
from app.page.negatives.view import REASONS, info_nce_numbers
from app.page.views import negatives_outputs
from index.building.runner import build_index, update_index
from index.catalog import sample_ids
from index.search.image_index import ImageIndex
from moco.data.augment import two_views
from moco.data.photos import load_rgb, square_u8
from moco.data.sample import make_sample_collection
from moco.embed import center
from moco.errors import UserError

from .conftest import random_backbone, trained_index

SAME, DUP, CLOSE = REASONS


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> dict[str, Path]:
    """A tiny trained run (a full queue with repeated photos), its exported backbone and an index of its photos."""
    return trained_index(tmp_path_factory.mktemp("neg"))


@pytest.fixture(scope="module")
def index(setup) -> ImageIndex:
    return ImageIndex.open(setup["idx"])


@pytest.fixture(scope="module")
def queue(setup, index) -> QueueNegatives:
    return QueueNegatives(setup["ckpt"], index)


def _copy(path: Path) -> Image.Image:
    """A resized (90%), JPEG re-encoded (quality 90) copy of a photo."""
    img = Image.open(path).convert("RGB")
    img = img.resize((img.width * 9 // 10, img.height * 9 // 10), Image.Resampling.BICUBIC)
    buf = io.BytesIO()
    img.save(buf, "JPEG", quality=90)
    return Image.open(io.BytesIO(buf.getvalue())).convert("RGB")


def _index_reference(index: ImageIndex, emb, img: Image.Image, seed: int, level: float) -> dict:
    """IndexNegatives by hand: centred cosines of the seeded views and of the clean embedding to every photo."""
    ids, raw = index.catalog.vectors()  # N, N x D
    vecs = index.to_space(raw)  # N x D
    square = square_u8(img, emb.resize)
    xq, xk = two_views(torch.tensor(square)[None], "v2", emb.image_size, emb.pixel_mean, emb.pixel_std,
                       torch.Generator().manual_seed(seed))
    q, k = index.to_space(emb.embed_views(torch.cat([xq, xk])))  # D, D
    clean = emb.embed_squares(np.array(square)[None])  # 1 x D
    keep = raw @ clean[0] < 0.9999  # copies of the query itself are left out
    sims, dup = vecs[keep] @ q, vecs[keep] @ index.to_space(clean)[0] >= index.dedup_threshold  # K, K
    if index.weak_below is not None and level <= index.weak_below:
        level = np.inf  # views no closer than random pairs: closeness is no evidence
    code = np.where(dup, 2, np.where(sims >= level, 3, 0))  # K
    return {"ids": ids[keep], "sims": sims, "pos": float(q @ k), "code": code}


def _flagged(code: np.ndarray) -> dict[str, int]:
    return {r: int(np.sum(code == i + 1)) for i, r in enumerate(REASONS)}


def test_index_reasons_match_a_brute_force_reference(setup, index, monkeypatch):
    emb = index.load_embedder(device="cpu")
    monkeypatch.setitem(index.meta, "weak_below", index.augment_level["median"] - 0.5)  # closeness counts
    src = IndexNegatives(index, emb)
    original = sorted(setup["photos"].rglob("*.jpg"))[6]
    orig_id = index.catalog.row_by_path(original.relative_to(setup["photos"]).as_posix()).id
    level = index.augment_level["median"]
    view = src.compute(_copy(original), n=len(index), seed=0)  # every negative shown
    ref = _index_reference(index, emb, _copy(original), 0, level)
    assert view.augment_level == level and "the index's space (backbone features, centred on this" in view.space
    assert view.positive == pytest.approx(ref["pos"], abs=1e-5) and view.count == len(ref["ids"])
    got = {n.id: n.reason for n in view.negatives}
    assert got == {int(i): REASONS[c - 1] if c else "" for i, c in zip(ref["ids"], ref["code"])}
    assert got[orig_id] == DUP  # the copy's original is a near-duplicate, whatever its score
    # an unrelated negative at or above the positive but under the level is not flagged; above it, it is
    pos, sims = view.positive, np.array([n.similarity for n in view.negatives])
    between = [n for n in view.negatives if pos <= n.similarity < level and n.reason != DUP]
    above = [n for n in view.negatives if n.similarity >= level and n.reason != DUP]
    assert between and all(n.reason == "" for n in between) and all(n.reason == CLOSE for n in above)
    assert view.above_positive == int(np.sum(sims >= pos))


def test_constructed_levels_flag_only_what_the_evidence_says(setup, index, monkeypatch):
    """The level placed between the positive and the best negative: both sides of the rule are exercised."""
    emb = index.load_embedder(device="cpu")
    src = IndexNegatives(index, emb)
    photo = sorted(setup["photos"].rglob("*.png"))[2]
    for seed in range(20):  # a view whose positive is beaten by at least two negatives
        view = src.compute(Image.open(photo), n=3, seed=seed)
        if view.above_positive >= 2:
            break
    else:
        pytest.fail("no seed in 0..19 makes a weak positive")
    ref = _index_reference(index, emb, Image.open(photo), seed, 1.0)
    top = np.sort(ref["sims"])[::-1]
    level = float((top[0] + top[1]) / 2)  # exactly one negative (the best) at or above it
    monkeypatch.setitem(index.meta, "augment_level", {**index.augment_level, "median": level})
    monkeypatch.setitem(index.meta, "weak_below", level - 0.5)
    view = src.compute(Image.open(photo), n=len(index), seed=seed)
    ref = _index_reference(index, emb, Image.open(photo), seed, level)
    reasons = {n.id: n.reason for n in view.negatives}
    assert reasons == {int(i): REASONS[c - 1] if c else "" for i, c in zip(ref["ids"], ref["code"])}
    best = view.negatives[0]
    assert best.reason in (CLOSE, DUP) and best.similarity >= level
    unflagged_above_positive = [n for n in view.negatives[1:] if n.similarity >= view.positive and not n.reason]
    assert unflagged_above_positive, "a negative above the positive, under the level, not a duplicate: no flag"
    assert view.flagged == _flagged(ref["code"]) and view.flagged[CLOSE] + view.flagged[DUP] < view.count


def test_counts_come_from_all_negatives_not_the_rows_shown(setup, index, queue):
    emb = index.load_embedder(device="cpu")
    photo = sorted(setup["photos"].rglob("*.jpg"))[7]
    view = IndexNegatives(index, emb).compute(Image.open(photo), n=2, seed=5)
    ref = _index_reference(index, emb, Image.open(photo), 5, index.augment_level["median"])
    assert len(view.negatives) == 2 and view.count == len(ref["sims"])
    assert view.above_positive == int(np.sum(ref["sims"] >= ref["pos"])) and view.flagged == _flagged(ref["code"])
    nums = info_nce_numbers(ref["pos"], ref["sims"], view.temperature)
    assert view.loss == pytest.approx(nums["loss"], rel=1e-4)
    # the queue: every filled key, evidence by hand from the queue ids and the index vectors
    row = index.catalog.row_by_path(photo.relative_to(setup["photos"]).as_posix())
    view = queue.compute_for_id(row.id, n=3, seed=1)
    filled = queue.queue_ids >= 0
    ids = queue.queue_ids[filled]  # K
    cfg, square = queue.cfg, square_u8(load_rgb(photo, min_short=queue.size), queue.size)
    q, k = queue.keys(*two_views(torch.tensor(square)[None], cfg.augment, cfg.image_size, cfg.mean, cfg.std,
                                 torch.Generator().manual_seed(1)))
    sims = (q @ queue.queue)[0].numpy()[filled]  # K
    train_id = queue.files.index(photo.relative_to(setup["photos"]).as_posix())
    paths = [queue.files[i] for i in ids]
    idx_ids = np.array([index.catalog.row_by_path(p).id for p in paths])
    near = index.to_space(index.vectors(idx_ids)) @ index.to_space(index.vectors([row.id]))[0] >= index.dedup_threshold
    level = view.augment_level if view.augment_level > queue._chance else np.inf  # closeness above chance only
    code = np.where(ids == train_id, 1, np.where(near, 2, np.where(sims >= level, 3, 0)))
    assert view.count == len(ids) and view.above_positive == int(np.sum(sims >= float((q * k).sum())))
    assert view.flagged == _flagged(code) and len(view.negatives) == 3


def test_views_no_closer_than_random_pairs_flag_nothing_by_closeness(setup, index, monkeypatch):
    """A weak model (two views of a photo no closer than 1 in 100 random pairs): closeness is no evidence."""
    emb = index.load_embedder(device="cpu")
    photo = sorted(setup["photos"].rglob("*.jpg"))[4]
    level = float(np.sort(_index_reference(index, emb, Image.open(photo), 2, 1.0)["sims"])[-3])  # 3 at or above
    monkeypatch.setitem(index.meta, "augment_level", {**index.augment_level, "median": level})
    monkeypatch.setitem(index.meta, "weak_below", level - 0.5)
    shown = IndexNegatives(index, emb).compute(Image.open(photo), n=len(index), seed=2)
    assert shown.flagged[CLOSE] > 0, "the check needs negatives above the level"
    monkeypatch.setitem(index.meta, "weak_below", level + 0.01)
    gated = IndexNegatives(index, emb).compute(Image.open(photo), n=len(index), seed=2)
    assert gated.flagged[CLOSE] == 0 and gated.augment_level == level
    assert gated.flagged[DUP] == shown.flagged[DUP] and any("cannot tell photos apart" in n for n in gated.notes)
    ref = _index_reference(index, emb, Image.open(photo), 2, level)
    assert gated.flagged == _flagged(ref["code"])


def test_queue_repeated_keys_and_same_photo_by_id(setup, index, queue):
    filled = queue.queue_ids >= 0
    ids = queue.queue_ids[filled]  # K
    uniq, counts = np.unique(ids, return_counts=True)
    assert counts.max() >= 2, "the tiny run's queue should hold some photo twice"
    train_id = int(uniq[np.argmax(counts)])
    row = index.catalog.row_by_path(queue.files[train_id])
    view = queue.compute_for_id(row.id, n=len(ids), seed=0)  # every key shown
    assert any(f"training image #{train_id}" in n for n in view.notes)
    seen: dict[int, int] = {}
    for neg in view.negatives:
        seen[neg.id] = seen.get(neg.id, 0) + 1
        assert neg.keys_of_photo == int(np.sum(ids == neg.id)) and neg.key_number == seen[neg.id]
        assert (neg.reason == SAME) == (neg.id == train_id)
    assert view.flagged[SAME] == int(counts.max()) == sum(n.id == train_id for n in view.negatives)
    _, _, _, table = negatives_outputs(view)  # the page says which key of a repeated photo a row is
    for row, neg in zip(table, view.negatives):
        assert (f"key {neg.key_number} of {neg.keys_of_photo} of this photo" in row[1]) == (neg.keys_of_photo > 1)
        assert row[5] == neg.reason
    # an upload of the same photo is identified through the index (its clean embedding) and flagged the same
    upload = queue.compute(Image.open(setup["photos"] / queue.files[train_id]), n=4, seed=0)
    assert upload.flagged[SAME] == int(counts.max())
    assert queue.augment_level is not None and -1 <= queue.augment_level <= 1


def test_index_compute_for_id_leaves_the_photo_out_and_falls_back_to_its_thumbnail(setup, index, tmp_path):
    emb = index.load_embedder(device="cpu")
    src = IndexNegatives(index, emb)
    path = sorted(setup["photos"].rglob("*.jpg"))[1]
    row = index.catalog.row_by_path(path.relative_to(setup["photos"]).as_posix())
    view = src.compute_for_id(row.id, n=5)
    assert view.count == len(index) - 1 and row.id not in {n.id for n in view.negatives}
    assert any(f"#{row.id}" in n for n in view.notes)
    assert view.loss == pytest.approx(src.compute(load_rgb(path, min_short=emb.resize), n=5).loss, rel=1e-5)
    shutil.move(path, tmp_path / "away.jpg")  # the original is gone: its thumbnail is inspected
    try:
        view = src.compute_for_id(row.id, n=5)
        assert any("thumbnail" in n for n in view.notes) and view.count == len(index) - 1
    finally:
        shutil.move(tmp_path / "away.jpg", path)
    for bad, words in [(10**6, "not a photo of the index"), ("7", "not a catalog id")]:
        with pytest.raises(UserError, match=words):
            src.compute_for_id(bad)
    with pytest.raises(UserError, match="n=0"):
        src.compute_for_id(row.id, n=0)


def _by_hand_level(idx: ImageIndex) -> dict:
    """index.json's augment_level recomputed: seeded sample, decoded as the index does, two v2 views, centred."""
    emb = idx.load_embedder(device="cpu")
    ids, _ = idx.catalog.vectors()
    rows = idx.catalog.rows_by_id(sample_ids(ids, 64, np.random.default_rng(0)))
    squares = np.stack([square_u8(load_rgb(idx.root / rows[i].path, min_short=emb.resize), emb.resize)
                        for i in sorted(rows)])
    xq, xk = two_views(torch.from_numpy(squares), "v2", emb.image_size, emb.pixel_mean, emb.pixel_std,
                       torch.Generator().manual_seed(0))
    cos = np.sum(center(emb.embed_views(xq), idx.mean) * center(emb.embed_views(xk), idx.mean), axis=1)  # B
    return {"median": float(np.median(cos)), "p10": float(np.percentile(cos, 10)), "pairs": len(cos)}


def test_augment_level_is_measured_at_build_kept_by_updates_and_remeasured_with_the_mean(tmp_path):
    photos = tmp_path / "photos"
    make_sample_collection(photos, per_family=3, size=48, seed=4)  # 18 photos
    backbone = random_backbone(tmp_path)
    out = tmp_path / "idx"
    build_index(photos, backbone, out, progress=False)
    idx = ImageIndex.open(out)
    level, by_hand = idx.augment_level, _by_hand_level(idx)
    assert level["recipe"] == "v2" and level["space"] == "centred (the index's space)"
    assert level["pairs"] == by_hand["pairs"]
    assert level["median"] == pytest.approx(by_hand["median"], abs=2e-4)
    assert level["p10"] == pytest.approx(by_hand["p10"], abs=2e-4)
    assert idx.stats()["augment_level"] == level
    meta_file = out / "index.json"
    meta = json.loads(meta_file.read_text())
    meta["augment_level"] = {**level, "median": 0.123}  # a marker: an update that keeps the mean keeps the level
    meta_file.write_text(json.dumps(meta))
    update_index(out, progress=False)
    assert json.loads(meta_file.read_text())["augment_level"]["median"] == 0.123
    del meta["augment_level"]  # an index from before the level: the next update measures it
    meta_file.write_text(json.dumps(meta))
    update_index(out, progress=False)
    assert json.loads(meta_file.read_text())["augment_level"] == level
    meta = json.loads(meta_file.read_text())
    meta["augment_level"] = {**level, "median": 0.123}
    meta_file.write_text(json.dumps(meta))
    make_sample_collection(photos / "more", per_family=2, size=48, seed=9)  # 18 -> 30: the mean is recomputed
    update_index(out, progress=False)
    meta = json.loads(meta_file.read_text())
    assert meta["mean_count"] == 30 and meta["augment_level"]["median"] != 0.123
    idx = ImageIndex.open(out)
    assert idx.augment_level["median"] == pytest.approx(_by_hand_level(idx)["median"], abs=2e-4)
