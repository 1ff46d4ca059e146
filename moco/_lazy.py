"""The faces of our packages: a public name is imported from the module that defines it when it is first used, so
that importing one module (a decoding worker's, the command line's parser) never imports its siblings (torch, faiss,
gradio)."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from typing import Any


def lazy_face(package: str, where: dict[str, str]) -> tuple[list[str], Callable[[str], Any], Callable[[], list[str]]]:
    """``__all__``, ``__getattr__`` and ``__dir__`` of the face of ``package``. ``where`` maps each public name to
    the module that defines it, relative to the package (``"cache"``), or to ``"module:attribute"`` where the public
    name differs from the attribute's."""
    home = {name: (f"{package}.{spot.partition(':')[0]}", spot.partition(":")[2] or name)
            for name, spot in where.items()}

    def __getattr__(name: str) -> Any:
        if name not in home:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        module, attribute = home[name]
        value = getattr(importlib.import_module(module), attribute)
        setattr(sys.modules[package], name, value)  # found once; no public name is also a submodule's name
        return value

    def __dir__() -> list[str]:
        return sorted(home)

    return list(home), __getattr__, __dir__
