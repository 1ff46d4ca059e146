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
import contextlib
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from torch import nn

from moco.config import IMAGENET_MEAN, IMAGENET_STD, is_vit
from moco.errors import UserError
from moco.export import FORMATS
from moco.export.meta import BackboneMeta
from moco.export.reader import WhitenedBackbone
from moco.export.writers import write_onnx, write_pt2, write_safetensors, write_timm
from moco.files import sha256_file
from moco.model.backbones import build_backbone
from moco.weights.arch import ArchGuess, detect_arch, detect_vit, moco_version
from moco.weights.layouts import (
    CLASSIFIER_PREFIXES,
    SplitCheckpoint,
    load_backbone_state,
    read_checkpoint,
    sequential_names,
)
from moco.whiten import Whitening

# the command here; what it calls, re-exported for the callers of this module
__all__ = ["export_backbone"]

logger = logging.getLogger(__name__)




def export_backbone(
    checkpoint: str | Path,
    out: str | Path,
    arch: str | None = None,
    fmt: str = "safetensors",
    image_size: int | None = None,
    space: str | Path | None = None,
) -> BackboneMeta:
    """Write the query backbone of ``checkpoint`` (a file, or an official NAME: fetched once) to ``out``; returns
    the metadata written.

    Every format declares what it outputs (metadata ``output``: width, whitened, centred, normalized, mirror image,
    stages, fitted on). Its embedding space is the one the run fitted on its training photos (``--whiten``), or
    with ``space`` (an index directory, or its ``space.safetensors``) the space that index fitted on the photos it
    searches: a pt2/ONNX program then outputs exactly the index's vectors, and a timm folder carries it as
    ``space.safetensors`` for :func:`moco.apply_space`.

    Nothing is left behind, whatever happens: ``out`` is written whole or not at all, and what torch and
    onnxruntime write into the temporary folder (torch's compile cache ``torchinductor_USER``, onnxruntime's
    ``.ses``) goes into a private folder that is removed at the end (:func:`_private_caches`).
    """
    from moco.weights.pretrained import resolve

    with _private_caches(["torch._dynamo", *(["onnxruntime"] if fmt == "onnx" else [])]):
        return _export(resolve(checkpoint), Path(out), arch, fmt, image_size, space)


def _export(checkpoint: Path, out: Path, arch: str | None, fmt: str, image_size: int | None,
            space: str | Path | None) -> BackboneMeta:
    """:func:`export_backbone`'s work, on the checkpoint's file."""
    if fmt == "torchscript":
        raise UserError("--format torchscript is gone (torch.jit.trace is deprecated): use --format pt2, a "
                        "torch.export program that torch.export.load(path).module() runs")
    if fmt not in FORMATS:
        raise UserError(f"--format {fmt!r} is not supported: use one of {', '.join(FORMATS)}")
    split = read_checkpoint(checkpoint)
    vit_keys = {"pos_embed", "patch_embed.proj.weight"} <= set(split.backbone)
    if arch and is_vit(arch) and split.format != "moco-retrieval" and vit_keys:
        guess = detect_vit(split, image_size, arch)  # the image size, heads and depth come from the file
    elif arch:
        guess = detect_arch(split, image_size) if split.format == "moco-retrieval" else None
        small = "conv1.weight" in split.backbone and split.backbone["conv1.weight"].shape[-1] == 3
        guess = ArchGuess(arch, guess.small_stem if guess else small, image_size or (guess.image_size if guess else
                          (32 if small else 224)), guess.kwargs if guess and guess.arch == arch else {},
                          how="--arch")
    else:
        guess = detect_arch(split, image_size)
    logger.info("%s: %s checkpoint, backbone %s%s (from %s)", checkpoint.name, split.format, guess.arch,
                " with the small stem" if guess.small_stem else "", guess.how)
    backbone, dim = build_backbone(guess.arch, guess.small_stem, guess.image_size, **guess.kwargs)
    split.backbone = sequential_names(backbone, split.backbone)
    load_backbone_state(backbone, split.backbone, str(checkpoint))
    dropped = _account(split, backbone)
    logger.info("stripped: %s", ", ".join(f"{n} {why}" for why, n in sorted(dropped.items())) or "nothing")
    backbone.eval()
    whitening = _whitening_of(split, dim, checkpoint)
    if space is not None:
        if fmt == "safetensors":
            raise UserError("--space bakes an index's space into a program (--format onnx or pt2) or a timm "
                            "folder; a safetensors backbone takes it when loaded: Embedder.load(B, space=INDEX_DIR)")
        whitening = _index_space(Path(space), checkpoint, whitening, dim)
    module: nn.Module = backbone
    plain = {"width": dim, "whitened": False, "centred": False, "normalized": fmt == "safetensors", "mirror": False,
             "stages": [], "fitted_on": None}
    output = whitening.describe() if whitening is not None else plain
    info, embed_dim, backbone_dim = None, dim, None
    if whitening is not None:
        info = {"shrinkage": whitening.shrinkage, "count": whitening.count, "source": whitening.source,
                "mirror": whitening.mirror, "stages": whitening.state()["stages"]}
        if fmt in ("onnx", "pt2"):  # a program: its output is the space's L2-normalized embedding
            module = WhitenedBackbone(backbone, whitening).eval()
            embed_dim, backbone_dim = whitening.dim, dim
        elif fmt == "timm":  # timm's model outputs the backbone's features; space.safetensors maps them
            output = {**output, "apply": "moco.apply_space(model, x, DIR)",
                      "model_output": {"width": dim, "normalized": False}}
    cfg = split.meta.get("config") or {}
    meta = BackboneMeta(
        arch=guess.arch, small_stem=guess.small_stem, embed_dim=embed_dim, image_size=guess.image_size,
        resize=_resize_for(guess.image_size), mean=tuple(cfg.get("mean", IMAGENET_MEAN)),
        std=tuple(cfg.get("std", IMAGENET_STD)), arch_kwargs=guess.kwargs,
        source_file=os.fsencode(checkpoint.name).decode("utf-8", "backslashreplace"),  # any bytes: text
        source_sha256=sha256_file(checkpoint), source_format=split.format, moco_version=moco_version(split),
        dropped=dropped, training=_training_summary(split), whitening=info, backbone_dim=backbone_dim, output=output,
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    if fmt == "safetensors":
        write_safetensors(backbone, meta, out, whitening)
    elif fmt == "timm":
        write_timm(module, meta, out, whitening)
    else:
        {"onnx": write_onnx, "pt2": write_pt2}[fmt](module, meta, out)
    logger.info("wrote %s (%s, %s, %d-d output%s)", out, fmt, guess.arch, output["width"],
                f", {'whitened' if output['whitened'] else 'centred'} on {output['fitted_on']}"
                if whitening is not None else "")
    return meta


@contextlib.contextmanager
def _private_caches(modules: list[str]) -> Iterator[None]:
    """A private folder, removed afterwards, for what torch and onnxruntime write into the temporary folder: torch's
    compile cache (``$TORCHINDUCTOR_CACHE_DIR`` points there for the block, unless it is set already: tracing a
    program reads it), and what ``modules`` write there when first imported (``$TMPDIR`` points there only while
    they are imported, so that other threads' temporary files never land in it)."""
    import importlib
    import sys
    import tempfile

    from moco.files import scratch_dir

    saved = {k: os.environ.get(k) for k in ("TMPDIR", "TORCHINDUCTOR_CACHE_DIR")}
    with scratch_dir("moco-export-") as folder:
        private = str(folder)
        try:
            if saved["TORCHINDUCTOR_CACHE_DIR"] is None:
                os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(private, "torchinductor")
            unimported = [m for m in modules if m not in sys.modules]
            if unimported:
                saved_tempdir = tempfile.tempdir  # gettempdir()'s cached answer
                os.environ["TMPDIR"] = tempfile.tempdir = private
                try:
                    for name in unimported:
                        with contextlib.suppress(ImportError):  # onnxruntime missing: write_onnx says how to install it
                            importlib.import_module(name)
                finally:
                    tempfile.tempdir = saved_tempdir
                    _restore("TMPDIR", saved["TMPDIR"])
            yield
        finally:
            _restore("TORCHINDUCTOR_CACHE_DIR", saved["TORCHINDUCTOR_CACHE_DIR"])


def _restore(key: str, value: str | None) -> None:
    if value is None:
        os.environ.pop(key, None)
    else:
        os.environ[key] = value


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


def _index_space(where: Path, checkpoint: Path, whitening: Whitening | None, dim: int) -> Whitening:
    """The space in ``where`` (an index directory or a ``space.safetensors``), checked to belong to this checkpoint
    (its sha256, or its export's) and to its features."""
    from moco.whiten import SPACE_FILE, load_space

    path = where / SPACE_FILE if where.is_dir() else where
    if not path.is_file():
        raise UserError(f"--space {where}: no {SPACE_FILE} there: pass an index directory made by `moco index build` "
                        f"(`moco index update {where}` writes it for an older index)")
    try:
        space, smeta = load_space(path)
    except ValueError as e:
        raise UserError(str(e)) from None
    digest = sha256_file(checkpoint)
    if digest not in (smeta.get("source_sha256"), smeta.get("backbone_sha256")):
        raise UserError(f"--space {where}: that index was built from another model (its backbone's source sha256 "
                        f"{str(smeta.get('source_sha256'))[:12]}..., {checkpoint} is {digest[:12]}...): export the "
                        "checkpoint that index's backbone came from")
    want = (whitening.mirror, whitening.stages) if whitening is not None else (False, ())
    if (space.mirror, space.stages) != want or space.dim != dim + sum(c for _, c in space.stages):
        raise UserError(f"--space {where}: its features (mirror {space.mirror}, stages {space.stages}) are not this "
                        f"export's (mirror {want[0]}, stages {want[1]}): rebuild the index with this export")
    return space


def _resize_for(image_size: int) -> int:
    from moco.data.cache import cache_size_for

    return cache_size_for(image_size)


def _training_summary(split: SplitCheckpoint) -> dict[str, Any]:
    cfg = split.meta.get("config") or {}
    summary = {k: split.meta[k] for k in ("epoch", "arch") if k in split.meta}
    if cfg:
        summary.update({k: cfg.get(k) for k in ("preset", "arch", "image_size", "batch_size", "queue_size",
                                                "temperature", "epochs")})
        summary["step"] = split.meta.get("step")
        summary["images"] = split.meta.get("images")
    return summary


def _whitening_of(split: SplitCheckpoint, dim: int, checkpoint: Path) -> Whitening | None:
    """The whitening a run fitted at its end (``--whiten``), checked against the backbone's width; else None."""
    state = split.meta.get("whitening")
    if not state:
        return None
    try:
        return Whitening.from_state(state, dim, str(checkpoint))
    except ValueError as e:
        raise UserError(f"{e}: train again, or resume the run to its end to fit it anew") from None
