"""The command-line flags of TrainConfig: one ``--flag`` per field with its help, its default and the presets' own
values (``moco train``, ``python -m moco.train``), and the fields a parsed command line sets. Without torch."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import fields
from typing import Any

from moco.config import CHOICES, PRESETS, VIT_V3, TrainConfig, field_problem, flag_name, show_value

__all__ = ["add_config_arguments", "config_overrides"]


def config_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The config fields the user set on the command line (flags left at None are not set)."""
    out = {}
    for f in fields(TrainConfig):
        value = getattr(args, f.name, None)
        if value is not None and f.name not in ("data_dir", "out", "preset"):
            out[f.name] = value
    return out


def add_config_arguments(
    parser: argparse.ArgumentParser, skip: tuple[str, ...] = ("data_dir", "out", "preset")
) -> None:
    """Add one ``--flag`` per TrainConfig field with the field's help and default; flags default to None (unset)."""
    for f in fields(TrainConfig):
        if f.name in skip:
            continue
        help_text = f"{f.metadata.get('help', '')} {_default_text(f.name, f.default)}".replace("%", "%%")
        flag = f"--{flag_name(f.name)}"
        if f.type in ("bool", bool):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=help_text)
        elif str(f.type).startswith("tuple"):  # mean, std: one value per channel
            rgb = _rgb_type(flag, f.name)
            parser.add_argument(flag, type=rgb, default=None, help=help_text, metavar="R,G,B")
        else:
            kind = {"int": int, "float": float, "str": str}[str(f.type)]
            parser.add_argument(
                flag,
                type=kind,
                default=None,
                choices=CHOICES.get(f.name),
                help=help_text,
                metavar=None if f.name in CHOICES else f.name.upper(),
            )


def _default_text(name: str, default: Any) -> str:
    """'(default: X)', followed by the presets' own values where they differ from X."""
    own = [f"{p}: {show_value(v[name])}" for p, v in PRESETS.items() if v.get(name, default) != default]
    if name in VIT_V3 and VIT_V3[name] != PRESETS["v3"].get(name, default):
        own.append(f"v3 with a ViT: {show_value(VIT_V3[name])}")
    return f"(default: {show_value(default)}; preset {', '.join(own)})" if own else f"(default: {show_value(default)})"


def _rgb_type(flag: str, name: str) -> Callable[[str], tuple[float, float, float]]:
    """The argparse type of --mean/--std: 'R,G,B' -> a tuple of three floats, within the field's bounds (the same
    check as ``validate``'s, which a --config file's values pass too)."""

    def parse(text: str) -> tuple[float, float, float]:
        example = show_value(getattr(TrainConfig, name))
        try:
            values = tuple(float(v) for v in text.split(","))
        except ValueError:
            values = ()
        if len(values) != 3:
            raise argparse.ArgumentTypeError(f"{text!r}: give three numbers, one per channel, e.g. {flag} {example}")
        if problem := field_problem(name, values):
            raise argparse.ArgumentTypeError(f"{text!r}: {problem}")
        return values  # type: ignore[return-value]

    return parse
