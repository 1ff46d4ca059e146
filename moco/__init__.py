"""moco: train MoCo (v1, v2, v3) on your own photos, export the backbone, embed images.

Names are imported lazily, so ``import moco.data`` (e.g. in decoding worker processes) stays light.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = [
    "MoCo",
    "TrainConfig",
    "PRESETS",
    "resolve_config",
    "train",
    "resume_config",
    "export_backbone",
    "Embedder",
    "apply_space",
    "UserError",
    "fetch_pretrained",
    "PRETRAINED",
]

_WHERE = {
    "MoCo": "moco.model",
    "TrainConfig": "moco.config",
    "PRESETS": "moco.config",
    "resolve_config": "moco.config",
    "train": "moco.train",
    "resume_config": "moco.train",
    "UserError": "moco.errors",
    "export_backbone": "moco.export",
    "Embedder": "moco.embed",
    "apply_space": "moco.whiten",
    "fetch_pretrained": "moco.pretrained",
    "PRETRAINED": "moco.pretrained",
}


def _version() -> str:
    """The installed distribution's version (pyproject.toml is its one source); 0+unknown in a bare tree."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("moco-retrieval")
    except PackageNotFoundError:
        return "0+unknown"


def __getattr__(name: str) -> Any:
    if name == "__version__":  # lazy too: importlib.metadata costs ~50 ms, decoding workers import moco.data
        return _version()
    if name in _WHERE:
        module = importlib.import_module(_WHERE[name])
        return getattr(module, {"fetch_pretrained": "fetch", "PRETRAINED": "REGISTRY"}.get(name, name))
    raise AttributeError(f"module 'moco' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
