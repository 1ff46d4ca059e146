"""Catalog: the SQLite file (WAL) that is the index's source of truth.

One row per file under the collection root: its id (the FAISS id, never reused or renumbered),
path relative to the root, size, mtime, content hash, status (``ok`` or ``error`` with the reason),
thumbnail and time added, and what its header says: the photo's date (``Row.date``, the column ``taken``: when it
was taken, EXIF DateTimeOriginal, else the file's mtime, ``date_exif`` saying which; seconds since the epoch of the
camera's clock read as UTC, so a photo's date is the one it shows), the camera and the pixels. Elsewhere in the code
"taken" is EXIF's date taken alone (None without one). The column keeps its name (the file's format), as do the
public names that always meant this date: ``--taken-from``/``--taken-to`` and a search result's ``taken``.
``vectors`` holds each ok row's float32 embedding, so the FAISS index can always be rebuilt, re-tuned or checked
without decoding a photo again.

A catalog made before the header columns existed gets them (``ALTER TABLE``) when it is opened writable; the next
``moco index update`` fills them, reading headers only. Opened read-only, it reads as if they were empty.

Two flags make updates crash-safe. ``indexed`` is 1 once the committed ``index.faiss`` holds the
row's current vector; ``deleted`` marks a file that is gone but may still be in ``index.faiss``.
An update writes the new index file first, then in one transaction sets ``indexed`` and drops
deleted rows, so a kill at any point leaves a readable index and a re-run that finishes the job.

The user's say on duplicates lives here too: ``not_duplicates`` (pairs of photos never grouped), ``keepers``
(photos chosen to keep of their group), both leaving with their photo's row, and ``dedup_moves``, the journal of
duplicates moved out of the collection (:mod:`index.duplicates.resolve.journal`). A catalog of an older version gets
these
tables when it is first written to.

Paths are the ``str`` Python gets from the OS: a file name that is not valid UTF-8 holds lone
surrogates (``surrogateescape``), which SQLite cannot store as TEXT; such a path is stored as a BLOB
of its file-system bytes and read back as the same ``str`` (valid names stay TEXT). A catalog in a
directory without write permission, or on a read-only file system, opens read-only: search works,
writes raise a :class:`UserError` saying so.
"""

from __future__ import annotations

import datetime
import logging
import os
import shutil
import sqlite3
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

import numpy as np

from moco.errors import StorageError, UserError

__all__ = ["Catalog", "Row", "display_path", "MAX_ID", "sample_ids", "wall_clock", "date_text", "taken_bound"]

logger = logging.getLogger(__name__)

_LOW_SPACE = 16 << 20  # bytes: below this much free space, SQLite's "disk I/O error" is taken as a full disk

_SCHEMA = """
CREATE TABLE IF NOT EXISTS images (
    id       INTEGER PRIMARY KEY,           -- the FAISS id
    path     TEXT NOT NULL UNIQUE,          -- relative to the collection root, '/' separated; BLOB if not UTF-8
    size     INTEGER NOT NULL,
    mtime_ns INTEGER NOT NULL,
    hash     TEXT,                          -- blake2b-128 of the bytes; NULL when unreadable
    status   TEXT NOT NULL CHECK (status IN ('ok', 'error')),
    error    TEXT,                          -- why the file could not be indexed
    thumb    TEXT,                          -- relative to the index directory
    added    REAL NOT NULL,                 -- unix time the row was first written
    indexed  INTEGER NOT NULL DEFAULT 0,    -- 1: index.faiss holds this row's current vector
    deleted  INTEGER NOT NULL DEFAULT 0,    -- 1: file gone, row leaves once index.faiss no longer has it
    taken    REAL,                          -- date taken: EXIF DateTimeOriginal, else mtime (wall clock as UTC)
    taken_exif INTEGER,                     -- 1: taken is EXIF's; 0: the file's mtime
    camera   TEXT,                          -- EXIF Make and Model, when present
    width    INTEGER,                       -- pixels as stored (NULL until the header was read)
    height   INTEGER
);
CREATE INDEX IF NOT EXISTS images_hash ON images(hash);
CREATE TABLE IF NOT EXISTS vectors (
    id     INTEGER PRIMARY KEY REFERENCES images(id) ON DELETE CASCADE,
    vector BLOB NOT NULL                    -- float32 x dim, L2-normalized
);
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
"""

# Tables an older catalog gets when it is first written to (``Catalog._ensure``): the user's say on duplicates, which
# leaves with the photo (a photo whose content changed is re-embedded under its id: its row is replaced, and its say
# with it), and the journal of duplicates moved (``index.duplicates.resolve.journal``).
_DEDUP_SCHEMA = """
CREATE TABLE IF NOT EXISTS not_duplicates (  -- two photos the user said are not duplicates of each other
    a      INTEGER NOT NULL REFERENCES images(id) ON DELETE CASCADE,
    b      INTEGER NOT NULL REFERENCES images(id) ON DELETE CASCADE,
    marked REAL NOT NULL,
    PRIMARY KEY (a, b),
    CHECK (a < b)
);
CREATE TABLE IF NOT EXISTS keepers (         -- photos the user chose to keep of their group
    id     INTEGER PRIMARY KEY REFERENCES images(id) ON DELETE CASCADE,
    chosen REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS dedup_moves (     -- the journal of duplicates moved out of the collection
    seq      INTEGER PRIMARY KEY AUTOINCREMENT,
    batch    TEXT NOT NULL,                  -- one action (a move of some groups)
    group_id TEXT NOT NULL,
    photo    INTEGER NOT NULL,               -- its catalog id when moved (the row leaves with the file)
    path     BLOB NOT NULL,                  -- where it was, relative to the collection root (file-system bytes)
    dest     BLOB NOT NULL,                  -- where it went (absolute, file-system bytes)
    back     BLOB,                           -- where an undo puts it (relative; path unless taken meanwhile)
    hash     TEXT NOT NULL,                  -- blake2b-128 of its bytes: checked at every step
    size     INTEGER NOT NULL,
    state    TEXT NOT NULL CHECK (state IN ('planned', 'moved', 'undoing', 'undone', 'failed')),
    note     TEXT,                           -- why it failed (its file stays where it was)
    synced   INTEGER NOT NULL DEFAULT 0,     -- 1: the index was updated since its last state
    updated  REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS dedup_moves_state ON dedup_moves(state);
"""
_DEDUP_TABLES = ("not_duplicates", "keepers", "dedup_moves")


@dataclass
class Row:
    """One catalog row (without its vector)."""

    id: int
    path: str
    size: int
    mtime_ns: int
    hash: str | None
    status: str
    error: str | None = None
    thumb: str | None = None
    added: float = 0.0
    indexed: int = 0
    deleted: int = 0
    date: float | None = None  # the photo's date (column ``taken``): see the module's docstring; None until read
    date_exif: int | None = None  # 1: ``date`` is when it was taken (EXIF); 0: its file's mtime (no date taken)
    camera: str | None = None
    width: int | None = None
    height: int | None = None


# Ids are SQLite INTEGERs (signed 64 bits): a number outside this range is no photo's id (binding it would raise
# OverflowError), so lookups leave it out as they leave out any unknown id.
MAX_ID = 2**63 - 1
_COLUMNS = ("id, path, size, mtime_ns, hash, status, error, thumb, added, indexed, deleted, taken, taken_exif, camera, "
            "width, height")
_HEADER_COLUMNS = (("taken", "REAL"), ("taken_exif", "INTEGER"), ("camera", "TEXT"), ("width", "INTEGER"),
                   ("height", "INTEGER"))


def wall_clock(seconds: float) -> float:
    """A moment (seconds since the epoch) as the catalog's dates hold it: this machine's local clock at that
    moment, read as UTC (what a camera's EXIF date is), so both kinds of dates compare and show alike."""
    local = datetime.datetime.fromtimestamp(seconds)
    return local.replace(tzinfo=datetime.timezone.utc).timestamp()


def date_text(date: float | None) -> str | None:
    """A date as the catalog keeps it (``Row.date``, a date taken) as ISO 8601 without a zone (the camera's clock):
    ``2024-05-06T07:08:09`` (``0001-01-01T...`` for the year 1, four digits always); None for None."""
    if date is None:
        return None
    try:
        moment = _EPOCH + datetime.timedelta(seconds=float(date))
    except (OverflowError, ValueError):  # outside the years 1-9999 (no camera writes such a date): unknown
        return None
    return moment.isoformat(timespec="seconds")


_EPOCH = datetime.datetime(1970, 1, 1)  # ``taken`` values: seconds of the camera's clock since then, read as UTC
_SHOWN = 60  # characters of a bad value echoed in a message


def taken_bound(text: str | None, end: bool, what: str = "--taken-from") -> float | None:
    """A date filter's bound as a ``taken`` value: ``YYYY-MM-DD`` (its start, or with ``end`` the start of the next
    day: a day is included whole, 9999-12-31 too) or ``YYYY-MM-DDTHH:MM[:SS]``; None for an empty one; a UserError
    naming ``what``, the value (its first 60 characters) and the form otherwise."""
    text = (text or "").strip()
    if not text:
        return None
    try:
        if len(text) == 10:
            day = datetime.date.fromisoformat(text)
            moment = datetime.datetime(day.year, day.month, day.day)
        else:
            moment = datetime.datetime.fromisoformat(text.replace(" ", "T"))
            if moment.tzinfo is not None:
                raise ValueError("a zone")
    except (ValueError, OverflowError):
        shown = text if len(text) <= _SHOWN else text[:_SHOWN] + "..."
        raise UserError(f"{what} {shown!r}: give a date as YYYY-MM-DD (e.g. 2024-12-31) or a time as "
                        "YYYY-MM-DDTHH:MM, the camera's clock, without a zone") from None
    seconds = (moment - _EPOCH).total_seconds()
    return seconds + (86400.0 if end and len(text) == 10 else 0.0)


def display_path(path: str) -> str:
    """``path`` for people: bytes that are not UTF-8 (surrogates from the OS) shown escaped, as ``\\xe9``."""
    try:
        return path.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
    except UnicodeEncodeError:  # a lone surrogate that no file name decodes to
        return path.encode("utf-8", "backslashreplace").decode("utf-8")


def _sql_path(path: str) -> str | bytes:
    """A path as the catalog stores it: TEXT when valid UTF-8, else a BLOB of its file-system bytes."""
    try:
        path.encode("utf-8")
    except UnicodeEncodeError:
        return os.fsencode(path)
    return path


def _os_path(value: str | bytes) -> str:
    """A stored path back as the ``str`` the OS gave (the inverse of ``_sql_path``)."""
    return os.fsdecode(value) if isinstance(value, bytes) else value


def _valid_ids(ids: Iterable[int]) -> list[int]:
    """``ids`` as ints, those no photo can have (outside 0 .. MAX_ID) left out."""
    return [i for i in (int(i) for i in ids) if 0 <= i <= MAX_ID]


def _row(r: tuple) -> Row:
    """A Row from ``SELECT {_COLUMNS}``."""
    return Row(r[0], _os_path(r[1]), *r[2:])


def _writable(path: Path) -> bool:
    """Whether SQLite may write ``path`` and its -wal/-shm files beside it (the OS says, root included)."""
    return os.access(path.parent, os.W_OK) and (not path.exists() or os.access(path, os.W_OK))


def _read_only_reason(folder: Path) -> str:
    with suppress(OSError):
        if os.statvfs(folder).f_flag & os.ST_RDONLY:
            return "a read-only file system"
    return "no write permission"


class Catalog:
    """The catalog of one index directory.

    Args:
        path: the ``catalog.sqlite`` file.
        create: make it when missing (``build``); otherwise a missing file is an error, and a catalog
            that cannot be written opens read-only (``read_only``; writes raise :class:`UserError`).
    """

    def __init__(self, path: str | Path, create: bool = False) -> None:
        self.path = Path(path)
        if not create and not self.path.is_file():
            raise UserError(f"{self.path} does not exist: is {self.path.parent} an index made by `moco index build`?")
        self.read_only = not _writable(self.path)
        if create:
            self.check_writable()
        try:
            if self.read_only:
                self.db = self._connect_read_only()
            else:
                self.db = self._connect(str(self.path))
                with self._writing():
                    self.db.execute("PRAGMA journal_mode=WAL")
            self.db.execute("PRAGMA synchronous=NORMAL")
            self.db.execute("PRAGMA foreign_keys=ON")
            if create:
                with self._writing():
                    self.db.executescript(_SCHEMA + _DEDUP_SCHEMA)
            self._select = self._header_columns()
        except sqlite3.DatabaseError as e:
            raise UserError(f"{self.path} is not a readable SQLite catalog ({e}): "
                            "rebuild with `moco index build`") from e

    def _header_columns(self) -> str:
        """The columns to select for a Row: a catalog from before the header columns gets them when it can be
        written (``ALTER TABLE``), else reads them as NULL."""
        have = {r[1] for r in self.db.execute("PRAGMA table_info(images)")}
        missing = [(name, kind) for name, kind in _HEADER_COLUMNS if name not in have]
        if have and missing and not self.read_only:
            logger.info("%s: adding the columns %s (filled by the next `moco index update`)", self.path,
                        ", ".join(name for name, _ in missing))
            for name, kind in missing:
                try:
                    with self._writing():
                        self.db.execute(f"ALTER TABLE images ADD COLUMN {name} {kind}")
                except sqlite3.OperationalError as e:
                    if "duplicate column" not in str(e):  # another process added it meanwhile: nothing to do
                        raise
            missing = []
        gone = {name for name, _ in missing} if have else set()
        return ", ".join(f"NULL AS {c}" if c in gone else c for c in _COLUMNS.split(", "))

    @staticmethod
    def _connect(target: str, uri: bool = False) -> sqlite3.Connection:
        return sqlite3.connect(target, timeout=60, isolation_level=None, check_same_thread=False, uri=uri)

    def _connect_read_only(self) -> sqlite3.Connection:
        """``mode=ro``; ``immutable=1`` when even the WAL's shared-memory file (-shm) cannot be created."""
        target = "file:" + quote(os.fsencode(self.path.absolute()))
        db = self._connect(target + "?mode=ro", uri=True)
        try:
            db.execute("SELECT COUNT(*) FROM sqlite_master").fetchone()
            return db
        except sqlite3.OperationalError:  # "unable to open database file": no -shm on a read-only medium
            db.close()
        wal = self.path.with_name(self.path.name + "-wal")
        if wal.is_file() and wal.stat().st_size:
            logger.warning("%s holds changes a read-only open cannot see: run `moco index update %s` where the "
                           "index is writable", wal, self.path.parent)
        db = self._connect(target + "?immutable=1", uri=True)
        db.execute("SELECT COUNT(*) FROM sqlite_master").fetchone()
        return db

    def close(self) -> None:
        self.db.close()

    def check_writable(self) -> None:
        """Raise a :class:`UserError` naming the cause and the fix when this index cannot be written."""
        if not self.read_only:
            return
        where, why = self.path.parent, _read_only_reason(self.path.parent)
        if self.path.is_file():
            raise UserError(f"{where} is read-only ({why}): search works; to update it, make it writable or copy it")
        raise UserError(f"{where} is read-only ({why}): cannot create {self.path.name} there; make it writable or "
                        "choose another index directory")

    @contextmanager
    def _writing(self) -> Iterator[None]:
        """SQLite's full-disk and I/O errors become a StorageError naming the catalog, the cause and the fix."""
        try:
            yield
        except sqlite3.OperationalError as e:
            msg = str(e)
            if "readonly database" in msg:  # the medium became read-only under us
                self.read_only = True
                self.check_writable()
            with suppress(OSError):
                if "disk I/O error" in msg and shutil.disk_usage(self.path.parent).free < _LOW_SPACE:
                    msg = "database or disk is full"  # SQLite says I/O error when ENOSPC hits its -shm file
            if "disk is full" in msg:
                raise StorageError(f"no space left on device while writing {self.path}: free space and run the "
                                   "same command; the index is unchanged") from e
            if "disk I/O error" in msg:
                raise StorageError(f"I/O error writing {self.path} ({e}): check the disk; the index is "
                                   "unchanged") from e
            raise

    @contextmanager
    def transaction(self) -> Iterator[sqlite3.Connection]:
        """All statements inside commit together or not at all."""
        self.check_writable()
        with self._writing():
            self.db.execute("BEGIN IMMEDIATE")
            try:
                yield self.db
                self.db.execute("COMMIT")
            except BaseException:
                if self.db.in_transaction:  # a failed COMMIT may have ended it already
                    with suppress(sqlite3.Error):
                        self.db.execute("ROLLBACK")
                raise

    # ------------------------------------------------------------------------------------ meta
    def get_meta(self, key: str, default: str | None = None) -> str | None:
        row = self.db.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        return row[0] if row else default

    def set_meta(self, key: str, value: str) -> None:
        self.check_writable()
        with self._writing():
            self.db.execute("INSERT OR REPLACE INTO meta(key, value) VALUES (?, ?)", (key, value))

    # ------------------------------------------------------------------------- tables, duplicates
    def has_table(self, name: str) -> bool:
        """Whether the catalog has table ``name`` (an older catalog lacks the later ones until first written)."""
        return self.db.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?", (name,)).fetchone() \
            is not None

    def ensure_dedup_tables(self) -> None:
        """Create the duplicates' tables an older catalog lacks (``not_duplicates``, ``keepers``, ``dedup_moves``)."""
        if all(self.has_table(t) for t in _DEDUP_TABLES):
            return
        self.check_writable()
        with self._writing():
            self.db.executescript(_DEDUP_SCHEMA)

    def not_duplicate_pairs(self) -> set[tuple[int, int]]:
        """Every (a, b), a < b, of photos the user said are not duplicates of each other."""
        if not self.has_table("not_duplicates"):
            return set()
        return {(a, b) for a, b in self.db.execute("SELECT a, b FROM not_duplicates")}

    def mark_not_duplicates(self, ids: Iterable[int]) -> int:
        """Say that no two of the photos ``ids`` are duplicates of each other; returns the pairs newly marked."""
        ids = sorted(set(_valid_ids(ids)))
        self.ensure_dedup_tables()
        now = time.time()
        with self.transaction() as db:
            before = db.total_changes
            db.executemany("INSERT OR IGNORE INTO not_duplicates(a, b, marked) SELECT ?, ?, ? WHERE EXISTS "
                           "(SELECT 1 FROM images WHERE id = ?) AND EXISTS (SELECT 1 FROM images WHERE id = ?)",
                           [(a, b, now, a, b) for n, a in enumerate(ids) for b in ids[n + 1 :]])
            return db.total_changes - before

    def chosen_keepers(self) -> set[int]:
        """The photos the user chose to keep of their groups."""
        if not self.has_table("keepers"):
            return set()
        return {r[0] for r in self.db.execute("SELECT id FROM keepers")}

    def choose_keeper(self, keep: int, others: Iterable[int]) -> None:
        """Keep photo ``keep`` of its group, whose other photos are ``others`` (no longer chosen, if they were)."""
        self.ensure_dedup_tables()
        with self.transaction() as db:
            db.executemany("DELETE FROM keepers WHERE id = ?", [(i,) for i in _valid_ids(others)])
            db.execute("INSERT OR REPLACE INTO keepers(id, chosen) VALUES (?, ?)", (int(keep), time.time()))

    # ------------------------------------------------------------------------------------ rows
    def rows(self, include_deleted: bool = False) -> dict[str, Row]:
        """Every row by path."""
        sql = f"SELECT {self._select} FROM images" + ("" if include_deleted else " WHERE deleted = 0")
        return {row.path: row for row in map(_row, self.db.execute(sql))}

    def rows_by_id(self, ids: Iterable[int]) -> dict[int, Row]:
        """Live (not deleted) rows for ``ids``; unknown ids (any outside 0 .. MAX_ID among them) are left out."""
        ids = _valid_ids(ids)
        out: dict[int, Row] = {}
        for start in range(0, len(ids), 900):  # SQLite's bound-parameter limit
            chunk = ids[start : start + 900]
            marks = ",".join("?" * len(chunk))
            sql = f"SELECT {self._select} FROM images WHERE deleted = 0 AND id IN ({marks})"
            out.update({r[0]: _row(r) for r in self.db.execute(sql, chunk)})
        return out

    def row_by_path(self, path: str) -> Row | None:
        """The live row of ``path`` (relative to the collection root), or None."""
        sql = f"SELECT {self._select} FROM images WHERE path = ? AND deleted = 0"
        r = self.db.execute(sql, (_sql_path(path),)).fetchone()
        return _row(r) if r else None

    def next_id(self) -> int:
        """The id after every id ever used (ids are never reused, even after a delete)."""
        used = self.db.execute("SELECT MAX(id) FROM images").fetchone()[0]
        floor = int(self.get_meta("next_id", "0") or 0)
        return max(floor, (used + 1) if used is not None else 0)

    def put(self, db: sqlite3.Connection, row: Row, vector: np.ndarray | None) -> None:
        """Insert or replace ``row`` (by id) and its vector, inside a transaction."""
        db.execute(f"INSERT OR REPLACE INTO images({_COLUMNS}) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
                   (row.id, _sql_path(row.path), row.size, row.mtime_ns, row.hash, row.status, row.error, row.thumb,
                    row.added or time.time(), row.indexed, row.deleted, row.date, row.date_exif, row.camera,
                    row.width, row.height))
        if vector is None:
            db.execute("DELETE FROM vectors WHERE id = ?", (row.id,))
        else:
            db.execute("INSERT OR REPLACE INTO vectors(id, vector) VALUES (?, ?)",
                       (row.id, np.ascontiguousarray(vector, np.float32).tobytes()))

    def move(self, db: sqlite3.Connection, id_: int, path: str, size: int, mtime_ns: int) -> None:
        """Give row ``id_`` the new ``path`` of its moved or renamed file (keeping id and vector), in a transaction."""
        db.execute("UPDATE images SET path=?, size=?, mtime_ns=? WHERE id=?", (_sql_path(path), size, mtime_ns, id_))

    def without_header(self) -> list[Row]:
        """Live ok rows whose header was never read (a catalog from before the header columns)."""
        sql = (f"SELECT {self._select} FROM images WHERE deleted = 0 AND status = 'ok' "
               "AND (taken IS NULL OR taken_exif IS NULL)")
        return [_row(r) for r in self.db.execute(sql)]

    def set_header(self, values: Iterable[tuple[int, float, int, str | None, int | None, int | None]]) -> None:
        """Record (id, date, date_exif, camera, width, height) of rows, in one transaction."""
        with self.transaction() as db:
            db.executemany("UPDATE images SET taken = ?, taken_exif = ?, camera = ?, width = ?, height = ? "
                           "WHERE id = ?", [(t, e, c, w, h, i) for i, t, e, c, w, h in values])

    # --------------------------------------------------------------------------------- vectors
    def vectors(self, ids: Iterable[int] | None = None, dim: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(ids N int64, vectors N x D float32) of ok rows (all live ones, or just ``ids``), by id. Read a few
        thousand rows at a time into arrays: the rows are never all held as Python objects (at 1,000,000 photos
        they took as much memory again as the vectors)."""
        dim = dim or int(self.get_meta("dim", "0") or 0)
        if ids is None:
            sql = ("SELECT v.id, v.vector FROM vectors v JOIN images i ON i.id = v.id "
                   "WHERE i.deleted = 0 AND i.status = 'ok' ORDER BY v.id")
            total = self.db.execute(f"SELECT COUNT(*) FROM ({sql})").fetchone()[0]
            cursors: Iterable[sqlite3.Cursor] = [self.db.execute(sql)]
        else:
            wanted = sorted(_valid_ids(ids))
            total = len(wanted)  # at most: unknown ids are left out
            cursors = (self.db.execute(f"SELECT id, vector FROM vectors WHERE id IN ({','.join('?' * len(chunk))}) "
                                       "ORDER BY id", chunk)
                       for chunk in (wanted[start : start + 900] for start in range(0, len(wanted), 900)))
        out_ids = np.empty(total, np.int64)
        vecs: np.ndarray | None = None  # N x D, writable (dedup centres in place)
        n = 0
        for cur in cursors:
            while rows := cur.fetchmany(4096):
                if vecs is None:
                    vecs = np.empty((total, len(rows[0][1]) // 4), np.float32)
                if n + len(rows) > total:  # rows added since they were counted
                    grow = n + len(rows) - total
                    out_ids = np.concatenate([out_ids, np.empty(grow, np.int64)])
                    vecs = np.concatenate([vecs, np.empty((grow, vecs.shape[1]), np.float32)])
                    total += grow
                out_ids[n : n + len(rows)] = [r[0] for r in rows]
                vecs[n : n + len(rows)] = np.frombuffer(b"".join(r[1] for r in rows), np.float32).reshape(len(rows), -1)
                n += len(rows)
        if vecs is None:
            return np.zeros(0, np.int64), np.zeros((0, dim), np.float32)
        return out_ids[:n], vecs[:n]

    def ids_with_hashes(self, hashes: Iterable[str]) -> list[int]:
        """Ids of the live ok rows whose bytes have one of these content hashes, sorted."""
        hashes = sorted({str(h) for h in hashes})
        out: list[int] = []
        for start in range(0, len(hashes), 900):
            chunk = hashes[start : start + 900]
            out += [r[0] for r in self.db.execute(
                f"SELECT id FROM images WHERE deleted = 0 AND status = 'ok' AND hash IN ({','.join('?' * len(chunk))})",
                chunk)]
        return sorted(out)

    def ok_ids(self) -> np.ndarray:
        """Ids of the live ok rows (those with a vector), sorted."""
        cur = self.db.execute("SELECT v.id FROM vectors v JOIN images i ON i.id = v.id "
                              "WHERE i.deleted = 0 AND i.status = 'ok' ORDER BY v.id")
        return np.array([r[0] for r in cur], np.int64)

    # ----------------------------------------------------------------------------- index sync
    def pending(self) -> np.ndarray:
        """Ids of ok rows whose current vector is not yet in ``index.faiss``."""
        cur = self.db.execute("SELECT id FROM images WHERE indexed = 0 AND deleted = 0 AND status = 'ok'")
        return np.array([r[0] for r in cur], np.int64)

    def stale(self) -> np.ndarray:
        """Ids that ``index.faiss`` may still hold but must not: deleted rows and rows now in error."""
        cur = self.db.execute("SELECT id FROM images WHERE deleted = 1 OR (status = 'error' AND indexed = 1)")
        return np.array([r[0] for r in cur], np.int64)

    def mark_indexed(self, added: np.ndarray, removed: np.ndarray) -> None:
        """After ``index.faiss`` was replaced: ``added`` are in it, ``removed`` are gone from it."""
        with self.transaction() as db:
            db.executemany("UPDATE images SET indexed = 1 WHERE id = ?", [(int(i),) for i in added])
            db.executemany("UPDATE images SET indexed = 0 WHERE id = ? AND deleted = 0", [(int(i),) for i in removed])
            # ids are never reused: remember the next one before rows (perhaps the highest) leave
            used = db.execute("SELECT MAX(id) FROM images").fetchone()[0]
            if used is not None:
                db.execute("INSERT OR REPLACE INTO meta(key, value) VALUES ('next_id', ?)",
                           (str(max(self.next_id(), used + 1)),))
            db.executemany("DELETE FROM images WHERE id = ? AND deleted = 1", [(int(i),) for i in removed])

    def reset_indexed(self) -> None:
        """Forget which rows ``index.faiss`` holds (before a rebuild from scratch)."""
        with self.transaction() as db:
            db.execute("UPDATE images SET indexed = 0")

    def entries(self) -> tuple[np.ndarray, list[str], np.ndarray]:
        """(ids N int64 ascending, paths, taken N float64 with NaN where unknown) of every live photo indexed
        without error: the collection as browsing and the views of it list it (no vectors read)."""
        cur = self.db.execute(f"SELECT id, path, {'taken' if 'NULL AS taken' not in self._select else 'NULL'} "
                              "FROM images WHERE deleted = 0 AND status = 'ok' ORDER BY id")
        got = cur.fetchall()
        ids = np.fromiter((r[0] for r in got), np.int64, len(got))
        taken = np.fromiter((np.nan if r[2] is None else r[2] for r in got), np.float64, len(got))
        return ids, [_os_path(r[1]) for r in got], taken

    # ---------------------------------------------------------------------------------- counts
    def counts(self) -> dict[str, int]:
        """Rows by state: ok, error, pending (embedded, not yet searchable), deleted."""
        q = "SELECT SUM(status='ok' AND deleted=0), SUM(status='error' AND deleted=0), " \
            "SUM(status='ok' AND deleted=0 AND indexed=0), SUM(deleted=1) FROM images"
        ok, err, pend, dele = (int(v or 0) for v in self.db.execute(q).fetchone())
        return {"ok": ok, "error": err, "pending": pend, "deleted": dele}

    def errors(self) -> list[tuple[str, str]]:
        """(path, reason) of every file that could not be indexed."""
        return [(_os_path(p), e or "") for p, e in self.db.execute(
            "SELECT path, error FROM images WHERE status = 'error' AND deleted = 0 ORDER BY path")]


def catalog_meta(catalog: Catalog) -> dict[str, Any]:
    """The build settings the catalog records: root, backbone path/sha256/metadata, dim, kind, memory budget, the
    ``--exclude`` patterns."""
    import json

    return {k: json.loads(catalog.get_meta(k) or "null") for k in
            ("root", "backbone_path", "backbone_sha256", "backbone", "dim", "kind", "memory_budget",
             "flat_until", "features", "vectors", "exclude")}


def set_catalog_meta(catalog: Catalog, **values: Any) -> None:
    import json

    with catalog.transaction():
        for k, v in values.items():
            catalog.set_meta(k, json.dumps(v))


def sample_ids(ids: np.ndarray, n: int, rng: np.random.Generator) -> np.ndarray:
    """``n`` of ``ids`` at random, sorted (all of them when there are no more)."""
    return ids if len(ids) <= n else np.sort(rng.choice(ids, n, replace=False))
