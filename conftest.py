"""Doctest namespace: a small exported backbone for the runnable examples in the docstrings."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _doctest_namespace(doctest_namespace, tmp_path_factory):
    if "backbone_path" not in doctest_namespace:
        import torch
        import torchvision

        from moco.export.exporter import export_backbone

        tmp = tmp_path_factory.mktemp("doctest")
        torch.save(torchvision.models.resnet18(weights=None).state_dict(), tmp / "tv.pth")
        export_backbone(tmp / "tv.pth", tmp / "backbone.safetensors", image_size=64)
        doctest_namespace["backbone_path"] = tmp / "backbone.safetensors"
