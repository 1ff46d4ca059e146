"""A run's whitening (``--whiten``, the cpu preset): fitted on its photos at the end of training, carried by the
checkpoint and the export, applied by every embedding (library, index, search), checked against references."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from moco.config import resolve_config
from moco.embed import Embedder
from moco.errors import UserError
from moco.export.exporter import export_backbone
from moco.training.checkpoints import save_checkpoint
from moco.training.loop import train
from moco.weights.layouts import load_checkpoint
from moco.whiten import Whitening, fit_whitening

# resnet10t (the cpu preset's timm network, so that --format timm applies) at 32 px, a few steps in fp32
SETUP = dict(image_size=32, batch_size=8, bn_splits=2, queue_size=16, workers=0, max_steps=3, precision="fp32",
             keep_checkpoints=1, save_every_minutes=1000.0)


@pytest.fixture(scope="module")
def run(tmp_path_factory, sample_photos):
    out = tmp_path_factory.mktemp("white") / "run"
    cfg = resolve_config("cpu", data_dir=str(sample_photos), out=str(out), val_dir=str(sample_photos),
                         whiten_stages="on", whiten_edges="off", **SETUP)  # 48 photos: too few for the preset's
    # auto stages (a test below); its edges (auto: on for 48 photos from scratch) go through tests/test_doors.py
    assert cfg.whiten  # the preset's
    train(cfg, progress=False)
    return out


def _photos(root):
    return sorted(p for p in root.rglob("*") if p.suffix in (".jpg", ".png"))


STAGES = (("layer1", 64), ("layer2", 128), ("layer3", 256))  # resnet10t's stages before the last, pooled
DIM = 512 + 64 + 128 + 256


@torch.no_grad()
def _staged(net, x) -> torch.Tensor:
    """By hand through timm's ResNet: the global averages of layer1, layer2, layer3 and layer4 (N x 960)."""
    h = net.maxpool(net.act1(net.bn1(net.conv1(x))))  # N x 64 x s/4 x s/4
    pooled = []
    for layer in (net.layer1, net.layer2, net.layer3, net.layer4):
        h = layer(h)  # N x C_i x . x .
        pooled.append(h.float().mean((2, 3)))  # N x C_i
    return torch.cat(pooled, 1)  # N x 960


def _mirrored(run, files, mirror: bool = True) -> np.ndarray:
    """Reference: the plain backbone's pooled stages of each photo's view, normalized, plus its mirror image's,
    normalized (``mirror``), the sum normalized."""
    from moco.data.augment import center_view
    from moco.data.photos import load_square_u8

    plain = Embedder.load(run / "checkpoint.pt", device="cpu", precision="fp32", whiten=False)
    squares = torch.from_numpy(np.stack([load_square_u8(f, plain.resize) for f in files]))  # N x R x R x 3
    x = center_view(squares, plain.image_size, plain.pixel_mean, plain.pixel_std)  # N x 3 x s x s
    net = plain.backbone.eval()
    both = F.normalize(_staged(net, x), dim=1)  # N x 960
    if mirror:
        both = both + F.normalize(_staged(net, x.flip(3)), dim=1)  # N x 960
    return F.normalize(both, dim=1).numpy()


def _gram_inverse(w: Whitening) -> np.ndarray:
    """W W^T: the inverse of the shrunk covariance, whatever the eigenvectors' signs."""
    return w.matrix.astype(np.float64) @ w.matrix.T.astype(np.float64)


def test_the_checkpoint_carries_the_whitening_of_the_trained_features_of_its_photos(run, sample_photos):
    ckpt = load_checkpoint(run / "checkpoint.pt")
    w = Whitening.from_state(ckpt["whitening"], 512, "ckpt")
    assert w.count == len(_photos(sample_photos)) == 48  # fewer photos than WHITEN_ROWS: all of them
    numbered = sorted(run.glob("checkpoint-*.pt"))
    assert len(numbered) == 1 and "whitening" in load_checkpoint(numbered[0])  # the step's copy was rewritten too
    assert w.mirror  # fitted on each photo's features averaged with its mirror image's
    assert w.stages == STAGES and w.dim == DIM  # and on the pooled outputs of the stages before the last
    ref = fit_whitening(_mirrored(run, _photos(sample_photos)))  # a fit of our own on the same photos' features
    assert ref.shrinkage == pytest.approx(w.shrinkage, abs=1e-3)
    np.testing.assert_allclose(w.mean, ref.mean, atol=1e-4)
    g, gref = _gram_inverse(w), _gram_inverse(ref)
    assert np.abs(g - gref).max() < 1e-3 * np.abs(gref).max()


def test_the_kNN_monitor_reports_the_exported_embedding(run, sample_photos):
    from moco.training.knn import knn_top1

    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    exported = [r["knn_exported"] for r in lines if "knn_exported" in r]
    assert len(exported) == 1
    files = _photos(sample_photos)
    vecs = Embedder.load(run / "checkpoint.pt", device="cpu", precision="fp32").embed(files)  # whitened
    families = sorted({f.parent.name for f in files})
    labels = torch.tensor([families.index(f.parent.name) for f in files])
    want = knn_top1(torch.from_numpy(vecs), labels, None, None, len(families), 200, 0.1)  # leave-one-out
    assert exported[0] == pytest.approx(want, abs=1.5 / len(files))  # at most one photo's vote apart (bf16 ties)


def test_embeddings_apply_it_and_the_export_formats_keep_it(run, sample_photos, tmp_path):
    files = _photos(sample_photos)[:6]
    ckpt = load_checkpoint(run / "checkpoint.pt")
    w = Whitening.from_state(ckpt["whitening"], 512, "ckpt")
    meta = export_backbone(run / "checkpoint.pt", tmp_path / "b.safetensors")
    assert meta.whitening["count"] == 48
    from moco.export.reader import embedding_dim

    assert (meta.embed_dim, embedding_dim(meta)) == (512, DIM)  # the backbone's width; what it embeds
    white = Embedder.load(tmp_path / "b.safetensors", device="cpu", precision="fp32")
    plain = Embedder.load(tmp_path / "b.safetensors", device="cpu", precision="fp32", whiten=False)
    assert white.space is not None and plain.space is None
    got, raw, mirrored = white.embed(files), plain.embed(files), _mirrored(run, files)
    assert (white.dim, plain.dim, got.shape[1], raw.shape[1]) == (DIM, 512, DIM, 512)
    np.testing.assert_allclose(got, w(mirrored), atol=2e-5)  # normalize((normalize(f + f_mirror) - mean) @ matrix)
    assert np.abs(got - w(_mirrored(run, files, mirror=False))).max() > 1e-2  # the mirror image's features count
    unnormalized = white.embed(files, normalize=False)
    np.testing.assert_allclose(unnormalized, (mirrored - w.mean) @ w.matrix, rtol=1e-4, atol=1e-4)
    x = torch.randn(3, 3, 32, 32)
    np.testing.assert_allclose(white.embed_views(x.flip(3)), white.embed_views(x), atol=2e-5)  # mirror-invariant
    assert np.abs(plain.embed_views(x.flip(3)) - plain.embed_views(x)).max() > 1e-2  # the backbone is not

    export_backbone(run / "checkpoint.pt", tmp_path / "b.pt2", fmt="pt2")  # a program: whitening inside
    program = torch.export.load(str(tmp_path / "b.pt2")).module()
    np.testing.assert_allclose(program(x).detach().numpy(), white.embed_views(x), atol=2e-5)
    import onnxruntime as ort

    export_backbone(run / "checkpoint.pt", tmp_path / "b.onnx", fmt="onnx")  # the same map, batch of 5 this time
    session = ort.InferenceSession(str(tmp_path / "b.onnx"), providers=["CPUExecutionProvider"])
    x5 = torch.randn(5, 3, 32, 32)
    np.testing.assert_allclose(session.run(None, {"images": x5.numpy()})[0], white.embed_views(x5), atol=1e-4)

    import timm

    from moco.whiten import apply_space

    timm_meta = export_backbone(run / "checkpoint.pt", tmp_path / "timm", fmt="timm")  # the space beside the model
    assert timm_meta.output["apply"].startswith("moco.apply_space")
    model = timm.create_model(f"local-dir:{tmp_path / 'timm'}", pretrained=True)
    np.testing.assert_allclose(apply_space(model, x, tmp_path / "timm").numpy(), white.embed_views(x), atol=2e-5)


def test_a_damaged_whitening_is_refused_naming_the_file_and_the_fix(run, tmp_path):
    ckpt = load_checkpoint(run / "checkpoint.pt")
    ckpt["whitening"]["matrix"] = torch.zeros(3, 3)
    save_checkpoint({k: v for k, v in ckpt.items() if k not in ("format", "version")}, tmp_path, keep=0)
    with pytest.raises(UserError, match=rf"{tmp_path / 'checkpoint.pt'}.*shapes.*train again"):
        export_backbone(tmp_path / "checkpoint.pt", tmp_path / "b.safetensors")
    assert not (tmp_path / "b.safetensors").exists()


def test_the_index_stores_and_searches_the_whitened_embeddings(run, sample_photos, tmp_path):
    from index.building.runner import build_index
    from index.search.image_index import ImageIndex

    export_backbone(run / "checkpoint.pt", tmp_path / "b.safetensors")
    build_index(sample_photos, tmp_path / "b.safetensors", tmp_path / "idx", progress=False, device="cpu")
    idx = ImageIndex.open(tmp_path / "idx")
    ids, stored = idx.catalog.vectors(dim=idx.dim)  # N, N x D: the features, mirror image and stages included
    paths = [idx.catalog.rows_by_id([int(i)])[int(i)].path for i in ids]
    raw = _mirrored(run, [sample_photos / p for p in paths])
    raw /= np.linalg.norm(raw, axis=1, keepdims=True)
    cos = (stored * raw).sum(1)  # N: bf16 here, fp32 the reference
    assert cos.min() > 0.98
    q = stored[:2]  # two stored photos as queries: brute-force top-5 in the index's space (centred on the
    # collection: 48 photos are too few to whiten on their own)
    m = stored.mean(0)
    space = stored - m
    space /= np.linalg.norm(space, axis=1, keepdims=True)
    qc = q - m
    qc /= np.linalg.norm(qc, axis=1, keepdims=True)
    want = np.argsort(-(qc @ space.T), axis=1)[:, :5]
    found = idx.search(q, k=5)
    assert [[int(i) for i in r] for r in found.ids] == [[int(ids[j]) for j in r] for r in want]


def test_a_run_without_it_has_none_and_can_fit_it_when_resumed_to_its_end(sample_photos, tmp_path):
    from dataclasses import replace

    from moco.training.checkpoints import resume_config

    tiny = {**SETUP, "max_steps": 2}
    cfg = resolve_config("cpu", data_dir=str(sample_photos), out=str(tmp_path / "r"), whiten=False, **tiny)
    summary = train(cfg, progress=False)
    assert summary.whitening is None and "whitening" not in load_checkpoint(tmp_path / "r" / "checkpoint.pt")
    assert Embedder.load(tmp_path / "r" / "checkpoint.pt", device="cpu").space is None  # raw features, as before
    again = resume_config(tmp_path / "r", {"whiten": True, "max_steps": 3})
    summary = train(replace(again), resume=True, progress=False)
    assert summary.steps == 3 and summary.whitening is not None
    assert summary.whitening.rows == 48 and summary.whitening.seconds >= 0
    from moco.training.command import summary_line

    # the preset's --whiten-stages auto: 48 photos are too few to whiten 960-d features (2 x 960 needed); its
    # --whiten-edges auto: 48 photos from scratch take their edge layout
    assert ("whitening fitted on 48 photos and their mirror images, 1024-d with the photos' edge layout in "
            in summary_line(summary, tmp_path / "r"))
    white = Embedder.load(tmp_path / "r" / "checkpoint.pt", device="cpu").space
    assert white.count == 48 and white.stages == (("edges", 512),) and white.dim == 512 + 512
    assert resume_config(tmp_path / "r", {"whiten_stages": "off"}).whiten_stages == "off"  # an end-of-run choice too
    assert resume_config(tmp_path / "r", {"whiten_edges": "off"}).whiten_edges == "off"


def test_near_duplicates_of_a_whitened_index_use_its_threshold(run, sample_photos, tmp_path, capsys):
    import shutil

    from PIL import Image

    from app.cli.commands import main
    from index.building.runner import build_index
    from index.calibrate import DEDUP_THRESHOLD, STAGED_DEDUP_THRESHOLD, WHITENED_DEDUP_THRESHOLD, dedup_threshold
    from index.duplicates.dedup import find_duplicates, load_duplicates
    from index.duplicates.verify import COPY_SCORE
    from index.search.image_index import ImageIndex

    photos = tmp_path / "photos"
    shutil.copytree(sample_photos, photos)
    originals = _photos(photos)[::12]  # 4 photos, each with an exact copy and a resized JPEG copy
    for n, f in enumerate(originals):
        shutil.copy(f, photos / f"copy{n}{f.suffix}")
        with Image.open(f) as im:
            im.convert("RGB").resize((40, 40)).save(photos / f"small{n}.jpg", quality=90)
    export_backbone(run / "checkpoint.pt", tmp_path / "b.safetensors")
    build_index(photos, tmp_path / "b.safetensors", tmp_path / "idx", progress=False, device="cpu")
    idx = ImageIndex.open(tmp_path / "idx")
    threshold = idx.meta["dedup_calibration"]["threshold"]  # measured on copies of its photos (test_dedup_groups)
    assert idx.pooled_stages and idx.stats()["dedup_threshold"] == threshold
    groups = find_duplicates(idx)  # no threshold given: the index's
    assert load_duplicates(idx.dir).threshold == threshold
    ids, vecs = idx.catalog.vectors(dim=idx.dim)
    c = dict(zip(ids.tolist(), idx.to_space(vecs)))  # id -> D, the search space
    for g in groups:  # every member a copy of its group's representative by its pixels, its cosine the search's
        rep = g.representative.id
        assert all(m.copy_score >= COPY_SCORE for m in g.members)
        assert all(c[rep] @ c[m.id] == pytest.approx(m.similarity, abs=1e-4) for m in g.members)
    grouped = {m.path for g in groups for m in g.members}
    assert {f"copy{n}{f.suffix}" for n, f in enumerate(originals)} <= grouped  # exact copies: cosine 1
    assert main(["index", "dedup", str(tmp_path / "idx")]) == 0
    assert f"by the model at cosine >= {threshold} (calibrated on" in capsys.readouterr().out
    del idx.meta["dedup_calibration"]  # an index from before calibrations: the default of its kind
    assert not idx.whitened and idx.stats()["dedup_threshold"] == DEDUP_THRESHOLD  # 52 photos: centred
    from dataclasses import replace

    idx.space = replace(idx.space, matrix=np.eye(idx.dim, dtype=np.float32))  # as a whitened index of 2,000 photos
    assert idx.whitened and idx.stats()["dedup_threshold"] == STAGED_DEDUP_THRESHOLD == 0.7
    idx.meta["features"]["stages"] = []  # an index of a run without the stages
    assert not idx.pooled_stages and dedup_threshold(idx) == WHITENED_DEDUP_THRESHOLD == 0.8
