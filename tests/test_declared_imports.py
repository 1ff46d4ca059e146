"""Every third-party package that app/, index/ and moco/ import is declared in pyproject.toml: a package that only
arrives through another one (fastapi, starlette, uvicorn, pydantic through gradio) goes when that one stops pulling
it in, or pins something our code does not run on. An import is declared by the core ``dependencies`` or, for the
imports the table ``EXTRAS_FOR`` names, by each extra it lists there (``dev`` and ``bench`` never count: no user
installs them to run ``moco``)."""

from __future__ import annotations

import ast
import functools
import re
import sys
from dataclasses import dataclass
from importlib.metadata import packages_distributions
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("app", "index", "moco")

# The imports an extra may declare instead of the core: what `moco serve` runs on (app/api, app/guard, app/page,
# app/server: imported only by `moco serve`), and the optional imports, made inside a function or under
# try/except ImportError, with one line saying which extra to install when it is missing.
EXTRAS_FOR = {
    # index/search/store.py: try/except ModuleNotFoundError; faiss-cpu or faiss-gpu, one of them
    "faiss": ("index", "gpu"),
    "gradio": ("ui",),
    "gradio_client": ("ui",),  # app/page/blocks.py
    "fastapi": ("ui",),  # app/api/routes.py, app/guard/access.py
    "starlette": ("ui",),  # app/api/routes.py, app/guard/access.py, app/server/launch.py
    "uvicorn": ("ui",),  # app/guard/connections.py
    "h11": ("ui",),  # app/guard/connections.py
    "pydantic": ("ui",),  # app/api/models.py
    "anyio": ("ui",),  # app/api/routes.py
    "pandas": ("ui",),  # app/run/status.py: the Status tab's loss curve for gr.LinePlot
    "matplotlib": ("plot",),  # RUN_DIR/curves.png and the map PNG, skipped without it
    "yaml": ("all",),  # YAML configs; JSON ones need nothing
    "onnxruntime": ("onnx",),  # the onnx export, checked on writing
    "onnxscript": ("onnx",),
    "pyarrow": ("parquet",),  # `moco embed -o FILE.parquet`
    "pillow_heif": ("heic",),
    "rawpy": ("raw",),
    "watchdog": ("watch",),  # --watch: file system events; without it a scan every 10 s (index/building/watch.py)
    "umap": ("map",),  # `moco index map --method umap`
}

# Import names whose distributions packages_distributions() cannot tell here: not installed in this environment
# (umap-learn, faiss-gpu), or shipped under another name by several wheels (faiss).
SHIPPED_BY = {"faiss": {"faiss-cpu", "faiss-gpu"}, "umap": {"umap-learn"}}


@dataclass(frozen=True)
class Import:
    module: str  # the top-level name: "fastapi" for `from fastapi.responses import JSONResponse`
    where: str  # path:line
    optional: bool  # inside a function, or under try/except ImportError
    module_level: bool = False  # a statement of the module itself (not in a function, a class, an if or a try)


def _normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _catches_import_error(node: ast.Try) -> bool:
    names = set()
    for handler in node.handlers:
        if handler.type is None:
            return True
        types = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
        names |= {ast.unparse(t) for t in types}
    return bool(names & {"ImportError", "ModuleNotFoundError", "Exception"})


def third_party_imports() -> list[Import]:
    found = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            tree = ast.parse(path.read_text(), str(path))
            parent = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
            module_level = {id(node) for node in tree.body}
            for node in ast.walk(tree):
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                else:
                    continue
                optional, up = False, node
                while up in parent:
                    up = parent[up]
                    if isinstance(up, (ast.FunctionDef, ast.AsyncFunctionDef)) or (
                            isinstance(up, ast.Try) and _catches_import_error(up)):
                        optional = True
                for name in names:
                    top = name.partition(".")[0]
                    if top not in sys.stdlib_module_names and top not in PACKAGES:
                        found.append(Import(top, f"{path.relative_to(ROOT)}:{node.lineno}", optional,
                                            id(node) in module_level))
    return found


def declared() -> tuple[set[str], dict[str, set[str]]]:
    """The normalized names of pyproject.toml's core dependencies, and of each extra's."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    from packaging.requirements import Requirement

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    names = lambda requirements: {_normalized(Requirement(r).name) for r in requirements}
    return names(project["dependencies"]), {k: names(v) for k, v in project["optional-dependencies"].items()}


@functools.cache
def _shipped() -> dict[str, list[str]]:
    return packages_distributions()  # reads every installed distribution's RECORD: once


def distributions(module: str) -> set[str]:
    return {_normalized(d) for d in _shipped().get(module, ())} | SHIPPED_BY.get(module, set())


def test_the_walk_sees_the_imports():
    seen = {i.module for i in third_party_imports()}
    assert {"torch", "numpy", "PIL", "faiss", "gradio", "fastapi", "starlette", "uvicorn", "pydantic"} <= seen
    assert not seen & {"os", "json", "__future__", "moco", "index", "app"}
    stale = set(EXTRAS_FOR) - seen
    assert not stale, f"EXTRAS_FOR names {sorted(stale)}, which nothing under {PACKAGES} imports any more"


def test_every_import_is_declared():
    core, extras = declared()
    missing = []
    for i in third_party_imports():
        dists = distributions(i.module)
        assert dists, f"{i.where}: which distribution ships {i.module!r}? (install it, or add it to SHIPPED_BY)"
        if dists & core:
            continue
        if i.module not in EXTRAS_FOR:
            missing.append(f"{i.where}: {i.module} ({', '.join(sorted(dists))}) is not a core dependency")
        for extra in EXTRAS_FOR.get(i.module, ()):
            if not dists & extras.get(extra, set()):
                missing.append(f"{i.where}: {i.module} ({', '.join(sorted(dists))}) is not in the `{extra}` extra")
    assert not missing, "imported but not declared in pyproject.toml:\n" + "\n".join(sorted(set(missing)))


def test_the_library_imports_extras_only_where_it_may_do_without():
    """moco/ and index/ are the library: importing one of their modules needs the core dependencies only; what an
    extra brings is imported inside the function that needs it, or under try/except ImportError."""
    core, _ = declared()
    eager = [f"{i.where}: {i.module}" for i in third_party_imports()
             if i.where.startswith(("moco/", "index/")) and not i.optional and not distributions(i.module) & core]
    assert not eager, "extras imported at module level by the library:\n" + "\n".join(eager)
