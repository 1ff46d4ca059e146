"""``--exclude GLOB``: folders and files of a collection that are never read, as patterns relative to its root.

A pattern is matched against a path relative to the collection root, ``/``-separated, case-insensitively (as
extensions are): ``*`` is any run of characters within one name, ``**`` any number of folders, ``?`` one
character, ``[abc]`` one of a set. A pattern without a ``/`` matches a name at any depth (``*.gif``,
``Screenshots``); one with a ``/`` matches from the root (``private/**``, ``2019/trip``). A folder that matches is
left out whole (``private``, ``private/`` and ``private/**`` all leave out ``private/`` and everything under it):
it is never listed, so nothing in it is ever opened. An absolute pattern (``/photos/private/**``,
``~/Pictures/2019/**``) is taken relative to the collection when it lies under it, and refused otherwise: it would
leave out nothing.

    >>> ex = Excludes(["private/**", "*.gif"])
    >>> ex.folder("private"), ex.file("a/b/anim.GIF"), ex.file("public/x.jpg")
    (True, True, False)
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from pathlib import Path

from moco.errors import UserError

__all__ = ["Excludes", "check_patterns"]


def _under_root(pattern: str, root: str | Path, flag: str, given: str) -> str:
    """An absolute ``pattern`` made relative to the collection ``root`` (either of them as given or with its links
    resolved), or a UserError naming it, the root and the fix."""
    path = os.path.normpath(os.path.expanduser(pattern))
    parts = path.split("/")
    plain = next((i for i, part in enumerate(parts) if any(c in part for c in "*?[")), len(parts))
    real = "/".join([os.path.realpath("/".join(parts[:plain]) or "/").rstrip("/"), *parts[plain:]])
    for base in dict.fromkeys((os.path.abspath(os.path.expanduser(root)), os.path.realpath(root))):
        base = base.rstrip("/")
        for candidate in (path, real):
            if candidate.startswith(base + "/") and candidate != base + "/":
                return candidate[len(base) + 1:] + ("/" if pattern.endswith("/") else "")
    tail = path.strip("/")
    example = tail if 0 < tail.count("/") < 3 else "private/**"
    raise UserError(f"{flag} {given!r} is not under the collection {root}: it would leave out nothing; give a pattern "
                    f"relative to the collection (e.g. {flag} {example!r}) or an absolute one under it")


def check_patterns(patterns: Iterable[str], flag: str = "--exclude", root: str | Path | None = None
                   ) -> tuple[str, ...]:
    """``patterns`` cleaned (``./`` dropped, each once, in order; an absolute one made relative to ``root``), or a
    UserError naming the bad one and the fix. Without ``root``, an absolute pattern is kept for a later check."""
    out: list[str] = []
    for given in patterns:
        if not isinstance(given, str):
            raise UserError(f"{flag} {given!r}: a pattern is text, e.g. {flag} 'private/**'")
        pattern = given.strip()
        while pattern.startswith("./"):
            pattern = pattern[2:]
        if pattern.startswith(("/", "~")):
            if root is None:
                if pattern not in out:
                    out.append(pattern)
                continue
            pattern = _under_root(pattern, root, flag, given)
        if not pattern.rstrip("/") or pattern.rstrip("/") in ("**", "*"):
            raise UserError(f"{flag} {given!r} would leave out the whole collection: name a folder or files, e.g. "
                            f"{flag} 'private/**' or {flag} '*.gif'")
        if ".." in pattern.split("/") or any(ord(c) < 32 for c in pattern):
            raise UserError(f"{flag} {given!r}: patterns are relative to the collection root, without `..` or "
                            f"control characters, e.g. {flag} 'private/**'")
        if pattern not in out:
            out.append(pattern)
    return tuple(out)


def _regex(pattern: str) -> str:
    """The regular expression of one cleaned pattern, matching a whole relative path."""
    body = pattern.rstrip("/")
    if "/" not in body:
        body = "**/" + body  # a bare name matches at any depth
    out, i = [], 0
    while i < len(body):
        if body.startswith("**/", i):
            out.append("(?:.*/)?")
            i += 3
        elif body.startswith("/**", i) and i + 3 == len(body):
            out.append("(?:/.*)?")
            i += 3
        elif body.startswith("**", i):
            out.append(".*")
            i += 2
        elif body[i] == "*":
            out.append("[^/]*")
            i += 1
        elif body[i] == "?":
            out.append("[^/]")
            i += 1
        elif body[i] == "[" and (end := body.find("]", i + 2)) > 0:
            inner = body[i + 1 : end]
            negate = inner.startswith("!")
            cls = re.escape(inner[1:] if negate else inner).replace(r"\-", "-")
            out.append(f"[^/{cls}]" if negate else f"[{cls}]")
            i = end + 1
        else:
            out.append(re.escape(body[i]))
            i += 1
    return "".join(out)


class Excludes:
    """Compiled ``--exclude`` patterns: ask :meth:`folder` before listing a folder, :meth:`file` for each file."""

    def __init__(self, patterns: Iterable[str] = (), root: str | Path | None = None) -> None:
        self.patterns = check_patterns(patterns, root=root)
        self._res = [re.compile(_regex(p), re.IGNORECASE | re.DOTALL) for p in self.patterns]
        self.used: set[str] = set()  # the patterns that left something out

    def __bool__(self) -> bool:
        return bool(self.patterns)

    def _match(self, rel: str) -> bool:
        for pattern, rx in zip(self.patterns, self._res):
            if rx.fullmatch(rel):
                self.used.add(pattern)
                return True
        return False

    def folder(self, rel: str) -> bool:
        """Whether the folder ``rel`` (relative, ``/``-separated) is left out, and so everything under it."""
        return bool(rel) and self._match(rel)

    def file(self, rel: str) -> bool:
        """Whether the file ``rel`` is left out (by a pattern of files; its folders are asked with :meth:`folder`)."""
        return self._match(rel)

    def excludes(self, rel: str) -> bool:
        """Whether the path ``rel`` is left out, by itself or by any folder above it."""
        parts = rel.split("/")
        return any(self.folder("/".join(parts[:n])) for n in range(1, len(parts))) or self.file(rel)

    def unused(self) -> list[str]:
        """The patterns that left nothing out so far (a typo, or a folder that is gone)."""
        return [p for p in self.patterns if p not in self.used]
