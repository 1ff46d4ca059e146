"""What a search for duplicates keeps between runs, in the index directory: each photo's grey frame
(:data:`FRAMES_FILE`), crop windows (:data:`WINDOWS_FILE`) and shrunk frames (:data:`FLATS_FILE`), each photo's
proposed neighbours (:data:`NEIGHBOURS_FILE`), the model's links (:data:`LINKS_FILE`) and every pair the pixel check
has scored (:data:`CHECKED_FILE`).

The pixel check is most of a search's time, and a library changes little between two searches: after an ``index update``
that added a few photos, only the pairs that hold one of them are new. So every scored pair is kept with its score, and
a later search checks only the pairs it has not scored before. A search killed midway keeps the pairs it scored (they
are written a chunk at a time) and the next one goes on from there. The frames (about 12 kB a photo) are kept the same
way, so memory does not hold them all: a search reads the ones it needs. So are the crop windows the proposals look up
(:func:`~index.duplicates.propose.crop_windows`, 8 kB a photo, made from the frame's image by the first search that
needs them): after an update, the crop search of every photo among the new ones reads them instead of making them again.
So are the grey frames shrunk for both pixel searches (1.3 kB a photo, read instead of the frames' 12 kB). The proposals
are kept too (each photo's closest photos by each search, :class:`~index.duplicates.propose.Neighbours`, about 300 bytes
a photo, written anew by each search): after an update, only the new photos are looked up among all, and the others only
among the new ones. So are the model's links (the pairs at a cosine of at least a floor a little under the near
threshold: a range search of the index, whose cost grows faster than the photos; :class:`LinkFile`): after an update,
only the new photos' links are searched.

A record is valid for the photo it was made from: each carries a version of its photo (a digest of its content hash
and thumbnail, :func:`photo_version`), and a pair scored for other versions of its photos (a file replaced in
place) is checked again. Each file begins with a header: its kind, its format and a digest of the settings its
records depend on (the frame's side, the check's thresholds: :func:`check_settings`; for the neighbours, the
proposals' settings and the index's backbone and space); a file of other settings is
started anew, as is one that is not ours. Records are appended whole; a record cut short by a kill is dropped when
the file is next read. Files that came to hold more stale records than live ones are written anew (atomically).
Deleting them loses nothing: the next search makes them again.

File layout (little-endian)::

    header   8 bytes kind (b"MOCOFRM1", b"MOCOWIN1", b"MOCOFLT1", b"MOCONBR1", b"MOCOLNK1" or b"MOCOCHK1"), 8 bytes
             settings digest, 8 bytes record size
    frames   id int64, version uint64, aspect float32, width uint16, height uint16,
             grey SIDE x SIDE uint8, image (2 SIDE) x (2 SIDE) uint8 (its first width x height bytes), colour
             2 x COLOUR_SIDE x COLOUR_SIDE uint8
    windows  id int64, version uint64, windows float32 (CROP_WINDOWS x CROP_SIDE^2)
    flats    id int64, version uint64, pixel float32 (PIXEL_SIDE^2), crop float32 (CROP_SIDE^2)
    neighbours  id int64, version uint64, framed uint8 (1: the photo had a frame), near int64 (5 x k: a photo id, -1
             for none), scores float32 (5 x k), k = PROPOSE_K
    links    a int64, b int64, version uint64, cosine float32: a photo searched (b = -1, its version, the floor
             searched at: one for the file) or a link (a < b, version 0, their centred cosine)
    pairs    a int64, b int64 (a < b), version of a uint64, version of b uint64, score float64
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
from collections import OrderedDict
from collections.abc import Callable, Container, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image

from index.duplicates import propose, verify
from index.duplicates.propose import PROPOSE_K, SOURCES, Neighbours
from index.duplicates.verify import COLOUR_SIDE, SIDE, Frame, frames
from moco.data.photos import ImageDecodeError, load_rgb
from moco.data.workers import ONE_THREAD, in_workers
from moco.files import atomic_write

__all__ = ["FrameFile", "CheckedPairs", "NeighbourFile", "NEIGHBOURS_FILE", "LinkFile", "KeptLinks", "LINKS_FILE",
           "kept_links", "photo_version", "check_settings", "neighbour_settings", "FRAMES_FILE", "WINDOWS_FILE",
           "FLATS_FILE", "CHECKED_FILE", "kept_frames", "kept_scores", "kept_neighbours"]

logger = logging.getLogger(__name__)

FRAMES_FILE, CHECKED_FILE, NEIGHBOURS_FILE = "dedup-frames.bin", "dedup-checked.bin", "dedup-neighbours.bin"
LINKS_FILE = "dedup-links.bin"
WINDOWS_FILE, FLATS_FILE = "dedup-windows.bin", "dedup-flats.bin"
FRAME_FORMAT = 2  # raised when verify.frame_of makes other frames (2: with their colours)
_HEADER = 24
_FRAME = np.dtype([("id", "<i8"), ("version", "<u8"), ("aspect", "<f4"), ("width", "<u2"), ("height", "<u2"),
                   ("grey", "u1", (SIDE * SIDE,)), ("image", "u1", (4 * SIDE * SIDE,)),
                   ("colour", "u1", (2 * COLOUR_SIDE * COLOUR_SIDE,))])
_NEIGHBOURS = np.dtype([("id", "<i8"), ("version", "<u8"), ("framed", "u1"),
                        ("near", "<i8", (len(SOURCES), PROPOSE_K)), ("scores", "<f4", (len(SOURCES), PROPOSE_K))])
_LINK = np.dtype([("a", "<i8"), ("b", "<i8"), ("version", "<u8"), ("cos", "<f4")])
_PAIR = np.dtype([("a", "<i8"), ("b", "<i8"), ("va", "<u8"), ("vb", "<u8"), ("score", "<f8")])
FRAMES_KEPT = 4096  # frames a FrameFile keeps decoded at once
STALE_SLACK = 1024  # records: a file holding more stale records than live ones by more than this is written anew
GREYS_SPAN = 512  # records a FrameFile reads at once for the grey frames of many photos (6 MB)
_BLOCK = 1 << 16  # neighbour records read or written at a time (20 MB)


def _digest(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")


def photo_version(content_hash: str | None, thumb: str | None, path: str, size: int, mtime_ns: int) -> int:
    """A photo's version (64 bits): its content hash and thumbnail; a photo without a content hash by its path,
    size and modification time."""
    return _digest(f"{content_hash}|{thumb}" if content_hash else f"{path}|{size}|{mtime_ns}|{thumb}")


def check_settings() -> int:
    """A digest of what a pair's copy score depends on: the frames and every threshold of the pixel check."""
    names = ("SIDE", "SCALES", "REFINE_FROM", "REFINE_GAP", "COPY_SCORE", "TONE_FROM", "TONE_WEIGHT", "LOW_FROM",
             "LOW_SIDE", "LOW_WEIGHT", "FLAT", "BUSY_SHARE", "BUSY_TONE_WEIGHT", "FLAT_LEVELS", "WINDOW_TONE_WEIGHT",
             "SCREEN_SIDE", "SCREEN_FROM", "FINE_SIDE", "FINE_MIN", "FINE_FROM", "FINE_SCALES", "FINER_SIDE",
             "FINER_FROM", "TEXTURE_SHARE", "TEXTURE_FINE_FROM", "COLOUR_SIDE", "COLOUR_GRID", "COLOUR_FROM",
             "COLOUR_AGREE", "COLOUR_COPY_FROM", "COLOUR_PATTERN")
    return _digest(repr((FRAME_FORMAT, *(getattr(verify, n) for n in names))))


def neighbour_settings(space: str) -> int:
    """A digest of what a photo's proposed neighbours depend on: the proposals' settings, the frames, and ``space``
    (the index's backbone and space, which the model's neighbours are found in)."""
    names = ("PROPOSE_K", "SAME_BYTES_MARGIN", "PIXEL_SIDE", "CROP_SIDE", "CROP_GRIDS", "CROP_SHARES",
             "PIXEL_EXACT_UP_TO", "FLAT_PAIRS", "IVF_CELLS_PER_ROOT", "IVF_PROBE", "CROP_PROBE",
             "SOURCES")
    return _digest(repr((FRAME_FORMAT, SIDE, space, *(getattr(propose, n) for n in names))))


def _frame_settings() -> int:
    return _digest(repr((FRAME_FORMAT, SIDE)))


def _window_settings() -> int:
    return _digest(repr((FRAME_FORMAT, SIDE, propose.CROP_SIDE, propose.CROP_GRIDS, propose.CROP_SHARES)))


def _flat_settings() -> int:
    return _digest(repr((FRAME_FORMAT, SIDE, propose.PIXEL_SIDE, propose.CROP_SIDE)))


class _RecordFile:
    """A header and fixed-size records, appended whole (see the module docstring)."""

    def __init__(self, path: Path, kind: bytes, settings: int, dtype: np.dtype) -> None:
        self.path, self.kind, self.settings, self.dtype = Path(path), kind, settings, dtype
        self.header = kind + settings.to_bytes(8, "little") + dtype.itemsize.to_bytes(8, "little")
        self.writable = True

    def records(self) -> int:
        """Whole records in the file (0 when it is missing or not of these settings: it is then started anew)."""
        try:
            with open(self.path, "rb") as f:
                head = f.read(_HEADER)
                size = os.fstat(f.fileno()).st_size
        except FileNotFoundError:
            return 0
        if head != self.header:
            logger.info("%s is of other settings or not ours: started anew", self.path)
            self._start()
            return 0
        return (size - _HEADER) // self.dtype.itemsize

    def _start(self) -> None:
        try:
            atomic_write(self.path, lambda f: f.write(self.header))
        except OSError as e:  # a read-only index: searched without keeping anything
            logger.warning("cannot write %s (%s): this search keeps nothing for the next", self.path, e)
            self.writable = False

    def read(self, start: int, count: int, fields: list[str] | None = None) -> np.ndarray:
        """Records ``start`` to ``start + count`` (whole ones only)."""
        with open(self.path, "rb") as f:
            f.seek(_HEADER + start * self.dtype.itemsize)
            data = f.read(count * self.dtype.itemsize)
        rec = np.frombuffer(data[: len(data) // self.dtype.itemsize * self.dtype.itemsize], self.dtype)
        return rec if fields is None else rec[fields]

    def heads(self) -> tuple[np.ndarray, np.ndarray]:
        """The ids and versions (the first two fields: int64, uint64) of every whole record, read 16 bytes a record
        (a file of large records is not read whole for them)."""
        n = self.records()
        if not n:
            return np.zeros(0, np.int64), np.zeros(0, np.uint64)
        buf = bytearray(16 * n)
        with open(self.path, "rb") as f:
            fd, size = f.fileno(), self.dtype.itemsize
            for k in range(n):
                buf[16 * k : 16 * k + 16] = os.pread(fd, 16, _HEADER + k * size)
        rec = np.frombuffer(buf, [("id", "<i8"), ("version", "<u8")])
        return rec["id"], rec["version"]

    def append(self, rec: np.ndarray) -> int | None:
        """Append whole records (under a lock: two searches at once append in turn); a record cut short at the
        file's end (a killed write) is dropped first. Returns the number of the first one (None: not written)."""
        if not self.writable:
            return None
        if not self.path.exists():
            self._start()
            if not self.writable:
                return None
        try:
            with open(self.path, "r+b") as f:
                fcntl.flock(f.fileno(), fcntl.LOCK_EX)
                size = os.fstat(f.fileno()).st_size
                first = (size - _HEADER) // self.dtype.itemsize
                f.seek(_HEADER + first * self.dtype.itemsize)
                f.truncate()
                f.write(rec.astype(self.dtype, copy=False).tobytes())
                return first
        except OSError as e:
            logger.warning("cannot write %s (%s): this search keeps nothing more for the next", self.path, e)
            self.writable = False
            return None

    def rewrite(self, chunks: Callable[[], Iterator[np.ndarray]]) -> None:
        """Write the file anew (atomically) with the records ``chunks()`` gives."""
        if not self.writable:
            return

        def write(f) -> None:  # noqa: ANN001 - a binary file
            f.write(self.header)
            for rec in chunks():  # records of this file's dtype
                f.write(rec.tobytes())
        try:
            atomic_write(self.path, write)
        except OSError as e:
            logger.warning("cannot write %s anew (%s)", self.path, e)


def _spans(file: _RecordFile, places: np.ndarray, fields: list[str] | None = None
           ) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """``(pos, records)``: positions in ``places`` (record numbers, K) and those records' ``fields`` (K; None: whole),
    read from ``file`` from one to :data:`GREYS_SPAN` further at once (no map of the file, which would count as this
    process's memory), in the file's order."""
    order = np.argsort(places, kind="stable")
    at = places[order]
    start = 0
    while start < len(at):
        stop = int(np.searchsorted(at, at[start] + GREYS_SPAN))
        rec = file.read(int(at[start]), int(at[stop - 1] - at[start]) + 1, fields)
        yield order[start:stop], rec[at[start:stop] - at[start]]
        start = stop


FRAMES_IN_WORKERS = 4096  # photos to make frames of, at least, for worker processes to make them (a second to start)


def _original(path: Path | None) -> Image.Image | None:
    """A photo decoded from its file for its frame (at least twice a frame's side on its short side); None where it
    cannot be."""
    if path is None:
        return None
    try:
        return load_rgb(path, min_short=2 * SIDE)
    except ImageDecodeError:
        return None


def _records(made: Mapping[int, Frame], versions: Mapping[int, int]) -> np.ndarray:
    """The frames file's records of frames ``made`` (``{id: frame}``, at ``versions``): F records, in order."""
    rec = np.zeros(len(made), _FRAME)
    for n, (i, f) in enumerate(made.items()):
        w, h = f.image.size
        rec[n]["id"], rec[n]["version"], rec[n]["aspect"] = i, versions[i], f.aspect
        rec[n]["width"], rec[n]["height"], rec[n]["grey"] = w, h, f.grey.ravel()
        rec[n]["image"][: w * h] = np.frombuffer(f.image.tobytes(), np.uint8)
        rec[n]["colour"] = 128 if f.colour is None else f.colour.ravel()
    return rec


def _frame(rec: np.void) -> Frame:
    """The frame a record of the frames file holds."""
    w, h = int(rec["width"]), int(rec["height"])
    return Frame(rec["grey"].reshape(SIDE, SIDE).copy(), float(rec["aspect"]),
                 Image.frombytes("L", (w, h), rec["image"][: w * h].tobytes()),
                 rec["colour"].reshape(2, COLOUR_SIDE, COLOUR_SIDE).copy())


def _made_records(part: list[tuple[int, int, Path | None, Path | None]]) -> np.ndarray:
    """A worker's records of the frames of photos ``(id, version, thumbnail path, the photo's file)``, in order (of
    those it could make): the worker packs them, so this process only appends them."""
    files = {i: photo for i, _, _, photo in part}
    made = frames({i: thumb for i, _, thumb, _ in part}, lambda i: _original(files[i]))
    return _records(made, {i: v for i, v, _, _ in part})


class _Versions:
    """Photos' versions as two sorted arrays (16 bytes a photo, where a dict takes about 100: 0.1 GB at 1,000,000
    photos): :meth:`of` looks them up."""

    def __init__(self, versions: Mapping[int, int]) -> None:
        ids = np.fromiter(versions.keys(), np.int64, len(versions))  # N
        order = np.argsort(ids, kind="stable")
        self.ids = ids[order]
        self.versions = np.fromiter(versions.values(), np.uint64, len(versions))[order]  # N

    def of(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """For photos ``ids`` (N int64): which have a version here (N bools), and those versions (N uint64, 0 for
        the others)."""
        ids = np.asarray(ids, np.int64)
        if not len(self.ids):
            return np.zeros(len(ids), bool), np.zeros(len(ids), np.uint64)
        at = np.minimum(np.searchsorted(self.ids, ids), len(self.ids) - 1)  # N
        known = self.ids[at] == ids
        return known, np.where(known, self.versions[at], np.uint64(0))


def _last_of_each(ids: np.ndarray, records: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Photo ids and their records, sorted by id with one record each: the last one (a photo's later record wins)."""
    order = np.lexsort((records, ids))
    ids, records = ids[order], records[order]
    last = np.r_[ids[1:] != ids[:-1], True] if len(ids) else np.zeros(0, bool)
    return ids[last], records[last]


def _live(file: _RecordFile, every: _Versions) -> tuple[np.ndarray, np.ndarray, int]:
    """The photos ``file`` holds at their versions of ``every`` (sorted ids) and their records (a photo's last), and
    how many records the file holds in all."""
    kept_ids, kept_versions = file.heads()
    known, current = every.of(kept_ids)
    live = np.flatnonzero(known & (current == kept_versions))  # records of photos' current versions
    ids, records = _last_of_each(kept_ids[live], live.astype(np.int64))
    return ids, records, len(kept_ids)


class _KeptVectors:
    """Vectors made from each photo's frame, kept in a file of their own (a record a photo: id, version and the
    ``fields``): :meth:`get` reads them where the file holds them for the photo's version, and ``make(ids)`` (``{field:
    M x ...}``) makes the others, which are appended (records appended whole, the file written anew when it holds more
    stale records than live ones, as the frames file is). Where the file holds what is kept in sorted arrays (16 bytes
    a photo)."""

    def __init__(self, path: Path, kind: bytes, settings: int, fields: list[tuple[str, str, tuple[int, ...]]],
                 make: Callable[[list[int]], dict[str, np.ndarray]]) -> None:
        self._file = _RecordFile(path, kind, settings, np.dtype([("id", "<i8"), ("version", "<u8"), *fields]))
        self._make = make
        self._ids = np.zeros(0, np.int64)  # the photos held at their current versions, sorted ...
        self._records = np.zeros(0, np.int64)  # ... and their records
        self._read = False  # (the file's records are read when first needed)
        self.made = 0  # photos whose vectors were made (the rest were read)

    def get(self, ids: Sequence[int], every: _Versions, field: str) -> np.ndarray:
        """``field`` of photos ``ids`` (N x ...), read or made (and kept, for the photos whose versions ``every``
        gives)."""
        at = self._where(ids, every)  # N records, -1 where none
        sub = self._file.dtype[field]
        out = np.empty((len(ids), *sub.shape), sub.base)
        have = np.flatnonzero(at >= 0)
        for pos, rec in _spans(self._file, at[have], [field]):
            out[have[pos]] = rec[field]
        missing = np.flatnonzero(at < 0)
        if len(missing):
            lacking = [ids[n] for n in missing.tolist()]
            made = self._make(lacking)  # {field: M x ...}
            out[missing] = made[field]
            self.made += len(missing)
            self._keep(lacking, made, every)
        return out

    def _where(self, ids: Sequence[int], every: _Versions) -> np.ndarray:
        """Each photo's record in the file at its version of ``every`` (N int64; -1: none). The file's records are
        read the first time; the file is written anew where it holds more stale records than live ones."""
        if not self._read:
            self._read = True
            self._ids, self._records, total = _live(self._file, every)
            if total - len(self._ids) > len(self._ids) + STALE_SLACK and self._file.writable:
                places = np.sort(self._records)
                self._file.rewrite(lambda: (rec for _, rec in _spans(self._file, places)))
                self._records = np.searchsorted(places, self._records).astype(np.int64)
        q = np.asarray(ids, np.int64)
        if not len(self._ids):
            return np.full(len(q), -1, np.int64)
        at = np.minimum(np.searchsorted(self._ids, q), len(self._ids) - 1)  # N
        return np.where(self._ids[at] == q, self._records[at], -1)

    def _keep(self, ids: list[int], made: dict[str, np.ndarray], every: _Versions) -> None:
        """Append the vectors ``made`` of photos ``ids`` (those whose versions ``every`` gives) to the file."""
        known, versions = every.of(np.asarray(ids, np.int64))
        keep = np.flatnonzero(known)
        if not len(keep) or not self._file.writable:
            return
        rec = np.zeros(len(keep), self._file.dtype)
        rec["id"], rec["version"] = np.asarray(ids, np.int64)[keep], versions[keep]
        for field, values in made.items():
            rec[field] = values[keep]
        first = self._file.append(rec)
        if first is not None:
            self._ids, self._records = _last_of_each(np.concatenate([self._ids, rec["id"]]), np.concatenate(
                [self._records, first + np.arange(len(rec), dtype=np.int64)]))


class FrameFile(Mapping[int, Frame]):
    """The frames of the photos of one search, kept in :data:`FRAMES_FILE`: a mapping ``{id: Frame}`` of the photos
    that have one, read from the file as needed (the last :data:`FRAMES_KEPT` kept decoded)."""

    def __init__(self, path: Path) -> None:
        path = Path(path)
        self._file = _RecordFile(path, b"MOCOFRM1", _frame_settings(), _FRAME)

        def beside(name: str, kind: str) -> Path:  # the frames file's neighbour (named after it, but for the index's)
            return path.with_name(name if path.name == FRAMES_FILE else f"{path.stem}-{kind}{path.suffix}")
        s2, p2 = propose.CROP_SIDE**2, propose.PIXEL_SIDE**2
        self._windows = _KeptVectors(beside(WINDOWS_FILE, "windows"), b"MOCOWIN1", _window_settings(),
                                     [("windows", "<f4", (propose.CROP_WINDOWS, s2))],
                                     lambda ids: {"windows": propose.crop_windows_of(self.images(ids))})
        self._flats = _KeptVectors(beside(FLATS_FILE, "flats"), b"MOCOFLT1", _flat_settings(),
                                   [("pixel", "<f4", (p2,)), ("crop", "<f4", (s2,))], self._made_flats)
        self._every = _Versions({})  # every photo of the index and its version (after update)
        self._where: dict[int, int] = {}  # id -> record number, of this search's photos with a valid frame
        self._kept: OrderedDict[int, Frame] = OrderedDict()
        self._memory: dict[int, Frame] = {}  # frames that could not be written (a read-only index)
        self.made = 0  # frames made by this search (the rest were read)

    def update(self, photos: Mapping[int, tuple[int, Path | None]], fallback: Callable[[int], Image.Image | None],
               step: Callable[[int], object] | None = None, every: Mapping[int, int] | None = None,
               batch: int = 256, originals: Callable[[int], Path | None] | None = None,
               workers: int = 0) -> FrameFile:
        """Take the frames of ``photos`` (``{id: (version, thumbnail path)}``) from the file where it holds them at
        that version; make the others (:func:`index.duplicates.verify.frames`, ``fallback`` decoding a photo) and append
        them.
        ``every``: the versions of every photo of the index (``{id: version}``; None: ``photos``'): the file is
        written anew without the others' records when they outnumber the live ones. ``step(n)``: called as photos
        are done. ``workers`` processes make the frames (``batch`` photos at a time, appended in order: the same
        file) where there are at least :data:`FRAMES_IN_WORKERS` to make and ``originals(id)`` gives the file a
        photo is decoded from where its thumbnail cannot serve (what ``fallback`` decodes). Returns itself."""
        step = step or (lambda n: None)
        every = every if every is not None else {i: v for i, (v, _) in photos.items()}
        self._every = _Versions(every)
        live_ids, live_records, total = _live(self._file, self._every)
        known = dict(zip(live_ids.tolist(), live_records.tolist()))  # id -> record, of every photo's current version
        stale = total - len(known)
        self._where = {i: known[i] for i in photos if i in known and photos[i][0] == every[i]}
        step(len(self._where))
        missing = [i for i in photos if i not in self._where]
        parts = [missing[start : start + batch] for start in range(0, len(missing), batch)]
        if (workers > 0 and originals is not None and len(missing) >= FRAMES_IN_WORKERS
                and self._file.writable):  # (a read-only folder keeps the frames in memory: made here)
            logger.info("frames of %d photos made in %d worker processes", len(missing), workers)
            packed = in_workers(_made_records, ([(i, photos[i][0], photos[i][1], originals(i)) for i in part]
                                                for part in parts), workers, "frame-making", env=ONE_THREAD)
            for part, rec in zip(parts, packed):
                step(len(part))
                self._append(rec, {})
            return self._compacted(stale, known)
        for part in parts:
            made = frames({i: photos[i][1] for i in part}, fallback)
            step(len(part))
            for i, f in made.items():
                self._keep(i, f)
            self._append(_records(made, {i: photos[i][0] for i in made}), made)
        return self._compacted(stale, known)

    def _append(self, rec: np.ndarray, made: Mapping[int, Frame]) -> None:
        """Append records ``rec`` (of frames ``made``, where this process made them) to the file, or keep
        ``made`` in memory where the file cannot be written."""
        first = self._file.append(rec) if len(rec) else None
        if first is not None:
            self._where.update({int(i): first + n for n, i in enumerate(rec["id"].tolist())})
        elif len(rec):  # nowhere to keep them (the disk full, say): in memory
            self._memory.update(made or {int(r["id"]): _frame(r) for r in rec})
        self.made += len(rec)

    def _compacted(self, stale: int, known: Mapping[int, int]) -> FrameFile:
        """Itself, its file written anew where it holds more ``stale`` records than live ones (``known``)."""
        if stale > len(known) + STALE_SLACK and self._file.writable:  # more stale records than live ones: anew
            self._compact(known | self._where)
        return self

    def _compact(self, live: Mapping[int, int]) -> None:
        """Write the file anew with the records ``live`` (``{id: record}``) alone."""
        order = sorted(live.items(), key=lambda t: t[1])

        def chunks() -> Iterator[np.ndarray]:
            for start in range(0, len(order), 4096):
                yield np.concatenate([self._file.read(n, 1) for _, n in order[start : start + 4096]])
        self._file.rewrite(chunks)
        at = {i: n for n, (i, _) in enumerate(order)}
        self._where = {i: at[i] for i in self._where}

    def placement(self) -> dict[int, int] | None:
        """Where the file holds each frame (``{id: record}``), for another process to read them (:meth:`placed`);
        None when some frames are held only in this process's memory (the file could not be written)."""
        return None if self._memory else dict(self._where)

    @classmethod
    def placed(cls, path: Path, where: Mapping[int, int]) -> FrameFile:
        """The frames another process's :class:`FrameFile` of ``path`` holds where its :meth:`placement` says (read
        only: nothing is made or written)."""
        frames_ = cls(path)
        frames_._where = dict(where)
        return frames_

    @property
    def path(self) -> Path:
        return self._file.path

    def _keep(self, i: int, f: Frame) -> None:
        self._kept[i] = f
        while len(self._kept) > FRAMES_KEPT:
            self._kept.popitem(last=False)

    def __getitem__(self, i: int) -> Frame:
        f = self._kept.get(i)
        if f is not None:
            self._kept.move_to_end(i)
            return f
        if i in self._memory:
            return self._memory[i]
        f = _frame(self._file.read(self._where[i], 1)[0])  # KeyError: no frame
        self._keep(i, f)
        return f

    def greys(self, ids: Sequence[int]) -> np.ndarray:
        """The grey frames of photos ``ids`` (N x SIDE x SIDE uint8; KeyError: one without a frame), read from the
        file at once, in its order (one photo at a time, a frame costs more to read than to use)."""
        out = np.empty((len(ids), SIDE, SIDE), np.uint8)
        for at, rec in self._spans(ids, ["grey"]):
            out[at] = [self[ids[n]].grey for n in at.tolist()] if rec is None else rec["grey"].reshape(-1, SIDE, SIDE)
        return out

    def images(self, ids: Sequence[int]) -> list[np.ndarray]:
        """The grey images of photos ``ids`` (:attr:`~index.duplicates.verify.Frame.image` as h x w uint8 arrays;
        KeyError: one without a frame), read from the file at once as :meth:`greys` are."""
        out: list[np.ndarray] = [np.empty((0, 0), np.uint8)] * len(ids)
        for at, rec in self._spans(ids, ["width", "height", "image"]):
            for k, n in enumerate(at.tolist()):
                if rec is None:
                    out[n] = np.asarray(self[ids[n]].image, np.uint8)
                else:
                    w, h = int(rec["width"][k]), int(rec["height"][k])
                    out[n] = rec["image"][k, : w * h].reshape(h, w).copy()
        return out

    def windows(self, ids: Sequence[int]) -> np.ndarray:
        """The crop windows of photos ``ids`` (:func:`~index.duplicates.propose.crop_windows`: N x W x S^2 float32),
        read from :data:`WINDOWS_FILE` where it holds them for the photo's version; made from the frames' images for
        the others (:meth:`images`; KeyError: a photo without a frame) and appended there, so the next search reads
        them (after an update, the crop search of every photo among the new ones makes only theirs)."""
        return self._windows.get(ids, self._every, "windows")

    def flats(self, ids: Sequence[int], side: int) -> np.ndarray:
        """The grey frames of photos ``ids`` shrunk to ``side`` a side, less their mean, over their norm
        (:func:`~index.duplicates.propose.flats_of`: N x side^2 float32; ``side`` :data:`~.propose.PIXEL_SIDE` or
        :data:`~.propose.CROP_SIDE`), kept in :data:`FLATS_FILE` as the windows are (1.3 kB a photo, read where
        the frames' greys would be: 12 kB)."""
        return self._flats.get(ids, self._every, {propose.PIXEL_SIDE: "pixel", propose.CROP_SIDE: "crop"}[side])

    def _made_flats(self, ids: list[int]) -> dict[str, np.ndarray]:
        greys = self.greys(ids)  # M x SIDE x SIDE
        return {"pixel": propose.flats_of(greys, propose.PIXEL_SIDE),
                "crop": propose.flats_of(greys, propose.CROP_SIDE)}

    @property
    def windows_made(self) -> int:
        """Photos whose crop windows this search made (the rest were read)."""
        return self._windows.made

    @property
    def flats_made(self) -> int:
        """Photos whose shrunk frames (:meth:`flats`) this search made (the rest were read)."""
        return self._flats.made

    def _spans(self, ids: Sequence[int], fields: list[str]) -> Iterator[tuple[np.ndarray, np.ndarray | None]]:
        """``(at, records)``: positions in ``ids`` (K) and their records' ``fields`` (K), read from the file from one to
        :data:`GREYS_SPAN` further at once (no map of the file, which would count as this process's memory), in the
        file's order; ``(at, None)`` for the frames held only in memory (KeyError: a photo without a frame)."""
        held = np.array([n for n, i in enumerate(ids) if i in self._memory or i not in self._where], np.int64)
        if len(held):
            yield held, None
        rest = np.setdiff1d(np.arange(len(ids)), held)
        if not len(rest):
            return
        at = np.array([self._where[ids[n]] for n in rest.tolist()], np.int64)
        for pos, rec in _spans(self._file, at, fields):
            yield rest[pos], rec

    def __contains__(self, i: object) -> bool:
        return i in self._where or i in self._memory

    def __iter__(self) -> Iterator[int]:
        yield from self._where
        yield from (i for i in self._memory if i not in self._where)

    def __len__(self) -> int:
        return len(self._where) + sum(1 for i in self._memory if i not in self._where)


class CheckedPairs:
    """The pairs the pixel check scored, kept in :data:`CHECKED_FILE` with their photos' versions: :meth:`known`
    gives the scores of pairs scored before at their photos' current versions, :meth:`add` keeps new ones."""

    def __init__(self, path: Path, versions: Mapping[int, int]) -> None:
        self._file = _RecordFile(path, b"MOCOCHK1", check_settings(), _PAIR)
        self._versions = versions
        keys, scores, stale = [], [], 0
        total = self._file.records()
        for start in range(0, total, 1 << 20):
            rec = self._file.read(start, 1 << 20)
            va = np.array([versions.get(a, 0) for a in rec["a"].tolist()], np.uint64)  # 0: not a photo now
            vb = np.array([versions.get(b, 0) for b in rec["b"].tolist()], np.uint64)
            ok = (va == rec["va"]) & (vb == rec["vb"])
            stale += int((~ok).sum())
            keys.append((rec["a"][ok] << 32) | rec["b"][ok])
            scores.append(rec["score"][ok])
        keys_ = np.concatenate(keys) if keys else np.empty(0, np.int64)
        scores_ = np.concatenate(scores) if scores else np.empty(0, np.float64)
        order = np.argsort(keys_, kind="stable")
        keys_, scores_ = keys_[order], scores_[order]
        last = np.ones(len(keys_), bool)
        last[:-1] = keys_[1:] != keys_[:-1]  # a pair scored twice (two searches at once): one of them
        self._keys, self._scores = keys_[last], scores_[last]
        if stale > len(self._keys) + 65536:
            self._file.rewrite(lambda: iter([self._records(self._keys, self._scores)]))

    def _records(self, keys: np.ndarray, scores: np.ndarray) -> np.ndarray:
        rec = np.zeros(len(keys), _PAIR)
        rec["a"], rec["b"] = keys >> 32, keys & 0xFFFFFFFF
        rec["va"] = [self._versions[a] for a in rec["a"].tolist()]
        rec["vb"] = [self._versions[b] for b in rec["b"].tolist()]
        rec["score"] = scores
        return rec

    def __len__(self) -> int:
        return len(self._keys)

    def known(self, pairs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """For pairs (P x 2, a < b, ids under 2^32): which were scored before (P bools) and their scores (P)."""
        keys = (pairs[:, 0].astype(np.int64) << 32) | pairs[:, 1].astype(np.int64)  # P
        at = np.minimum(np.searchsorted(self._keys, keys), max(len(self._keys) - 1, 0))  # P
        hit = self._keys[at] == keys if len(self._keys) else np.zeros(len(keys), bool)
        return hit, np.where(hit, self._scores[at] if len(self._keys) else 0.0, np.nan)

    def add(self, scores: Mapping[tuple[int, int], float]) -> None:
        """Keep newly scored pairs ``{(a, b): score}`` (appended to the file at once: a kill loses none of them)."""
        if not scores:
            return
        pairs = np.array(list(scores), np.int64).reshape(-1, 2)
        keys = (pairs[:, 0] << 32) | pairs[:, 1]
        self._file.append(self._records(keys, np.array(list(scores.values()), np.float64)))


class NeighbourFile:
    """The proposed neighbours of the last search (:class:`~index.duplicates.propose.Neighbours`), kept in
    :data:`NEIGHBOURS_FILE` with their photos' versions and whether each had a frame."""

    def __init__(self, path: Path, space: str) -> None:
        self._file = _RecordFile(path, b"MOCONBR1", neighbour_settings(space), _NEIGHBOURS)

    def load(self, versions: Mapping[int, int], framed: Container[int]) -> Neighbours | None:
        """The neighbours of the photos that are as they were (``versions``: every photo's now; ``framed``: the
        photos with a frame now); None when the file holds none."""
        total = self._file.records()
        if not total:
            return None
        parts = []
        for start in range(0, total, _BLOCK):
            rec = self._file.read(start, _BLOCK)
            ok = np.array([versions.get(i) == v and (i in framed) == bool(f) for i, v, f in
                           zip(rec["id"].tolist(), rec["version"].tolist(), rec["framed"].tolist())], bool)
            parts.append(rec[ok])
        rec = np.concatenate(parts)
        _, last = np.unique(rec["id"][::-1], return_index=True)  # the last record of a photo wins
        rec = rec[::-1][last]
        return Neighbours(rec["id"].astype(np.int64), rec["near"].astype(np.int64), rec["scores"].astype(np.float32))

    def save(self, found: Neighbours, versions: Mapping[int, int], framed: Container[int]) -> None:
        """Write the file anew with ``found`` (atomically; nothing where the index cannot be written)."""
        if found.near.shape[2] != PROPOSE_K or not self._file.writable:
            return

        def chunks() -> Iterator[np.ndarray]:
            for start in range(0, len(found.ids), _BLOCK):
                ids = found.ids[start : start + _BLOCK].tolist()
                rec = np.zeros(len(ids), _NEIGHBOURS)
                rec["id"] = ids
                rec["version"] = [versions[i] for i in ids]
                rec["framed"] = [i in framed for i in ids]
                rec["near"], rec["scores"] = found.near[start : start + _BLOCK], found.scores[start : start + _BLOCK]
                yield rec
        self._file.rewrite(chunks)


@dataclass
class KeptLinks:
    """The model's links a search kept (:class:`LinkFile`): every pair of ``photos`` at a cosine of ``floor`` or
    more."""

    floor: float
    photos: np.ndarray  # N ids: the photos searched, as they are now
    pairs: np.ndarray  # L x 2 ids, a < b: both of ``photos``
    cosines: np.ndarray  # L float32


class LinkFile:
    """The model's links of the last search, kept in :data:`LINKS_FILE`: the pairs of photos at a centred cosine of
    at least a floor (a range search of the index), with the photos searched and their versions. Written anew by
    each search; a photo's links to the photos new since are found by the new photos' own searches."""

    def __init__(self, path: Path, space: str) -> None:
        self._file = _RecordFile(path, b"MOCOLNK1", _digest(repr(("links", space))), _LINK)

    def load(self, versions: Mapping[int, int], threshold: float) -> KeptLinks | None:
        """The links among the photos searched that are as they were (``versions``: every photo's now); None when
        the file holds none, or its floor is above ``threshold`` (a search at a lower one finds links it lacks)."""
        total = self._file.records()
        if not total:
            return None
        rec = np.concatenate([self._file.read(start, _BLOCK) for start in range(0, total, _BLOCK)])
        marks, links = rec[rec["b"] < 0], rec[rec["b"] >= 0]
        if not len(marks):
            return None
        floor = float(marks["cos"].max())
        if floor > threshold:
            logger.info("%s holds the links at %.4f or more, above this search's %.4f: searched anew", self._file.path,
                        floor, threshold)
            return None
        ok = np.array([versions.get(i) == v for i, v in zip(marks["a"].tolist(), marks["version"].tolist())], bool)
        photos = np.unique(marks["a"][ok])
        inside = np.isin(links["a"], photos) & np.isin(links["b"], photos)
        return KeptLinks(floor, photos.astype(np.int64), np.stack([links["a"][inside], links["b"][inside]], axis=1),
                         links["cos"][inside].astype(np.float32))

    def save(self, floor: float, photos: Iterable[int], versions: Mapping[int, int],
             links: Mapping[int, Mapping[int, float]]) -> None:
        """Write the file anew (atomically; nothing where the index cannot be written): ``photos`` were searched at
        ``floor`` and ``links`` (``{id: {other: cosine}}``, symmetric) are all their pairs at ``floor`` or more."""
        if not self._file.writable:
            return

        def chunks() -> Iterator[np.ndarray]:
            ids = list(photos)
            for start in range(0, len(ids), _BLOCK):
                part = ids[start : start + _BLOCK]
                rec = np.zeros(len(part), _LINK)
                rec["a"], rec["b"], rec["version"], rec["cos"] = part, -1, [versions[i] for i in part], floor
                yield rec
            pairs = [(a, b, s) for a, nb in links.items() for b, s in nb.items() if a < b]
            for start in range(0, len(pairs), _BLOCK):
                part = pairs[start : start + _BLOCK]
                rec = np.zeros(len(part), _LINK)
                rec["a"], rec["b"], rec["cos"] = [p[0] for p in part], [p[1] for p in part], [p[2] for p in part]
                yield rec
        self._file.rewrite(chunks)


def kept_links(path: Path) -> dict[tuple[int, int], float]:
    """Every link a links file holds (``{(a, b): cosine}``, a < b), whatever its photos' versions (for tests)."""
    rec = np.fromfile(path, _LINK, offset=_HEADER)
    rec = rec[rec["b"] >= 0]
    return {(a, b): s for a, b, s in zip(rec["a"].tolist(), rec["b"].tolist(), rec["cos"].tolist())}


def kept_frames(path: Path, ids: Iterable[int]) -> dict[int, Frame]:
    """The frames a frames file holds for ``ids`` (the last record of each, whatever its version): for benches that
    check again what a search checked."""
    frames = FrameFile(path)
    total, wanted, where = frames._file.records(), set(ids), {}
    for start in range(0, total, 4096):
        for n, i in enumerate(frames._file.read(start, 4096, ["id"])["id"].tolist()):
            if i in wanted:
                where[i] = start + n
    frames._where = where
    return {i: frames[i] for i in where}


def kept_neighbours(path: Path) -> Neighbours:
    """Every photo's neighbours a neighbours file holds, whatever their versions and the settings it was written
    with (for tests and benches)."""
    rec = np.fromfile(path, _NEIGHBOURS, offset=_HEADER)
    return Neighbours(rec["id"].astype(np.int64), rec["near"].astype(np.int64), rec["scores"].astype(np.float32))


def kept_scores(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """Every pair a checked-pairs file holds (P x 2, a < b) and its score (P), whatever the photos' versions and the
    settings it was written with (for benches; the file is only read)."""
    rec = np.fromfile(path, _PAIR, offset=_HEADER)
    return np.stack([rec["a"], rec["b"]], axis=1).astype(np.int64), rec["score"].astype(np.float64)
