"""Export a clean backbone from any supported MoCo checkpoint: safetensors + preprocessing metadata.

Everything that is not the query backbone is stripped (projection head, predictor, momentum
encoder, queue, classifier); every source key is accounted for, and a key the layout does not explain
is an error. Other formats, each carrying the preprocessing and checked against the PyTorch backbone on
batch sizes other than the export example's: ``timm`` (a folder ``timm.create_model("local-dir:DIR")``
loads), ``onnx`` (the torch.export-based exporter, dynamic batch, checked with onnxruntime) and ``pt2``
(a ``torch.export`` program, dynamic batch, for ``torch.export.load``).
"""

from __future__ import annotations

import collections
import hashlib
import json
import logging
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from moco.backbones import build_backbone, is_vit
from moco.config import IMAGENET_MEAN, IMAGENET_STD, backbone_kwargs, from_plain
from moco.errors import UserError
from moco.formats import (
    CLASSIFIER_PREFIXES,
    SplitCheckpoint,
    load_backbone_state,
    read_checkpoint,
    sequential_names,
)
from moco.whiten import Whitening, embedding_features, whiten_features

__all__ = ["BACKBONE_FORMAT", "ArchGuess", "detect_arch", "checkpoint_num_heads", "export_backbone", "load_exported",
           "build_exported", "embedding_dim", "exported_whitening", "WhitenedBackbone"]  # fmt: skip

logger = logging.getLogger(__name__)

BACKBONE_FORMAT = "moco-retrieval/backbone"
FORMATS = ("safetensors", "timm", "onnx", "pt2")


@dataclass
class ArchGuess:
    arch: str
    small_stem: bool = False
    image_size: int = 224
    kwargs: dict[str, Any] = field(default_factory=dict)
    how: str = ""


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _resnet_candidates() -> list[str]:
    return ["resnet18", "resnet34", "resnet50", "resnet101", "resnet152", "wide_resnet50_2", "wide_resnet101_2",
            "resnext50_32x4d", "resnext101_32x8d", "resnext101_64x4d"]  # fmt: skip


def detect_arch(split: SplitCheckpoint, image_size: int | None = None) -> ArchGuess:
    """The architecture of a checkpoint's backbone, from our config, the file's ``arch`` or the keys."""
    if split.format == "moco-retrieval" and split.meta.get("config"):
        cfg = split.meta["config"]
        return ArchGuess(cfg["arch"], bool(cfg.get("small_stem")), int(cfg.get("image_size", 224)),
                         backbone_kwargs(from_plain(cfg)), how="run config")  # fmt: skip
    sd = split.backbone
    if "pos_embed" in sd and "patch_embed.proj.weight" in sd:
        return _detect_vit(split, image_size)
    small = "conv1.weight" in sd and sd["conv1.weight"].shape[-1] == 3
    hinted = split.meta.get("arch")
    names = ([hinted] if isinstance(hinted, str) and hinted in _resnet_candidates() else []) + _resnet_candidates()
    for name in names:
        import torchvision.models.resnet as tvr

        with torch.device("meta"):
            net = getattr(tvr, name)(weights=None)
        if small:
            net.conv1 = nn.Conv2d(3, net.conv1.out_channels, 3, 1, 1, bias=False, device="meta")
        net.fc = nn.Identity()
        named = sequential_names(net, sd)
        target = {k: v.shape for k, v in net.state_dict().items()}
        if set(target) == set(named) and all(named[k].shape == target[k] for k in target):
            how = "the file's 'arch' field" if name == hinted else "the shapes of its keys"
            return ArchGuess(name, small, image_size or (32 if small else 224), how=how)
    raise UserError(
        "cannot tell the backbone architecture from the checkpoint's keys: pass --arch NAME "
        "(a torchvision ResNet or timm model name)"
    )


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


def _detect_vit(split: SplitCheckpoint, image_size: int | None, arch: str | None = None) -> ArchGuess:
    """A ViT's timm name (``arch`` if given), image size from its position grid, heads and depth."""
    import timm

    sd = split.backbone
    dim = sd["pos_embed"].shape[-1]
    patch = sd["patch_embed.proj.weight"].shape[-1]
    depth = len({k.split(".")[1] for k in sd if k.startswith("blocks.")})
    tokens = sd["pos_embed"].shape[1]
    grid = math.isqrt(tokens - 1)
    size = image_size or grid * patch
    width = {192: "tiny", 384: "small", 768: "base", 1024: "large", 1280: "huge"}.get(dim)
    name = (arch or f"vit_{width}_patch{patch}_224").removeprefix("timm/")
    if arch is None and (width is None or not timm.is_model(name)):
        raise UserError(f"a ViT of width {dim}, patch {patch}, depth {depth}: pass --arch with its timm name")
    heads = checkpoint_num_heads(split)
    kwargs: dict[str, Any] = {"num_heads": heads} if heads else {}
    how = f"{'--arch and ' if arch else ''}ViT shapes (width {dim}, depth {depth}, patch {patch})"
    if not timm.is_model(name):  # an unknown --arch: build_backbone names the choices
        return ArchGuess(arch or name, False, size, kwargs, how=how)
    with torch.device("meta"):
        probe = timm.create_model(name, pretrained=False, num_classes=0, img_size=size, **kwargs)
    if len(probe.blocks) != depth:
        kwargs["depth"] = depth
    return ArchGuess(arch or name, False, size, kwargs, how=how)


def _moco_version(split: SplitCheckpoint) -> str:
    if split.format == "moco-retrieval":
        return str(split.meta.get("config", {}).get("preset", "unknown"))
    if split.format.startswith("moco-v3"):
        return "v3"
    if split.format.startswith("moco-v1/v2"):
        return "v1" if set(split.projector) == {"0.weight", "0.bias"} else "v2"
    return "unknown"


def _account(split: SplitCheckpoint, backbone: nn.Module) -> dict[str, int]:
    """Count every source key that is not in the exported backbone, by reason; unknown keys are errors."""
    unknown = sorted(k for k, why in split.dropped.items() if why == "unknown entry")
    if unknown:
        raise UserError(
            f"the checkpoint has entries this {split.format} layout does not explain: {', '.join(unknown[:8])}"
            + (" ..." if len(unknown) > 8 else "")
            + "; refusing to guess: check the file, or convert it to a plain backbone state_dict"
        )
    counts: collections.Counter[str] = collections.Counter(split.dropped.values())
    counts["projection head"] += len(split.projector)
    counts["predictor"] += len(split.predictor)
    target = backbone.state_dict()
    extra = [k for k in split.backbone if k not in target]
    assert all(k.startswith(CLASSIFIER_PREFIXES) for k in extra), extra  # load_backbone_state checked this
    counts["classifier"] += len(extra)
    return {k: v for k, v in counts.items() if v}


def export_backbone(
    checkpoint: str | Path,
    out: str | Path,
    arch: str | None = None,
    fmt: str = "safetensors",
    image_size: int | None = None,
    space: str | Path | None = None,
) -> dict[str, str]:
    """Write the query backbone of ``checkpoint`` (a file, or an official NAME: fetched once) to ``out``; returns
    the metadata written.

    Every format declares what it outputs (metadata ``output``: width, whitened, centred, normalized, mirror image,
    stages, fitted on). Its embedding space is the one the run fitted on its training photos (``--whiten``), or
    with ``space`` (an index directory, or its ``space.safetensors``) the space that index fitted on the photos it
    searches: a pt2/ONNX program then outputs exactly the index's vectors, and a timm folder carries it as
    ``space.safetensors`` for :func:`moco.apply_space`.
    """
    from moco.pretrained import resolve

    checkpoint, out = resolve(checkpoint), Path(out)
    if fmt == "torchscript":
        raise UserError("--format torchscript is gone (torch.jit.trace is deprecated): use --format pt2, a "
                        "torch.export program that torch.export.load(path).module() runs")  # fmt: skip
    if fmt not in FORMATS:
        raise UserError(f"--format {fmt!r} is not supported: use one of {', '.join(FORMATS)}")
    split = read_checkpoint(checkpoint)
    vit_keys = {"pos_embed", "patch_embed.proj.weight"} <= set(split.backbone)
    if arch and is_vit(arch) and split.format != "moco-retrieval" and vit_keys:
        guess = _detect_vit(split, image_size, arch)  # the image size, heads and depth come from the file
    elif arch:
        guess = detect_arch(split, image_size) if split.format == "moco-retrieval" else None
        small = "conv1.weight" in split.backbone and split.backbone["conv1.weight"].shape[-1] == 3
        guess = ArchGuess(arch, guess.small_stem if guess else small, image_size or (guess.image_size if guess else
                          (32 if small else 224)), guess.kwargs if guess and guess.arch == arch else {},
                          how="--arch")  # fmt: skip
    else:
        guess = detect_arch(split, image_size)
    logger.info("%s: %s checkpoint, backbone %s%s (from %s)", checkpoint.name, split.format, guess.arch,
                " with the small stem" if guess.small_stem else "", guess.how)  # fmt: skip
    backbone, dim = build_backbone(guess.arch, guess.small_stem, guess.image_size, **guess.kwargs)
    split.backbone = sequential_names(backbone, split.backbone)
    load_backbone_state(backbone, split.backbone, str(checkpoint))
    dropped = _account(split, backbone)
    logger.info("stripped: %s", ", ".join(f"{n} {why}" for why, n in sorted(dropped.items())) or "nothing")
    cfg = split.meta.get("config") or {}
    meta = {
        "format": BACKBONE_FORMAT,
        "format_version": "1",
        "arch": guess.arch,
        "arch_kwargs": json.dumps(guess.kwargs),
        "small_stem": json.dumps(guess.small_stem),
        "embed_dim": str(dim),
        "image_size": str(guess.image_size),
        "resize": str(_resize_for(guess.image_size)),
        "crop": "center",
        "interpolation": "bicubic",
        "mean": json.dumps(list(cfg.get("mean", IMAGENET_MEAN))),
        "std": json.dumps(list(cfg.get("std", IMAGENET_STD))),
        "source_file": os.fsencode(checkpoint.name).decode("utf-8", "backslashreplace"),  # any bytes: text
        "source_sha256": _sha256(checkpoint),
        "source_format": split.format,
        "moco_version": _moco_version(split),
        "dropped": json.dumps(dropped, sort_keys=True),
        "training": json.dumps(_training_summary(split)),
    }
    backbone.eval()
    whitening = _whitening_of(split, dim, checkpoint)
    if space is not None:
        if fmt == "safetensors":
            raise UserError("--space bakes an index's space into a program (--format onnx or pt2) or a timm "
                            "folder; a safetensors backbone takes it when loaded: Embedder.load(B, space=INDEX_DIR)")
        whitening = _index_space(Path(space), checkpoint, whitening, dim)
    module: nn.Module = backbone
    plain = {"width": dim, "whitened": False, "centred": False, "normalized": fmt == "safetensors", "mirror": False,
             "stages": [], "fitted_on": None}  # fmt: skip
    output = whitening.describe() if whitening is not None else plain
    if whitening is not None:
        meta["whitening"] = json.dumps({"shrinkage": whitening.shrinkage, "count": whitening.count, "source":
                                        whitening.source, "mirror": whitening.mirror,
                                        "stages": whitening.state()["stages"]})  # fmt: skip
        if fmt in ("onnx", "pt2"):  # a program: its output is the space's L2-normalized embedding
            module = WhitenedBackbone(backbone, whitening).eval()
            meta["backbone_dim"], meta["embed_dim"] = str(dim), str(whitening.dim)
        elif fmt == "timm":  # timm's model outputs the backbone's features; space.safetensors maps them
            output = {**output, "apply": "moco.apply_space(model, x, DIR)",
                      "model_output": {"width": dim, "normalized": False}}  # fmt: skip
    meta["output"] = json.dumps(output)
    out.parent.mkdir(parents=True, exist_ok=True)
    if fmt == "safetensors":
        _write_safetensors(backbone, meta, out, whitening)
    elif fmt == "timm":
        _write_timm(module, meta, out, whitening)
    else:
        {"onnx": _write_onnx, "pt2": _write_pt2}[fmt](module, meta, out)
    logger.info("wrote %s (%s, %s, %d-d output%s)", out, fmt, guess.arch, output["width"],
                f", {'whitened' if output['whitened'] else 'centred'} on {output['fitted_on']}"
                if whitening is not None else "")  # fmt: skip
    return meta


def _index_space(where: Path, checkpoint: Path, whitening: Whitening | None, dim: int) -> Whitening:
    """The space in ``where`` (an index directory or a ``space.safetensors``), checked to belong to this checkpoint
    (its sha256, or its export's) and to its features."""
    from moco.whiten import SPACE_FILE, load_space

    path = where / SPACE_FILE if where.is_dir() else where
    if not path.is_file():
        raise UserError(f"--space {where}: no {SPACE_FILE} there: pass an index directory made by `moco index build` "
                        f"(`moco index update {where}` writes it for an older index)")  # fmt: skip
    try:
        space, smeta = load_space(path)
    except ValueError as e:
        raise UserError(str(e)) from None
    digest = _sha256(checkpoint)
    if digest not in (smeta.get("source_sha256"), smeta.get("backbone_sha256")):
        raise UserError(f"--space {where}: that index was built from another model (its backbone's source sha256 "
                        f"{str(smeta.get('source_sha256'))[:12]}..., {checkpoint} is {digest[:12]}...): export the "
                        "checkpoint that index's backbone came from")  # fmt: skip
    want = (whitening.mirror, whitening.stages) if whitening is not None else (False, ())
    if (space.mirror, space.stages) != want or space.dim != dim + sum(c for _, c in space.stages):
        raise UserError(f"--space {where}: its features (mirror {space.mirror}, stages {space.stages}) are not this "
                        f"export's (mirror {want[0]}, stages {want[1]}): rebuild the index with this export")
    return space


def _resize_for(image_size: int) -> int:
    from moco.train import cache_size_for

    return cache_size_for(image_size)


def _training_summary(split: SplitCheckpoint) -> dict[str, Any]:
    cfg = split.meta.get("config") or {}
    summary = {k: split.meta[k] for k in ("epoch", "arch") if k in split.meta}
    if cfg:
        summary.update({k: cfg.get(k) for k in ("preset", "arch", "image_size", "batch_size", "queue_size",
                                                "temperature", "epochs")})  # fmt: skip
        summary["step"] = split.meta.get("step")
        summary["images"] = split.meta.get("images")
    return summary


class WhitenedBackbone(nn.Module):
    """``backbone`` followed by a whitening (:mod:`moco.whiten`, of the features it was fitted on: mirror-averaged,
    with pooled stages):
    L2-normalized whitened embeddings (N x D)."""

    def __init__(self, backbone: nn.Module, whitening: Whitening) -> None:
        super().__init__()
        self.backbone = backbone
        self.register_buffer("mean", torch.from_numpy(whitening.mean.copy()))  # D
        eye = torch.eye(whitening.dim)  # centring only: the identity keeps one program for both
        self.register_buffer("matrix", eye if whitening.matrix is None else torch.from_numpy(whitening.matrix.copy()))
        self.mirror = whitening.mirror  # average each view's features with its mirror image's first
        self.stages = whitening.stage_names  # pooled before the backbone's output

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        f = embedding_features(self.backbone, x, self.mirror, self.stages)  # N x D'
        return F.normalize(whiten_features(f, self.mean, self.matrix), dim=1)  # N x D


def _whitening_of(split: SplitCheckpoint, dim: int, checkpoint: Path) -> Whitening | None:
    """The whitening a run fitted at its end (``--whiten``), checked against the backbone's width; else None."""
    state = split.meta.get("whitening")
    if not state:
        return None
    try:
        return Whitening.from_state(state, dim, str(checkpoint))
    except ValueError as e:
        raise UserError(f"{e}: train again, or resume the run to its end to fit it anew") from None


def embedding_dim(meta: dict[str, str]) -> int:
    """The width of what the export embeds (its declared ``output``; for an older file the backbone's ``embed_dim``,
    plus the channels of the stages its whitening pools)."""
    if meta.get("output"):
        return int(json.loads(meta["output"])["width"])
    stages = json.loads(meta.get("whitening") or "{}").get("stages") or []
    return int(meta["embed_dim"]) + sum(int(c) for _, c in stages)


def exported_whitening(state: dict[str, torch.Tensor], meta: dict[str, str], path: str | Path) -> Whitening | None:
    """The whitening an exported ``.safetensors`` carries (``whitening.mean``, ``whitening.matrix``), or None."""
    if "whitening.mean" not in state and "whitening.matrix" not in state:
        return None
    info = json.loads(meta.get("whitening") or "{}")
    try:
        return Whitening.from_state({"mean": state["whitening.mean"], "matrix": state["whitening.matrix"], **info},
                                    int(meta["embed_dim"]), str(path))  # fmt: skip
    except ValueError as e:
        raise UserError(f"{e}: export it again with `moco export`") from None


def _write_safetensors(backbone: nn.Module, meta: dict[str, str], out: Path,
                       whitening: Whitening | None = None) -> None:  # fmt: skip
    from safetensors.torch import save

    from moco.checkpoint import atomic_write

    state = {k: v.detach().contiguous().cpu() for k, v in backbone.state_dict().items()}
    if whitening is not None:  # beside the backbone's tensors; build_exported leaves them to the Embedder
        state.update({f"whitening.{k}": v for k, v in whitening.state().items() if isinstance(v, torch.Tensor)})
    data = save(state, metadata=meta)  # in memory: our own write reports a full or read-only disk, naming `out`
    atomic_write(out, lambda f: f.write(data))


def _example(meta: dict[str, str], n: int = 2) -> torch.Tensor:
    size = int(meta["image_size"])
    return torch.randn(n, 3, size, size, generator=torch.Generator().manual_seed(n))


def _check_faithful(run: Any, backbone: nn.Module, meta: dict[str, str], what: str) -> None:
    """``run(x)`` (numpy N x D) equals the PyTorch backbone for batch sizes 1 and 3, else a RuntimeError."""
    for n in (1, 3):  # the export example has 2: the batch dimension must really be dynamic
        x = _example(meta, n)
        with torch.no_grad():
            want, got = backbone(x).numpy(), run(x)
        err = float(abs(got - want).max()) if got.shape == want.shape else math.inf
        if err > 1e-3 * max(1.0, float(abs(want).max())):
            raise RuntimeError(f"{what} output differs from PyTorch by {err:.3g} (batch {n}): not a faithful export")
    logger.info("%s output matches PyTorch on batch sizes 1 and 3", what)


def _publish(tmp: Path, out: Path) -> None:
    """Put a finished, checked ``tmp`` in place of ``out`` atomically (``out`` is never left half written)."""
    from moco.checkpoint import atomic_write

    atomic_write(out, lambda f: f.write(tmp.read_bytes()))


def _dynamic_batch() -> tuple[dict[int, Any], ...]:
    return ({0: torch.export.Dim("batch", min=1)},)


def _timm_config(backbone: nn.Module, meta: dict[str, str]) -> dict[str, Any]:
    """timm's ``config.json`` for ``backbone`` (architecture, model_args, pretrained_cfg), or a UserError where
    timm has no model with exactly these layers (the small stem, a layout timm names differently)."""
    import timm

    arch = meta["arch"].removeprefix("timm/")
    if json.loads(meta["small_stem"]):
        raise UserError(f"--format timm: {arch} with the small stem (3x3 conv, no max-pool) is not a timm "
                        "model: use --format safetensors (moco.Embedder loads it)")  # fmt: skip
    if not timm.is_model(arch):
        raise UserError(f"--format timm: timm has no model {arch!r}: use --format safetensors")
    args: dict[str, Any] = json.loads(meta["arch_kwargs"])
    if is_vit(arch):
        args["img_size"] = int(meta["image_size"])
    with torch.device("meta"):
        probe = timm.create_model(arch, pretrained=False, num_classes=0, **args)
    want = {k: tuple(v.shape) for k, v in backbone.state_dict().items()}
    have = {k: tuple(v.shape) for k, v in probe.state_dict().items()}
    if want != have:
        diff = sorted(set(want) ^ set(have)) or sorted(k for k in want if want[k] != have[k])
        raise UserError(f"--format timm: timm's {arch} has other layers than this backbone ({', '.join(diff[:4])}): "
                        "use --format safetensors")  # fmt: skip
    size, resize = int(meta["image_size"]), int(meta["resize"])
    crop_pct = size / resize
    while math.floor(size / crop_pct) < resize:  # timm resizes to floor(size / crop_pct): keep it exactly `resize`
        crop_pct = math.nextafter(crop_pct, 0.0)
    # timm's own names of the layers it adapts: create_model(..., num_classes=N) drops `classifier` (ours has none)
    # and builds a fresh N-way head; in_chans=1 adapts `first_conv`; a fixed input size (ViTs) comes from input_size
    own = {k: probe.pretrained_cfg[k] for k in ("classifier", "first_conv", "fixed_input_size")
           if probe.pretrained_cfg.get(k)}  # fmt: skip
    return {
        "architecture": arch,
        "num_classes": 0,
        "num_features": int(meta["embed_dim"]),
        "model_args": args,
        "pretrained_cfg": {
            "input_size": [3, size, size],
            "interpolation": meta["interpolation"],
            "mean": json.loads(meta["mean"]),
            "std": json.loads(meta["std"]),
            "crop_pct": crop_pct,
            "crop_mode": meta["crop"],
            "num_classes": 0,
            **own,
        },
    }


def _write_timm(backbone: nn.Module, meta: dict[str, str], out: Path, space: Whitening | None = None) -> None:
    """A folder timm loads with ``create_model("local-dir:OUT", pretrained=True)``: config.json, model.safetensors,
    and the embedding space (``space.safetensors``, for :func:`moco.apply_space`) where the export has one."""
    import tempfile

    import timm

    from moco.whiten import SPACE_FILE, save_space

    config = _timm_config(backbone, meta)  # refusals come before anything is written
    if out.exists() and not out.is_dir():
        raise UserError(f"--format timm writes a folder, but {out} is a file: pass a folder path to -o")
    with tempfile.TemporaryDirectory(prefix=f".{out.name}.", dir=out.parent) as tmp:  # checked there, then moved
        _write_safetensors(backbone, meta, Path(tmp) / "model.safetensors")  # our metadata: moco.Embedder loads it
        (Path(tmp) / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        model = timm.create_model(f"local-dir:{tmp}", pretrained=True).eval()
        _check_faithful(lambda x: model(x).numpy(), backbone, meta, "timm")
        names = ["model.safetensors", "config.json"]
        if space is not None:
            save_space(space, Path(tmp) / SPACE_FILE, meta["source_sha256"], source_sha256=meta["source_sha256"])
            names.append(SPACE_FILE)
        out.mkdir(exist_ok=True)
        (out / SPACE_FILE).unlink(missing_ok=True)  # an older export's space never outlives its model
        for name in names:
            _publish(Path(tmp) / name, out / name)


def _write_pt2(backbone: nn.Module, meta: dict[str, str], out: Path) -> None:
    """A ``torch.export`` program with a dynamic batch; the metadata is its extra file ``moco_meta.json``."""
    if out.suffix != ".pt2":
        raise UserError(f"--format pt2: torch.export.load reads only files named *.pt2, not {out.name}: "
                        f"use -o {out.with_suffix('.pt2')}")  # fmt: skip
    program = torch.export.export(backbone, (_example(meta),), dynamic_shapes=_dynamic_batch())
    tmp = out.with_name(f".{out.stem}.part.pt2")
    try:
        torch.export.save(program, str(tmp), extra_files={"moco_meta.json": json.dumps(meta)})
        module = torch.export.load(str(tmp)).module()
        _check_faithful(lambda x: module(x).numpy(), backbone, meta, "torch.export program")
        _publish(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)


def _write_onnx(backbone: nn.Module, meta: dict[str, str], out: Path) -> None:
    """ONNX from the torch.export-based exporter, dynamic batch; the metadata is in ``metadata_props``."""
    try:
        import onnxruntime as ort
        import onnxscript  # noqa: F401 - the exporter's dependency: fail here with the fix, not deep inside torch
    except ImportError as e:
        raise UserError(f"--format onnx needs the onnx extra: pip install 'moco-retrieval[onnx]' ({e})") from None
    chatty = [logging.getLogger(name) for name in ("onnxscript", "onnx_ir")]  # an INFO line per optimizer pass
    levels = [log.level for log in chatty]
    try:
        for log in chatty:
            log.setLevel(max(log.getEffectiveLevel(), logging.WARNING))
        program = torch.onnx.export(backbone, (_example(meta),), input_names=["images"], output_names=["features"],
                                    dynamic_shapes=_dynamic_batch(), dynamo=True, verbose=False)  # fmt: skip
    finally:
        for log, level in zip(chatty, levels):
            log.setLevel(level)
    program.model.metadata_props.update(meta)
    tmp = out.with_name(f".{out.name}.part")
    try:
        program.save(str(tmp), external_data=False)
        session = ort.InferenceSession(str(tmp), providers=["CPUExecutionProvider"])
        _check_faithful(lambda x: session.run(None, {"images": x.numpy()})[0], backbone, meta, "ONNX")
        _publish(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)


def load_exported(path: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Tensors and metadata of an exported ``.safetensors`` backbone (checked to be ours)."""
    from moco.checkpoint import read_safetensors

    path = Path(path)
    if not path.is_file():
        raise UserError(f"backbone file {path} does not exist: create it with `moco export CHECKPOINT -o {path}`")
    try:
        state, meta = read_safetensors(path)
    except Exception as e:  # noqa: BLE001 - any parse failure means an unusable file
        raise UserError(f"cannot read {path} as safetensors ({e}); export it again with `moco export`") from None
    if meta.get("format") != BACKBONE_FORMAT:
        raise UserError(f"{path} is a safetensors file but not a moco-retrieval backbone (no metadata): "
                        "export it with `moco export`")  # fmt: skip
    return state, _checked_meta(meta, path)


# The metadata a backbone file may carry: it is data from anywhere, so only these keys pass, each checked before
# anything is built from it. Bounds: 16 px is the smallest crop training takes, 4096 px 18x the papers' 224 (no
# backbone we export is fed more; one such image is already 200 MB in float32); the resize is at least the crop
# and at most twice it (we write the crop or crop * 8/7; timm's crop_pct stays above 0.5), so a decoded photo is
# at most 4x the crop's pixels; widths up to 65536 (the widest timm backbones give a few thousand features).
_META_TEXT = ("format", "format_version", "arch", "crop", "interpolation", "source_file", "source_sha256",
              "source_format", "moco_version")  # fmt: skip
_META_INTS = {"image_size": (16, 4096), "embed_dim": (1, 65536), "backbone_dim": (1, 65536)}
_META_JSON = {"small_stem": bool, "mean": list, "std": list, "arch_kwargs": dict, "whitening": dict, "output": dict,
              "dropped": dict, "training": dict}  # fmt: skip
_META_REQUIRED = ("arch", "small_stem", "embed_dim", "image_size", "resize", "mean", "std")
_NOT_JSON = object()


def _checked_meta(meta: dict[str, str], path: Path) -> dict[str, str]:
    """The known keys of ``meta`` (read from ``path``), each checked (a missing one, a wrong type, a value out of
    bounds: a UserError naming the file, the key and the fix); unknown keys are dropped, with a warning."""

    def bad(key: str, why: str) -> UserError:
        return UserError(f"{path}: its metadata {key!r} {why}: export the backbone again with `moco export "
                         f"CHECKPOINT -o {path}`")  # fmt: skip

    for key in _META_REQUIRED:
        if key not in meta:
            raise bad(key, "is missing")
    known = {*_META_TEXT, *_META_INTS, *_META_JSON, "resize"}
    if unknown := sorted(set(meta) - known):
        logger.warning("%s: ignoring metadata %s (not known to this version)", path, ", ".join(map(repr, unknown)))
    if not meta["arch"].strip():
        raise bad("arch", "is empty")
    bounds = dict(_META_INTS)
    for key in (*_META_INTS, "resize"):  # image_size first: the resize's bounds follow from it
        if key not in meta:
            continue
        try:
            value = int(meta[key])
        except ValueError:
            raise bad(key, f"= {meta[key][:40]!r} is not a whole number") from None
        lo, hi = bounds[key]
        if not lo <= value <= hi:
            raise bad(key, f"= {value} is outside {lo}..{hi}")
        if key == "image_size":
            bounds["resize"] = (value, 2 * value)
    for key, kind in _META_JSON.items():
        if key not in meta:
            continue
        try:
            value = json.loads(meta[key])
        except (ValueError, RecursionError):
            value = _NOT_JSON  # said below, as the key's own kind where it has one
        if key == "small_stem" and not isinstance(value, bool):
            raise bad(key, f"= {meta[key][:40]!r} is not true or false")
        if value is _NOT_JSON:
            raise bad(key, f"= {meta[key][:40]!r} is not valid JSON")
        if key in ("mean", "std") and not (isinstance(value, list) and len(value) == 3 and all(
                isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) for v in value)):
            raise bad(key, f"= {meta[key][:40]} is not three finite numbers, one per channel")  # fmt: skip
        if key == "std" and min(value) <= 0:
            raise bad(key, f"= {meta[key][:40]} is not positive (pixels are divided by it)")
        if not isinstance(value, kind):
            raise bad(key, f"= {meta[key][:40]!r} is not a JSON object")
        if key == "output" and not (isinstance(value.get("width"), int) and 1 <= value["width"] <= 65536):
            raise bad(key, f"width = {str(value.get('width'))[:20]!r} is not a width from 1 to 65536")
        stages = (value.get("stages") or []) if key == "whitening" else []
        if not (isinstance(stages, list) and all(isinstance(p, list) and len(p) == 2 and isinstance(p[0], str)
                                                 and isinstance(p[1], int) and p[1] > 0 for p in stages)):  # fmt: skip
            raise bad(key, "stages are not [name, channels] pairs")
    return {k: v for k, v in meta.items() if k in known}


def build_exported(state: dict[str, torch.Tensor], meta: dict[str, str]) -> nn.Module:
    """The backbone module described by exported ``meta``, with ``state`` loaded exactly."""
    backbone, dim = build_backbone(meta["arch"], json.loads(meta["small_stem"]), int(meta["image_size"]),
                                   **json.loads(meta.get("arch_kwargs", "{}")))  # fmt: skip
    backbone.load_state_dict({k: v for k, v in state.items() if not k.startswith("whitening.")}, strict=True)
    if dim != int(meta["embed_dim"]):
        raise UserError(f"backbone metadata says {meta['embed_dim']}-d features but {meta['arch']} gives {dim}")
    return backbone.eval()
