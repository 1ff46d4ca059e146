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
from dataclasses import dataclass

import numpy as np

from index.catalog import Row

__all__ = ["taken_apart", "Captures", "APART_S", "ZONE_STEP_S"]

APART_S = 1.0  # seconds: dates taken this far apart or more are two captures (EXIF dates are whole seconds)
ZONE_STEP_S = 900.0  # seconds: time zones differ by whole quarter hours; dates that far apart may be one capture


@dataclass
class Captures:
    """What the files of some photos say of their capture: a table to ask which pairs were taken apart
    (:meth:`apart`), built once for many questions (:meth:`of`)."""

    ids: np.ndarray  # N photo ids, sorted
    taken: np.ndarray  # N float32: the EXIF date taken (seconds) modulo ZONE_STEP_S, NaN where none
    camera: np.ndarray  # N int32: the camera's number, -1 where none

    @classmethod
    def of(cls, rows: Mapping[int, Row], ids: np.ndarray | None = None) -> Captures:
        """The table of photos ``ids`` (None: every photo of ``rows``); photos missing from ``rows`` say nothing."""
        ids = np.unique(np.fromiter(rows, np.int64, len(rows)) if ids is None else np.asarray(ids, np.int64))
        names = {name: n for n, name in enumerate(sorted({r.camera for r in rows.values() if r.camera}))}
        taken = np.array([_taken(rows.get(int(i))) for i in ids.tolist()], np.float64)  # N
        camera = np.array([names.get(getattr(rows.get(int(i)), "camera", None) or "", -1) for i in ids.tolist()],
                          np.int32)  # N
        return cls(ids, np.mod(taken, ZONE_STEP_S).astype(np.float32), camera)

    def _at(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The dates and cameras of ``ids`` (any shape; a photo the table lacks: NaN and -1)."""
        ids = np.asarray(ids, np.int64)
        if not len(self.ids):
            return np.full(ids.shape, np.nan, np.float32), np.full(ids.shape, -1, np.int32)
        at = np.minimum(np.searchsorted(self.ids, ids), len(self.ids) - 1)
        known = self.ids[at] == ids
        return np.where(known, self.taken[at], np.nan), np.where(known, self.camera[at], -1)

    def pairs_apart(self, pairs: np.ndarray) -> np.ndarray:
        """Which pairs (P x 2 ids) were taken apart, by the rule of :func:`taken_apart`: P bools."""
        if not len(pairs):
            return np.zeros(0, bool)
        (ta, ca), (tb, cb) = self._at(pairs[:, 0]), self._at(pairs[:, 1])
        return _apart(ta, ca, tb, cb)

    def apart(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        """Which photos of ``a`` (A ids) were taken apart from which of ``b`` (B ids), by the rule of
        :func:`taken_apart`: A x B bools."""
        (ta, ca), (tb, cb) = self._at(np.asarray(a)[:, None]), self._at(np.asarray(b)[None, :])
        return _apart(ta, ca, tb, cb)


def taken_apart(pairs: np.ndarray, rows: Mapping[int, Row]) -> np.ndarray:
    """Which pairs (P x 2 ids) the photos' files say were taken apart (P bools): both have an EXIF date taken and
    they differ by at least :data:`APART_S` (and not by whole quarter hours), or both name a camera and the cameras
    differ. Photos missing from ``rows`` say nothing."""
    return Captures.of(rows, np.unique(pairs)).pairs_apart(pairs)


def _apart(ta: np.ndarray, ca: np.ndarray, tb: np.ndarray, cb: np.ndarray) -> np.ndarray:
    """The rule of :func:`taken_apart` on dates modulo :data:`ZONE_STEP_S` (NaN: none) and cameras (-1: none),
    broadcast. Two dates are within :data:`APART_S` of a whole number of quarter hours apart (0 among them) exactly
    when their remainders are that close, or that close to a quarter hour apart."""
    gap = np.abs(ta - tb)  # NaN where either has no date
    with np.errstate(invalid="ignore"):
        dated = (gap >= APART_S) & (gap <= ZONE_STEP_S - APART_S)  # NaN compares False
    return dated | ((ca >= 0) & (cb >= 0) & (ca != cb))


def _taken(row: Row | None) -> float:
    return float(row.date) if row is not None and row.date_exif and row.date is not None else np.nan
