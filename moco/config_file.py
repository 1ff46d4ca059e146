"""A ``--config`` file: the TrainConfig fields set in a JSON or YAML file, type-checked with the flags' own checks.

YAML is read safely: PyYAML's SafeLoader (with floats as a person writes them), and a document whose aliases would
expand it past ``MAX_YAML_NODES`` values (an alias bomb) or that nests too deeply is refused before it is built.
"""

from __future__ import annotations

import functools
import json
import os
import re
from dataclasses import fields
from typing import Any

from moco.config import PRESETS, TrainConfig, field_problem, short_repr, show_value
from moco.errors import UserError

__all__ = ["MAX_YAML_NODES", "load_config_file"]


def load_config_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The TrainConfig fields set in a JSON or YAML file (``--config``), type-checked; UserError names key and fix.

    The file is a mapping of field names (as in a run's ``config.json``) to values; ``preset`` picks the recipe
    whose defaults the other keys override. Lists become tuples (``mean``, ``std``).
    """
    text = _read_config_text(path)
    if str(path).lower().endswith((".yaml", ".yml")):
        try:
            import yaml
        except ImportError as e:
            raise UserError(f"--config {path}: reading YAML needs PyYAML: pip install pyyaml, or write the config "
                            "as JSON (a .json file)") from e  # fmt: skip
        try:
            data = _load_yaml(text, path)
        except yaml.YAMLError as e:
            raise UserError(f"--config {path} is not valid YAML: {_yaml_problem(e)}") from None
    elif str(path).lower().endswith(".json"):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise UserError(f"--config {path} is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}") from e
    else:
        raise UserError(f"--config {path}: give a .json, .yaml or .yml file (a run's config.json works as is)")
    if not isinstance(data, dict):
        raise UserError(f"--config {path} must hold a mapping of config fields to values, e.g. "
                        '{"arch": "resnet18", "epochs": 100}')  # fmt: skip
    known = {f.name: f for f in fields(TrainConfig)}
    out: dict[str, Any] = {}
    for key, value in data.items():
        if key not in known:
            import difflib

            close = difflib.get_close_matches(str(key), known, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise UserError(f"--config {path}: unknown key {key!r}: {hint}valid keys are the TrainConfig fields "
                            f"({', '.join(known)})")  # fmt: skip
        out[key] = _config_value(path, key, str(known[key].type), value)
        if key != "preset" and (problem := field_problem(key, out[key])):  # the flags' own checks, naming the file
            raise UserError(f"--config {path}: {key} = {problem}")
    if "preset" in out and out["preset"] not in PRESETS:
        raise UserError(f"--config {path}: preset {out['preset']!r} is unknown: use one of {', '.join(PRESETS)}")
    return out


MAX_YAML_NODES = 10_000  # a config is ~70 values; an alias bomb ("billion laughs") expands 400 bytes to billions


@functools.cache
def _yaml_loader() -> type:
    """PyYAML's SafeLoader that also reads 3e-2 and 1.0e5 as floats (YAML 1.1 wants a dot and a signed exponent)."""
    import yaml

    class Loader(yaml.SafeLoader):
        """SafeLoader with the float rule below added (a class of its own: SafeLoader itself stays as it is)."""

    exponent = re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$")
    Loader.add_implicit_resolver("tag:yaml.org,2002:float", exponent, list("-+.0123456789"))
    return Loader


def _load_yaml(text: str, path: str | os.PathLike[str]) -> Any:
    """The document in ``text``, refused before it is built when its aliases expand it past ``MAX_YAML_NODES``."""
    loader = _yaml_loader()(text)
    try:
        try:
            node = loader.get_single_node()
        except RecursionError:
            raise UserError(f"--config {path} nests lists or mappings too deeply: a config is a flat mapping of "
                            "field names to values") from None  # fmt: skip
        if node is None:
            return None
        size = _expanded_size(node, MAX_YAML_NODES)
        if size is None:
            raise UserError(f"--config {path}: an alias (*name) refers to itself: a config is a flat mapping of "
                            "field names to values; write the values out")  # fmt: skip
        if size > MAX_YAML_NODES:
            raise UserError(f"--config {path}: its aliases (*name) expand it to more than {MAX_YAML_NODES} values "
                            "(an alias bomb?): a config is a flat mapping of field names to values; write the values "
                            "out")  # fmt: skip
        return loader.construct_document(node)
    finally:
        loader.dispose()


def _yaml_problem(err: Any) -> str:
    """PyYAML's error ``err`` in one line, where it is (its own message quotes the file in several lines)."""
    problem = getattr(err, "problem", None) or str(err).splitlines()[0]
    mark = getattr(err, "problem_mark", None)
    where = f" at line {mark.line + 1} column {mark.column + 1}" if mark is not None else ""
    if "unhashable key" in problem:
        return (f"a key{where} is a list or a mapping: a config's keys are field names, one per line, e.g. "
                "arch: resnet18")
    return f"{problem[:200]}{where}"


def _expanded_size(node: Any, limit: int) -> int | None:
    """Nodes under ``node`` with every alias expanded (counting stops past ``limit``); None for a cycle."""
    import yaml

    sizes: dict[int, int] = {}  # id(node) -> its expanded size: each distinct node is walked once
    open_: set[int] = set()

    def size(n: Any) -> int | None:
        if id(n) in sizes:
            return sizes[id(n)]
        if id(n) in open_:
            return None  # an alias inside its own anchor
        open_.add(id(n))
        children = (n.value if isinstance(n, yaml.SequenceNode)
                    else [x for pair in n.value for x in pair] if isinstance(n, yaml.MappingNode) else [])  # fmt: skip
        total = 1
        for child in children:
            sub = size(child)
            if sub is None:
                return None
            total += sub
            if total > limit:
                break
        open_.discard(id(n))
        sizes[id(n)] = total
        return total

    return size(node)


def _read_config_text(path: str | os.PathLike[str]) -> str:
    """The text of the file at ``path`` (UTF-8), or UserError saying why it cannot be read."""
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except FileNotFoundError as e:
        raise UserError(f"--config {path}: file not found") from e
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"--config {path} cannot be read ({e}): give a readable UTF-8 JSON or YAML file") from e


def _config_value(path: str | os.PathLike[str], key: str, kind: str, value: Any) -> Any:
    """``value`` of field ``key`` (annotated ``kind``) from a config file, checked (ints accepted for floats)."""
    wrong = f"--config {path}: {key} = {short_repr(value)} is not"
    if kind == "bool":
        if not isinstance(value, bool):
            raise UserError(f"{wrong} true or false")
        return value
    if kind.startswith("tuple"):
        if not (isinstance(value, list | tuple) and len(value) == 3
                and all(isinstance(v, int | float) and not isinstance(v, bool) for v in value)):  # fmt: skip
            raise UserError(f"{wrong} three numbers, one per channel, e.g. [0.485, 0.456, 0.406]")
        return tuple(float(v) for v in value)
    if kind == "float" and isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    if kind == "int" and isinstance(value, int) and not isinstance(value, bool):
        return value
    if kind == "str" and isinstance(value, str):
        return value
    example = show_value(getattr(TrainConfig, key))
    raise UserError(f"{wrong} a{'n' if kind == 'int' else ''} {kind}: write e.g. {key}: {example}")
