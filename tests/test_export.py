"""Export: every key layout strips to the exact backbone, features equal the training model's."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import torchvision
from torch import nn

from app.cli.commands import main
from moco.config import resolve_config, to_plain
from moco.data.augment import center_view
from moco.embed import Embedder
from moco.errors import UserError
from moco.export.exporter import export_backbone
from moco.export.reader import load_exported
from moco.model.builder import build_mlp
from moco.training.checkpoints import save_checkpoint
from moco.training.setup import build_model
from moco.weights.arch import detect_arch
from moco.weights.layouts import read_checkpoint


def _resnet18(head: nn.Module | None = None) -> nn.Module:
    net = torchvision.models.resnet18(weights=None)
    if head is not None:
        net.fc = head
    return net


def _backbone_of(net: nn.Module, head: str = "fc.") -> dict[str, torch.Tensor]:
    return {k: v for k, v in net.state_dict().items() if not k.startswith(head)}


def _check(path, out, expected: dict[str, torch.Tensor], dropped: dict[str, int], arch: str, **kw):
    meta = export_backbone(path, out, **kw)
    state, meta2 = load_exported(out)
    assert meta2 == meta and meta.arch == arch
    assert set(state) == set(expected) and all(torch.equal(state[k], expected[k]) for k in state)
    assert meta.dropped == dropped
    return meta


@pytest.mark.parametrize("prefix", ["module.", ""])
def test_official_v1_v2(tmp_path, prefix):
    for version, head in (
        ("v1", nn.Linear(512, 128)),
        ("v2", nn.Sequential(nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 128))),
    ):
        q = _resnet18(head)
        sd = {f"{prefix}encoder_q.{k}": v for k, v in q.state_dict().items()}
        sd |= {f"{prefix}encoder_k.{k}": v.clone() for k, v in q.state_dict().items()}
        sd |= {f"{prefix}queue": torch.randn(128, 1024), f"{prefix}queue_ptr": torch.zeros(1, dtype=torch.long)}
        torch.save({"arch": "resnet18", "epoch": 200, "state_dict": sd}, tmp_path / f"{version}.pth.tar")
        n_head = len(head.state_dict())
        meta = _check(tmp_path / f"{version}.pth.tar", tmp_path / f"{version}.safetensors", _backbone_of(q),
                      {"momentum (key) encoder": len(q.state_dict()), "projection head": n_head,
                       "queue (keys of the original training images)": 2}, "resnet18")
        assert meta.moco_version == version and meta.source_format == "moco-v1/v2 (official)"
        assert meta.image_size == 224 and meta.resize == 256
        assert meta.training == {"epoch": 200, "arch": "resnet18"}


def test_official_v3_resnet_and_vit(tmp_path):
    import timm

    base = _resnet18(build_mlp(2, 512, 64, 32, last_bn=True))
    pred = build_mlp(2, 32, 64, 32, last_bn=False)
    sd = {f"module.base_encoder.{k}": v for k, v in base.state_dict().items()}
    sd |= {f"module.momentum_encoder.{k}": v for k, v in base.state_dict().items()}
    sd |= {f"module.predictor.{k}": v for k, v in pred.state_dict().items()}
    torch.save({"state_dict": sd}, tmp_path / "r.pth.tar")
    n_head = len(base.fc.state_dict())
    meta = _check(tmp_path / "r.pth.tar", tmp_path / "r.safetensors", _backbone_of(base),
                  {"momentum (key) encoder": len(base.state_dict()), "projection head": n_head,
                   "predictor": len(pred.state_dict())}, "resnet18")
    assert meta.moco_version == "v3"

    vit = timm.create_model("vit_small_patch16_224", pretrained=False, img_size=64, num_heads=12)
    vit.head = build_mlp(3, 384, 64, 32, last_bn=True)
    sd = {f"module.base_encoder.{k}": v for k, v in vit.state_dict().items()}
    sd |= {f"module.predictor.{k}": v for k, v in pred.state_dict().items()}
    torch.save({"state_dict": sd}, tmp_path / "v.pth.tar")
    meta = _check(tmp_path / "v.pth.tar", tmp_path / "v.safetensors", _backbone_of(vit, "head."),
                  {"projection head": len(vit.head.state_dict()), "predictor": len(pred.state_dict())},
                  "vit_small_patch16_224")
    assert meta.arch_kwargs == {"num_heads": 12} and meta.image_size == 64
    # the 12-head ViT-S of MoCo v3 computes the same features after the round trip
    emb = Embedder.load(tmp_path / "v.safetensors", device="cpu", precision="fp32")
    x = torch.randint(0, 256, (2, 73, 73, 3), dtype=torch.uint8)
    vit.head = nn.Identity()
    with torch.no_grad():
        want = nn.functional.normalize(vit.eval()(center_view(x, 64, emb.pixel_mean, emb.pixel_std)), dim=1).numpy()
    assert abs(emb.embed_squares(x) - want).max() < 1e-5


def test_plain_lightly_solo(tmp_path):
    net = _resnet18()
    torch.save(net.state_dict(), tmp_path / "tv.pth")
    _check(tmp_path / "tv.pth", tmp_path / "tv.safetensors", _backbone_of(net), {"classifier": 2}, "resnet18")
    seq = nn.Sequential(*list(net.children())[:-1])
    sd = {f"backbone.{k}": v for k, v in seq.state_dict().items()}
    sd |= {f"backbone_momentum.{k}": v for k, v in seq.state_dict().items()}
    sd |= {"projection_head.layers.0.weight": torch.zeros(4, 512)}
    torch.save(sd, tmp_path / "lightly.ckpt")
    _check(tmp_path / "lightly.ckpt", tmp_path / "l.safetensors", _backbone_of(net),
           {"momentum (key) encoder": len(seq.state_dict()), "projection head": 1}, "resnet18")
    solo = {f"backbone.{k}": v for k, v in _backbone_of(net).items()}
    solo |= {"projector.0.weight": torch.zeros(4, 512), "classifier.weight": torch.zeros(10, 512)}
    solo |= {f"momentum_backbone.{k}": v for k, v in _backbone_of(net).items()}
    torch.save({"state_dict": solo, "epoch": 9}, tmp_path / "solo.ckpt")
    meta = _check(tmp_path / "solo.ckpt", tmp_path / "s.safetensors", _backbone_of(net),
                  {"momentum (key) encoder": len(_backbone_of(net)), "projection head": 1, "classifier": 1},
                  "resnet18")
    assert meta.source_format == "solo-learn"


def test_unknown_keys_and_undetectable_arch_are_errors(tmp_path):
    q = _resnet18(nn.Linear(512, 128))
    sd = {f"module.encoder_q.{k}": v for k, v in q.state_dict().items()} | {"module.mystery": torch.zeros(3)}
    torch.save({"state_dict": sd}, tmp_path / "odd.pth.tar")
    with pytest.raises(UserError, match="module.mystery"):
        export_backbone(tmp_path / "odd.pth.tar", tmp_path / "o.safetensors")
    torch.save({"conv_a.weight": torch.zeros(3, 3)}, tmp_path / "weird.pth")
    with pytest.raises(UserError, match="--arch"):
        detect_arch(read_checkpoint(tmp_path / "weird.pth"))


@pytest.mark.parametrize("preset,arch,size", [("v2", "resnet18", 32), ("v3", "vit_tiny_patch16_224", 32)])
def test_exported_features_equal_training_model(tmp_path, preset, arch, size):
    kw = dict(arch=arch, image_size=size, batch_size=8, queue_size=64 if preset == "v2" else 0)
    if preset == "v2":
        kw.update(small_stem=True, bn_splits=2)
    else:
        kw.update(mlp_hidden=32, dim=16)
    cfg = resolve_config(preset, **kw)
    model = build_model(cfg)
    with torch.no_grad():  # move BN statistics away from their init so eval mode matters
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.uniform_(-0.1, 0.1)
                m.running_var.uniform_(0.5, 1.5)
    save_checkpoint({"model": model.state_dict(), "step": 7, "config": to_plain(cfg), "files": ["a"] * 5},
                    tmp_path, keep=0)
    meta = export_backbone(tmp_path / "checkpoint.pt", tmp_path / "b.safetensors")
    assert meta.moco_version == preset and meta.arch == arch and meta.small_stem == (preset == "v2")
    assert meta.training["step"] == 7 and meta.training["images"] == 5
    emb = Embedder.load(tmp_path / "b.safetensors", device="cpu", precision="fp32")
    x = torch.randint(0, 256, (4, size, size, 3), dtype=torch.uint8)
    model.eval()
    with torch.no_grad():
        want = nn.functional.normalize(model.backbone(center_view(x, size, cfg.mean, cfg.std)), dim=1).numpy()
    got = emb.embed_squares(x)
    assert got.dtype == "float32" and got.shape == (4, emb.dim)
    assert abs(got - want).max() < 1e-5
    # loading the checkpoint directly gives the same embedder
    assert (
        abs(Embedder.load(tmp_path / "checkpoint.pt", device="cpu", precision="fp32").embed_squares(x) - got).max() == 0
    )


def test_pt2_and_cli(tmp_path, capsys):
    net = _resnet18()
    torch.save(net.state_dict(), tmp_path / "tv.pth")
    assert main(["export", str(tmp_path / "tv.pth"), "-o", str(tmp_path / "b.pt2"), "--format", "pt2",
                 "--image-size", "64"]) == 0
    program = torch.export.load(str(tmp_path / "b.pt2"))
    x = torch.randn(2, 3, 64, 64)
    net.fc = nn.Identity()
    with torch.no_grad():
        torch.testing.assert_close(program.module()(x), net.eval()(x), rtol=1e-4, atol=1e-4)
    assert "exported resnet18 (512-d" in capsys.readouterr().out
    assert main(["export", str(tmp_path / "missing.pth"), "-o", str(tmp_path / "x.safetensors")]) == 2
    # the deprecated torch.jit.trace path is gone: a clear message names its replacement, nothing is written
    assert main(["export", str(tmp_path / "tv.pth"), "-o", str(tmp_path / "b.pt"), "--format", "torchscript"]) == 2
    assert "--format pt2" in capsys.readouterr().err and not (tmp_path / "b.pt").exists()
    assert main(["export", str(tmp_path / "tv.pth"), "-o", str(tmp_path / "b.pt"), "--format", "pt2"]) == 2
    assert f"use -o {tmp_path / 'b.pt2'}" in capsys.readouterr().err and not (tmp_path / "b.pt").exists()


class _Evil:
    def __reduce__(self):
        return (print, ("pwned",))


def test_pickle_payload_refused_by_export(tmp_path, capsys):
    torch.save({"state_dict": {"x": torch.zeros(1)}, "extra": _Evil()}, tmp_path / "evil.pth")
    assert main(["export", str(tmp_path / "evil.pth"), "-o", str(tmp_path / "e.safetensors")]) == 2
    err = capsys.readouterr().err
    assert "refusing" in err and "pickled code" in err
    assert not (tmp_path / "e.safetensors").exists()


def _randomized_bn(net: nn.Module) -> nn.Module:
    with torch.no_grad():  # BN statistics away from their init, so eval-mode differences would show
        for m in net.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.uniform_(-0.1, 0.1)
                m.running_var.uniform_(0.5, 1.5)
    return net


@pytest.mark.parametrize("fmt", ["onnx", "pt2"])
def test_onnx_and_pt2_dynamic_batch_match_pytorch(tmp_path, fmt):
    import warnings

    torch.manual_seed(0)
    net = _randomized_bn(_resnet18())
    torch.save(net.state_dict(), tmp_path / "tv.pth")
    out = tmp_path / f"b.{fmt}"
    with warnings.catch_warnings():  # the current exporters: no deprecation warning from our calls
        warnings.simplefilter("error", DeprecationWarning)
        warnings.simplefilter("error", FutureWarning)
        meta = export_backbone(tmp_path / "tv.pth", out, fmt=fmt, image_size=32)
    if fmt == "onnx":
        import onnx
        import onnxruntime as ort

        assert {p.key: p.value for p in onnx.load(str(out)).metadata_props} == meta.to_strings()
        session = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
        run = lambda x: session.run(None, {"images": x.numpy()})[0]
    else:
        extra = {"moco_meta.json": ""}
        program = torch.export.load(str(out), extra_files=extra)
        assert json.loads(extra["moco_meta.json"]) == meta.to_strings()
        run = lambda x: program.module()(x).detach().numpy()
    assert meta.image_size == 32 and meta.mean and meta.std
    net.fc = nn.Identity()
    for n in (1, 5):  # batch sizes other than the export example's, from the one file
        x = torch.randn(n, 3, 32, 32)
        with torch.no_grad():
            want = net.eval()(x).numpy()
        got = run(x)
        assert got.shape == (n, 512) and abs(got - want).max() < 1e-4


def _square_images(n: int, side: int) -> list:
    from PIL import Image

    g = torch.Generator().manual_seed(1)
    return [Image.fromarray(torch.randint(0, 256, (side, side, 3), generator=g, dtype=torch.uint8).numpy())
            for _ in range(n)]


@pytest.mark.parametrize("kind", ["resnet18", "vit_small_12_heads"])
def test_timm_format_loads_in_timm_with_its_preprocessing(tmp_path, kind):
    import timm
    import timm.data

    torch.manual_seed(0)
    if kind == "resnet18":
        size, arch = 112, "resnet18"
        torch.save(_randomized_bn(_resnet18()).state_dict(), tmp_path / "ckpt.pth")
    else:  # an official MoCo v3 ViT-S layout: 12 heads (timm's vit_small has 6)
        size, arch = 32, "vit_small_patch16_224"
        vit = timm.create_model(arch, pretrained=False, img_size=size, num_heads=12, num_classes=0)
        torch.save({"state_dict": {f"module.base_encoder.{k}": v for k, v in vit.state_dict().items()}},
                   tmp_path / "ckpt.pth")
    meta = export_backbone(tmp_path / "ckpt.pth", tmp_path / "timm", fmt="timm", image_size=size)
    assert sorted(p.name for p in (tmp_path / "timm").iterdir()) == ["config.json", "model.safetensors"]
    cfg = json.loads((tmp_path / "timm" / "config.json").read_text())
    assert cfg["architecture"] == arch and cfg["num_classes"] == 0
    model = timm.create_model(f"local-dir:{tmp_path / 'timm'}", pretrained=True).eval()
    data = timm.data.resolve_data_config({}, model=model)
    assert tuple(data["input_size"]) == (3, size, size) and data["interpolation"] == "bicubic"
    assert tuple(data["mean"]) == meta.mean and tuple(data["std"]) == meta.std
    transform = timm.data.create_transform(**data)
    assert transform.transforms[0].size == meta.resize  # timm resizes to our resize, then crops
    export_backbone(tmp_path / "ckpt.pth", tmp_path / "ref.safetensors", image_size=size)
    emb = Embedder.load(tmp_path / "ref.safetensors", device="cpu", precision="fp32")
    images = _square_images(3, meta.resize)
    with torch.no_grad():
        got = nn.functional.normalize(model(torch.stack([transform(im) for im in images])), dim=1).numpy()
    assert abs(got - emb.embed(images)).max() < 1e-4
    # the weights file carries our metadata too: the Embedder reads it as it is
    assert Embedder.load(tmp_path / "timm" / "model.safetensors", device="cpu").config == meta


@pytest.mark.parametrize(("arch", "size"), [("resnet18", 64), ("vit_tiny_patch16_224", 32)])
def test_timm_format_fine_tunes_with_a_fresh_head(tmp_path, arch, size):
    """What a timm user does first: create_model(num_classes=10) on our export loads every backbone tensor as
    exported and gives a new 10-way head (timm drops the `classifier` the config names)."""
    import timm

    torch.manual_seed(0)
    if arch == "resnet18":
        torch.save(_randomized_bn(_resnet18()).state_dict(), tmp_path / "ckpt.pth")
    else:  # an official MoCo v3 layout
        vit = timm.create_model(arch, pretrained=False, img_size=size, num_classes=0)
        torch.save({"state_dict": {f"module.base_encoder.{k}": v for k, v in vit.state_dict().items()}},
                   tmp_path / "ckpt.pth")
    export_backbone(tmp_path / "ckpt.pth", tmp_path / "timm", fmt="timm", image_size=size)
    exported, _ = load_exported(tmp_path / "timm" / "model.safetensors")

    model = timm.create_model(f"local-dir:{tmp_path / 'timm'}", pretrained=True, num_classes=10)
    head = "fc" if arch == "resnet18" else "head"
    state = model.state_dict()
    assert set(state) - set(exported) == {f"{head}.weight", f"{head}.bias"}  # only the new head is not ours
    assert all(torch.equal(state[k], exported[k]) for k in exported)  # every backbone tensor exactly
    assert model.get_classifier().out_features == 10 and model.num_classes == 10
    with torch.no_grad():
        assert model.eval()(torch.randn(2, 3, size, size)).shape == (2, 10)
    # grayscale fine-tuning: timm sums the first conv over the colour channels (it knows which conv is first)
    gray = timm.create_model(f"local-dir:{tmp_path / 'timm'}", pretrained=True, num_classes=10, in_chans=1)
    first = "conv1" if arch == "resnet18" else "patch_embed.proj"
    assert torch.allclose(gray.state_dict()[f"{first}.weight"], exported[f"{first}.weight"].sum(1, keepdim=True))


def test_timm_format_refuses_the_small_stem(tmp_path):
    net = _resnet18()
    net.conv1 = nn.Conv2d(3, 64, 3, 1, 1, bias=False)
    torch.save(net.state_dict(), tmp_path / "small.pth")
    with pytest.raises(UserError, match="small stem.*--format safetensors"):
        export_backbone(tmp_path / "small.pth", tmp_path / "timm", fmt="timm")
    assert not (tmp_path / "timm").exists()


# ------------------------------------------------------------------------------- full disks, damaged metadata
@pytest.mark.parametrize("case", ["full", "read-only"])
def test_export_onto_a_full_or_read_only_disk_names_the_path(tmp_path, capsys, case):
    from tests.mounts import remount_ro, tmpfs

    torch.save(_resnet18().state_dict(), tmp_path / "tv.pth")  # a 45 MB backbone
    with tmpfs(tmp_path / "disk", "1m") as disk:
        if case == "read-only":
            remount_ro(disk)
        out = disk / "B.safetensors"
        assert main(["export", str(tmp_path / "tv.pth"), "-o", str(out)]) == 1  # storage: not bad input
        err = capsys.readouterr().err
        assert str(out) in err and ("no space left" if case == "full" else "read-only") in err
        assert "SafetensorError" not in err and "run the same command" in err
        assert list(disk.iterdir()) == []  # nothing half written left behind


def _with_meta(src, dst, change) -> None:
    """Copy the safetensors file ``src`` to ``dst`` with ``change(metadata)`` applied."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(src), framework="pt") as f:
        meta, state = dict(f.metadata()), {k: f.get_tensor(k) for k in f.keys()}
    change(meta)
    save_file(state, str(dst), metadata=meta)


@pytest.mark.parametrize(
    "key, value, needle",
    [
        ("arch", None, "is missing"),
        ("embed_dim", None, "is missing"),
        ("resize", "100000", "100000"),  # decoding one photo at that size would take 30 GB
        ("resize", "16", "16"),  # smaller than the crop
        ("image_size", "0", "0"),
        ("image_size", "abc", "whole number"),
        ("embed_dim", "-3", "-3"),
        ("mean", "[0.5, 0.5]", "three finite numbers"),
        ("mean", "[NaN, 0, 0]", "three finite numbers"),
        ("std", "[0, 0.2, 0.2]", "positive"),
        ("small_stem", "maybe", "true or false"),
        ("arch", "", "empty"),
        ("arch_kwargs", "[1, 2]", "JSON object"),
        ("output", "{broken", "JSON"),
        ("output", '{"width": 0}', "width"),
        ("whitening", '{"stages": [["layer3", "x"]]}', "stages"),
        ("training", "[" * 100000, "JSON"),  # nested past the parser's recursion limit
    ],
)
def test_damaged_backbone_metadata_names_the_file_and_the_key(backbone, tmp_path, key, value, needle):
    bad = tmp_path / "bad.safetensors"
    _with_meta(backbone, bad, lambda m: m.pop(key) if value is None else m.__setitem__(key, value))
    with pytest.raises(UserError) as e:
        load_exported(bad)
    msg = str(e.value)
    assert str(bad) in msg and repr(key) in msg and needle in msg and "moco export" in msg and len(msg) < 400


def test_backbone_metadata_is_an_allow_list(backbone, tmp_path, caplog):
    odd = tmp_path / "odd.safetensors"
    _with_meta(backbone, odd, lambda m: m.update(evil="x", other="y"))
    with caplog.at_level("WARNING"):
        _, meta = load_exported(odd)
    assert meta == load_exported(backbone)[1]  # unknown keys are dropped, and said
    assert "'evil', 'other'" in caplog.text and str(odd) in caplog.text


def test_cli_on_a_backbone_without_its_arch_exits_2_naming_it(backbone, sample_photos, tmp_path, capsys):
    bad = tmp_path / "bad.safetensors"
    _with_meta(backbone, bad, lambda m: m.pop("arch"))
    assert main(["index", "build", str(sample_photos), "--backbone", str(bad), "-o", str(tmp_path / "idx")]) == 2
    err = capsys.readouterr().err
    assert str(bad) in err and "'arch'" in err and "KeyError" not in err


@pytest.mark.parametrize(
    "key, value, needles",
    [
        ("arch", "no_such_net", ["'no_such_net' is not a backbone this version builds", "timm"]),
        ("arch_kwargs", '{"evil": 1}', ["'evil' = '1'", "not an architecture setting", "num_heads"]),
        ("arch_kwargs", '{"depth": 1000000000}', ["'depth' = '1000000000'", "outside 1..65536"]),
        ("arch_kwargs", '{"num_heads": "12"}', ["'num_heads' = '12'", "is not int"]),
        ("output", '{"width": 7}', ["declares width 7", "give 512-d vectors", "resnet18"]),  # the weights: 512
        ("embed_dim", "256", ["'embed_dim' says 256-d", "gives 512"]),  # output and features declared alike
        ("arch", "resnet50", ["weights are not those of", "'resnet50'"]),  # a known arch, other weights
    ],
)
def test_backbone_metadata_that_contradicts_the_weights_names_the_file_the_key_and_the_fix(
        backbone, tmp_path, key, value, needles):
    bad = tmp_path / "bad.safetensors"
    change = {key: value, **({"output": json.dumps({"width": 256})} if key == "embed_dim" else {})}
    _with_meta(backbone, bad, lambda m: m.update(change))
    with pytest.raises(UserError) as e:
        Embedder.load(bad, device="cpu")
    msg = str(e.value)
    assert msg.startswith(f"{bad}: its ") and f"'{key}'" in msg and "moco export" in msg and len(msg) < 500, msg
    assert all(n in msg for n in needles), msg


def test_cli_on_a_backbone_of_an_unknown_arch_exits_2_naming_the_file(backbone, sample_photos, tmp_path, capsys):
    bad = tmp_path / "bad.safetensors"
    _with_meta(backbone, bad, lambda m: m.update(arch="no_such_net"))
    assert main(["index", "build", str(sample_photos), "--backbone", str(bad), "-o", str(tmp_path / "idx")]) == 2
    err = capsys.readouterr().err
    assert str(bad) in err and "'arch' = 'no_such_net'" in err and "moco export" in err


def _export_env(tmpdir) -> dict[str, str]:
    """The environment of a `moco export` subprocess whose temporary folder is ``tmpdir`` (as a user's $TMPDIR)."""
    import os
    from pathlib import Path

    tmpdir.mkdir()
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]), TMPDIR=str(tmpdir))
    env.pop("TORCHINDUCTOR_CACHE_DIR", None)  # this process's torch set it: the subprocess must choose its own
    return env


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["onnx", "pt2"])
def test_a_program_onto_a_full_disk_names_the_path_and_leaves_nothing(tmp_path, fmt):
    import subprocess
    import sys

    from tests.mounts import tmpfs

    torch.save(_resnet18().state_dict(), tmp_path / "tv.pth")
    env = _export_env(tmp_path / "tmp")
    with tmpfs(tmp_path / "disk", "1m") as disk:
        out = disk / f"b.{fmt}"
        argv = ["export", str(tmp_path / "tv.pth"), "-o", str(out), "--format", fmt, "--image-size", "32"]
        r = subprocess.run([sys.executable, "-m", "app.cli", *argv], env=env, capture_output=True, text=True)
        assert r.returncode == 1, r.stderr[-3000:]  # storage: not bad input, and never an abort (-6)
        assert f"no space left on device while writing {out}: free space" in r.stderr, r.stderr[-3000:]
        assert "Traceback" not in r.stderr and "frame #" not in r.stderr
        assert list(disk.iterdir()) == []  # nothing half written left behind
    assert list((tmp_path / "tmp").iterdir()) == []  # no .ses, no torchinductor_USER


def test_a_timm_folder_onto_a_full_disk_names_the_folder(tmp_path, capsys):
    from tests.mounts import tmpfs

    torch.save(_resnet18().state_dict(), tmp_path / "tv.pth")
    with tmpfs(tmp_path / "disk", "1m") as disk:
        out = disk / "exp-timm"
        assert main(["export", str(tmp_path / "tv.pth"), "-o", str(out), "--format", "timm", "--image-size", "64"]) == 1
        err = capsys.readouterr().err
        assert f"no space left on device while writing {out}: free space" in err, err
        assert list(disk.iterdir()) == []


@pytest.mark.slow
def test_sigterm_during_an_export_leaves_nothing_beside_it_or_in_tmpdir(tmp_path):
    import signal
    import subprocess
    import sys
    import time

    torch.save(_resnet18().state_dict(), tmp_path / "tv.pth")
    (tmp_path / "to").mkdir()
    out = tmp_path / "to" / "exp-timm"
    env = _export_env(tmp_path / "tmp")
    argv = ["export", str(tmp_path / "tv.pth"), "-o", str(out), "--format", "timm", "--image-size", "64"]
    for _ in range(5):  # until the export is held still midway (a loaded machine may see its folder late)
        proc = subprocess.Popen([sys.executable, "-m", "app.cli", *argv], env=env, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 300
        while not list(out.parent.glob(".exp-timm.*")) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.002)
        assert proc.poll() is None, "the export ended before its temporary folder was seen"
        proc.send_signal(signal.SIGSTOP)  # held still: its folder there and no output yet is midway
        midway = bool(list(out.parent.glob(".exp-timm.*"))) and not out.exists()
        if midway:
            break
        proc.send_signal(signal.SIGCONT)
        assert proc.communicate(timeout=120) is not None and proc.returncode == 0
        shutil.rmtree(out)
    assert midway, "no export was held still midway in 5 tries"
    proc.send_signal(signal.SIGTERM)  # as a service manager or `kill` stops it, midway
    proc.send_signal(signal.SIGCONT)
    err = proc.communicate(timeout=120)[1]
    assert proc.returncode == 130, err[-3000:]
    assert "moco export: interrupted" in err
    assert list(out.parent.iterdir()) == []  # no .exp-timm.* beside the output, and no half output
    assert list((tmp_path / "tmp").iterdir()) == []
