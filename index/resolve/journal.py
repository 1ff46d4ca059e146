"""The journal of duplicates moved out of the collection: the catalog's ``dedup_moves`` table.

Every move is written down before its file is touched (``planned``, with its destination) and again once it is done
(``moved``); an undo writes where the file goes back (``undoing``, with that path) before moving it, and ``undone``
after. Each state commits on its own, so a kill at any moment leaves a journal that says what to finish: a
``planned`` move is finished by the next move (or taken back by an undo), an ``undoing`` one by the next undo (or
move). A move whose file could not be moved is ``failed``, with the reason; its file is where it was. ``synced`` says
whether the index was updated after the entry's last state. Paths are stored as the file system's bytes.
"""

from __future__ import annotations

import os
import secrets
import time
from dataclasses import dataclass
from pathlib import Path

from index.catalog import Catalog

__all__ = ["Journal", "Entry", "OUTSTANDING"]

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


class Journal:
    """The moves of one index's catalog."""

    def __init__(self, catalog: Catalog) -> None:
        self.catalog = catalog

    def _select(self, where: str, args: tuple = ()) -> list[Entry]:
        if not self.catalog.has_table("dedup_moves"):
            return []
        sql = f"SELECT {_COLUMNS} FROM dedup_moves WHERE {where} ORDER BY seq"
        return [_entry(r) for r in self.catalog.db.execute(sql, args)]

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
