"""Read MoCo checkpoints of every common layout into one form: backbone / projector / predictor.

Layouts: ours (``moco-retrieval/checkpoint``), official MoCo v1/v2 (``module.encoder_q.*`` with a
linear ``fc`` or MLP ``fc.0``/``fc.2`` head, ``module.encoder_k.*``, ``module.queue``), official MoCo v3
(``module.base_encoder.*``, ``module.momentum_encoder.*``, ``module.predictor.*``), lightly
(``backbone.*``, ``projection_head.*``), solo-learn Lightning (``state_dict`` with ``backbone.*``,
``projector.*``, ``momentum_*``, ``classifier.*``) and plain torchvision/timm state dicts.
The ``module.`` prefix of DataParallel/DDP is optional everywhere.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from moco.config import is_vit
from moco.errors import UserError

__all__ = ["SplitCheckpoint", "split_checkpoint", "read_checkpoint", "load_init", "load_backbone_state",
           "sequential_names", "load_checkpoint", "CHECKPOINT_ID", "CHECKPOINT_VERSION"]

logger = logging.getLogger(__name__)

CHECKPOINT_ID = "moco-retrieval/checkpoint"  # our own layout: the "format" of a checkpoint.pt, and its version
CHECKPOINT_VERSION = 1
# Classifier parameters of plain torchvision / timm models; a backbone has none of them.
CLASSIFIER_PREFIXES = ("fc.", "head.", "classifier.", "head_dist.", "last_linear.")


@dataclass
class SplitCheckpoint:
    """A checkpoint's tensors sorted into our parts; every source key is in exactly one place."""

    format: str  # "moco-retrieval", "moco-v1/v2 (official)", "moco-v3 (official)", "lightly", "solo-learn", "plain"
    backbone: dict[str, torch.Tensor]
    projector: dict[str, torch.Tensor] = field(default_factory=dict)
    predictor: dict[str, torch.Tensor] = field(default_factory=dict)
    dropped: dict[str, str] = field(default_factory=dict)  # source key -> why it is not used
    meta: dict = field(default_factory=dict)  # e.g. arch, epoch, our config
    source: str = ""  # the file it was read from


def _tensors(d: dict) -> dict[str, torch.Tensor]:
    return {k: v for k, v in d.items() if isinstance(v, torch.Tensor)}


def _take(sd: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    return {k[len(prefix) :]: v for k, v in sd.items() if k.startswith(prefix)}


def _strip_module(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k.removeprefix("module."): v for k, v in sd.items()}


def load_checkpoint(path: str | Path, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """Load a checkpoint with ``torch.load(weights_only=True)``; never runs pickled code."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"checkpoint {path} does not exist: check the path, or train first with `moco train`")
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except Exception as e:  # noqa: BLE001 - any failure here means the file is not usable
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        if "Weights only load failed" in str(e) or "Unsupported global" in str(e):
            raise UserError(
                f"refusing to load {path}: it needs arbitrary pickled code to load ({msg[:200]}); "
                "only plain tensor checkpoints are accepted (re-save it with torch.save(state_dict))"
            ) from None
        raise UserError(
            f"cannot read checkpoint {path}: {msg[:300]}; the file may be truncated or not a PyTorch file"
        ) from None


def split_checkpoint(obj: dict) -> SplitCheckpoint:
    """Detect the layout of a loaded checkpoint ``obj`` and sort its tensors into our parts."""
    if not isinstance(obj, dict):
        raise UserError(f"expected a checkpoint dict, got {type(obj).__name__}")
    if obj.get("format") == CHECKPOINT_ID:
        sd = obj["model"]
        split = SplitCheckpoint(
            "moco-retrieval",
            _take(sd, "backbone."),
            _take(sd, "projector."),
            _take(sd, "predictor."),
            meta={"config": obj.get("config", {}), "step": obj.get("step"), "images": len(obj.get("files", [])),
                  "whitening": obj.get("whitening")},
        )
        for k in sd:
            if k.startswith(("backbone_momentum.", "projector_momentum.")):
                split.dropped[k] = "momentum (key) encoder"
            elif k.startswith("queue"):
                split.dropped[k] = "queue"
        return split

    meta = {k: obj[k] for k in ("arch", "epoch") if k in obj and not isinstance(obj[k], (dict, torch.Tensor))}
    raw = obj.get("state_dict", obj.get("model", obj))
    if not isinstance(raw, dict) or not _tensors(raw):
        raise UserError("the checkpoint holds no tensors under 'state_dict', 'model' or at its top level")
    dropped = {k: "not a tensor" for k, v in raw.items() if not isinstance(v, torch.Tensor)}
    sd = _strip_module(_tensors(raw))
    orig = {k.removeprefix("module."): k for k in _tensors(raw)}  # names as in the file, for the report

    if any(k.startswith("encoder_q.") for k in sd):  # official MoCo v1 / v2
        q = _take(sd, "encoder_q.")
        head = _take(q, "fc.")
        split = SplitCheckpoint(
            "moco-v1/v2 (official)",
            {k: v for k, v in q.items() if not k.startswith("fc.")},
            _official_v12_head(head),
            meta=meta,
        )
        for k in sd:
            if k.startswith("encoder_k."):
                dropped[orig[k]] = "momentum (key) encoder"
            elif k.startswith("queue"):
                dropped[orig[k]] = "queue (keys of the original training images)"
            elif not k.startswith("encoder_q."):
                dropped[orig[k]] = "unknown entry"
    elif any(k.startswith("base_encoder.") for k in sd):  # official MoCo v3 (ResNet: fc, ViT: head)
        b = _take(sd, "base_encoder.")
        head_prefix = "head." if any(k.startswith("head.") for k in b) else "fc."
        split = SplitCheckpoint(
            "moco-v3 (official)",
            {k: v for k, v in b.items() if not k.startswith(head_prefix)},
            _take(b, head_prefix),
            _take(sd, "predictor."),
            meta=meta,
        )
        for k in sd:
            if k.startswith("momentum_encoder."):
                dropped[orig[k]] = "momentum (key) encoder"
            elif not k.startswith(("base_encoder.", "predictor.")):
                dropped[orig[k]] = "unknown entry"
    elif any(k.startswith("backbone.") for k in sd):  # lightly / solo-learn
        solo = "state_dict" in obj and (
            "momentum_backbone." in "".join(sd) or "classifier." in "".join(sd) or "projector." in "".join(sd)
        )
        split = SplitCheckpoint(
            "solo-learn" if solo else "lightly",
            _take(sd, "backbone."),
            _take(sd, "projector.") or _take(sd, "projection_head."),
            _take(sd, "predictor.") or _take(sd, "prediction_head."),
            meta=meta,
        )
        used = ("backbone.", "projector.", "projection_head.", "predictor.", "prediction_head.")
        for k in sd:
            if k.startswith(used):
                continue
            if "momentum" in k.split(".")[0]:
                dropped[k] = "momentum (key) encoder"
            elif k.startswith("classifier."):
                dropped[k] = "classifier"
            else:
                dropped[k] = "unknown entry"
    else:  # a plain torchvision / timm model
        split = SplitCheckpoint(
            "plain", {k: v for k, v in sd.items() if not k.startswith(CLASSIFIER_PREFIXES)}, meta=meta
        )
        dropped.update({k: "classifier" for k in sd if k.startswith(CLASSIFIER_PREFIXES)})
    split.dropped.update(dropped)
    return split


def _official_v12_head(head: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Official v1 ``fc.{weight,bias}`` -> ``0.*``; v2 ``fc.0.*``/``fc.2.*`` keep their indices."""
    if "weight" in head:
        return {f"0.{k}": v for k, v in head.items()}
    return head


def read_checkpoint(path: str | Path) -> SplitCheckpoint:
    """Load the checkpoint file ``path`` with ``weights_only=True`` and split it (an official NAME is resolved to its
    file by the caller, once: :func:`moco.weights.pretrained.resolve`)."""
    split = split_checkpoint(load_checkpoint(path))
    split.source = str(path)
    logger.info("%s: %s checkpoint (%d backbone tensors)", path, split.format, len(split.backbone))
    return split


def load_backbone_state(backbone: nn.Module, state: dict[str, torch.Tensor], source: str) -> None:
    """Load ``state`` into ``backbone`` requiring every key to match in name and shape.

    Leftover source keys that look like a classifier are fine (the caller lists them as dropped);
    anything else missing, unexpected or of another shape is a UserError naming the keys.
    """
    target = backbone.state_dict()
    missing = sorted(set(target) - set(state))
    unexpected = sorted(k for k in set(state) - set(target) if not k.startswith(CLASSIFIER_PREFIXES))
    mismatched = sorted(k for k in set(state) & set(target) if state[k].shape != target[k].shape)
    if missing or unexpected or mismatched:
        detail = "; ".join(
            f"{what}: {', '.join(keys[:6])}{' ...' if len(keys) > 6 else ''}"
            for what, keys in (
                ("missing", missing),
                ("unexpected", unexpected),
                ("different shape", [f"{k} {tuple(state[k].shape)} vs {tuple(target[k].shape)}" for k in mismatched]),
            )
            if keys
        )
        raise UserError(
            f"the backbone in {source} does not fit the model ({detail}): pick the matching --arch "
            "(and --small-stem only if the checkpoint was trained with it)"
        )
    backbone.load_state_dict({k: state[k] for k in target})


def sequential_names(backbone: nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Map ``nn.Sequential(*list(resnet.children())[:-1])`` keys (``0.weight``, ``4.1.conv1.weight``: the
    lightly way to cut a classifier off) back to the model's child names (``conv1.weight``, ``layer1.1...``)."""
    if not state or not all(k.split(".")[0].isdigit() for k in state):
        return state
    names = [n for n, _ in backbone.named_children()]
    out = {}
    for k, v in state.items():
        i, _, rest = k.partition(".")
        out[f"{names[int(i)]}.{rest}" if int(i) < len(names) else k] = v
    return out


def _load_head(module: nn.Module | None, state: dict[str, torch.Tensor], name: str) -> str:
    if module is None:
        return f"{name}: not in this model" + (f" ({len(state)} tensors ignored)" if state else "")
    if not state:
        return f"{name}: re-initialized (not in the checkpoint)"
    target = module.state_dict()
    if set(target) == set(state) and all(state[k].shape == target[k].shape for k in target):
        module.load_state_dict(state)
        return f"{name}: loaded ({len(state)} tensors)"
    return f"{name}: re-initialized (its {len(state)} tensors have other names or shapes than this model's)"


def load_init(model: nn.Module, init: SplitCheckpoint | str | Path) -> dict[str, list[str]]:
    """Initialize a MoCo model from ``init``: a checkpoint already read (:func:`read_checkpoint`), or a file of any
    supported layout or an official NAME, read here; the key encoder: a copy.

    Returns and logs exactly what was loaded, re-initialized and ignored.
    """
    if isinstance(init, SplitCheckpoint):
        split, path = init, init.source
    else:
        from moco.weights.pretrained import resolve

        path = resolve(init)
        split = read_checkpoint(path)
    _check_heads(model, split, path)
    backbone = sequential_names(model.backbone, split.backbone)
    load_backbone_state(model.backbone, backbone, str(path))
    report = {
        "loaded": [f"backbone: loaded ({len(model.backbone.state_dict())} tensors)"],
        "reinitialized": [],
        "ignored": [],
    }
    for name in ("projector", "predictor"):
        line = _load_head(getattr(model, name, None), getattr(split, name), name)
        report["loaded" if "loaded" in line else "ignored" if "not in this model" in line else "reinitialized"].append(
            line
        )
    extra = sorted(set(backbone) - set(model.backbone.state_dict()))
    report["ignored"] += [f"{k} (classifier)" for k in extra]
    report["ignored"] += [f"{k} ({why})" for k, why in sorted(split.dropped.items())]
    with torch.no_grad():
        model.backbone_momentum.load_state_dict(model.backbone.state_dict())
        model.projector_momentum.load_state_dict(model.projector.state_dict())
    logger.info("--init %s (%s): loaded: %s", path, split.format, "; ".join(report["loaded"]))
    if report["reinitialized"]:
        logger.info("--init: re-initialized: %s", "; ".join(report["reinitialized"]))
    if report["ignored"]:
        logger.info(
            "--init: ignored %d entries: %s",
            len(report["ignored"]),
            "; ".join(report["ignored"][:20]) + (" ..." if len(report["ignored"]) > 20 else ""),
        )
    return report


def checkpoint_num_heads(split: SplitCheckpoint) -> int | None:
    """The ViT attention heads a checkpoint's layout fixes: its weights have the same shapes for any count.

    Official MoCo v3 ViT-S: 12 (vits.py; timm's vit_small has 6); our runs: their config's (0: the timm
    model's own); None where the file does not tell.
    """
    if split.format == "moco-retrieval":
        return int((split.meta.get("config") or {}).get("num_heads", 0))
    pos = split.backbone.get("pos_embed")
    if split.format.startswith("moco-v3") and pos is not None and pos.shape[-1] == 384:
        return 12
    return None


def init_settings(split: SplitCheckpoint, arch: str) -> dict[str, int]:
    """The config fields an ``--init`` checkpoint fixes for a model of ``arch``: a ViT's attention heads where the
    checkpoint's layout tells them (the weights have the same shapes for any count: other heads, another model).
    The commands that take ``--init`` set them unless the user did (``--num-heads``)."""
    if not is_vit(arch):
        return {}
    heads = checkpoint_num_heads(split)
    return {} if heads is None else {"num_heads": heads}


def _check_heads(model: nn.Module, split: SplitCheckpoint, path: str | Path) -> None:
    """Refuse weights trained with other attention heads than the model's: they load without an error (the same
    shapes) into another model."""
    heads = checkpoint_num_heads(split)
    blocks = getattr(model.backbone, "blocks", None)
    attn = getattr(blocks[0], "attn", None) if blocks is not None and len(blocks) else None
    have = getattr(attn, "num_heads", None)
    if heads and have is not None and have != heads:
        raise UserError(f"--init {path}: its ViT has {heads} attention heads, the model {have}: set --num-heads "
                        f"{heads} (num_heads={heads}), or start from weights trained with {have}")
