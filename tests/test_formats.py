"""--init from every supported checkpoint layout, built here from torchvision/timm models with the
official key names, with an exact account of what was loaded, re-initialized and ignored."""

from __future__ import annotations

import pickle

import pytest
import torch
import torchvision
from torch import nn

from moco.config import resolve_config
from moco.errors import UserError
from moco.model.builder import build_mlp
from moco.training.setup import build_model
from moco.weights.layouts import load_init, read_checkpoint


def _resnet18_sd(head: nn.Module | None = None, prefix: str = "") -> dict[str, torch.Tensor]:
    net = torchvision.models.resnet18(weights=None)
    if head is not None:
        net.fc = head
    return {prefix + k: v for k, v in net.state_dict().items()}


def _model(preset="v2", **kw):
    base = dict(arch="resnet18", queue_size=256, batch_size=8, bn_splits=2)
    if preset == "v3":
        base.update(queue_size=0, bn_splits=1, mlp_hidden=64, dim=32)
    return build_model(resolve_config(preset, **{**base, **kw}))


def _same(module: nn.Module, sd: dict[str, torch.Tensor]) -> bool:
    own = module.state_dict()
    return set(own) == set(sd) and all(torch.equal(own[k], sd[k]) for k in own)


def _backbone_part(sd: dict, prefix: str) -> dict:
    return {
        k[len(prefix) :]: v for k, v in sd.items() if k.startswith(prefix) and not k[len(prefix) :].startswith("fc.")
    }


@pytest.mark.parametrize("module_prefix", ["module.", ""])
@pytest.mark.parametrize("version", ["v1", "v2"])
def test_official_v1_v2(tmp_path, version, module_prefix):
    head = (
        nn.Linear(512, 128) if version == "v1" else nn.Sequential(nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 128))
    )
    q = _resnet18_sd(head, module_prefix + "encoder_q.")
    k = _resnet18_sd(head, module_prefix + "encoder_k.")
    sd = {**q, **k, module_prefix + "queue": torch.randn(128, 4096), module_prefix + "queue_ptr": torch.zeros(1)}
    path = tmp_path / "moco.pth.tar"
    torch.save({"epoch": 200, "arch": "resnet18", "state_dict": sd, "optimizer": {"state": {}}}, path)
    split = read_checkpoint(path)
    assert split.format == "moco-v1/v2 (official)" and split.meta == {"arch": "resnet18", "epoch": 200}
    model = _model(version)
    report = load_init(model, path)
    assert _same(model.backbone, _backbone_part(q, module_prefix + "encoder_q."))
    assert _same(model.backbone_momentum, _backbone_part(q, module_prefix + "encoder_q."))  # key encoder = copy
    head_sd = {k[len(module_prefix + "encoder_q.fc.") :]: v for k, v in q.items() if ".fc." in k}
    if version == "v1":
        head_sd = {f"0.{k}": v for k, v in head_sd.items()}
    assert _same(model.projector, head_sd) and _same(model.projector_momentum, head_sd)
    n_backbone = len(model.backbone.state_dict())
    assert report["loaded"] == [
        f"backbone: loaded ({n_backbone} tensors)",
        f"projector: loaded ({len(head_sd)} tensors)",
    ]
    assert report["reinitialized"] == []
    ignored = {line.split(" (")[0] for line in report["ignored"]}
    expected = set(k) | {module_prefix + "queue", module_prefix + "queue_ptr", "predictor: not in this model"}
    assert ignored == expected


def test_official_v1_head_into_v2_model_is_reinitialized(tmp_path):
    sd = _resnet18_sd(nn.Linear(512, 128), "module.encoder_q.")
    torch.save({"state_dict": sd}, tmp_path / "v1.pth.tar")
    model = _model("v2")
    fresh = {k: v.clone() for k, v in model.projector.state_dict().items()}
    report = load_init(model, tmp_path / "v1.pth.tar")
    assert len(report["reinitialized"]) == 1 and report["reinitialized"][0].startswith("projector: re-initialized")
    assert _same(model.projector, fresh)


@pytest.mark.parametrize("arch", ["resnet18", "vit_tiny_patch16_224"])
def test_official_v3(tmp_path, arch):
    model = _model("v3", arch=arch, image_size=32)
    width = 512 if arch == "resnet18" else 192
    if arch == "resnet18":
        base = torchvision.models.resnet18(weights=None)
        base.fc = build_mlp(2, width, 64, 32, last_bn=True)  # builder.py MoCo_ResNet
        head = "fc."
    else:
        import timm

        base = timm.create_model(arch, pretrained=False, img_size=32)
        base.head = build_mlp(3, width, 64, 32, last_bn=True)
        head = "head."
    pred = build_mlp(2, 32, 64, 32, last_bn=arch != "resnet18")  # a last BN for ViTs only (builder.py)
    sd = {
        **{f"module.base_encoder.{k}": v for k, v in base.state_dict().items()},
        **{f"module.momentum_encoder.{k}": v.clone() for k, v in base.state_dict().items()},
        **{f"module.predictor.{k}": v for k, v in pred.state_dict().items()},
    }
    torch.save({"epoch": 100, "arch": arch, "state_dict": sd}, tmp_path / "v3.pth.tar")
    report = load_init(model, tmp_path / "v3.pth.tar")
    assert read_checkpoint(tmp_path / "v3.pth.tar").format == "moco-v3 (official)"
    assert _same(model.backbone, {k: v for k, v in base.state_dict().items() if not k.startswith(head)})
    assert _same(model.projector, {k[len(head) :]: v for k, v in base.state_dict().items() if k.startswith(head)})
    assert _same(model.predictor, pred.state_dict())
    assert [r.split(":")[0] for r in report["loaded"]] == ["backbone", "projector", "predictor"]
    assert {r.split(" (")[0] for r in report["ignored"]} == {k for k in sd if k.startswith("module.momentum_encoder.")}


def test_plain_torchvision_and_timm(tmp_path):
    sd = _resnet18_sd()
    torch.save(sd, tmp_path / "tv.pth")
    model = _model("v2")
    report = load_init(model, tmp_path / "tv.pth")
    assert read_checkpoint(tmp_path / "tv.pth").format == "plain"
    assert {r.split(" (")[0] for r in report["ignored"]} == {"fc.weight", "fc.bias", "predictor: not in this model"}
    assert report["reinitialized"] == ["projector: re-initialized (not in the checkpoint)"]
    import timm

    t = timm.create_model("resnet18", pretrained=False)
    torch.save(t.state_dict(), tmp_path / "timm.pth")
    model = _model("v2", arch="timm/resnet18")
    load_init(model, tmp_path / "timm.pth")
    assert _same(model.backbone, {k: v for k, v in t.state_dict().items() if not k.startswith("fc.")})


def test_lightly_sequential_backbone_and_solo_learn(tmp_path):
    net = torchvision.models.resnet18(weights=None)
    seq = nn.Sequential(*list(net.children())[:-1])
    sd = {f"backbone.{k}": v for k, v in seq.state_dict().items()}
    sd.update({f"backbone_momentum.{k}": v for k, v in seq.state_dict().items()})
    sd["projection_head.layers.0.weight"] = torch.randn(512, 512)
    torch.save(sd, tmp_path / "lightly.ckpt")
    model = _model("v2")
    report = load_init(model, tmp_path / "lightly.ckpt")
    assert read_checkpoint(tmp_path / "lightly.ckpt").format == "lightly"
    assert _same(model.backbone, {k: v for k, v in net.state_dict().items() if not k.startswith("fc.")})
    assert report["reinitialized"][0].startswith("projector: re-initialized")

    solo = {f"backbone.{k}": v for k, v in net.state_dict().items() if not k.startswith("fc.")}
    solo.update({f"momentum_backbone.{k}": v for k, v in net.state_dict().items() if not k.startswith("fc.")})
    solo.update({"classifier.weight": torch.randn(10, 512), "classifier.bias": torch.zeros(10)})
    torch.save({"state_dict": solo, "epoch": 3}, tmp_path / "solo.ckpt")
    report = load_init(_model("v2"), tmp_path / "solo.ckpt")
    assert read_checkpoint(tmp_path / "solo.ckpt").format == "solo-learn"
    ignored = {r.split(" (")[0] for r in report["ignored"]}
    assert {"classifier.weight", "classifier.bias"} <= ignored


def test_our_checkpoint_and_wrong_arch(tmp_path):
    from moco.training.checkpoints import save_checkpoint

    src = _model("v2")
    save_checkpoint({"model": src.state_dict(), "step": 5, "config": {}}, tmp_path, keep=0)
    dst = _model("v2")
    report = load_init(dst, tmp_path / "checkpoint.pt")
    assert _same(dst.backbone, src.backbone.state_dict()) and _same(dst.projector, src.projector.state_dict())
    assert any("queue" in r for r in report["ignored"])
    with pytest.raises(UserError, match="--arch"):
        load_init(_model("v2", arch="resnet34"), tmp_path / "checkpoint.pt")


class _Evil:
    def __reduce__(self):
        return (print, ("pwned",))


def test_pickle_payload_is_refused(tmp_path):
    path = tmp_path / "evil.pth"
    with open(path, "wb") as f:
        pickle.dump({"state_dict": _Evil()}, f)
    torch.save({"state_dict": {"x": torch.zeros(1)}, "extra": _Evil()}, tmp_path / "evil2.pth")
    for p in (path, tmp_path / "evil2.pth"):
        with pytest.raises(UserError, match="refusing|cannot read"):
            read_checkpoint(p)
