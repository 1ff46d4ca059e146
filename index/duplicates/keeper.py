"""Which photo of a group of duplicates to keep, and why.

The suggested keeper is the photo the others were most likely made from: the most pixels (a crop or a resize has
fewer); among equals one with a date taken (the camera's file: an edited or re-encoded copy often loses it), the
earliest; then the oldest file (its modification time, in steps of :data:`SAME_TIME_S`: a copy is made after its
photo); then the largest file; then the oldest to the fraction of a second; then the first indexed (the smallest
id). The size comes late: a brightened, mirrored or re-encoded copy saved as PNG is larger than its JPEG photo. A
keeper the user chose (the catalog's ``keepers``, :meth:`index.catalog.Catalog.choose_keeper`) comes before all of
these. The reason shown is the rule that decided.

A photo's pixels and date taken come from the catalog when its rows carry them (``width``, ``height``, ``taken``
when ``taken_exif``: a date from the file's mtime is no date taken),
else from the photo's header (:func:`moco.data.photos.photo_info`, nothing decoded): :func:`photo_facts`.
"""

from __future__ import annotations

import datetime
import logging
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from index.catalog import Row
from moco.data.photos import ImageDecodeError, photo_info

__all__ = ["Facts", "photo_facts", "suggest_keeper", "CHOSEN"]

logger = logging.getLogger(__name__)

CHOSEN = "chosen by you"  # the reason of a keeper the user chose


@dataclass(frozen=True)
class Facts:
    """What the keeper rule reads of one photo."""

    id: int
    path: str
    width: int | None
    height: int | None
    bytes: int
    taken: float | None  # EXIF DateTimeOriginal, seconds since the epoch of its clock; None without one
    mtime: float  # the file's modification time, seconds since the epoch

    @property
    def pixels(self) -> int:
        return (self.width or 0) * (self.height or 0)

    def as_dict(self) -> dict[str, Any]:
        """The facts a group's member carries in ``dedup.json`` (and the API): width, height, bytes, taken, mtime."""
        return {"width": self.width, "height": self.height, "bytes": self.bytes, "taken": self.taken,
                "mtime": round(self.mtime, 3)}


def photo_facts(root: Path, row: Row) -> Facts:
    """The facts of a catalog row: pixels and date taken from the catalog's columns where it has them, else from the
    header of ``root / row.path`` (unknown when it cannot be read); size and mtime from the catalog."""
    width, height = row.width, row.height
    taken = row.taken if row.taken_exif else None  # a date from the file's mtime is no date taken
    if width is None or height is None:
        try:
            info = photo_info(root / row.path)
            width, height, taken = info.width, info.height, taken if taken is not None else info.taken
        except ImageDecodeError as e:
            logger.debug("no header for %s: %s", row.path, e.reason)
    return Facts(row.id, row.path, width, height, int(row.size), taken, row.mtime_ns / 1e9)


def _day(t: float) -> str:
    return datetime.datetime.fromtimestamp(t, datetime.timezone.utc).strftime("%Y-%m-%d %H:%M")


def _bytes(n: int) -> str:
    return f"{n / 1e6:.1f} MB" if n >= 1e6 else f"{n / 1e3:.0f} kB" if n >= 1e3 else f"{n} bytes"


# The rules in order: (key to maximise, the reason when it decides).
SAME_TIME_S = 2.0  # file times in one step of this many seconds count as one (FAT keeps them to 2 s)
_RULES: list[tuple[Callable[[Facts], Any], Callable[[Facts], str]]] = [
    (lambda f: f.pixels, lambda f: f"most pixels ({f.width} x {f.height})"),
    (lambda f: f.taken is not None, lambda f: f"has a date taken ({_day(f.taken or 0)})"),
    (lambda f: -(f.taken or 0), lambda f: f"earliest date taken ({_day(f.taken or 0)})"),
    (lambda f: -(f.mtime // SAME_TIME_S), lambda f: f"oldest file (modified {_day(f.mtime)})"),
    (lambda f: f.bytes, lambda f: f"largest file ({_bytes(f.bytes)})"),
    (lambda f: -f.mtime, lambda f: f"oldest file (modified {_day(f.mtime)}, within {SAME_TIME_S:.0f} s)"),
]


def suggest_keeper(members: Sequence[Facts], chosen: Collection[int] = ()) -> tuple[int, str]:
    """(id, reason) of the photo to keep of ``members``: one of ``chosen`` (the user's keepers) if any is a member
    (the first by id), else by the rules of the module docstring."""
    mine = sorted(f.id for f in members if f.id in chosen)
    if mine:
        return mine[0], CHOSEN
    left = list(members)
    for key, reason in _RULES:
        best = max(key(f) for f in left)
        narrowed = [f for f in left if key(f) == best]
        if len(narrowed) == 1 and len(left) > 1:
            return narrowed[0].id, reason(narrowed[0])
        left = narrowed
    first = min(left, key=lambda f: f.id)
    return first.id, "the same pixels, size, date and age: the first indexed"
