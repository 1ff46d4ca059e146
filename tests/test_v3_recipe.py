"""MoCo v3 as published (facebookresearch/moco-v3 builder.py, vits.py, main_moco.py, CONFIG.md).

Heads per backbone family, zero-init residuals, crop scale, the ViT initialization, and the official
ViT-Small's 12 heads (timm's ``vit_small_patch16_224`` has 6 with the same weight shapes) through
``moco export``, ``Embedder.load`` and ``--init``.
"""

from __future__ import annotations

import math
from functools import partial

import pytest
import timm
import torch
from timm.models.vision_transformer import VisionTransformer
from torch import nn

from app.cli.commands import main
from moco.config import resolve_config, to_plain
from moco.data.augment import RECIPES, center_view
from moco.embed import Embedder
from moco.errors import UserError
from moco.model.backbones import build_backbone
from moco.model.builder import build_mlp
from moco.model.resnet import BasicBlock, Bottleneck
from moco.training.checkpoints import save_checkpoint
from moco.training.setup import build_model
from moco.weights.layouts import load_init

SIZE, HIDDEN, DIM = 32, 64, 32  # tiny images and heads; ViT-S keeps its width 384 and depth 12


def _v3(arch: str, **kw) -> object:
    return resolve_config("v3", arch=arch, image_size=SIZE, batch_size=8, mlp_hidden=HIDDEN, dim=DIM, **kw)


def _layout(mlp: nn.Module) -> list[tuple]:
    """Module types, weight shapes and BN affinity: what decides whether official weights load and mean the same."""
    return [(type(m).__name__, tuple(p.shape for p in m.parameters(recurse=False)), getattr(m, "affine", None))
            for m in mlp]


# ------------------------------------------------------------------------------------------- heads
@pytest.mark.parametrize(
    "arch,width,projector_layers,predictor_last_bn",
    [("resnet18", 512, 2, False), ("vit_tiny_patch16_224", 192, 3, True)],  # MoCo_ResNet / MoCo_ViT in builder.py
)
def test_v3_heads_follow_the_official_builder(arch, width, projector_layers, predictor_last_bn):
    model = build_model(_v3(arch))
    assert _layout(model.projector) == _layout(build_mlp(projector_layers, width, HIDDEN, DIM, last_bn=True))
    assert _layout(model.predictor) == _layout(build_mlp(2, DIM, HIDDEN, DIM, last_bn=predictor_last_bn))
    last = model.predictor[-1]
    assert isinstance(last, nn.BatchNorm1d) == predictor_last_bn and getattr(last, "affine", False) is False


@pytest.mark.parametrize("arch,block,last_bn", [("resnet18", BasicBlock, "bn2"), ("resnet50", Bottleneck, "bn3")])
def test_v3_resnet_zero_inits_the_last_bn_of_each_residual_block(arch, block, last_bn):
    v3 = build_model(_v3(arch))
    for encoder in (v3.backbone, v3.backbone_momentum):
        gammas = [getattr(m, last_bn).weight for m in encoder.modules() if isinstance(m, block)]
        assert gammas and all(torch.count_nonzero(g) == 0 for g in gammas)
    # v1/v2 keep torchvision's defaults, as the official v1/v2 code does
    v2 = build_model(resolve_config("v2", arch=arch, image_size=SIZE, batch_size=16, queue_size=64))
    assert all(torch.all(getattr(m, last_bn).weight == 1) for m in v2.backbone.modules() if isinstance(m, block))


def test_v3_crop_min_scale_is_02_for_resnets_and_008_for_vits():
    for arch, crop_min in [("resnet50", 0.2), ("resnet18", 0.2), ("vit_small_patch16_224", 0.08)]:
        query, key = RECIPES[resolve_config("v3", arch=arch).augment]
        assert query.crop_scale == key.crop_scale == (crop_min, 1.0), arch


# ---------------------------------------------------------------------------------------- ViT init
def _official_sincos(h: int, w: int, dim: int, temperature: float = 10000.0) -> torch.Tensor:
    """vits.py's build_2d_sincos_position_embedding, patch rows (without the class token's zeros)."""
    grid_w, grid_h = torch.meshgrid(torch.arange(w, dtype=torch.float32), torch.arange(h, dtype=torch.float32),
                                    indexing="ij")
    omega = 1.0 / temperature ** (torch.arange(dim // 4, dtype=torch.float32) / (dim // 4))
    out_w = torch.einsum("m,d->md", grid_w.flatten(), omega)
    out_h = torch.einsum("m,d->md", grid_h.flatten(), omega)
    return torch.cat([out_w.sin(), out_w.cos(), out_h.sin(), out_h.cos()], dim=1)


def _uniform_std(bound: float) -> float:
    return bound / math.sqrt(3)


def test_vit_init_follows_vits_py():
    torch.manual_seed(0)
    net, _ = build_backbone("vit_small_patch16_224", image_size=64, depth=2, moco_v3_vit=True)
    d = net.embed_dim
    linears = [(n, m) for n, m in net.named_modules() if isinstance(m, nn.Linear)]
    assert len(linears) == 8
    for name, m in linears:
        assert torch.count_nonzero(m.bias) == 0, name
        if name.endswith("qkv"):  # q, k and v are initialized as three d x d matrices
            parts, bound = m.weight.chunk(3), math.sqrt(6 / (d + d))
        else:  # xavier_uniform
            parts, bound = [m.weight], math.sqrt(6 / sum(m.weight.shape))
        for w in parts:
            assert w.abs().max() <= bound and w.abs().max() > 0.99 * bound, name
            assert w.std().item() == pytest.approx(_uniform_std(bound), rel=0.03), name
    proj = net.patch_embed.proj
    bound = math.sqrt(6 / (3 * 16 * 16 + d))  # xavier with fan_out = embed_dim, as vits.py
    assert proj.weight.abs().max() <= bound and proj.weight.std().item() == pytest.approx(_uniform_std(bound), rel=0.03)
    assert torch.count_nonzero(proj.bias) == 0
    assert not proj.weight.requires_grad and not proj.bias.requires_grad
    assert 0 < net.cls_token.abs().max() < 1e-5  # normal, std 1e-6
    torch.testing.assert_close(net.pos_embed[0, 1:], _official_sincos(4, 4, d), rtol=0, atol=1e-6)
    assert torch.count_nonzero(net.pos_embed[0, 0]) == 0 and not net.pos_embed.requires_grad


# --------------------------------------------------------------------- the official ViT-S: 12 heads
def _vits_small() -> VisionTransformer:
    """A ViT-Small built like vits.py's ``vit_small`` (12 heads), small images, random weights everywhere."""
    net = VisionTransformer(img_size=SIZE, patch_size=16, embed_dim=384, depth=12, num_heads=12, mlp_ratio=4,
                            qkv_bias=True, norm_layer=partial(nn.LayerNorm, eps=1e-6), num_classes=HIDDEN)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in net.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    net.head = build_mlp(3, 384, HIDDEN, DIM, last_bn=True)  # builder.py's MoCo_ViT projector
    return net.eval()


@pytest.fixture(scope="module")
def official_vits(tmp_path_factory):
    """(path of a checkpoint in the official moco-v3 layout, its 12-head backbone, a 6-head copy, images)."""
    net = _vits_small()
    pred = build_mlp(2, DIM, HIDDEN, DIM, last_bn=True)
    sd = {f"module.base_encoder.{k}": v for k, v in net.state_dict().items()}
    sd |= {f"module.predictor.{k}": v for k, v in pred.state_dict().items()}
    path = tmp_path_factory.mktemp("official") / "vit-s-300ep.pth.tar"
    torch.save({"epoch": 300, "arch": "vit_small", "state_dict": sd, "optimizer": {}}, path)
    net.head = nn.Identity()
    six = timm.create_model("vit_small_patch16_224", pretrained=False, num_classes=0, img_size=SIZE)
    six.load_state_dict(net.state_dict())
    images = torch.randint(0, 256, (3, SIZE, SIZE, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(4))
    return path, net, six.eval(), images


def _features(net: nn.Module, images: torch.Tensor) -> torch.Tensor:
    mean, std = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
    with torch.no_grad():
        return nn.functional.normalize(net(center_view(images, SIZE, mean, std)), dim=1)


def _check_twelve_heads(got, official_vits) -> None:
    _, twelve, six, images = official_vits
    want, wrong = _features(twelve, images), _features(six, images)
    assert (want - wrong).abs().max() > 1e-3  # the layouts really compute different things
    assert (torch.as_tensor(got) - want).abs().max() < 1e-5


@pytest.mark.parametrize(
    "flags", [[], ["--arch", "vit_small_patch16_224"], ["--arch", "vit_small_patch16_224", "--image-size", str(SIZE)]]
)
def test_moco_export_builds_12_heads_for_the_official_vit_s(tmp_path, official_vits, flags):
    path, _, _, images = official_vits
    out = tmp_path / "b.safetensors"
    assert main(["export", str(path), "-o", str(out), *flags]) == 0
    emb = Embedder.load(out, device="cpu", precision="fp32")
    _check_twelve_heads(emb.embed_squares(images), official_vits)


def test_embedder_loads_the_official_vit_s_with_12_heads(official_vits):
    path, _, _, images = official_vits
    emb = Embedder.load(path, device="cpu", precision="fp32")
    _check_twelve_heads(emb.embed_squares(images), official_vits)


def test_init_from_the_official_vit_s_trains_12_heads_and_records_them(tmp_path, official_vits):
    path, _, _, images = official_vits
    cfg = _v3("vit_small_patch16_224", init=str(path))
    assert cfg.num_heads == 12
    model = build_model(cfg)
    report = load_init(model, path)  # what `moco train --init` does after build_model
    assert [line.split(":")[0] for line in report["loaded"]] == ["backbone", "projector", "predictor"]
    _check_twelve_heads(_features(model.backbone.eval(), images), official_vits)
    # the run records its heads: export of the run (and an Embedder on it) builds 12 again
    save_checkpoint({"model": model.state_dict(), "step": 0, "config": to_plain(cfg), "files": []}, tmp_path, keep=0)
    assert main(["export", str(tmp_path / "checkpoint.pt"), "-o", str(tmp_path / "run.safetensors")]) == 0
    emb = Embedder.load(tmp_path / "run.safetensors", device="cpu", precision="fp32")
    _check_twelve_heads(emb.embed_squares(images), official_vits)


def test_v3_vit_small_from_scratch_has_the_papers_12_heads():
    assert _v3("vit_small_patch16_224").num_heads == 12
    model = build_model(_v3("vit_small_patch16_224"))
    assert all(b.attn.num_heads == 12 for b in model.backbone.blocks)
    assert resolve_config("v2", arch="vit_small_patch16_224").num_heads == 0  # not the v3 recipe: timm's model
    assert _v3("vit_small_patch16_224", num_heads=6).num_heads == 6  # a flag wins
    with pytest.raises(UserError, match="--num-heads"):
        resolve_config("v2", arch="resnet18", num_heads=12)


def test_a_head_count_the_width_does_not_divide_is_a_user_error():
    with pytest.raises(UserError, match="vit_small_patch16_224 cannot be built with num_heads=5"):
        build_model(_v3("vit_small_patch16_224", num_heads=5))


def test_v3_weight_decay_as_the_official_optimizers():
    """AdamW (ViT) decays every parameter (moco-v3 main_moco.py); LARS (ResNet) exempts 1-D ones (optimizer.py)."""
    from moco.training.optim import build_optimizer
    from moco.training.setup import build_model

    for arch, extra in (("vit_tiny_patch16_224", dict(image_size=32, num_heads=3)), ("resnet18", {})):
        cfg = resolve_config("v3", arch=arch, batch_size=8, mlp_hidden=64, dim=16, **extra)
        model = build_model(cfg)
        opt = build_optimizer(model, cfg)
        trainable = [p for p in model.parameters() if p.requires_grad]
        decayed = [p for g in opt.param_groups if g["weight_decay"] > 0 for p in g["params"]]
        if cfg.optimizer == "adamw":
            assert len(decayed) == len(trainable) and cfg.weight_decay == 0.1
        else:
            assert cfg.optimizer == "lars" and len(decayed) == sum(p.ndim > 1 for p in trainable)
