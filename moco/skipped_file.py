"""A run's ``skipped.txt``: the photos its cache could not decode, one ``PATH<tab>REASON`` line each, written so
that any file name (tabs, newlines, bytes that are not UTF-8) reads back exactly."""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path

__all__ = ["read_skipped", "write_skipped"]

_ESCAPE = {"\\": "\\\\", "\t": "\\t", "\n": "\\n", "\r": "\\r"}
_UNESCAPE = {"\\": "\\", "t": "\t", "n": "\n", "r": "\r"}
_ESCAPED = re.compile(r"\\(.)", re.DOTALL)


def _escape(text: str) -> bytes:
    text = "".join(_ESCAPE.get(c, c) for c in text)
    try:
        return text.encode("utf-8", "surrogateescape")  # a name's bytes that are not UTF-8: written as they are
    except UnicodeEncodeError:  # a lone surrogate that no file name decodes to: shown escaped
        return text.encode("utf-8", "backslashreplace")


def _unescape(text: str) -> str:
    return _ESCAPED.sub(lambda m: _UNESCAPE.get(m[1], m[0]), text)


def write_skipped(path: str | Path, skipped: Sequence[tuple[str, str]]) -> None:
    r"""Write the files a run skipped to ``path`` (``RUN/skipped.txt``): one ``PATH<tab>REASON`` line each.

    UTF-8, except that the bytes of a name that are not UTF-8 are written as they are (the name as ``ls`` shows
    it); a backslash, tab, carriage return or newline in a name or reason is written ``\\``, ``\t``, ``\r``,
    ``\n``. :func:`read_skipped` reads back exactly the names given (``os.fsdecode`` of their bytes).
    """
    Path(path).write_bytes(b"".join(_escape(p) + b"\t" + _escape(r) + b"\n" for p, r in skipped))


def read_skipped(path: str | Path) -> list[tuple[str, str]]:
    """The (path, reason) pairs of a ``skipped.txt`` written by :func:`write_skipped`."""
    text = Path(path).read_bytes().decode("utf-8", "surrogateescape")
    lines = text.split("\n")  # not splitlines(): a name may hold U+0085 or U+2028
    return [(_unescape(p), _unescape(r)) for p, _, r in (line.partition("\t") for line in lines if line)]
