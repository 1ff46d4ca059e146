"""One file moved to a new place: never over another file, never lost, and finished by the next call after a kill at
any point.

On one file system the destination is a hard link of the source (``link`` fails when the name is taken, so nothing is
ever overwritten), its folder synced, then the source unlinked. Across file systems (or on one without hard links)
the source is copied to a hidden partial file beside the destination, synced, checked against the content hash, given
the destination's name (a link, or a rename while the name is still free), then the source unlinked. A kill leaves
the source alone, or the source and a complete destination (the next call removes the source), never neither; a
partial copy left behind is removed by the next call. Symbolic links are never moved, nor followed.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
from collections.abc import Collection
from pathlib import Path

from index.building.plan import file_hash
from moco.errors import UserError, storage_error

__all__ = ["transfer", "free_name", "same_file", "TransferError", "PARTIAL_SUFFIX"]

logger = logging.getLogger(__name__)

PARTIAL_SUFFIX = ".moco-partial"  # a copy on its way: ".NAME.moco-partial" beside its destination
_NO_LINK = {errno.EXDEV, errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EMLINK, errno.ENOSYS}


class TransferError(UserError):
    """A file that was not moved, and why (it stays where it was)."""


def free_name(dest: Path, claimed: Collection[Path] = ()) -> Path:
    """``dest``, or the first of ``NAME (2).EXT``, ``NAME (3).EXT``, ... that is neither on disk nor ``claimed``."""
    candidate, n = dest, 1
    while os.path.lexists(candidate) or candidate in claimed:
        n += 1
        candidate = dest.with_name(f"{dest.stem} ({n}){dest.suffix}")
    return candidate


def same_file(a: Path, b: Path) -> bool:
    """Whether ``a`` and ``b`` are one file (hard links of one inode; links themselves are not followed)."""
    try:
        sa, sb = os.lstat(a), os.lstat(b)
    except OSError:
        return False
    return (sa.st_dev, sa.st_ino) == (sb.st_dev, sb.st_ino)


def _digest(path: Path) -> str | None:
    try:
        return file_hash(path)
    except OSError:
        return None


def _sync_dir(folder: Path) -> None:
    """Make a rename, link or unlink in ``folder`` durable (where the file system can)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError as e:  # a file system that cannot sync a folder (some network ones): what it has is what we get
        logger.debug("cannot sync the folder %s: %s", folder, e)
    finally:
        os.close(fd)


def _unlink(path: Path) -> None:
    try:
        path.unlink(missing_ok=True)
    except OSError as e:
        raise storage_error(e, path) from e
    _sync_dir(path.parent)


def _copy_in(src: Path, dst: Path, digest: str) -> None:
    """Copy ``src`` beside ``dst`` (synced, checked), then give it the name ``dst`` without overwriting."""
    partial = dst.with_name(f".{dst.name}{PARTIAL_SUFFIX}")
    try:
        with open(src, "rb") as fi, open(partial, "wb") as fo:
            shutil.copyfileobj(fi, fo, 1 << 20)
            fo.flush()
            os.fsync(fo.fileno())
        shutil.copystat(src, partial)  # its times: the keeper rule and the index's size/mtime read them
    except OSError as e:
        partial.unlink(missing_ok=True)
        raise storage_error(e, dst) from e
    if _digest(partial) != digest:
        partial.unlink(missing_ok=True)
        raise TransferError(f"the copy of {src} at {dst} differs from it: the disk may be failing; {src} is "
                            "unchanged")
    try:
        os.link(partial, dst, follow_symlinks=False)
        partial.unlink()
    except FileExistsError:
        partial.unlink(missing_ok=True)
        raise TransferError(f"{dst} was taken by another file meanwhile: {src} stays where it is") from None
    except OSError as e:
        if e.errno not in _NO_LINK:
            partial.unlink(missing_ok=True)
            raise storage_error(e, dst) from e
        if os.path.lexists(dst):  # no hard links here: a rename, once the name is seen free
            partial.unlink(missing_ok=True)
            raise TransferError(f"{dst} was taken by another file meanwhile: {src} stays where it is") from None
        os.rename(partial, dst)
    _sync_dir(dst.parent)


def transfer(src: Path, dst: Path, digest: str) -> None:
    """Move the file ``src`` (whose bytes hash to ``digest``) to ``dst``, or finish a move of it that was cut off.

    Done already (``dst`` with those bytes, no ``src``): nothing to do. Both there, one file or the same bytes: the
    move was complete but for removing ``src``. A :class:`TransferError` (``src`` stays) for a ``dst`` taken by
    another file, a ``src`` that is a symbolic link or whose bytes changed, or neither file there.
    """
    has_src, has_dst = os.path.lexists(src), os.path.lexists(dst)
    if has_dst and not has_src:
        if _digest(dst) != digest:
            raise TransferError(f"{src} is gone and {dst} holds other bytes than it did: look for the photo there")
        return
    if not has_src:
        raise TransferError(f"neither {src} nor {dst} exists: the photo was moved or deleted by something else")
    if has_dst:
        if same_file(src, dst) or (_digest(dst) == digest == _digest(src)):
            _unlink(src)  # the move was complete but for this; the photo is at dst
            return
        raise TransferError(f"{dst} is taken by another file: {src} stays where it is")
    if os.path.islink(src):
        raise TransferError(f"{src} is a symbolic link: not moved (links are never followed); move it yourself")
    if _digest(src) != digest:
        raise TransferError(f"{src} changed since it was indexed: run `moco index update`, then look at its group "
                            "again")
    try:
        dst.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise storage_error(e, dst.parent) from e
    partial = dst.with_name(f".{dst.name}{PARTIAL_SUFFIX}")
    partial.unlink(missing_ok=True)  # a copy cut off by a kill: ours, and src is still there
    try:
        os.link(src, dst, follow_symlinks=False)
        _sync_dir(dst.parent)
    except FileExistsError:
        raise TransferError(f"{dst} was taken by another file meanwhile: {src} stays where it is") from None
    except OSError as e:
        if e.errno not in _NO_LINK:
            raise storage_error(e, dst) from e
        _copy_in(src, dst, digest)
    _unlink(src)
    logger.debug("moved %s to %s", src, dst)
