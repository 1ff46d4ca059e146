"""Plan: what a build or update must do, from a scan of the collection diffed against the catalog.

A file is *unchanged* when its size and mtime match its row; when they differ its content hash
decides between a stat-only *touch* and a re-embedding under the same id. A new path whose hash
belongs to a row whose file is gone is a *move* (the row keeps its id and vector); one whose hash
belongs to a live row is a *copy* (new id, vector copied); anything else is embedded.

The scan leaves out what the index's ``--exclude`` patterns name (their rows go), and counts the photos of a format
whose package is missing here; those already indexed (by an install that had it) stay as they are, unread.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import logging
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from index.catalog import Catalog, Row
from moco.data.photos import open_regular, scan_photos

__all__ = ["Plan", "make_plan", "file_hash", "file_hashes", "content_hash", "Stat", "Summary"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Stat:
    size: int
    mtime_ns: int


@dataclass
class Plan:
    """Work for one sync; ``embed`` is (id, path) sorted by path, ids assigned in that order."""

    embed: list[tuple[int, str]] = field(default_factory=list)
    touch: list[tuple[int, Stat]] = field(default_factory=list)
    moves: list[tuple[int, str, Stat]] = field(default_factory=list)
    copies: list[tuple[int, str, Stat, str, int]] = field(default_factory=list)  # id, path, stat, hash, source id
    gone: list[int] = field(default_factory=list)
    unchanged: int = 0
    stats: dict[str, Stat] = field(default_factory=dict)
    unsupported: dict[str, int] = field(default_factory=dict)  # extension -> files not read: its package is missing
    excluded: int = 0  # files and folders left out by the --exclude patterns


def content_hash(data: bytes) -> str:
    """blake2b-128 of ``data`` (hex): :func:`file_hash` of a file holding these bytes (an upload)."""
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def file_hash(path: str | Path) -> str:
    """blake2b-128 of a file's bytes (hex); ``OSError`` with a reason for special or oversized files (open_regular)."""
    h = hashlib.blake2b(digest_size=16)
    with open_regular(path) as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def file_hashes(paths: Iterable[str | os.PathLike[str]]) -> list[str]:
    """:func:`file_hash` of each file that can be read (a query photo's, to find its indexed twins); one that cannot
    (gone, a pipe, a device) has none and is logged at DEBUG: whoever decodes it says why it cannot be used."""
    hashes = []
    for path in paths:
        try:
            hashes.append(file_hash(path))
        except OSError as e:
            logger.debug("no content hash of %s: %s", path, e)
    return hashes


def _stat(path: Path) -> Stat | None:
    """Size and mtime of ``path``, or of the link itself when its target is out of reach (a symlink loop
    or a dangling link is still planned, then recorded as an error); None when the path is gone."""
    try:
        st = os.stat(path)
    except OSError:
        try:
            st = os.lstat(path)
        except OSError:
            return None
    return Stat(st.st_size, st.st_mtime_ns)


def _hashes(root: Path, paths: list[str], workers: int) -> dict[str, str | None]:
    def one(p: str) -> str | None:
        try:
            return file_hash(root / p)
        except OSError:
            return None

    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        return dict(zip(paths, pool.map(one, paths)))


def make_plan(root: Path, catalog: Catalog, workers: int = 4, exclude: Sequence[str] = ()) -> Plan:
    """Scan ``root`` (less the ``exclude`` patterns) and diff it against ``catalog``."""
    scan = scan_photos(root, exclude)
    names = scan.files
    rows = catalog.rows(include_deleted=True)
    kept = {p for paths in scan.unsupported.values() for p in paths if p in rows and not rows[p].deleted}
    if kept:  # indexed where their package was installed: kept as they are, never read here
        logger.warning("%d indexed photos (e.g. %s) cannot be read by this install; they stay in the index as "
                       "they are", len(kept), min(kept))
        names = sorted([*names, *kept])
    plan = Plan(unsupported=scan.unsupported_counts(), excluded=scan.excluded)
    for pattern in scan.unused:
        logger.warning("--exclude %r left nothing out of %s", pattern, root)
    next_id = catalog.next_id()
    stats = {n: s for n in names if (s := _stat(root / n)) is not None}
    plan.stats = stats
    present = set(stats)
    new_paths: list[str] = []
    changed: list[tuple[Row, Stat]] = []
    for name in sorted(present):
        row, st = rows.get(name), stats[name]
        if row is None:
            new_paths.append(name)
        elif name in kept:
            plan.unchanged += 1  # never read: its format's package is missing here
        elif row.deleted or (row.size, row.mtime_ns) != (st.size, st.mtime_ns):
            changed.append((row, st))
        else:
            plan.unchanged += 1
    gone = {r.hash: r for p, r in rows.items() if p not in present and not r.deleted and r.status == "ok"}
    gone_ids = {r.id for p, r in rows.items() if p not in present and not r.deleted}
    live_hashes = {r.hash: r.id for p, r in rows.items() if p in present and not r.deleted and r.status == "ok"}
    need_hash = [r.path for r, _ in changed] + (new_paths if rows else [])
    hashes = _hashes(root, need_hash, workers) if need_hash else {}
    reembed: list[tuple[int, str]] = []
    for row, st in changed:
        h = hashes.get(row.path)
        if row.status == "ok" and h is not None and h == row.hash:  # also a deleted file that came back
            plan.touch.append((row.id, st))
        else:
            reembed.append((row.id, row.path))
    fresh: list[str] = []
    for name in new_paths:
        h = hashes.get(name)
        if h is not None and h in gone:
            row = gone.pop(h)
            gone_ids.discard(row.id)
            plan.moves.append((row.id, name, stats[name]))
        elif h is not None and h in live_hashes:
            plan.copies.append((next_id, name, stats[name], h, live_hashes[h]))
            next_id += 1
        else:
            fresh.append(name)
    plan.embed = sorted(reembed + [(next_id + i, n) for i, n in enumerate(fresh)], key=lambda t: t[1])
    plan.gone = sorted(gone_ids)
    logger.info("plan: %d to embed, %d unchanged, %d touched, %d moved, %d copied, %d gone",
                len(plan.embed), plan.unchanged, len(plan.touch), len(plan.moves), len(plan.copies),
                len(plan.gone))
    return plan


@dataclass
class Summary:
    """What a build/update did."""

    embedded: int = 0
    reembedded: int = 0
    moved: int = 0
    copied: int = 0
    touched: int = 0
    unchanged: int = 0
    removed: int = 0
    errors: list[tuple[str, str]] = field(default_factory=list)
    seconds: float = 0.0
    vectors: int = 0
    kind: str = ""
    recall_at_10: float | None = None
    params: dict[str, int] = field(default_factory=dict)
    unsupported: dict[str, int] = field(default_factory=dict)  # extension -> files skipped: its package is missing
    excluded: int = 0  # files and folders left out by ``exclude``
    exclude: list[str] = field(default_factory=list)  # the index's --exclude patterns
    headers_read: int = 0  # older rows whose date taken, camera and size were read

    @property
    def images_per_s(self) -> float:
        return (self.embedded + self.reembedded) / self.seconds if self.seconds else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {**{k: v for k, v in self.__dict__.items() if k != "errors"}, "images_per_s": self.images_per_s,
                "errors": [{"path": p, "reason": r} for p, r in self.errors]}
