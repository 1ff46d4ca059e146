"""Embedder: every input type gives the same vector; folders stream with bad files reported."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from moco.embed import Embedder
from moco.errors import UserError

from .conftest import random_backbone


@pytest.fixture(scope="module")
def embedder(tmp_path_factory) -> Embedder:
    return Embedder.load(random_backbone(tmp_path_factory.mktemp("emb"), image_size=64), device="cpu",
                         precision="fp32")


def _image(seed=0, h=50, w=70) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)


def test_every_input_type_gives_the_same_vector(embedder, tmp_path):
    arr = _image()
    path = tmp_path / "a.png"
    Image.fromarray(arr).save(path)
    ref = embedder.embed([path])
    assert ref.shape == (1, 512) and ref.dtype == np.float32
    assert np.allclose(np.linalg.norm(ref, axis=1), 1.0, atol=1e-5)
    inputs = [str(path), Image.open(path), Image.fromarray(arr).convert("RGBA"), arr, arr.transpose(2, 0, 1),
              torch.from_numpy(arr), torch.from_numpy(arr.transpose(2, 0, 1).copy())]
    for item in inputs:
        assert np.abs(embedder.embed(item) - ref).max() < 1e-6, type(item)
    batch = embedder.embed(np.stack([arr, arr]))  # a 4-D batch
    assert batch.shape == (2, 512) and np.abs(batch - ref).max() < 1e-6
    gray = embedder.embed(arr[:, :, 0])
    assert np.abs(gray - embedder.embed(np.repeat(arr[:, :, :1], 3, axis=2))).max() < 1e-6


def test_bad_inputs(embedder, tmp_path):
    with pytest.raises(UserError, match="uint8"):
        embedder.embed(np.zeros((10, 10, 3), np.float32))
    with pytest.raises(UserError, match="shape"):
        embedder.embed(np.zeros((10, 10, 5), np.uint8))
    with pytest.raises(UserError, match="no images"):
        embedder.embed([])
    with pytest.raises(UserError, match="cannot embed"):
        embedder.embed([42])
    (tmp_path / "bad.jpg").write_bytes(b"\xff\xd8 not really")
    with pytest.raises(UserError, match="bad.jpg"):
        embedder.embed([tmp_path / "bad.jpg"])


def test_embed_folder_streams_and_reports_failures(embedder, tmp_path):
    root = tmp_path / "photos"
    (root / "sub").mkdir(parents=True)
    good = []
    for i in range(7):
        p = root / ("sub" if i % 2 else "") / f"img{i}.{'jpg' if i % 3 else 'png'}"
        Image.fromarray(_image(i, 40 + i, 60)).save(p)
        good.append(p.relative_to(root).as_posix())
    (root / "zero.jpg").write_bytes(b"")
    (root / "sub" / "text.png").write_text("hello")
    batches = list(embedder.embed_folder(root, batch_size=3, workers=2, progress=False))
    paths = [p for b in batches for p in b[0]]
    failures = dict(f for b in batches for f in b[2])
    assert sorted(paths) == sorted(good)
    assert set(failures) == {"zero.jpg", "sub/text.png"} and "empty" in failures["zero.jpg"]
    vectors = np.concatenate([b[1] for b in batches])
    direct = embedder.embed([root / p for p in paths])
    assert np.abs(vectors - direct).max() < 1e-6
    assert all(len(b[0]) == len(b[1]) for b in batches)


def test_metadata_drives_preprocessing(embedder):
    assert embedder.image_size == 64 and embedder.resize == 64  # small inputs: no extra resize margin
    assert embedder.pixel_mean == (0.485, 0.456, 0.406) and embedder.dim == 512 and len(embedder.sha256) == 64


def test_batched_torchvision_jpeg_decode_matches_pil(embedder, tmp_path):
    # the path a GPU takes (decode_jpeg on the embedder's device), run here on the CPU
    root = tmp_path / "jpgs"
    root.mkdir()
    for i in range(5):
        Image.fromarray(_image(i, 90 + 7 * i, 120)).save(root / f"{i}.jpg", quality=95)
    (root / "broken.jpg").write_bytes((root / "0.jpg").read_bytes()[:200])
    pil = {p: v for b in embedder.embed_folder(root, decoder="pil", progress=False) for p, v in zip(b[0], b[1])}
    batches = list(embedder.embed_folder(root, decoder="torchvision", progress=False))
    tv = {p: v for b in batches for p, v in zip(b[0], b[1])}
    assert set(tv) == set(pil) == {f"{i}.jpg" for i in range(5)}
    assert [f[0] for b in batches for f in b[2]] == ["broken.jpg"]
    for p in pil:  # different resampling code, same picture
        assert float(pil[p] @ tv[p]) > 0.99


def test_encode_is_embed_under_sentence_transformers_names(embedder, tmp_path):
    arrs = [_image(1), _image(2, 40, 40)]
    path = tmp_path / "b.png"
    Image.fromarray(arrs[0]).save(path)
    ref = embedder.embed(arrs)  # 2 x D, unit vectors
    one = embedder.encode(str(path))  # one image in: one vector out, as SentenceTransformer.encode("a sentence")
    assert one.shape == (512,) and np.abs(one - ref[0]).max() < 1e-6
    many = embedder.encode(arrs, batch_size=1, show_progress_bar=False)
    assert isinstance(many, np.ndarray) and many.shape == (2, 512) and np.abs(many - ref).max() < 1e-6
    t = embedder.encode(arrs, convert_to_tensor=True)
    assert isinstance(t, torch.Tensor) and t.shape == (2, 512) and torch.allclose(t, torch.from_numpy(ref), atol=1e-6)
    listed = embedder.encode(arrs, convert_to_numpy=False)
    assert isinstance(listed, list) and [v.shape for v in listed] == [(512,), (512,)]
    raw = embedder.encode(arrs, normalize_embeddings=False)
    assert np.abs(raw - embedder.embed(arrs, normalize=False)).max() < 1e-6
    assert not np.allclose(np.linalg.norm(raw, axis=1), 1.0)  # not normalized when asked not to
