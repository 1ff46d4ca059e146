"""The index's embedding space belongs to the collection it searches (issue 28, 2-3): fitted at build, fitted again
when the collection grows by half or drifts, by the size rule; degenerate collections fall back to centring and no
stored vector is ever zero."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
from PIL import Image

from index.building.runner import build_index, update_index
from index.building.sync import DRIFT_REFIT, space_drift, space_rule
from index.search.image_index import ImageIndex
from moco.data.sample import make_sample_collection


def test_space_rule_by_size():
    from index.building.sync import WHITEN_FROM, WHITEN_PER_DIM

    assert space_rule(WHITEN_FROM, 960) == "whitened" and space_rule(WHITEN_FROM - 1, 960) == "centred"
    wide = WHITEN_PER_DIM * 2048  # wider features need more photos per dimension
    assert space_rule(wide - 1, 2048) == "centred" and space_rule(wide, 2048) == "whitened"


def test_space_drift_against_a_by_hand_formula():
    rng = np.random.default_rng(0)
    v = rng.normal(size=(500, 6)).astype(np.float32)
    mean, matrix = rng.normal(size=6).astype(np.float32) * 0.1, rng.normal(size=(6, 6)).astype(np.float32)
    want = np.sum(((v.mean(0) - mean) @ matrix) ** 2) / np.mean(np.sum(((v - mean) @ matrix) ** 2, axis=1))
    assert space_drift(v, mean, matrix, sample=500) == pytest.approx(float(want), rel=1e-4)
    same = space_drift(v, v.mean(0), None, sample=500)  # centred on its own mean: no drift
    assert same == pytest.approx(0.0, abs=1e-9)


def _noise(folder, n, seed):
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    for i in range(n):
        Image.fromarray(rng.integers(0, 256, (48, 48, 3), dtype=np.uint8)).save(folder / f"n{i:02d}.png")


def test_the_space_is_fitted_again_when_the_collection_grows_or_drifts_only(backbone, tmp_path, caplog):
    photos = tmp_path / "photos"
    make_sample_collection(photos, per_family=8, size=48, seed=0)  # 48 photos
    build_index(photos, backbone, tmp_path / "idx", progress=False, device="cpu")
    first = ImageIndex.open(tmp_path / "idx")
    digest, count = first.space.digest, first.space.count
    assert count == 48 and first.meta["space"]["rule"] == "centred"  # a backbone with no training whitening
    update_index(tmp_path / "idx", progress=False, device="cpu")  # nothing changed: the same space
    again = ImageIndex.open(tmp_path / "idx")
    assert again.space.digest == digest and again.meta["space"]["drift"] == pytest.approx(0.0, abs=1e-6)
    _noise(photos / "zz_noise", 20, seed=1)  # 68 photos (under 1.5 x 48) of another kind: the mean drifts
    with caplog.at_level("INFO", logger="index.building"):
        update_index(tmp_path / "idx", progress=False, device="cpu")
    drifted = ImageIndex.open(tmp_path / "idx")
    ids, feats = drifted.catalog.vectors(dim=drifted.dim)
    shift = space_drift(feats, first.space.mean, None)
    assert shift > DRIFT_REFIT, shift  # the criterion holds for this collection ...
    assert drifted.space.count == 68 and "drifted" in caplog.text  # ... and the space was fitted again
    np.testing.assert_allclose(drifted.mean, feats.mean(0), atol=1e-6)
    hits = drifted.search(feats[:3], k=3)  # search equals brute force in the new space
    c = feats - feats.mean(0)
    c /= np.linalg.norm(c, axis=1, keepdims=True)
    np.testing.assert_allclose(hits.scores[:, 0], np.max(c[:3] @ c.T, axis=1), atol=1e-5)


def test_twenty_identical_photos_centre_without_zero_vectors_and_group_as_duplicates(backbone, tmp_path, caplog):
    from index.duplicates.dedup import find_duplicates

    photos = tmp_path / "same"
    photos.mkdir()
    img = Image.fromarray(np.random.default_rng(3).integers(0, 256, (48, 48, 3), dtype=np.uint8))
    for i in range(20):
        img.save(photos / f"p{i:02d}.png")
    with caplog.at_level("WARNING"):
        build_index(photos, backbone, tmp_path / "idx", progress=False, device="cpu")
    idx = ImageIndex.open(tmp_path / "idx")
    ids, feats = idx.catalog.vectors(dim=idx.dim)
    vecs = idx.to_space(feats)  # what index.faiss holds
    assert np.isfinite(vecs).all() and (np.linalg.norm(vecs, axis=1) > 0.99).all()
    with pytest.warns(DeprecationWarning, match="to_space"):  # the former name still answers, and says the new one
        np.testing.assert_array_equal(idx.center(feats), vecs)
    assert idx.space.matrix is None
    hits = idx.search(feats[:1], k=20)
    np.testing.assert_allclose(hits.scores, 1.0, atol=1e-4)  # never 0.0000
    groups = find_duplicates(idx, save=False)
    assert len(groups) == 1 and groups[0].size == 20


def test_an_index_of_an_older_version_is_embedded_again_as_features(tmp_path, sample_photos):
    """An index whose catalog stored the export's whitened output is refused for search until an update, which
    embeds every photo again."""
    from moco.config import resolve_config
    from moco.errors import UserError
    from moco.export.exporter import export_backbone
    from moco.training.loop import train

    cfg = resolve_config("cpu", data_dir=str(sample_photos), out=str(tmp_path / "run"), image_size=32, batch_size=8,
                         bn_splits=2, queue_size=16, workers=0, max_steps=2, precision="fp32",
                         save_every_minutes=1000.0)
    train(cfg, progress=False)
    export_backbone(tmp_path / "run" / "checkpoint.pt", tmp_path / "b.safetensors")
    photos = tmp_path / "photos"
    shutil.copytree(sample_photos, photos)
    build_index(photos, tmp_path / "b.safetensors", tmp_path / "idx", progress=False, device="cpu")
    from index.catalog import Catalog, set_catalog_meta
    from index.search.index_dir import read_meta, write_meta

    cat = Catalog(tmp_path / "idx" / "catalog.sqlite")
    set_catalog_meta(cat, vectors=None)  # as an older version left it
    cat.close()
    meta = read_meta(tmp_path / "idx")
    meta.pop("vectors")
    write_meta(tmp_path / "idx", meta)
    with pytest.raises(UserError, match="older version.*moco index update"):
        ImageIndex.open(tmp_path / "idx").load_embedder(device="cpu")
    s = update_index(tmp_path / "idx", progress=False, device="cpu")
    assert s.reembedded == 48
    ImageIndex.open(tmp_path / "idx").load_embedder(device="cpu")  # accepted now
