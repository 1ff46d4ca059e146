"""moco: train MoCo (v1, v2, v3) on your own photos, export the backbone, embed images.

The stages are sub-packages: ``data`` (photos in), ``model`` (the network), ``weights`` (checkpoints of any layout,
official names), ``training`` (a run), ``export`` (a clean backbone); beside them the config, the embedding space
(``whiten``), the ``Embedder``, the file layer, the runtime and the errors. Names are imported when first used, so
``import moco.data.cache`` (e.g. in a decoding worker) stays light.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from moco._lazy import lazy_face

if TYPE_CHECKING:  # what editors and type checkers see; at run time each name is imported when first used
    from moco.config import PRESETS as PRESETS
    from moco.config import TrainConfig as TrainConfig
    from moco.config import resolve_config as resolve_config
    from moco.embed import Embedder as Embedder
    from moco.errors import UserError as UserError
    from moco.export.exporter import export_backbone as export_backbone
    from moco.model.builder import MoCo as MoCo
    from moco.training.checkpoints import resume_config as resume_config
    from moco.training.loop import train as train
    from moco.weights.pretrained import REGISTRY as PRETRAINED  # noqa: F401 - public under another name
    from moco.weights.pretrained import fetch as fetch_pretrained  # noqa: F401
    from moco.whiten import apply_space as apply_space

__all__, _getattr, __dir__ = lazy_face(__name__, {
    "MoCo": "model.builder", "TrainConfig": "config", "PRESETS": "config", "resolve_config": "config",
    "train": "training.loop", "resume_config": "training.checkpoints", "export_backbone": "export.exporter",
    "Embedder": "embed", "apply_space": "whiten", "UserError": "errors",
    "fetch_pretrained": "weights.pretrained:fetch", "PRETRAINED": "weights.pretrained:REGISTRY",
})


def _version() -> str:
    """The installed distribution's version (pyproject.toml is its one source); 0+unknown in a bare tree."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("moco-retrieval")
    except PackageNotFoundError:
        return "0+unknown"


def __getattr__(name: str) -> Any:
    if name == "__version__":  # lazy too: importlib.metadata costs ~50 ms
        return _version()
    return _getattr(name)
