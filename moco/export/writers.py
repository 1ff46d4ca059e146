"""The export formats' writers: safetensors, a timm folder, a torch.export program (pt2) and ONNX. Each writes into
a temporary file, checks what it wrote against the PyTorch backbone on batch sizes other than the export example's,
then puts it in place atomically: ``out`` is never left half written."""

from __future__ import annotations

import contextlib
import json
import logging
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from moco.config import is_vit
from moco.errors import StorageError, UserError, storage_error
from moco.export.meta import BackboneMeta
from moco.extras import install_hint
from moco.whiten import Whitening

__all__ = ["write_safetensors", "write_timm", "write_pt2", "write_onnx"]

logger = logging.getLogger(__name__)


def write_safetensors(backbone: nn.Module, meta: BackboneMeta, out: Path,
                       whitening: Whitening | None = None) -> None:
    from safetensors.torch import save

    from moco.files import atomic_write

    state = {k: v.detach().contiguous().cpu() for k, v in backbone.state_dict().items()}
    if whitening is not None:  # beside the backbone's tensors; build_exported leaves them to the Embedder
        state.update({f"whitening.{k}": v for k, v in whitening.state().items() if isinstance(v, torch.Tensor)})
    # in memory: our own write reports a full or read-only disk, naming `out`
    data = save(state, metadata=meta.to_strings())
    atomic_write(out, lambda f: f.write(data))


def _example(meta: BackboneMeta, n: int = 2) -> torch.Tensor:
    size = meta.image_size
    return torch.randn(n, 3, size, size, generator=torch.Generator().manual_seed(n))


def _check_faithful(run: Any, backbone: nn.Module, meta: BackboneMeta, what: str) -> None:
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
    from moco.files import atomic_write

    atomic_write(out, lambda f: f.write(tmp.read_bytes()))


@contextlib.contextmanager
def _naming(out: Path) -> Iterator[None]:
    """A failed write in this block (disk full, read-only) is reported as writing ``out``, not a temporary file."""
    try:
        yield
    except StorageError as e:
        if isinstance(e.__cause__, OSError):
            raise storage_error(e.__cause__, out) from e.__cause__
        raise
    except OSError as e:
        raise storage_error(e, out) from e


def _dynamic_batch() -> tuple[dict[int, Any], ...]:
    return ({0: torch.export.Dim("batch", min=1)},)


def _timm_config(backbone: nn.Module, meta: BackboneMeta) -> dict[str, Any]:
    """timm's ``config.json`` for ``backbone`` (architecture, model_args, pretrained_cfg), or a UserError where
    timm has no model with exactly these layers (the small stem, a layout timm names differently)."""
    import timm

    arch = meta.arch.removeprefix("timm/")
    if meta.small_stem:
        raise UserError(f"--format timm: {arch} with the small stem (3x3 conv, no max-pool) is not a timm "
                        "model: use --format safetensors (moco.Embedder loads it)")
    if not timm.is_model(arch):
        raise UserError(f"--format timm: timm has no model {arch!r}: use --format safetensors")
    args: dict[str, Any] = dict(meta.arch_kwargs)
    if is_vit(arch):
        args["img_size"] = meta.image_size
    with torch.device("meta"):
        probe = timm.create_model(arch, pretrained=False, num_classes=0, **args)
    want = {k: tuple(v.shape) for k, v in backbone.state_dict().items()}
    have = {k: tuple(v.shape) for k, v in probe.state_dict().items()}
    if want != have:
        diff = sorted(set(want) ^ set(have)) or sorted(k for k in want if want[k] != have[k])
        raise UserError(f"--format timm: timm's {arch} has other layers than this backbone ({', '.join(diff[:4])}): "
                        "use --format safetensors")
    size, resize = meta.image_size, meta.resize
    crop_pct = size / resize
    while math.floor(size / crop_pct) < resize:  # timm resizes to floor(size / crop_pct): keep it exactly `resize`
        crop_pct = math.nextafter(crop_pct, 0.0)
    # timm's own names of the layers it adapts: create_model(..., num_classes=N) drops `classifier` (ours has none)
    # and builds a fresh N-way head; in_chans=1 adapts `first_conv`; a fixed input size (ViTs) comes from input_size
    own = {k: probe.pretrained_cfg[k] for k in ("classifier", "first_conv", "fixed_input_size")
           if probe.pretrained_cfg.get(k)}
    return {
        "architecture": arch,
        "num_classes": 0,
        "num_features": meta.embed_dim,
        "model_args": args,
        "pretrained_cfg": {
            "input_size": [3, size, size],
            "interpolation": meta.interpolation,
            "mean": list(meta.mean),
            "std": list(meta.std),
            "crop_pct": crop_pct,
            "crop_mode": meta.crop,
            "num_classes": 0,
            **own,
        },
    }


def write_timm(backbone: nn.Module, meta: BackboneMeta, out: Path, space: Whitening | None = None) -> None:
    """A folder timm loads with ``create_model("local-dir:OUT", pretrained=True)``: config.json, model.safetensors,
    and the embedding space (``space.safetensors``, for :func:`moco.apply_space`) where the export has one."""
    import timm

    from moco.files import scratch_dir
    from moco.whiten import SPACE_FILE, save_space

    config = _timm_config(backbone, meta)  # refusals come before anything is written
    if out.exists() and not out.is_dir():
        raise UserError(f"--format timm writes a folder, but {out} is a file: pass a folder path to -o")
    with scratch_dir(f".{out.name}.", out.parent) as tmp, _naming(out):  # then moved
        write_safetensors(backbone, meta, Path(tmp) / "model.safetensors")  # our metadata: moco.Embedder loads it
        (Path(tmp) / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        model = timm.create_model(f"local-dir:{tmp}", pretrained=True).eval()
        _check_faithful(lambda x: model(x).numpy(), backbone, meta, "timm")
        names = ["model.safetensors", "config.json"]
        if space is not None:
            assert meta.source_sha256 is not None  # the exporter records it in every export
            save_space(space, Path(tmp) / SPACE_FILE, meta.source_sha256, source_sha256=meta.source_sha256)
            names.append(SPACE_FILE)
        out.mkdir(exist_ok=True)
        (out / SPACE_FILE).unlink(missing_ok=True)  # an older export's space never outlives its model
        for name in names:
            _publish(Path(tmp) / name, out / name)


def write_pt2(backbone: nn.Module, meta: BackboneMeta, out: Path) -> None:
    """A ``torch.export`` program with a dynamic batch; the metadata is its extra file ``moco_meta.json``."""
    if out.suffix != ".pt2":
        raise UserError(f"--format pt2: torch.export.load reads only files named *.pt2, not {out.name}: "
                        f"use -o {out.with_suffix('.pt2')}")
    import io

    from moco.files import atomic_write

    program = torch.export.export(backbone, (_example(meta),), dynamic_shapes=_dynamic_batch())
    # In memory, then our own atomic write: torch's file writer aborts the interpreter on a full disk, and
    # our write names `out` and leaves nothing
    buffer = io.BytesIO()
    torch.export.save(program, buffer, extra_files={"moco_meta.json": json.dumps(meta.to_strings())})
    buffer.seek(0)
    module = torch.export.load(buffer).module()
    _check_faithful(lambda x: module(x).numpy(), backbone, meta, "torch.export program")
    atomic_write(out, lambda f: f.write(buffer.getbuffer()))


def write_onnx(backbone: nn.Module, meta: BackboneMeta, out: Path) -> None:
    """ONNX from the torch.export-based exporter, dynamic batch; the metadata is in ``metadata_props``."""
    try:
        import onnxruntime as ort
        import onnxscript  # noqa: F401 - the exporter's dependency: fail here with the fix, not deep inside torch
    except ImportError as e:
        raise UserError(f"--format onnx needs the onnx extra: {install_hint('onnx')} ({e})") from None
    chatty = [logging.getLogger(name) for name in ("onnxscript", "onnx_ir")]  # an INFO line per optimizer pass
    levels = [log.level for log in chatty]
    try:
        for log in chatty:
            log.setLevel(max(log.getEffectiveLevel(), logging.WARNING))
        program = torch.onnx.export(backbone, (_example(meta),), input_names=["images"], output_names=["features"],
                                    dynamic_shapes=_dynamic_batch(), dynamo=True, verbose=False)
    finally:
        for log, level in zip(chatty, levels):
            log.setLevel(level)
    program.model.metadata_props.update(meta.to_strings())
    tmp = out.with_name(f".{out.name}.part")
    try:
        with _naming(out):  # a full disk: the exporter's own error names no file
            program.save(str(tmp), external_data=False)
        session = ort.InferenceSession(str(tmp), providers=["CPUExecutionProvider"])
        _check_faithful(lambda x: session.run(None, {"images": x.numpy()})[0], backbone, meta, "ONNX")
        _publish(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
