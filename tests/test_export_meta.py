"""Export metadata: one typed value (BackboneMeta) that every format stores as the strings the exporter has always
written, read back equal; files written by the previous exporter (a string dict built key by key) load unchanged."""

from __future__ import annotations

import json
import zipfile

import numpy as np
import pytest
import torch

from moco.config import IMAGENET_MEAN, IMAGENET_STD, resolve_config, to_plain
from moco.export.exporter import export_backbone
from moco.export.meta import BACKBONE_ID, BackboneMeta
from moco.export.reader import embedding_dim, load_exported
from moco.training.checkpoints import save_checkpoint
from moco.training.setup import build_model
from moco.whiten import Whitening

WHITENING = {"shrinkage": 0.25, "count": 48, "source": "training photos", "mirror": True, "stages": [["layer3", 256]]}


def _old_strings(meta: BackboneMeta, fmt: str = "safetensors") -> dict[str, str]:
    """The reference: the metadata of ``meta``'s values as the previous exporter built it, key by key (its code,
    with its inputs taken from ``meta``; a program with a space: ``backbone_dim`` added, ``embed_dim`` replaced)."""
    dim = meta.backbone_dim if meta.backbone_dim is not None else meta.embed_dim
    old = {
        "format": BACKBONE_ID,
        "format_version": "1",
        "arch": meta.arch,
        "arch_kwargs": json.dumps(meta.arch_kwargs),
        "small_stem": json.dumps(meta.small_stem),
        "embed_dim": str(dim),
        "image_size": str(meta.image_size),
        "resize": str(meta.resize),
        "crop": "center",
        "interpolation": "bicubic",
        "mean": json.dumps(list(meta.mean)),
        "std": json.dumps(list(meta.std)),
        "source_file": meta.source_file,
        "source_sha256": meta.source_sha256,
        "source_format": meta.source_format,
        "moco_version": meta.moco_version,
        "dropped": json.dumps(meta.dropped, sort_keys=True),
        "training": json.dumps(meta.training),
    }
    if meta.whitening is not None:
        old["whitening"] = json.dumps(meta.whitening)
        if fmt in ("onnx", "pt2"):
            old["backbone_dim"], old["embed_dim"] = str(dim), str(meta.embed_dim)
    old["output"] = json.dumps(meta.output)
    return old


def _meta(**change) -> BackboneMeta:
    plain = {"width": 512, "whitened": False, "centred": False, "normalized": True, "mirror": False, "stages": [],
             "fitted_on": None}
    values = dict(arch="resnet18", small_stem=False, embed_dim=512, image_size=32, resize=36, mean=IMAGENET_MEAN,
                  std=IMAGENET_STD, arch_kwargs={}, source_file="tv.pth", source_sha256="ab" * 32,
                  source_format="plain", moco_version="unknown", dropped={"projection head": 2, "classifier": 2},
                  training={"epoch": 3}, output=plain)
    return BackboneMeta(**{**values, **change})


SPACE_OUTPUT = {"width": 768, "whitened": True, "centred": True, "normalized": True, "mirror": True,
                "stages": [["layer3", 256]], "fitted_on": "training photos", "count": 48, "shrinkage": 0.25,
                "digest": "0123456789abcdef"}
CASES = {
    "plain": ("safetensors", _meta()),
    "vit": ("safetensors", _meta(arch="vit_tiny_patch16_224", arch_kwargs={"num_heads": 12}, embed_dim=192,
                                 output={"width": 192})),
    "whitened": ("safetensors", _meta(whitening=WHITENING, output=SPACE_OUTPUT)),
    "program with its space": ("pt2", _meta(whitening=WHITENING, embed_dim=768, backbone_dim=512,
                                            output=SPACE_OUTPUT)),
    "timm with its space": ("timm", _meta(whitening=WHITENING, output={
        **SPACE_OUTPUT, "apply": "moco.apply_space(model, x, DIR)", "model_output": {"width": 512,
                                                                                       "normalized": False}})),
    "mean in ints, a small stem": ("safetensors", _meta(mean=(0, 0, 0), std=(1, 1, 1), small_stem=True)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_strings_are_the_previous_exporters_and_read_back_equal(case):
    fmt, meta = CASES[case]
    strings = meta.to_strings()
    assert list(strings.items()) == list(_old_strings(meta, fmt).items())  # keys, encodings and order
    assert json.dumps(strings) == json.dumps(_old_strings(meta, fmt))  # a pt2 program's moco_meta.json, byte for byte
    assert BackboneMeta.from_strings(strings, "b.safetensors") == meta


def test_values_are_held_as_the_file_holds_them():
    meta = _meta(mean=[0.5, 0.5, 0.5], training={"sizes": (1, 2), 3: "x"}, dropped={"head": 1})
    assert meta.mean == (0.5, 0.5, 0.5) and meta.training == {"sizes": [1, 2], "3": "x"}  # JSON's lists, text keys
    assert BackboneMeta.from_strings(meta.to_strings(), "b.safetensors") == meta
    assert embedding_dim(meta) == 512 and embedding_dim(_meta(output=None, whitening=WHITENING)) == 768


def test_the_strings_a_file_stores():
    stored = _meta(whitening=WHITENING).to_strings()
    assert stored["embed_dim"] == "512" and json.loads(stored["whitening"]) == WHITENING
    assert "backbone_dim" not in stored and stored["source_sha256"] == "ab" * 32


@pytest.fixture(scope="module")
def whitened_checkpoint(tmp_path_factory):
    """A moco-retrieval checkpoint (ResNet-18, 32 px) with the whitening its run fitted: mirror image, layer3 pooled."""
    folder = tmp_path_factory.mktemp("whitened")
    cfg = resolve_config("v2", arch="resnet18", image_size=32, batch_size=8, queue_size=64, bn_splits=2,
                         small_stem=False)
    torch.manual_seed(0)
    g = np.random.default_rng(0)
    mean = g.standard_normal(768).astype(np.float32)
    w = Whitening(mean / np.linalg.norm(mean), np.eye(768, dtype=np.float32) * 2, 0.25, 48, mirror=True,
                  stages=(("layer3", 256),))
    save_checkpoint({"model": build_model(cfg).state_dict(), "step": 7, "config": to_plain(cfg), "files": ["a"] * 5,
                     "whitening": w.state()}, folder, keep=0)
    return folder / "checkpoint.pt"


def _stored(out, fmt) -> dict[str, str]:
    """The metadata strings a file of ``fmt`` holds, as its own format stores them."""
    if fmt in ("safetensors", "timm"):
        from safetensors import safe_open

        with safe_open(str(out / "model.safetensors" if fmt == "timm" else out), framework="pt") as f:
            return dict(f.metadata())
    if fmt == "onnx":
        import onnx

        return {p.key: p.value for p in onnx.load(str(out)).metadata_props}
    with zipfile.ZipFile(out) as z:
        text = z.read(next(n for n in z.namelist() if n.endswith("moco_meta.json"))).decode()
    assert text == json.dumps(_old_strings(BackboneMeta.from_strings(json.loads(text), out), fmt))  # byte for byte
    return json.loads(text)


@pytest.mark.parametrize("fmt", ["safetensors", "timm", "pt2", "onnx"])
def test_every_format_stores_the_meta_and_reads_it_back_equal(whitened_checkpoint, tmp_path, fmt):
    out = tmp_path / {"safetensors": "b.safetensors", "timm": "timm", "pt2": "b.pt2", "onnx": "b.onnx"}[fmt]
    meta = export_backbone(whitened_checkpoint, out, fmt=fmt)
    strings = _stored(out, fmt)
    assert strings == meta.to_strings() == _old_strings(meta, fmt)
    assert BackboneMeta.from_strings(strings, out) == meta
    assert meta.whitening["stages"] == [["layer3", 256]] and meta.output["width"] == 768 == embedding_dim(meta)
    assert (meta.embed_dim, meta.backbone_dim) == ((768, 512) if fmt in ("onnx", "pt2") else (512, None))
    if fmt in ("safetensors", "timm"):  # the reader's own path: the file checked against its weights
        assert load_exported(out / "model.safetensors" if fmt == "timm" else out)[1] == meta


def test_a_file_the_previous_exporter_wrote_loads_to_the_same_meta(backbone, tmp_path):
    from safetensors import safe_open
    from safetensors.torch import save_file

    from moco.embed import Embedder

    with safe_open(str(backbone), framework="pt") as f:
        state = {k: f.get_tensor(k) for k in f.keys()}
    _, meta = load_exported(backbone)
    old = tmp_path / "old.safetensors"
    save_file(state, str(old), metadata=_old_strings(meta))  # the string dict, as the previous exporter wrote it
    assert load_exported(old)[1] == meta
    assert Embedder.load(old, device="cpu").config == meta

    minimal = {k: meta.to_strings()[k] for k in ("format", "arch", "small_stem", "embed_dim", "image_size", "resize",
                                                   "mean", "std")}  # an early export: only what the reader requires
    save_file(state, str(tmp_path / "early.safetensors"), metadata=minimal)
    early = load_exported(tmp_path / "early.safetensors")[1]
    assert early == BackboneMeta(arch="resnet18", small_stem=False, embed_dim=512, image_size=32,
                                 resize=meta.resize, mean=meta.mean, std=meta.std)
    assert (early.arch_kwargs, early.crop, early.whitening, early.output, early.source_sha256) == (
        {}, "center", None, None, None)
    assert embedding_dim(early) == 512
    emb = Embedder.load(tmp_path / "early.safetensors", device="cpu")
    assert emb.config.whitening is None and emb.dim == 512
