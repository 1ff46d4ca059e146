"""The kinds of groups of duplicates have one list, index.duplicates.dedup.KINDS: the page's kind filter is built from
it, and
the one copy (`moco index dedup --kind`'s choices, whose parser must load without torch) is held equal to it."""

from __future__ import annotations

import argparse

from app.cli import build_parser
from app.cli.index import DEDUP_KINDS
from app.page.views import KIND_CHOICES
from index.duplicates.dedup import DEFAULT_KINDS, KINDS


def _subparser(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[name]


def test_the_cli_offers_the_kinds_of_index_dedup():
    assert DEDUP_KINDS == KINDS
    dedup = _subparser(_subparser(build_parser(), "index"), "dedup")
    kind = next(a for a in dedup._actions if "--kind" in a.option_strings)
    assert tuple(kind.choices) == KINDS


def test_the_page_filters_by_every_kind_and_by_no_other():
    assert set(DEFAULT_KINDS) < set(KINDS)
    assert {kinds for kinds in KIND_CHOICES.values() if len(kinds) == 1} == {(k,) for k in KINDS}
    assert set().union(*KIND_CHOICES.values()) == set(KINDS)
    assert KIND_CHOICES["exact and near"] == DEFAULT_KINDS and KIND_CHOICES["all kinds"] == KINDS
