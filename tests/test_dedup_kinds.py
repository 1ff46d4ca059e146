"""The kinds of groups of duplicates have one list, index.duplicates.groups.KINDS: `moco index dedup --kind`'s
choices, the page's kind filter and the API's schema are built from it; the CLI reads it without loading torch."""

from __future__ import annotations

import argparse
import subprocess
import sys

from app.api.models import Group, Kind, MoveRequest
from app.cli import build_parser
from app.page.views import KIND_CHOICES
from index.duplicates.groups import DEFAULT_KINDS, KINDS


def _subparser(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[name]


def test_the_cli_offers_the_kinds_of_index_dedup():
    dedup = _subparser(_subparser(build_parser(), "index"), "dedup")
    kind = next(a for a in dedup._actions if "--kind" in a.option_strings)
    assert tuple(kind.choices) == KINDS


def test_the_page_filters_by_every_kind_and_by_no_other():
    assert set(DEFAULT_KINDS) < set(KINDS)
    assert {kinds for kinds in KIND_CHOICES.values() if len(kinds) == 1} == {(k,) for k in KINDS}
    assert set().union(*KIND_CHOICES.values()) == set(KINDS)
    assert KIND_CHOICES["exact and near"] == DEFAULT_KINDS and KIND_CHOICES["all kinds"] == KINDS


def test_the_cli_reads_the_kinds_without_torch():
    code = "import sys, app.cli.index; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_api_schema_offers_the_kinds():
    assert Group.model_json_schema()["properties"]["kind"]["enum"] == list(KINDS)
    assert Kind.__args__ == KINDS
    assert MoveRequest.model_json_schema()["properties"]["kinds"]["items"]["enum"] == list(DEFAULT_KINDS)
