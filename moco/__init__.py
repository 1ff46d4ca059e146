"""moco: train MoCo (v1, v2, v3) on your own photos, export the backbone, embed images.

Names are imported lazily, so ``import moco.data`` (e.g. in decoding worker processes) stays light.

``moco.train`` is the training function whatever was imported before, also after ``import moco.train`` (which
would otherwise bind the package attribute to the submodule of the same name): the submodule is reached with
``from moco.train import ...`` or ``sys.modules["moco.train"]``.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # what editors and type checkers see; at run time __getattr__ imports each name when first used
    from moco.config import PRESETS, TrainConfig, resolve_config
    from moco.embed import Embedder
    from moco.errors import UserError
    from moco.export import export_backbone
    from moco.model import MoCo
    from moco.pretrained import REGISTRY as PRETRAINED
    from moco.pretrained import fetch as fetch_pretrained
    from moco.train import resume_config, train
    from moco.whiten import apply_space

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

# name -> (module, attribute): the same pairs as the TYPE_CHECKING imports above
_WHERE = {
    "MoCo": ("moco.model", "MoCo"),
    "TrainConfig": ("moco.config", "TrainConfig"),
    "PRESETS": ("moco.config", "PRESETS"),
    "resolve_config": ("moco.config", "resolve_config"),
    "train": ("moco.train", "train"),
    "resume_config": ("moco.train", "resume_config"),
    "UserError": ("moco.errors", "UserError"),
    "export_backbone": ("moco.export", "export_backbone"),
    "Embedder": ("moco.embed", "Embedder"),
    "apply_space": ("moco.whiten", "apply_space"),
    "fetch_pretrained": ("moco.pretrained", "fetch"),
    "PRETRAINED": ("moco.pretrained", "REGISTRY"),
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
        module, attribute = _WHERE[name]
        return getattr(importlib.import_module(module), attribute)
    raise AttributeError(f"module 'moco' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)


class _Package(types.ModuleType):
    """The ``moco`` module: importing a submodule whose name is a public name (``moco.train``) does not rebind
    that name to the submodule; it stays the documented object (found by ``__getattr__``)."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _WHERE and isinstance(value, types.ModuleType) and value.__name__ == f"{__name__}.{name}":
            return  # the import system binding the submodule moco.NAME: sys.modules keeps it
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
