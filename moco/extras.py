"""How to add an optional part (an extra of pyproject.toml) from what a user has: this project comes from a clone or
from a wheel built by ``make dist``, not from a package index, so ``pip install "moco-retrieval[heic]"`` would not
find it. A hint names the extra's own packages (they come from any package index), read from this install's metadata,
and the clone's form; an extra of many packages (``ui``) gets the clone's and the wheel's forms."""

from __future__ import annotations

import functools
import re
import shlex

__all__ = ["install_hint", "extra_requirements"]

DIST = "moco-retrieval"
NAMED_UP_TO = 3  # an extra of at most this many packages is named package by package


@functools.cache
def extra_requirements(extra: str) -> tuple[str, ...]:
    """The requirements ``extra`` adds (``("pillow-heif>=1.0",)``), their markers other than the extra's dropped;
    empty when this install has no metadata (run from a bare source tree) or no such extra."""
    from importlib.metadata import PackageNotFoundError, requires

    try:
        found = requires(DIST) or []
    except PackageNotFoundError:
        return ()
    out = []
    for req in found:
        spec, _, marker = req.partition(";")
        if re.search(rf"""extra\s*==\s*["']{re.escape(extra)}["']""", marker) and not spec.startswith(DIST):
            out.append(spec.strip().replace(" ", ""))
    return tuple(out)


def install_hint(extra: str) -> str:
    """What to run to add ``extra``: ``pip install pillow-heif>=1.0 (the heic extra; in a clone: pip install
    ".[heic]")``, or for an extra of many packages the clone's and the wheel's forms."""
    clone = f'pip install ".[{extra}]"'
    packages = extra_requirements(extra)
    if packages and len(packages) <= NAMED_UP_TO:
        return f"pip install {' '.join(shlex.quote(p) for p in packages)} (the {extra} extra; in a clone: {clone})"
    return f'{clone} in the clone (from a wheel of `make dist`: pip install "dist/WHEEL.whl[{extra}]")'
