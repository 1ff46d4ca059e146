"""Photos into the catalog: each decoded once (in a pool of workers), its header read (date taken, camera, pixels),
its thumbnail written, the batch embedded, the results committed in one transaction; moves, copies and removals
need no decoding (:func:`quick_ops`); the headers of rows from before the header columns read (:func:`fill_headers`);
and the thumbnails kept in step with the catalog."""

from __future__ import annotations

import concurrent.futures
import contextlib
import errno
import logging
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from index.building.plan import Plan, Stat, Summary, file_hash
from index.catalog import Catalog, Row, wall_clock
from index.search.index_dir import (
    THUMBS_DIR,
)
from moco.data.photos import ImageDecodeError, load_rgb, photo_info, square_u8
from moco.errors import StorageError, storage_error

logger = logging.getLogger(__name__)

__all__ = ["THUMB_SIZE", "is_our_failure", "write_failed", "decode_round", "embed_round", "commit", "quick_ops",
           "ensure_thumbs_dir", "restore_thumbs", "clean_thumbs", "read_header", "fill_headers"]


THUMB_SIZE = 256


# What the catalog keeps of a photo's header: date, date_exif (1: the date is EXIF's date taken), camera, width, height.
Header = tuple[float, int, str | None, int | None, int | None]


@dataclass
class _Record:
    """One decoded (or failed) file, ready for the catalog."""

    id: int
    path: str
    stat: Stat
    hash: str | None
    square: np.ndarray | None = None  # resize x resize x 3 uint8, dropped after embedding
    vector: np.ndarray | None = None
    error: str | None = None
    thumb: str | None = None
    header: Header | None = None


def read_header(path: Path, mtime_ns: int) -> Header:
    """(date, date_exif, camera, width, height) of a photo for the catalog, from its header only
    (:func:`moco.data.photos.photo_info`): the date is when it was taken, EXIF DateTimeOriginal (date_exif 1), else
    the file's mtime (as the catalog keeps dates, :func:`index.catalog.wall_clock`; date_exif 0); an unreadable header
    gives the mtime and Nones."""
    try:
        info = photo_info(path)
    except ImageDecodeError as e:
        logger.debug("no header for %s: %s", path, e.reason)
        return wall_clock(mtime_ns / 1e9), 0, None, None, None
    if info.taken is None:
        return wall_clock(mtime_ns / 1e9), 0, info.camera, info.width, info.height
    return info.taken, 1, info.camera, info.width, info.height


_OUR_FAILURE = re.compile(r"\[Errno \d+\]|[A-Z]\w*(Error|Exception)\b")


def is_our_failure(reason: str | None) -> bool:
    """Whether an error row's reason is a failure on our side, not of the photo: retried by the next update.

    Photo decode reasons are short phrases ("truncated or corrupt: ...", "unreadable: ..."); older
    versions also stored any exception of theirs (a missing ``thumbs/``, a full disk) as
    ``"FileNotFoundError: ..."``, ``"OSError: [Errno 28] ..."``.
    """
    return bool(reason) and _OUR_FAILURE.match(reason) is not None


def write_failed(err: OSError, path: Path) -> StorageError:
    """The error for a failed write of ours into the index directory: the path, the cause and the fix."""
    if err.errno in (errno.ENOENT, errno.ENOTDIR, errno.EEXIST):  # a folder of the index is missing or a file
        return StorageError(f"cannot write {path} ({err.strerror or err}): {path.parent} is missing or not a folder; "
                            f"remove whatever is at that path (the next run makes {THUMBS_DIR}/ again) and run the "
                            "same command (nothing saved before this point is lost)")
    return storage_error(err, path)


def _write_jpeg(img: Any, dest: Path) -> None:
    tmp = dest.with_name(f".{dest.name}.{os.getpid()}.tmp")
    try:
        img.save(tmp, "JPEG", quality=85, optimize=True)
        os.replace(tmp, dest)
    except OSError as e:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        raise write_failed(e, dest) from e


def _write_thumb(img: Any, index_dir: Path, id_: int) -> str:
    """Write the thumbnail of photo ``id_`` (``img`` is shrunk in place); its path inside the index directory."""
    rel = f"{THUMBS_DIR}/{id_}.jpg"
    img.thumbnail((THUMB_SIZE, THUMB_SIZE))
    _write_jpeg(img, index_dir / rel)
    return rel


def _prepare(root: Path, index_dir: Path, item: tuple[int, str], resize: int) -> _Record:
    """Hash, decode once, make the model square and the thumbnail of one file.

    A photo that cannot be read or decoded becomes an error record with the reason; a failed write of
    ours (the thumbnail) raises :class:`StorageError` instead, so a good photo is never marked bad.
    """
    id_, name = item
    path = root / name
    try:
        content = file_hash(path)  # first: its reasons name special files, loops and dangling links
        st = os.stat(path)
        stat = Stat(st.st_size, st.st_mtime_ns)
    except OSError as e:
        return _Record(id_, name, Stat(0, 0), None, error=f"unreadable: {e.strerror or e}")
    try:
        img = load_rgb(path, min_short=resize)  # the same decode as Embedder.embed(path)
    except ImageDecodeError as e:
        return _Record(id_, name, stat, content, error=e.reason)
    square = square_u8(img, resize)
    return _Record(id_, name, stat, content, square=square, thumb=_write_thumb(img, index_dir, id_),
                   header=read_header(path, stat.mtime_ns))


def decode_round(items: list[tuple[int, str]], root: Path, index_dir: Path, resize: int,
                  pool: concurrent.futures.Executor) -> list[concurrent.futures.Future]:
    """Start decoding ``items`` in the pool (hash, model square, thumbnail): one future per file."""
    return [pool.submit(_prepare, root, index_dir, it, resize) for it in items]


def embed_round(decoding: list[concurrent.futures.Future], embedder: Any, batch_size: int) -> list[_Record]:
    """Wait for a round's decodes and embed them in batches; vectors land on the records."""
    records = [f.result() for f in decoding]
    ok = [r for r in records if r.square is not None]
    for start in range(0, len(ok), batch_size):
        batch = ok[start : start + batch_size]
        vectors = embedder.embed_squares(np.stack([r.square for r in batch]))  # B x D
        for r, v in zip(batch, vectors):
            r.vector, r.square = v, None
    return records


def commit(catalog: Catalog, records: list[_Record], summary: Summary, reembed_ids: set[int]) -> None:
    with catalog.transaction() as db:
        for r in sorted(records, key=lambda r: r.id):
            status = "ok" if r.vector is not None else "error"
            date, exif, camera, width, height = r.header if r.header and status == "ok" else (None,) * 5
            catalog.put(db, Row(r.id, r.path, r.stat.size, r.stat.mtime_ns, r.hash, status, r.error, r.thumb,
                                0.0, indexed=0, deleted=0, date=date, date_exif=exif, camera=camera, width=width,
                                height=height),
                        r.vector)
            if r.error:
                summary.errors.append((r.path, r.error))
                logger.warning("skipping %s: %s", r.path, r.error)
            elif r.id in reembed_ids:
                summary.reembedded += 1
            else:
                summary.embedded += 1


def quick_ops(catalog: Catalog, plan: Plan, index_dir: Path, summary: Summary) -> None:
    """Touches, moves, copies and deletions: no decoding, one transaction."""
    with catalog.transaction() as db:
        for id_, st in plan.touch:
            db.execute("UPDATE images SET size=?, mtime_ns=?, indexed=CASE WHEN deleted=1 THEN 0 ELSE indexed END, "
                       "deleted=0 WHERE id=?", (st.size, st.mtime_ns, id_))
        for id_, path, st in plan.moves:
            catalog.move(db, id_, path, st.size, st.mtime_ns)
        for id_, path, st, content, src in plan.copies:
            _, vec = catalog.vectors([src])  # 1 x D
            src_row = catalog.rows_by_id([src]).get(src)
            thumb = None
            if src_row is not None and src_row.thumb and (index_dir / src_row.thumb).is_file():
                thumb = f"{THUMBS_DIR}/{id_}.jpg"
                try:
                    shutil.copyfile(index_dir / src_row.thumb, index_dir / thumb)
                except OSError as e:
                    raise write_failed(e, index_dir / thumb) from e
            same = src_row or Row(0, "", 0, 0, None, "ok")  # a copy: the source's header (the same bytes)
            date = same.date if same.date_exif else wall_clock(st.mtime_ns / 1e9)  # without EXIF: its own mtime
            catalog.put(db, Row(id_, path, st.size, st.mtime_ns, content, "ok", None, thumb, date=date,
                                date_exif=same.date_exif or 0, camera=same.camera, width=same.width,
                                height=same.height), vec[0])
        db.executemany("UPDATE images SET deleted=1 WHERE id=?", [(i,) for i in plan.gone])
    summary.touched, summary.moved, summary.copied = len(plan.touch), len(plan.moves), len(plan.copies)
    summary.removed = len(plan.gone)


def fill_headers(root: Path, catalog: Catalog, workers: int, present: set[str]) -> int:
    """Read the headers of the indexed photos whose row has none (a catalog from before the header columns) and
    whose file the scan found (``present``): their date taken, camera and pixels, nothing decoded; how many."""
    todo = [r for r in catalog.without_header() if r.path in present]
    if not todo:
        return 0
    logger.info("reading the date taken, camera and size of %d photos indexed before they were recorded", len(todo))
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        headers = list(pool.map(lambda r: read_header(root / r.path, r.mtime_ns), todo))
    catalog.set_header([(r.id, *h) for r, h in zip(todo, headers)])
    return len(todo)


def ensure_thumbs_dir(index_dir: Path) -> None:
    """Make ``thumbs/`` when it is missing (deleted, or never made by an interrupted first build)."""
    thumbs = index_dir / THUMBS_DIR
    if not thumbs.exists() and not thumbs.is_symlink():
        try:
            thumbs.mkdir()
        except OSError as e:
            raise write_failed(e, thumbs) from e


def restore_thumbs(root: Path, index_dir: Path, catalog: Catalog, resize: int, workers: int) -> None:
    """Make the missing thumbnails of indexed photos again: decoded again, never re-embedded."""
    thumbs = index_dir / THUMBS_DIR
    have = {f"{THUMBS_DIR}/{n}" for n in os.listdir(thumbs)} if thumbs.is_dir() else set()
    todo = [r for r in catalog.rows().values() if r.status == "ok" and r.thumb not in have]
    if not todo:
        return
    logger.info("making %d missing thumbnails again", len(todo))

    def one(row: Row) -> tuple[str, int] | None:
        try:
            img = load_rgb(root / row.path, min_short=resize)
        except ImageDecodeError as e:  # changed since the scan: the next update re-embeds it
            logger.warning("no thumbnail for %s: %s", row.path, e.reason)
            return None
        return _write_thumb(img, index_dir, row.id), row.id

    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        made = [m for m in pool.map(one, todo) if m is not None]
    with catalog.transaction() as db:
        db.executemany("UPDATE images SET thumb = ? WHERE id = ?", made)


def clean_thumbs(index_dir: Path, catalog: Catalog) -> None:
    if not (index_dir / THUMBS_DIR).is_dir():
        return
    keep = {r.thumb for r in catalog.rows(include_deleted=True).values() if r.thumb}
    for f in (index_dir / THUMBS_DIR).iterdir():
        rel = f"{THUMBS_DIR}/{f.name}"
        if rel not in keep:
            f.unlink(missing_ok=True)
