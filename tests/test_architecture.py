"""The tree is the architecture: docs/ARCHITECTURE.md stays true, and the imports keep their floors, between the
packages (app -> index -> moco) and inside each (a stage imports only the stages below it), counting every import
(also those inside functions and under TYPE_CHECKING); no circle; each name defined once (only a package's face hands
on names it does not define); loggers named by their module; few modules beside the stages."""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"moco": 0, "index": 1, "app": 2}  # a module imports only its own package and those below

# The rooms of each package (a module at its top or a sub-package) by floor: a room imports only rooms on lower
# floors of its package. A new room must be placed here.
ROOMS = {
    "moco": {"moco._lazy": 0, "moco.errors": 0, "moco.extras": 0, "moco.files": 1, "moco.runtime": 1,
             "moco.excludes": 1, "moco.edges": 1, "moco.config": 2, "moco.whiten": 2, "moco.data": 2, "moco.model": 3,
             "moco.weights": 4, "moco.export": 5, "moco.training": 6, "moco.embed": 6},
    "index": {"index.catalog": 0, "index.calibrate": 1, "index.search": 2, "index.overview": 3, "index.building": 3,
              "index.duplicates": 4},
    "app": {"app.run": 0, "app.search": 0, "app.collection": 1, "app.guard": 1, "app.page": 2, "app.api": 2,
            "app.server": 3, "app.cli": 4},
}
# Rooms that stand side by side on what is below them: neither imports the other, whatever their floors.
SIBLINGS = [("app.page", "app.api")]
TOP_MODULES = {"moco": 12, "app": 12, "index": 3}  # at most this many modules beside the stages at each package's top


def _modules() -> dict[str, Path]:
    """Dotted name -> file of every module of the three packages, sub-packages included."""
    out = {}
    for pkg in PACKAGES:
        for f in sorted((ROOT / pkg).rglob("*.py")):
            parts = f.relative_to(ROOT).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    return out


def _imports(path: Path, known: set[str]) -> set[str]:
    """The known modules ``path`` imports, wherever the import stands (inside functions, under TYPE_CHECKING)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found |= {node.module} & known
            found |= {f"{node.module}.{a.name}" for a in node.names} & known
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names} & known
    return found


def _graph() -> dict[str, set[str]]:
    """Module -> the modules it imports; a package's face (its __init__) hands names on and is left out."""
    mods = _modules()
    faces = {m for m, f in mods.items() if f.name == "__init__.py"}
    return {m: _imports(f, set(mods)) - {m} - faces for m, f in mods.items() if m not in faces}


def _room(module: str) -> str:
    return ".".join(module.split(".")[:2])


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph.get(v, ())):
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


def _defined(tree: ast.Module) -> set[str]:
    """The names a module defines at its top (functions, classes, assignments, also inside if/try)."""
    out: set[str] = set()
    for node in tree.body:
        for n in ast.walk(node) if isinstance(node, ast.If | ast.Try) else [node]:
            if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                out.add(n.name)
            elif isinstance(n, ast.Assign | ast.AnnAssign):
                for t in n.targets if isinstance(n, ast.Assign) else [n.target]:
                    out |= {x.id for x in ast.walk(t) if isinstance(x, ast.Name)}
    return out


def test_the_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_the_import_reader_counts_imports_inside_functions_and_for_type_checkers(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from a.b import X\n"
                 "def g():\n    import c\n    from d import e\n")
    assert _imports(f, {"a.b", "c", "d.e", "z"}) == {"a.b", "c", "d.e"}


def test_no_module_imports_another_that_imports_it_back():
    assert _cycles(_graph()) == []


def test_no_package_imports_a_package_above_it():
    bad = [(m, t) for m, targets in _graph().items() for t in targets
           if PACKAGES[t.split(".")[0]] > PACKAGES[m.split(".")[0]]]
    assert bad == []


def test_every_room_has_its_floor_and_imports_only_rooms_below_it():
    rooms = {_room(m) for m in _modules() if "." in m}
    placed = {room for floors in ROOMS.values() for room in floors}
    assert rooms == placed, ("rooms to place in ROOMS", rooms - placed, "gone", placed - rooms)
    floor = {room: f for floors in ROOMS.values() for room, f in floors.items()}
    bad = [(m, t) for m, targets in _graph().items() for t in targets if "." in m and "." in t
           and m.split(".")[0] == t.split(".")[0] and _room(m) != _room(t) and floor[_room(t)] >= floor[_room(m)]]
    assert bad == []


def test_siblings_import_nothing_of_each_other():
    """The page and the JSON API stand on the rooms below them (the collection, the searches): neither imports the
    other, so either can change without the other."""
    graph = _graph()
    for a, b in SIBLINGS:
        assert [m for m in graph if _room(m) == a] and [m for m in graph if _room(m) == b], (a, b)
        crossing = [(m, t) for m, targets in graph.items() for t in targets
                    if {_room(m), _room(t)} == {a, b}]
        assert crossing == [], crossing


def test_the_exporter_does_not_import_the_trainer():
    graph = _graph()
    exporting = [m for m in graph if m.startswith(("moco.export.", "moco.weights."))]
    assert exporting
    assert [(m, t) for m in exporting for t in graph[m] if t.startswith("moco.training")] == []


def test_an_index_s_searches_and_duplicates_open_without_torch():
    """Opening an index and finding its duplicates needs numpy and faiss, not torch (a second of imports: most of
    a one-shot command after a small update). A fresh interpreter, so what other tests imported does not count."""
    import subprocess

    code = ("import sys; import index.duplicates.dedup, index.search.image_index, index.overview.documents; "
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout[:500]


def test_a_few_modules_beside_the_stages():
    assert set(TOP_MODULES) == set(PACKAGES)
    for pkg, most in TOP_MODULES.items():
        top = [f.name for f in (ROOT / pkg).glob("*.py") if f.name != "__init__.py"]
        assert len(top) <= most, (pkg, top)


def _private_imports() -> list[tuple[str, str, str]]:
    """(module, imported module, name) of every ``from X import _name`` (a private name of another module)."""
    out = []
    for m, f in _modules().items():
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                out += [(m, node.module, a.name) for a in node.names
                        if a.name.startswith("_") and not a.name.startswith("__")]
    return out


def test_no_module_imports_another_modules_private_names(tmp_path, monkeypatch):
    """What a module keeps to itself (a leading underscore) is not used from another room or package."""
    assert _private_imports() == []
    (tmp_path / "moco").mkdir()  # the check finds one where there is one
    (tmp_path / "moco" / "a.py").write_text("from moco.b import _hidden, shown\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    monkeypatch.setattr(sys.modules[__name__], "PACKAGES", {"moco": 0})
    assert _private_imports() == [("moco.a", "moco.b", "_hidden")]


def test_only_a_package_face_lists_names_it_does_not_define():
    foreign = {}
    for m, f in _modules().items():
        if f.name == "__init__.py":
            continue
        tree = ast.parse(f.read_text())
        for node in tree.body:
            if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__"
                                                    for t in node.targets):
                names = ast.literal_eval(node.value)
                if bad := [n for n in names if n not in _defined(tree)]:
                    foreign[m] = bad
    assert foreign == {}


def test_loggers_are_named_by_their_module():
    hard_coded = [f"{f.relative_to(ROOT)}:{n.lineno}" for f in _modules().values()
                  for n in ast.walk(ast.parse(f.read_text())) if isinstance(n, ast.Call)
                  and getattr(n.func, "attr", getattr(n.func, "id", "")) == "getLogger" and n.args
                  and isinstance(n.args[0], ast.Constant)]
    assert hard_coded == []


def test_no_public_name_of_a_face_is_also_a_module_name():
    """``moco.train`` is the function; a module of that name would take its place (or need a hack not to)."""
    import importlib

    mods = _modules()
    for m, f in mods.items():
        if f.name == "__init__.py":
            clash = {n for n in importlib.import_module(m).__all__ if f"{m}.{n}" in mods}
            assert clash == set(), (m, clash)


def test_every_module_and_name_the_architecture_page_gives_exists():
    text = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    paths = set(re.findall(r"`((?:moco|index|app|tests)/[\w/]+\.py)`", text))
    assert len(paths) >= 30, paths  # the page names the modules, not a handful
    assert [p for p in sorted(paths) if not (ROOT / p).is_file()] == []
    missing = [str(f.relative_to(ROOT)) for pkg in PACKAGES for f in (ROOT / pkg).rglob("*.py")
               if f.name not in ("__init__.py", "__main__.py") and str(f.relative_to(ROOT)) not in paths]
    assert missing == []  # every module of the packages is on it
    named = re.findall(r"`((?:moco|index|app)/[\w/]+\.py)` \(`(\w+)`", text)  # "`moco/weights/arch.py` (`detect_arch`"
    assert named
    for path, name in named:
        tree = ast.parse((ROOT / path).read_text())
        defined = {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.ClassDef)}
        defined |= {t.id for n in ast.walk(tree) if isinstance(n, ast.Assign) for t in n.targets
                    if isinstance(t, ast.Name)}
        assert name in defined, (path, name)


WHERE_TO_ADD = ("A backbone family", "An API route", "A duplicate rule", "An export format")


def test_the_where_to_add_entries_name_files_and_functions_that_exist():
    """Each entry of the page's "Where to add" above names files that exist, and the names in the parentheses
    after a file (``moco/weights/arch.py`` (``detect_arch``, ``detect_vit``)) are defined in that file."""
    text = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    section = text.split("## Where to add", 1)[1].split("\n## ", 1)[0]
    entries = {m.group(1): m.group(2) for m in re.finditer(r"^- \*\*(.+?)\*\*:(.*?)(?=^- \*\*|\Z)", section,
                                                           re.M | re.S)}
    assert set(WHERE_TO_ADD) <= set(entries), sorted(entries)
    for title in WHERE_TO_ADD:
        entry = entries[title]
        files = re.findall(r"`((?:moco|index|app|tests)/[\w/]+\.py)`", entry)
        assert files, title
        assert [f for f in files if not (ROOT / f).is_file()] == [], title
        named = re.findall(r"`((?:moco|index|app)/[\w/]+\.py)`\s*\(([^()]*)\)", entry)
        assert named, title  # at least one file with the names to look for in it
        for path, inside in named:
            tree = ast.parse((ROOT / path).read_text())
            defined = {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.ClassDef)}
            defined |= {t.id for n in ast.walk(tree) if isinstance(n, ast.Assign | ast.AnnAssign)
                        for t in (n.targets if isinstance(n, ast.Assign) else [n.target]) if isinstance(t, ast.Name)}
            names = re.findall(r"`([A-Za-z_][\w.]*)`", inside)
            assert names, (title, path)
            missing = [n for n in names if not set(n.split(".")) <= defined]
            assert missing == [], (title, path, missing)
