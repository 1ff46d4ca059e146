"""The journal of duplicates moved out of the collection: the catalog's ``dedup_moves`` table.

Every move is written down before its file is touched (``planned``, with its destination) and again once it is done
(``moved``); an undo writes where the file goes back (``undoing``, with that path) before moving it, and ``undone``
after. Each state commits on its own, so a kill at any moment leaves a journal that says what to finish: a
``planned`` move is finished by the next move (or taken back by an undo), an ``undoing`` one by the next undo (or
move). A move whose file could not be moved is ``failed``, with the reason; its file is where it was. ``synced`` says
whether the index was updated after the entry's last state. Paths are stored as the file system's bytes.

The journal is data from disk, and a changed catalog must not move files it does not own: a journal opened with the
collection's ``root`` hands out only entries whose paths resolve inside the collection (``path``, ``back``) and
inside a destination folder of this index (``dest``), each the same relative path (or its name with a `` (N)``
suffix); :func:`entry_fault` says why another is refused, and it is never acted on. A destination folder is one
that holds this index's mark (:data:`MARK_FILE`, written by the first move into it: a changed catalog cannot make
one), or the collection's own hidden ``.moco-duplicates`` folder.
"""

from __future__ import annotations

import json
import logging
import os
import re
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from index.catalog import Catalog
from moco.files import atomic_write

__all__ = ["Journal", "Entry", "OUTSTANDING", "MARK_FILE", "mark_destination", "is_marked", "entry_fault"]

logger = logging.getLogger(__name__)

MARK_FILE = ".moco-destination.json"  # in a destination folder: the indexes whose duplicates it holds
_MARK_BYTES = 1 << 16  # a mark larger than this is not ours

OUTSTANDING = ("planned", "moved", "undoing")  # entries an undo takes back
_COLUMNS = "seq, batch, group_id, photo, path, dest, back, hash, size, state, note"


@dataclass(frozen=True)
class Entry:
    """One move of the journal: ``path`` (and ``back``) relative to the collection root, ``dest`` absolute."""

    seq: int
    batch: str
    group_id: str
    photo: int
    path: str
    dest: str
    back: str | None
    hash: str
    size: int
    state: str
    note: str | None = None


def _bytes(path: str | None) -> bytes | None:
    return None if path is None else os.fsencode(path)


def _entry(r: tuple) -> Entry:
    return Entry(r[0], r[1], r[2], r[3], os.fsdecode(r[4]), os.fsdecode(r[5]), None if r[6] is None else
                 os.fsdecode(r[6]), r[7], r[8], r[9], r[10])


# ------------------------------------------------------------------------------------ destinations and checks
def _read_mark(folder: Path) -> list[str]:
    """The index keys ``folder``'s mark names ([] without a readable mark of ours)."""
    try:
        with open(folder / MARK_FILE, "rb") as f:
            raw = f.read(_MARK_BYTES + 1)
        doc = json.loads(raw) if len(raw) <= _MARK_BYTES else None
    except (OSError, ValueError):
        return []
    keys = doc.get("indexes") if isinstance(doc, dict) else None
    return [k for k in keys if isinstance(k, str)] if isinstance(keys, list) else []


def mark_destination(folder: Path, key: str) -> None:
    """Write down in ``folder`` that it holds photos moved out of the index ``key`` (beside the other indexes it may
    hold photos of), so that an undo may take them back from there."""
    keys = _read_mark(folder)
    if key in keys:
        return
    doc = {"what": "photos moved out of moco-retrieval collections as duplicates; `moco index dedup IDX --undo` "
                   "puts them back", "indexes": [*keys, key]}
    atomic_write(folder / MARK_FILE, lambda f: f.write(json.dumps(doc, indent=1).encode()))


def is_marked(folder: Path, key: str) -> bool:
    """Whether ``folder`` holds the mark of the index ``key``."""
    return key in _read_mark(folder)


def _clean_relative(rel: str) -> bool:
    """A plain relative path: no root, no empty, ``.`` or ``..`` part, no NUL or backslash."""
    return (bool(rel) and "\\" not in rel and "\0" not in rel and not os.path.isabs(rel)
            and all(part not in ("", ".", "..") for part in rel.split("/")))


def _inside(folder_real: str, path: Path) -> bool:
    """Whether ``path``'s folder, its links followed, is ``folder_real`` or under it."""
    real = os.path.realpath(path.parent)
    return real == folder_real or real.startswith(folder_real.rstrip(os.sep) + os.sep)


def _same_name(name: str, original: str) -> bool:
    """``name`` is ``original`` or ``original`` with a `` (N)`` suffix before its extension (``free_name``)."""
    o = PurePosixPath(original)
    suffixed = re.escape(o.stem) + r" \(\d{1,9}\)" + re.escape(o.suffix)
    return name == original or re.fullmatch(suffixed, name) is not None


def entry_fault(e: Entry, root: Path, trusted: Callable[[Path], bool]) -> str | None:
    """Why entry ``e`` is refused (None: it may be acted on): ``path`` and ``back`` must be plain relative paths that
    resolve inside the collection ``root``; ``dest`` the same relative path (or its name with a suffix) under a
    folder ``trusted`` accepts, with no link leading out of that folder."""
    real_root = os.path.realpath(root)
    if not _clean_relative(e.path) or not _inside(real_root, root / e.path):
        return f"its photo's path {e.path!r} is not a path inside the collection {root}"
    if e.back is not None:
        back = PurePosixPath(e.back)
        if (not _clean_relative(e.back) or back.parent != PurePosixPath(e.path).parent
                or not _same_name(back.name, PurePosixPath(e.path).name) or not _inside(real_root, root / e.back)):
            return f"its way back {e.back!r} is not the photo's place {e.path!r} (or beside it) in the collection"
    parts = PurePosixPath(e.path).parts
    dest = Path(e.dest)
    if (not dest.is_absolute() or os.path.normpath(e.dest) != e.dest or len(dest.parts) <= len(parts)
            or dest.parts[-len(parts):-1] != parts[:-1] or not _same_name(dest.name, parts[-1])):
        return f"its destination {e.dest!r} is not the photo's path {e.path!r} under a destination folder"
    folder = dest.parents[len(parts) - 1]
    if not trusted(folder):
        return (f"its destination folder {folder} holds no mark ({MARK_FILE}) of this index: if moco moved photos "
                f"there, say so with `--undo --move-to {folder}`")
    if not _inside(os.path.realpath(folder), dest):
        return f"its destination {e.dest} leads out of {folder} through a symbolic link"
    return None


class Journal:
    """The moves of one index's catalog. With the collection's ``root`` (and ``trusted``, which destination folders
    may hold its photos: :func:`entry_fault`), a refused entry is left out of every answer and kept in ``refused``
    (seq -> (entry, why)); without, every entry (for reading its states)."""

    def __init__(self, catalog: Catalog, root: Path | None = None,
                 trusted: Callable[[Path], bool] | None = None) -> None:
        self.catalog = catalog
        self.root = root
        self.trusted = trusted or (lambda folder: False)
        self.refused: dict[int, tuple[Entry, str]] = {}

    def _select(self, where: str, args: tuple = ()) -> list[Entry]:
        if not self.catalog.has_table("dedup_moves"):
            return []
        sql = f"SELECT {_COLUMNS} FROM dedup_moves WHERE {where} ORDER BY seq"
        entries = [_entry(r) for r in self.catalog.db.execute(sql, args)]
        if self.root is None:
            return entries
        kept = []
        for e in entries:
            why = entry_fault(e, self.root, self.trusted)
            if why is None:
                kept.append(e)
            elif e.seq not in self.refused:
                self.refused[e.seq] = (e, why)
                logger.warning("the duplicates journal's entry %d is refused (the catalog was changed by something "
                               "else?): %s", e.seq, why)
        return kept

    @staticmethod
    def new_batch() -> str:
        """An id for one action's moves: when it started (UTC) and a random part (``20250102T030405Z-1a2b3c``)."""
        return time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()) + "-" + secrets.token_hex(3)

    def plan(self, batch: str, moves: list[tuple[str, int, str, Path, str, int]]) -> list[Entry]:
        """Write down ``moves`` (group id, photo id, path, destination, hash, size) as ``planned``, in one commit."""
        self.catalog.ensure_dedup_tables()
        now = time.time()
        with self.catalog.transaction() as db:
            first = db.execute("SELECT COALESCE(MAX(seq), 0) FROM dedup_moves").fetchone()[0] + 1
            db.executemany("INSERT INTO dedup_moves(batch, group_id, photo, path, dest, hash, size, state, updated) "
                           "VALUES (?, ?, ?, ?, ?, ?, ?, 'planned', ?)",
                           [(batch, g, p, _bytes(path), _bytes(str(dest)), h, s, now)
                            for g, p, path, dest, h, s in moves])
        return self._select("seq >= ? AND batch = ?", (first, batch))

    def set_state(self, seq: int, state: str, back: str | None = None, note: str | None = None) -> None:
        """Commit entry ``seq``'s new ``state`` (with where an undo puts it, or why it failed)."""
        with self.catalog.transaction() as db:
            db.execute("UPDATE dedup_moves SET state = ?, back = COALESCE(?, back), note = COALESCE(?, note), "
                       "synced = 0, updated = ? WHERE seq = ?", (state, _bytes(back), note, time.time(), seq))

    def interrupted(self) -> list[Entry]:
        """Entries a kill cut off: ``planned`` moves and ``undoing`` undos."""
        return self._select("state IN ('planned', 'undoing')")

    def outstanding(self, batch: str | None = None) -> list[Entry]:
        """What an undo takes back (of ``batch``, or of every action), the latest first."""
        marks = ",".join("?" * len(OUTSTANDING))
        where = f"state IN ({marks})" + (" AND batch = ?" if batch else "")
        return self._select(where, (*OUTSTANDING, *([batch] if batch else [])))[::-1]

    def last_batch(self) -> str | None:
        """The latest action with moves still outstanding."""
        found = self.outstanding()
        return found[0].batch if found else None

    def batch(self, batch: str) -> list[Entry]:
        """Every entry of one action."""
        return self._select("batch = ?", (batch,))

    def unsynced(self) -> bool:
        """Whether some entry changed since the index was last updated."""
        if not self.catalog.has_table("dedup_moves"):
            return False
        return self.catalog.db.execute("SELECT 1 FROM dedup_moves WHERE synced = 0 LIMIT 1").fetchone() is not None

    def mark_synced(self) -> None:
        """After an index update: every entry's last state is in the index."""
        if not self.catalog.has_table("dedup_moves"):  # nothing was ever moved
            return
        with self.catalog.transaction() as db:
            db.execute("UPDATE dedup_moves SET synced = 1 WHERE synced = 0")
