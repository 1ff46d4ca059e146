"""What a user does with groups of duplicates, the same from the CLI, the JSON API and the page: move the photos that
are not a group's keeper out of the collection (and undo it), choose another keeper, say a group is not duplicates.

Moves never delete and never overwrite. Each moved photo keeps its path relative to the collection root under the
destination (a name taken there gets `` (2)``, `` (3)``, ...). The destination is a hidden folder of the collection,
``ROOT/.moco-duplicates`` (which scans skip), unless one is named (``moco index dedup --move-to DIR``); a folder
inside the collection must be hidden, else the photos moved there would be indexed again, and one that holds the
collection is refused. Symbolic links are neither moved nor followed out of the collection or the destination.
Every move is written in the journal (:mod:`index.duplicates.resolve.journal`) before and after its file moves
(:func:`index.duplicates.resolve.transfer.transfer`), so a kill at any moment is finished by the next move or undo,
nothing
lost or moved twice. The journal is read back with the collection's root and the destination folders this index
marked (:func:`index.duplicates.resolve.journal.entry_fault`): an entry that a changed catalog made up is refused, never
acted
on. A photo is moved only while its bytes and its keeper's are what the index holds. After the files, the index is
updated (:func:`index.building.runner.update_index`: the moved photos leave the catalog and ``index.faiss``; a running
server follows, see ``ImageIndex.refresh``) and the duplicates are searched again with the same settings.

"Not duplicates" marks and chosen keepers live in the catalog (:meth:`index.catalog.Catalog.mark_not_duplicates`,
:meth:`~index.catalog.Catalog.choose_keeper`) and survive ``moco index update``.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from index.catalog import display_path
from index.duplicates.dedup import Search, find_group, load_duplicates, search_duplicates, write_duplicates
from index.duplicates.groups import DEFAULT_KINDS, Group, SavedSearch
from index.duplicates.keeper import CHOSEN
from index.duplicates.resolve.journal import MARK_FILE, Entry, Journal, is_marked, mark_destination
from index.duplicates.resolve.transfer import TransferError, free_name, same_file, transfer
from index.search.image_index import ImageIndex
from index.search.index_dir import DEDUP_FILE, INDEX_ID_KEY
from moco.errors import NotFoundError, UserError
from moco.files import lock_dir

__all__ = ["move_duplicates", "undo_moves", "settle", "journal_of", "mark_not_duplicates", "choose_keeper",
           "destination", "select_groups", "search_again", "Outcome", "DUPLICATES_DIR", "PAUSE_ENV"]

logger = logging.getLogger(__name__)

DUPLICATES_DIR = ".moco-duplicates"  # the default destination, inside the collection root (hidden: never scanned)
PAUSE_ENV = "MOCO_DEDUP_PAUSE_S"  # tests: seconds to wait after each file moved (a kill lands between two)


@dataclass
class Outcome:
    """What a move or an undo did (or, ``dry_run``, would do): ``done`` ({"group", "id", "from", "to"}, paths for
    people) and ``skipped`` ({"group", "path", "reason"}); ``batch`` the action's id in the journal; ``groups``: the
    groups the search found again afterwards (None: not searched)."""

    action: str
    dry_run: bool = False
    batch: str | None = None
    destination: str | None = None
    done: list[dict[str, Any]] = field(default_factory=list)
    skipped: list[dict[str, Any]] = field(default_factory=list)
    finished: int = 0  # moves or undos a kill had cut off, finished first
    updated: bool = False
    groups: int | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


# --------------------------------------------------------------------------------------------- checks
def destination(index: ImageIndex, dest: str | Path | None = None) -> Path:
    """Where moved duplicates go: ``dest`` (named by the user) or ``ROOT/.moco-duplicates``; a UserError naming the
    folder and the fix for one inside the index directory, inside the collection but not hidden (its photos would be
    indexed again), or, unnamed, one that leads outside the collection (a symbolic link)."""
    root = index.root.resolve()
    named = dest is not None
    target = Path(dest).expanduser() if named else root / DUPLICATES_DIR
    if not target.is_absolute():
        target = Path.cwd() / target
    real = target.resolve()
    if real.exists() and not real.is_dir():
        raise UserError(f"--move-to {target}: not a folder; name a folder (it is made when missing)")
    if real in root.parents:
        raise UserError(f"--move-to {target} holds the collection {root}: the moved photos would land in or beside "
                        "it; name a folder outside the collection")
    if real == index.dir.resolve() or index.dir.resolve() in real.parents:
        raise UserError(f"--move-to {target} is inside the index directory {index.dir}: name a folder outside it")
    inside = real == root or root in real.parents
    if inside and not any(p.startswith(".") for p in real.relative_to(root).parts):
        raise UserError(f"--move-to {target} is inside the collection {root}: the photos moved there would be indexed "
                        f"again; name a hidden folder (like {root / DUPLICATES_DIR}) or one outside the collection")
    if not inside and not named:
        raise UserError(f"{root / DUPLICATES_DIR} leads outside the collection (to {real}): moves out of the "
                        f"collection need a folder named with `moco index dedup {index.dir} --move-to DIR`")
    return real


def _writable(folders: Iterable[Path], what: str) -> None:
    """A UserError naming the first of ``folders`` that cannot be written (and the fix)."""
    for folder in sorted(set(folders)):
        if folder.exists() and not os.access(folder, os.W_OK):
            ro = False
            try:
                ro = bool(os.statvfs(folder).f_flag & os.ST_RDONLY)
            except OSError as e:  # no file system flags: the permission's message below
                logger.debug("no file system flags for %s: %s", folder, e)
            why = "a read-only file system" if ro else "no write permission"
            raise UserError(f"{folder} is read-only ({why}): {what}; make it writable, then run the same command "
                            "(nothing was moved)")


def _index_key(index: ImageIndex) -> str:
    """What a destination folder's mark names this index by: its id (its folder's path for an index without one)."""
    return index.catalog.get_meta(INDEX_ID_KEY) or str(index.dir.resolve())


def journal_of(index: ImageIndex, vouched: Iterable[Path] = ()) -> Journal:
    """The index's journal as actions read it: only entries inside the collection and a destination folder this index
    marked, its own ``.moco-duplicates`` or one of ``vouched`` (named by the user)."""
    key = _index_key(index)
    root = os.path.realpath(index.root)
    own = os.path.realpath(index.root / DUPLICATES_DIR)
    allowed = {os.path.realpath(f) for f in vouched}
    if own.startswith(root + os.sep):  # not a link out of the collection
        allowed.add(own)

    def trusted(folder: Path) -> bool:
        return os.path.realpath(folder) in allowed or is_marked(folder, key)

    return Journal(index.catalog, index.root, trusted)


def _refused(out: Outcome, journal: Journal) -> None:
    """The journal's entries refused while acting, into ``out.skipped``."""
    for seq, (e, why) in journal.refused.items():
        out.skipped.append({"group": e.group_id, "path": display_path(e.path),
                            "reason": f"the journal's entry {seq} is refused, nothing was moved for it: {why}"})


@contextmanager
def _acting(index: ImageIndex, vouched: Iterable[Path] = ()) -> Iterator[Journal]:
    """The index's journal (:func:`_journal`) while this process alone acts on its duplicates (a second one is told
    who holds it)."""
    index.catalog.check_writable()
    with lock_dir(index.dir, "index"):
        yield journal_of(index, vouched)


def _update(index: ImageIndex, journal: Journal, device: str) -> None:
    """Update the index after moves (the moved photos leave it, photos put back come in) and reload it."""
    from index.building.runner import update_index

    update_index(index.dir, progress=False, device=device)
    journal.mark_synced()
    index.refresh()


def _after_acting(index: ImageIndex, journal: Journal, out: Outcome, device: str, acted: bool) -> None:
    """After a move or an undo (``acted``: it moved files), or finishing one cut off: the index updated where files
    moved or the journal is ahead of it, and the entries refused said in ``out``."""
    if acted or out.finished or journal.unsynced():
        _update(index, journal, device)
        out.updated = True
    _refused(out, journal)


def _searched(index: ImageIndex, out: Outcome, search: bool) -> Outcome:
    """``out``, with the groups of a new search for duplicates when ``search`` and the index changed."""
    if search and out.updated:
        out.groups = len(search_again(index).groups)
    return out


def _digest(path: Path) -> str | None:
    """The content hash of ``path`` as the catalog keeps it; None when it cannot be read."""
    from index.building.plan import file_hash

    try:
        return file_hash(path)
    except OSError:
        return None


def _pause() -> None:
    pause = float(os.environ.get(PAUSE_ENV) or 0)
    if pause > 0:
        time.sleep(pause)


# --------------------------------------------------------------------------------------------- moves
def _forward(index: ImageIndex, journal: Journal, e: Entry) -> dict[str, Any]:
    """Move (or finish moving) one planned entry: its record for the Outcome (``to`` None and a ``reason`` when its
    file stays where it was)."""
    try:
        transfer(index.root / e.path, Path(e.dest), e.hash)
    except TransferError as err:
        journal.set_state(e.seq, "failed", note=str(err))
        logger.warning("%s", err)
        return {"group": e.group_id, "id": e.photo, "from": display_path(e.path), "to": None, "reason": str(err)}
    journal.set_state(e.seq, "moved")
    return {"group": e.group_id, "id": e.photo, "from": display_path(e.path), "to": display_path(e.dest)}


def _record(out: Outcome, record: dict[str, Any]) -> None:
    """A move's or an undo's record into ``out.done``, or into ``out.skipped`` with its reason."""
    if record.get("to") is not None:
        out.done.append(record)
    else:
        out.skipped.append({"group": record["group"], "path": record["from"], "reason": record["reason"]})


def _backward(index: ImageIndex, journal: Journal, e: Entry) -> dict[str, Any] | None:
    """Put back (or finish putting back) one entry; its record, None when it could not be (it stays moved)."""
    src, dest = index.root / e.path, Path(e.dest)
    if e.state == "planned" and os.path.lexists(src) and not os.path.lexists(dest):
        journal.set_state(e.seq, "undone", note="never moved (cut off before its file)")
        return None
    back = e.back
    if back is None:  # where it goes: its place, unless another file took it meanwhile (not the photo itself)
        taken = os.path.lexists(src) and not same_file(src, dest) and _digest(src) != e.hash
        back = free_name(src).relative_to(index.root).as_posix() if taken else e.path
        journal.set_state(e.seq, "undoing", back=back)
    try:
        transfer(dest, index.root / back, e.hash)
    except TransferError as err:
        logger.warning("%s", err)
        if not os.path.lexists(dest) and not os.path.lexists(index.root / back):  # gone: nothing to try again
            journal.set_state(e.seq, "failed", note=str(err))
        return {"group": e.group_id, "id": e.photo, "from": display_path(e.dest), "to": None, "reason": str(err)}
    journal.set_state(e.seq, "undone")
    _prune(Path(e.dest).parent, len(Path(e.path).parts) - 1)
    return {"group": e.group_id, "id": e.photo, "from": display_path(e.dest), "to": display_path(back)}


def _prune(folder: Path, levels: int) -> None:
    """Remove ``folder`` and up to ``levels - 1`` of its parents while they are empty: the sub-folders a move made in
    its destination (``DEST/a/b`` for ``ROOT/a/b/photo.jpg``), once an undo has put their photos back. The destination
    folder itself stays (it holds its mark), and so does any folder holding a file."""
    for _ in range(max(0, levels)):
        if (folder / MARK_FILE).exists():
            return
        try:
            folder.rmdir()  # an empty folder only
        except OSError:
            return
        folder = folder.parent


def _settle(index: ImageIndex, journal: Journal) -> int:
    """Finish what a kill cut off (``planned`` moves forward, ``undoing`` ones back); how many."""
    cut = journal.interrupted()
    for e in cut:
        logger.info("finishing a %s cut off: %s", "move" if e.state == "planned" else "move back", e.path)
        (_forward if e.state == "planned" else _backward)(index, journal, e)
    return len(cut)


def settle(index: ImageIndex, device: str = "auto") -> int:
    """Finish the moves and undos a kill cut off, and update the index if the journal is ahead of it; how many were
    finished. Nothing to do on an index without a journal (or a read-only one: it is left as it is)."""
    journal = journal_of(index)
    if index.catalog.read_only or not (journal.interrupted() or journal.unsynced()):
        return 0
    with _acting(index) as journal:
        n = _settle(index, journal)
        _update(index, journal, device)
    return n


def select_groups(groups: Iterable[Group], kinds: Iterable[str] | None = None,
                  ids: Iterable[str] | None = None) -> list[Group]:
    """The groups of ``kinds`` (None: exact and near), or those of ``ids`` (a UserError for an unknown id)."""
    if ids:
        by_id = {g.id: g for g in groups}
        missing = [i for i in ids if i not in by_id]
        if missing:
            raise NotFoundError(f"no group {', '.join(map(repr, missing))} in the search: give ids it lists")
        return [by_id[i] for i in dict.fromkeys(ids)]
    kinds = tuple(kinds or DEFAULT_KINDS)
    return [g for g in groups if g.kind in kinds]


def _plan(index: ImageIndex, groups: list[Group], target: Path, keepers: Mapping[str, int]
          ) -> tuple[list[tuple[str, int, str, Path, str, int]], list[dict[str, Any]]]:
    """(moves, skipped) for ``groups``: each non-keeper whose file is the photo the index holds, to a free name."""
    root = index.root
    real_root = root.resolve()
    real_target = os.path.realpath(target)
    rows = index.catalog.rows_by_id([m.id for g in groups for m in g.members])
    moves: list[tuple[str, int, str, Path, str, int]] = []
    skipped: list[dict[str, Any]] = []
    claimed: set[Path] = set()
    for g in groups:
        keep = int(keepers.get(g.id, g.keep_id))  # type: ignore[arg-type]
        ids = g.ids
        if keep not in ids:
            raise UserError(f"photo {keep} is not in group {g.id} (its photos: {', '.join(map(str, ids))})")
        k = rows.get(keep)
        if k is None or k.status != "ok" or _digest(root / k.path) != k.hash:
            skipped.append({"group": g.id, "path": display_path(g.keep or str(keep)),
                            "reason": "its keeper is gone or changed since it was indexed: run `moco index update` "
                                      "and look at the group again"})
            continue
        for i in ids:
            row = rows.get(i)
            if i == keep:
                continue
            src = root / row.path if row else None
            why = ("no longer indexed" if row is None or row.status != "ok"
                   else "a symbolic link: not moved (links are never followed)" if src.is_symlink()
                   else "gone" if not src.exists()
                   else "in a folder that leads outside the collection" if real_root not in src.resolve().parents
                   else None)
            if why:
                skipped.append({"group": g.id, "path": display_path(row.path if row else str(i)), "reason": why})
                continue
            dest = free_name(target / row.path, claimed)
            real = os.path.realpath(dest.parent)
            if real != real_target and not real.startswith(real_target.rstrip(os.sep) + os.sep):
                skipped.append({"group": g.id, "path": display_path(row.path),
                                "reason": f"a symbolic link in {target} leads out of it (to {real}): not moved"})
                continue
            claimed.add(dest)
            moves.append((g.id, i, row.path, dest, row.hash, row.size))
    return moves, skipped


def move_duplicates(index: ImageIndex, groups: list[Group], dest: str | Path | None = None,
                    keepers: Mapping[str, int] | None = None, dry_run: bool = False, device: str = "auto",
                    search: bool = True) -> Outcome:
    """Move every photo of ``groups`` but its keeper (``keepers[group id]``, else the group's ``keep_id``) to
    ``dest`` (:func:`destination`), then update the index and (``search``) find the duplicates again; ``dry_run``:
    only say what would move. What a kill cut off before is finished first."""
    target = destination(index, dest)
    if dry_run:
        moves, skipped = _plan(index, groups, target, keepers or {})
        done = [{"group": g, "id": i, "from": display_path(p), "to": display_path(str(d))}
                for g, i, p, d, _, _ in moves]
        return Outcome("move", True, None, str(target), done, skipped)
    out = Outcome("move", destination=str(target))
    with _acting(index) as journal:
        out.finished = _settle(index, journal)
        moves, out.skipped = _plan(index, groups, target, keepers or {})
        _writable({(index.root / p).parent for _, _, p, _, _, _ in moves}, "its photos cannot be moved")
        try:
            target.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise UserError(f"cannot make {target} ({e.strerror or e}): name a folder you can write") from None
        _writable({target}, "nothing can be moved there")
        if moves:
            mark_destination(target, _index_key(index))  # an undo takes photos back from a folder so marked only
            out.batch = journal.new_batch()
            for e in journal.plan(out.batch, moves):  # all written down before the first file moves
                _record(out, _forward(index, journal, e))
                _pause()
        _after_acting(index, journal, out, device, bool(moves))
    return _searched(index, out, search)


def undo_moves(index: ImageIndex, batch: str | None = None, device: str = "auto", search: bool = True,
               moved_to: str | Path | None = None) -> Outcome:
    """Put back the photos moved by action ``batch`` (None: every move not yet undone), the latest first, each to its
    place (or beside it with a suffix when another file took it meanwhile); then update the index and find the
    duplicates again. ``moved_to``: a folder the user says moves went to (one moved into before moco marked its
    destination folders), checked as a destination, then marked."""
    out = Outcome("undo", batch=batch)
    vouched = [destination(index, moved_to)] if moved_to is not None else []
    with _acting(index, vouched) as journal:
        for folder in vouched:
            if folder.is_dir():
                mark_destination(folder, _index_key(index))
        cut = [e for e in journal.interrupted() if e.state == "undoing"]
        for e in cut:  # an undo cut off: finish it first
            _backward(index, journal, e)
        out.finished = len(cut)
        entries = journal.outstanding(batch)
        if batch and not entries and not journal.batch(batch):
            raise NotFoundError(f"no moves {batch!r} in the journal of {index.dir}: `moco index dedup {index.dir} "
                                "--undo` without one puts back every move")
        _writable({(index.root / e.path).parent for e in entries} | {Path(e.dest).parent for e in entries},
                  "the photos cannot be put back")
        for e in entries:
            record = _backward(index, journal, e)
            if record is not None:
                _record(out, record)
            _pause()
        _after_acting(index, journal, out, device, bool(entries))
    return _searched(index, out, search)


# ---------------------------------------------------------------------------------------- the user's say
def search_again(index: ImageIndex) -> Search:
    """Find the duplicates again with the settings of the last search (its given thresholds and kinds)."""
    doc = None
    try:
        doc = load_duplicates(index.dir)
    except UserError as e:  # a damaged dedup.json: the index's own thresholds and the default kinds
        logger.warning("%s; searching with the index's thresholds", e)
    settings = doc.given if doc else {}
    kinds = (doc.kinds if doc else None) or DEFAULT_KINDS
    return search_duplicates(index, settings.get("threshold"), kinds, settings.get("similar_threshold"),
                             exclude_folders=settings.get("exclude_folders") or ())


def _saved(index: ImageIndex) -> SavedSearch:
    doc = load_duplicates(index.dir)
    if doc is None:
        raise NotFoundError(f"no search for duplicates yet ({index.dir / DEDUP_FILE}): run `moco index dedup "
                            f"{index.dir}` (or press Find duplicates on the page) first")
    return doc


def mark_not_duplicates(index: ImageIndex, gid: str) -> Group:
    """Say that the photos of group ``gid`` (of the last search) are not duplicates: no two of them are grouped again,
    whatever the threshold (the marks survive ``moco index update``); the group leaves the saved search. Returns the
    group."""
    index.catalog.check_writable()
    doc = _saved(index)
    group = find_group(doc, gid, index.dir)
    index.catalog.mark_not_duplicates(group.ids)
    write_duplicates(index.dir, replace(doc, groups=tuple(g for g in doc.groups if g.id != gid)))
    return group


def choose_keeper(index: ImageIndex, gid: str, photo: int) -> Group:
    """Keep photo ``photo`` of group ``gid`` (of the last search), in every later search too; returns the group."""
    index.catalog.check_writable()
    doc = _saved(index)
    group = find_group(doc, gid, index.dir)
    ids = group.ids
    if int(photo) not in ids:
        raise UserError(f"photo {photo} is not in group {gid} (its photos: {', '.join(map(str, ids))})")
    index.catalog.choose_keeper(int(photo), [i for i in ids if i != int(photo)])
    group = group.with_keeper(int(photo), CHOSEN)
    write_duplicates(index.dir, replace(doc, groups=tuple(group if g.id == gid else g for g in doc.groups)))
    return group
