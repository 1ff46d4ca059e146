"""The backbone a bench script measures: an export given, a training run's checkpoint exported, or a randomly
initialized ResNet-18 (the weakest model there is, for a quick or tiny run)."""

from __future__ import annotations

from pathlib import Path


def bench_backbone(work: Path, backbone: Path | None, run: Path | None, size: int) -> tuple[Path, str]:
    """(the backbone file, how the results describe it): ``backbone`` as it is, else ``run``'s checkpoint exported
    into ``work``, else a seeded random ResNet-18 exported for ``size`` px photos into ``work``."""
    if backbone:
        return backbone, str(backbone)
    from moco.export.exporter import export_backbone

    work.mkdir(parents=True, exist_ok=True)
    out = work / "backbone.safetensors"
    if run:
        for old in work.glob("random-*px.done"):  # the file is a run's from now on
            old.unlink()
        export_backbone(run / "checkpoint.pt", out)
        return out, f"{run} (exported)"
    described = "random ResNet-18 (no training: the weakest model)"
    made_for = work / f"random-{size}px.done"  # the export of the same weights for this size: kept, so that the
    if out.is_file() and made_for.is_file():  # indexes built with it stay usable (an export's bytes differ each time)
        return out, described
    import torch
    import torchvision

    torch.manual_seed(0)
    torch.save(torchvision.models.resnet18(weights=None).state_dict(), work / "random.pth")
    export_backbone(work / "random.pth", out, image_size=size)
    for old in work.glob("random-*px.done"):
        old.unlink()
    made_for.touch()
    return out, described
