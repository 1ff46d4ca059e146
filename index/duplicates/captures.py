"""Were two photos taken apart? What their files say, as a second signal beside their pixels.

A copy keeps the photo's EXIF date taken (DateTimeOriginal, to the second) and its camera (Make and Model): a
re-encode, a resize, a crop or a tone edit in an editor writes them over unchanged, and a messenger or a website that
re-encodes a photo drops them altogether. Two photos whose files both carry a date taken, a whole second or more
apart, are two captures, never a copy of one another; so are two whose files name two different cameras. Such a
pair is left apart before the pixel check (:mod:`index.duplicates.verify`), whatever its pixels say: the one signal
that tells two shots of a plain subject apart where their pixels cannot (two pairs of plain trousers, two frames of
a blue sky), and one check the fewer.

A photo with no date taken (a screenshot, a scan, a copy whose metadata was dropped) or no camera says nothing,
and its pairs are the pixel check's to judge. Dates a whole number of quarter hours apart (within a second) are not
taken as apart: a copy whose date a tool moved to another time zone. A burst within one second shares its date and
is judged by its pixels too.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from index.catalog import Row

__all__ = ["taken_apart", "APART_S", "ZONE_STEP_S"]

APART_S = 1.0  # seconds: dates taken this far apart or more are two captures (EXIF dates are whole seconds)
ZONE_STEP_S = 900.0  # seconds: time zones differ by whole quarter hours; dates that far apart may be one capture


def taken_apart(pairs: np.ndarray, rows: Mapping[int, Row]) -> np.ndarray:
    """Which pairs (P x 2 ids) the photos' files say were taken apart (P bools): both have an EXIF date taken and
    they differ by at least :data:`APART_S` (and not by whole quarter hours), or both name a camera and the cameras
    differ. Photos missing from ``rows`` say nothing."""
    if not len(pairs):
        return np.zeros(0, bool)
    ids = np.unique(pairs)  # U, sorted
    taken = np.array([_taken(rows.get(int(i))) for i in ids], np.float64)  # U, NaN: no date taken
    names = {name: n for n, name in enumerate(sorted({r.camera for r in rows.values() if r.camera}))}
    camera = np.array([names.get(getattr(rows.get(int(i)), "camera", None) or "", -1) for i in ids], np.int64)  # U
    a, b = np.searchsorted(ids, pairs[:, 0]), np.searchsorted(ids, pairs[:, 1])  # P, P
    gap = np.abs(taken[a] - taken[b])  # P, NaN where either has no date
    zone = np.abs(gap - np.round(gap / ZONE_STEP_S) * ZONE_STEP_S) < APART_S  # P: a time zone's shift
    with np.errstate(invalid="ignore"):
        dated = (gap >= APART_S) & ~zone  # NaN compares False
    cameras = (camera[a] >= 0) & (camera[b] >= 0) & (camera[a] != camera[b])  # P
    return dated | cameras


def _taken(row: Row | None) -> float:
    return float(row.taken) if row is not None and row.taken_exif and row.taken is not None else np.nan
