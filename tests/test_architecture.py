"""docs/ARCHITECTURE.md stays true, and the imports keep their floors: app -> index -> moco, no circles."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FLOORS = {"moco": 0, "index": 1, "app": 2}  # a module imports only its own floor and those below


def _modules() -> dict[str, Path]:
    """Dotted name -> file of every module of the three packages."""
    out = {}
    for pkg in FLOORS:
        for f in sorted((ROOT / pkg).glob("*.py")):
            out[pkg if f.stem == "__init__" else f"{pkg}.{f.stem}"] = f
    return out


def _runtime_imports(path: Path, known: set[str]) -> set[str]:
    """The known modules ``path`` imports when it runs (also inside functions), not those under TYPE_CHECKING."""
    tree = ast.parse(path.read_text())
    typing_only = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
                   and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING")
                   for n in ast.walk(node)}
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found |= {node.module} & known
            found |= {f"{node.module}.{a.name}" for a in node.names} & known
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names} & known
    return found


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    return {m: _runtime_imports(f, set(mods)) - {m, *FLOORS} for m, f in mods.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_module_imports_another_that_imports_it_back():
    assert _cycles(_graph()) == []


def test_no_floor_imports_a_floor_above_it():
    bad = [(m, t) for m, targets in _graph().items() for t in targets
           if FLOORS[t.split(".")[0]] > FLOORS[m.split(".")[0]]]
    assert bad == []


def test_the_exporter_does_not_import_the_trainer():
    graph = _graph()
    for m in ("moco.export", "moco.export.writers", "moco.export.reader", "moco.weights.arch"):
        assert "moco.train" not in graph[m], m


def test_every_module_and_name_the_architecture_page_gives_exists():
    text = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    paths = set(re.findall(r"`((?:moco|index|app|tests)/\w+\.py)`", text))
    assert len(paths) >= 30, paths  # the page names the modules, not a handful
    assert [p for p in sorted(paths) if not (ROOT / p).is_file()] == []
    for pkg in ("moco", "index", "app"):  # and every module of the packages is on it
        missing = [f.name for f in (ROOT / pkg).glob("*.py") if f.stem != "__init__" and f"{pkg}/{f.name}" not in paths]
        assert missing == [], (pkg, missing)
    named = re.findall(r"`((?:moco|index|app)/\w+\.py)` \(`(\w+)`", text)  # "`moco/arch.py` (`detect_arch`)"
    assert named
    for path, name in named:
        tree = ast.parse((ROOT / path).read_text())
        defined = {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.ClassDef)}
        defined |= {t.id for n in ast.walk(tree) if isinstance(n, ast.Assign) for t in n.targets
                    if isinstance(t, ast.Name)}
        assert name in defined, (path, name)
