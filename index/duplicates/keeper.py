"""Which photo of a group of duplicates to keep, and why.

The suggested keeper is the photo the others were most likely made from: the most pixels (a crop or a resize has
fewer); among equals one with a date taken (the camera's file: an edited or re-encoded copy often loses it), the
earliest; then the least processed format (:func:`format_rank`: a camera's RAW file, then what cameras and editors
save, then formats made for the web); then a name that is not another member's name with
something added (``IMG_1 (1).jpg``, ``IMG_1-edited.jpg``, ``IMG_1 - Copy.jpg``, ``Copy of IMG_1.jpg``: what file
managers, browsers and photo apps name a copy; :func:`named_as_copy`); then the oldest file (its modification
time, in steps of :data:`SAME_TIME_S`: a copy is made after its photo); then the largest file; then the oldest to
the fraction of a second; then the first indexed (the smallest id). The size comes late: a brightened, mirrored or
re-encoded copy saved as PNG is larger than its JPEG photo. A keeper the user chose (the catalog's ``keepers``,
:meth:`index.catalog.Catalog.choose_keeper`) comes before all of these. The reason shown is the rule that decided.

What the pixels alone cannot tell: of a photo and its mirror image, or its brightened copy, with the same pixels,
format, dates and no name that gives one away, either may be the original; the file times then decide.

A photo's pixels and date taken come from the catalog when its rows carry them (``width``, ``height``, ``date``
when ``date_exif``: a date from the file's mtime is no date taken),
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
from moco.data.photos import RAW_EXTENSIONS, ImageDecodeError, photo_info

__all__ = ["Facts", "photo_facts", "suggest_keeper", "format_rank", "named_as_copy", "CHOSEN"]

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
    taken = row.date if row.date_exif else None  # a date from the file's mtime is no date taken
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


WEB_FORMATS = frozenset({".webp", ".avif", ".gif"})  # what a browser, a messenger or a site saves, not a camera
FORMATS = ("a camera's RAW file", "a camera's or an editor's format", "a format made for the web")


def format_rank(path: str) -> int:
    """How little a file's format says it was processed, by its suffix: 2 a camera's RAW file, 1 what cameras and
    editors save (JPEG, HEIC, PNG, TIFF, BMP), 0 formats made for the web (WebP, AVIF, GIF). JPEG and PNG rank
    alike: a PNG is as often an edit saved from a JPEG photo as the photo a JPEG was made from."""
    ext = Path(path).suffix.lower()
    return 2 if ext in RAW_EXTENSIONS else 0 if ext in WEB_FORMATS else 1


MIN_STEM = 3  # characters: a shorter name (``1.jpg``) is inside too many others to say one is a copy of it


def named_as_copy(path: str, others: Collection[str]) -> bool:
    """Whether ``path``'s name is one of ``others``' names with something added before or after it, where a word
    ends (case aside): ``IMG_1 (1).jpg``, ``IMG_1-edited.png`` or ``Copy of IMG_1.jpg`` beside ``IMG_1.jpg``, not
    ``IMG_12.jpg``."""
    stem = Path(path).stem.casefold()
    for other in others:
        base = Path(other).stem.casefold()
        if len(base) < MIN_STEM or len(stem) <= len(base):
            continue
        if (stem.startswith(base) and not stem[len(base)].isalnum()) or (
                stem.endswith(base) and not stem[-len(base) - 1].isalnum()):
            return True  # cut where a word ends: IMG_12 is no copy of IMG_1
    return False


# The rules in order: (key to maximise over the members left, the reason when it decides). A key takes the member
# and the paths of all the group's members.
SAME_TIME_S = 2.0  # file times in one step of this many seconds count as one (FAT keeps them to 2 s)
_RULES: list[tuple[Callable[[Facts, Collection[str]], Any], Callable[[Facts], str]]] = [
    (lambda f, _: f.pixels, lambda f: f"most pixels ({f.width} x {f.height})"),
    (lambda f, _: f.taken is not None, lambda f: f"has a date taken ({_day(f.taken or 0)})"),
    (lambda f, _: -(f.taken or 0), lambda f: f"earliest date taken ({_day(f.taken or 0)})"),
    (lambda f, _: format_rank(f.path), lambda f: f"least processed format ({FORMATS[2 - format_rank(f.path)]})"),
    (lambda f, paths: not named_as_copy(f.path, paths), lambda f: f"not named as a copy ({Path(f.path).name})"),
    (lambda f, _: -(f.mtime // SAME_TIME_S), lambda f: f"oldest file (modified {_day(f.mtime)})"),
    (lambda f, _: f.bytes, lambda f: f"largest file ({_bytes(f.bytes)})"),
    (lambda f, _: -f.mtime, lambda f: f"oldest file (modified {_day(f.mtime)}, within {SAME_TIME_S:.0f} s)"),
]


def suggest_keeper(members: Sequence[Facts], chosen: Collection[int] = ()) -> tuple[int, str]:
    """(id, reason) of the photo to keep of ``members``: one of ``chosen`` (the user's keepers) if any is a member
    (the first by id), else by the rules of the module docstring."""
    mine = sorted(f.id for f in members if f.id in chosen)
    if mine:
        return mine[0], CHOSEN
    left = list(members)
    paths = [f.path for f in members]
    for key, reason in _RULES:
        best = max(key(f, paths) for f in left)
        narrowed = [f for f in left if key(f, paths) == best]
        if len(narrowed) == 1 and len(left) > 1:
            return narrowed[0].id, reason(narrowed[0])
        left = narrowed
    first = min(left, key=lambda f: f.id)
    return first.id, "the same pixels, size, date and age: the first indexed"
