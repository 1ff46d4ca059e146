"""The file layer of the three packages: a file written atomically (temp file, fsync, rename) with the mode a plain
``open`` gives, a scratch folder that never outlives its block (Ctrl+C or SIGTERM included), a directory made with its
undo, a directory's lock, a safetensors file read, a file's sha256."""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import shutil
import signal
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import filelock

from moco.errors import UserError, storage_error

__all__ = ["LOCK_FILE", "holder", "write_holder", "atomic_write", "file_mode", "held_signals", "scratch_dir",
           "lock_dir", "make_dirs", "read_safetensors", "sha256_file"]

logger = logging.getLogger(__name__)

_UMASK_LOCK = threading.Lock()
LOCK_FILE = ".moco.lock"  # in a run or work directory while a moco process uses it: the holder's PID


def _umask() -> int:
    """The process umask, read without changing it where Linux tells it (``/proc/self/status``)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError) as e:
        logger.debug("umask not readable from /proc (%s): reading it with os.umask", e)
    with _UMASK_LOCK:  # elsewhere: set and restore it (not thread-safe, hence the lock)
        mask = os.umask(0o022)
        os.umask(mask)
    return mask


def file_mode() -> int:
    """The mode a plain ``open`` gives a new file (0666 less the umask): every file we write gets it."""
    return 0o666 & ~_umask()


class _Recording:
    """A file object that remembers the first ``OSError`` of a write, whoever swallows it (torch.save does)."""

    def __init__(self, f: Any) -> None:
        self._f, self.error = f, None

    def write(self, data: Any) -> int:
        try:
            return self._f.write(data)
        except OSError as e:
            self.error = self.error or e
            raise

    def __getattr__(self, name: str) -> Any:
        return getattr(self._f, name)


@contextlib.contextmanager
def held_signals() -> Iterator[None]:
    """SIGINT and SIGTERM received in the block are held and delivered as it ends.

    Wrap the step that makes a temporary file, so the name is in the caller's hands (inside its ``try``) before an
    interrupt can land. Off the main thread, where Python handles no signal, it holds nothing.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    pending: list[int] = []
    old: dict[int, Any] = {}
    try:
        for s in (signal.SIGINT, signal.SIGTERM):
            handler = signal.getsignal(s)
            if handler is None:  # installed outside Python: leave it alone
                continue
            old[s] = handler
            signal.signal(s, lambda signum, frame: pending.append(signum))
        yield
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)
        for s in pending:
            signal.raise_signal(s)  # now, with the caller's handler: KeyboardInterrupt where the CLI maps it so


@contextlib.contextmanager
def scratch_dir(prefix: str, parent: str | Path | None = None) -> Iterator[Path]:
    """A new private folder (in ``parent``, else the temporary folder) removed with its contents when the block ends,
    however it ends: an interrupt cannot land between the folder's creation and the cleanup that owns it."""
    made: str | None = None
    try:
        with held_signals():
            made = tempfile.mkdtemp(prefix=prefix, dir=parent)
        yield Path(made)
    finally:
        if made is not None:
            shutil.rmtree(made, ignore_errors=True)


def atomic_write(path: str | Path, write: Any) -> None:
    """Call ``write(file_object)`` on a temp file beside ``path``, fsync it, then rename it over ``path``.

    A crash at any moment leaves either the old file or the new one, never a partial file, and an interrupt
    (Ctrl+C, SIGTERM) leaves no temp file. The file gets the mode a plain ``open`` would give it (0666 less the
    umask). A failed write (disk full, read-only, I/O error) raises :class:`~moco.errors.StorageError` naming
    ``path``, the cause and the fix.
    """
    path = Path(path)
    tmp: str | None = None
    rec = None
    try:
        with held_signals():  # the temp file's name is ours before an interrupt can land
            fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        os.fchmod(fd, file_mode())  # mkstemp's is 0600
        with os.fdopen(fd, "wb") as f:
            rec = _Recording(f)
            write(rec)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
        cause = rec.error if rec is not None and rec.error is not None else e
        if isinstance(cause, OSError):
            raise storage_error(cause, path) from e
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


@contextlib.contextmanager
def lock_dir(directory: str | Path, flag: str) -> Iterator[None]:
    """Hold ``directory/.moco.lock`` while the block runs; a second process (or thread) that asks for it meanwhile
    gets a :class:`UserError` naming the holder's PID and ``flag`` (the option that picks another directory).

    The lock is :mod:`filelock`'s: ``flock`` on POSIX, ``msvcrt`` locking on Windows, a lock file of its own where a
    file system has neither. The OS releases a native lock when its process ends, however it ends (SIGKILL too), so
    a killed run never leaves a stale lock; the file stays, with the PID of its last holder (unlinking it races).
    """
    path = Path(directory) / LOCK_FILE
    lock = filelock.FileLock(path, timeout=0)
    try:
        lock.acquire()
    except filelock.Timeout:
        raise UserError(f"{directory} is in use by another moco run (PID {holder(path) or 'unknown'}): wait for it to "
                        f"end, or use another {flag}") from None
    except OSError as e:
        raise storage_error(e, path) from e
    try:
        write_holder(path, f"{os.getpid()}\n")
        yield
    finally:
        lock.release()


def holder(path: Path) -> str:
    """What the holder of the lock file ``path`` wrote into it (``""``: nothing readable)."""
    try:
        return path.read_text(errors="replace").strip()
    except OSError:
        return ""


def write_holder(path: Path, text: str) -> None:
    """Say who holds the lock file ``path``, for the processes that wait for it (a courtesy: a file system that
    refuses the write leaves it unsaid)."""
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_WRONLY)
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, text.encode(), 0)
        finally:
            os.close(fd)


def make_dirs(directory: str | Path) -> Callable[[], None]:
    """``mkdir -p directory``; returns its undo, for a command that fails before it wrote anything worth keeping.

    The undo removes what was created since: ``directory`` with all it holds when this call made it (and the
    parents it made, each only if nothing else is in it by then), else only the entries of ``directory`` that were
    not there at this call. What existed before is never removed. Call it while holding the directory's lock
    (:func:`lock_dir`), so that no other run works there meanwhile.
    """
    directory = Path(directory)
    made = [p for p in (directory, *directory.parents) if not p.exists()]  # innermost first
    before = set() if made else set(os.listdir(directory))
    directory.mkdir(parents=True, exist_ok=True)

    def undo() -> None:
        if made:
            shutil.rmtree(directory, ignore_errors=True)
            for parent in made[1:]:
                with contextlib.suppress(OSError):  # not empty: another run's, or the user's, since
                    parent.rmdir()
            return
        for name in set(os.listdir(directory)) - before:
            path = directory / name
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)

    return undo


def read_safetensors(path: str | Path, framework: str = "pt") -> tuple[dict[str, Any], dict[str, str]]:
    """Tensors and metadata of a ``.safetensors`` file, read through Python's own ``open`` (safetensors' loader
    refuses a path that is not UTF-8, which a folder name may be); ValueError on a damaged file."""
    import json
    import struct

    data = Path(path).read_bytes()
    if len(data) < 8:
        raise ValueError("shorter than a safetensors header")
    (n,) = struct.unpack("<Q", data[:8])
    if n > len(data) - 8:
        raise ValueError(f"its header claims {n} bytes, the file has {len(data) - 8}")
    header = json.loads(data[8 : 8 + n])
    meta = (header.get("__metadata__") or {}) if isinstance(header, dict) else {}
    if framework == "pt":
        from safetensors.torch import load
    else:
        from safetensors.numpy import load
    return load(data), {str(k): str(v) for k, v in meta.items()}


def sha256_file(path: Path) -> str:
    """The sha256 hex digest of the file at ``path``, read in 1 MiB chunks."""
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()
