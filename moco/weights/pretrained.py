"""Official MoCo checkpoints by name: a registry, a verified and resumable download into ``$MOCO_HOME``.

Names (top-1: ImageNet linear probe, as the official READMEs report it):

    moco_v1_200ep, moco_v2_200ep, moco_v2_800ep     facebookresearch/moco README: ResNet-50, md5 prefix published
    r-50-100ep, r-50-300ep, r-50-1000ep,            facebookresearch/moco-v3 CONFIG.md: no checksum published, so
    vit-s-300ep, vit-b-300ep                        the sha256 is recorded on first download and checked after

A name is fetched only when asked for, once: into ``FILE.part`` (an interrupted download resumes with an HTTP
Range request), verified, then renamed; every later use checks the cached file again. A file without a published
checksum has its sha256 recorded only once it proves whole (its zip checks pass, or it loads). Several processes
asking at once: one downloads, the others say who holds the lock and wait, as long as its file grows. A path that
exists always wins over a name. ``MOCO_PRETRAINED_URL`` replaces the download host (a mirror, or a test server), and
``REGISTRY`` takes more entries.
"""

from __future__ import annotations

import contextlib
import difflib
import errno
import hashlib
import http.client
import logging
import os
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import filelock

from moco.errors import NetworkError, UserError, storage_error
from moco.files import holder, write_holder

__all__ = ["Pretrained", "REGISTRY", "DEFAULT", "FetchError", "moco_home", "url_for", "cache_path", "fetch", "resolve",
           "listing"]

logger = logging.getLogger(__name__)

BASE_URL = "https://dl.fbaipublicfiles.com"
TIMEOUT_S = 30.0  # a connection silent for this long is offline (a message), never a hang
ATTEMPTS = 3  # connections per fetch while each one makes progress; each resumes where the last one stopped
CHUNK = 1 << 20
LOCK_POLL_S = 1.0  # how often a process waiting for another one's download tries its lock
LOCK_SAY_S = 30.0  # ... and says it is still waiting
LOCK_STALL_S = 300.0  # ... and gives up when that download's file has not grown for this long (its connections give
# up after TIMEOUT_S without data, ATTEMPTS times: a holder silent for longer is stuck, not downloading)
_clock, _sleep = time.monotonic, time.sleep  # tests put a synthetic clock here


@dataclass(frozen=True)
class Pretrained:
    """One official checkpoint: where it is, what it holds, how to verify it."""

    name: str
    path: str  # under the download host, e.g. "moco/moco_checkpoints/NAME/NAME_pretrain.pth.tar"
    arch: str  # our --arch name of its backbone
    moco_version: str  # "v1", "v2" or "v3"
    top1: float  # ImageNet linear-probe top-1 (%) the official README reports
    md5: str = ""  # the md5 prefix the official README publishes ("": none published)
    size: int | None = None  # bytes where the README gives them (it does not: known once cached)

    @property
    def filename(self) -> str:
        return self.path.rsplit("/", 1)[-1]


def _v12(name: str, version: str, top1: float, md5: str) -> Pretrained:
    return Pretrained(name, f"moco/moco_checkpoints/{name}/{name}_pretrain.pth.tar", "resnet50", version, top1, md5)


def _v3(name: str, arch: str, top1: float) -> Pretrained:
    return Pretrained(name, f"moco-v3/{name}/{name}.pth.tar", arch, "v3", top1)


REGISTRY: dict[str, Pretrained] = {
    p.name: p
    for p in (
        _v12("moco_v1_200ep", "v1", 60.6, "b251726a"),
        _v12("moco_v2_200ep", "v2", 67.7, "59fd9945"),
        _v12("moco_v2_800ep", "v2", 71.1, "a04e12f8"),
        _v3("r-50-100ep", "resnet50", 68.9),
        _v3("r-50-300ep", "resnet50", 72.8),
        _v3("r-50-1000ep", "resnet50", 74.6),
        _v3("vit-s-300ep", "vit_small_patch16_224", 73.2),  # 12 heads (the file's layout says so)
        _v3("vit-b-300ep", "vit_base_patch16_224", 76.7),
    )
}
DEFAULT = "moco_v2_800ep"  # what `moco run PHOTOS` starts from when it can


class FetchError(NetworkError):
    """A named checkpoint could not be downloaded or verified; the message names the URL, the path and the fix.

    Not bad input: the CLI exits 1."""


def moco_home() -> Path:
    """Where checkpoints and exports are cached: ``$MOCO_HOME``, else the platform's cache folder for the user
    (:func:`platformdirs.user_cache_path`): ``$XDG_CACHE_HOME/moco-retrieval`` or ``~/.cache/moco-retrieval`` on
    Linux, ``~/Library/Caches/moco-retrieval`` on macOS, ``%LOCALAPPDATA%\\moco-retrieval\\Cache`` on Windows. An
    empty variable counts as unset; a relative ``$XDG_CACHE_HOME`` is ignored, as the XDG Base Directory
    specification asks."""
    if os.environ.get("MOCO_HOME"):
        return Path(os.environ["MOCO_HOME"]).expanduser()
    import platformdirs

    return platformdirs.user_cache_path("moco-retrieval", appauthor=False)


def url_for(entry: Pretrained) -> str:
    """The download URL of ``entry`` (host: ``$MOCO_PRETRAINED_URL`` when set)."""
    return f"{(os.environ.get('MOCO_PRETRAINED_URL') or BASE_URL).rstrip('/')}/{entry.path}"


def cache_path(entry: Pretrained) -> Path:
    """Where ``entry`` is (or will be) cached: ``$MOCO_HOME/checkpoints/FILE``."""
    return moco_home() / "checkpoints" / entry.filename


def _entry(name: str) -> Pretrained:
    if name not in REGISTRY:
        raise UserError(f"unknown pretrained name {name!r}: use one of {', '.join(REGISTRY)} (`moco pretrained`)")
    return REGISTRY[name]


def resolve(value: str | os.PathLike[str], progress: bool = True) -> Path:
    """``value`` as a local file: an existing path as is; a registry name fetched (once) and verified.

    Any other value comes back as a path, for its reader to report as missing, except a bare word that is
    neither a file nor a name: that is a UserError listing the names. A :class:`~pathlib.Path` is a file already
    (what this returns): it is handed back as it is, so a name is resolved once, where a command or a public
    function takes it, and the file is passed down from there.
    """
    if isinstance(value, Path):
        return value.expanduser()
    path = Path(value).expanduser()
    text = str(value)
    if path.exists():
        return path  # a path that exists always wins over a name
    if text in REGISTRY:
        return fetch(text, progress)
    if os.sep not in text and "/" not in text and "." not in text:
        close = difflib.get_close_matches(text, REGISTRY, n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise UserError(f"{text!r} is neither a file nor a pretrained name: {hint}check the path, or use one of "
                        f"{', '.join(REGISTRY)} (`moco pretrained` lists them)")
    return path


def fetch(name: str, progress: bool = True) -> Path:
    """The cached file of ``name``, downloaded first when missing; its checksum is verified before it is returned."""
    entry = _entry(name)
    path = cache_path(entry)
    with _locked(path, name):  # several processes (torchrun ranks) asking at once: one downloads, the others wait
        if path.is_file():
            _verify(entry, path, url_for(entry))
        else:
            _download(entry, path, progress)
    return path


def listing() -> list[dict[str, Any]]:
    """One row per registry name: version, arch, top-1, size (None: unknown until cached), cached, path, URL."""
    rows = []
    for e in REGISTRY.values():
        path = cache_path(e)
        cached = path.is_file()
        rows.append({"name": e.name, "moco": e.moco_version, "arch": e.arch, "top1": e.top1,
                     "size": path.stat().st_size if cached else e.size, "cached": cached, "path": str(path),
                     "url": url_for(e), "md5": e.md5 or None})
    return rows


# ------------------------------------------------------------------------------------------------ download


def _by_hand(entry: Pretrained, path: Path) -> str:
    return (f"check the connection and run the same command (an interrupted download resumes), or download that URL "
            f"by hand and put the file at {path}")


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


def _cache_unusable(err: OSError, folder: Path) -> UserError:
    """The error for a checkpoint cache ``folder`` that cannot be created or opened: a MOCO_HOME that is not a folder
    is bad input (named, with the fix); a full or read-only disk is a storage error."""
    if err.errno not in (errno.ENOTDIR, errno.EEXIST, errno.ENOENT):
        return storage_error(err, folder, "creating the checkpoint cache")
    where = f"MOCO_HOME={os.environ['MOCO_HOME']}" if os.environ.get("MOCO_HOME") else f"the checkpoint cache {folder}"
    return UserError(f"{where} is not a usable folder ({err.strerror}: {err.filename}): set MOCO_HOME to a folder you "
                     "can write, e.g. export MOCO_HOME=~/.cache/moco-retrieval, or unset it for that default")


@contextlib.contextmanager
def _locked(path: Path, name: str) -> Iterator[None]:
    """Hold ``path``'s download lock (waiting for another process's download: said, and bounded); the lock file
    says who holds it (pid, host, since when, which name)."""
    lock_path = path.with_name(f".{path.name}.lock")  # kept (unlinking a lock races)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        lock = filelock.FileLock(lock_path, timeout=0)
        _acquire(lock, lock_path, path)
    except OSError as e:
        raise _cache_unusable(e, path.parent) from e
    try:
        write_holder(lock_path, f"pid {os.getpid()} on {socket.gethostname()} since "
                                f"{time.strftime('%Y-%m-%d %H:%M:%S')}, fetching {name}\n")
        yield
    finally:
        write_holder(lock_path, "")  # nobody holds it now
        lock.release()


def _acquire(lock: filelock.FileLock, lock_path: Path, path: Path) -> None:
    """Take ``lock``; while another process holds it, say who, every ``LOCK_SAY_S``, and wait as long as its
    download grows (a FetchError once ``path.part`` has not grown for ``LOCK_STALL_S``)."""

    def try_lock() -> bool:
        try:
            lock.acquire()
            return True
        except filelock.Timeout:
            return False

    def who() -> str:
        return holder(lock_path) or "another process"

    if try_lock():
        return
    part = path.with_name(path.name + ".part")
    logger.warning("%s is being fetched by %s: waiting for it (lock file %s; up to %.0f s without progress)", path,
                   who(), lock_path, LOCK_STALL_S)
    size, grew = _size(part), _clock()
    said = grew
    while not try_lock():
        _sleep(LOCK_POLL_S)
        now = _clock()
        if _size(part) != size:
            size, grew = _size(part), now
        if now - grew >= LOCK_STALL_S:
            raise FetchError(f"{path} is being fetched by {who()}, but {part} has not grown for {now - grew:.0f} "
                             f"s: wait for that process to finish, or stop it and run the same command (the lock "
                             f"{lock_path} is free once it exits)")
        if now - said >= LOCK_SAY_S:
            logger.warning("still waiting for %s (%d bytes of %s so far)", who(), size, part.name)
            said = now
    logger.info("%s: the other process is done; going on", path)


def _download(entry: Pretrained, path: Path, progress: bool) -> None:
    url, part = url_for(entry), path.with_name(path.name + ".part")
    logger.info("downloading %s (MoCo %s, %s) from %s to %s", entry.name, entry.moco_version, entry.arch, url, path)
    reason = ""
    for _ in range(ATTEMPTS):
        start = _size(part)
        try:
            if _transfer(url, part, progress):
                break
            reason = "the connection closed before the end of the file"
        except urllib.error.HTTPError as e:
            if e.code == 416 and start:  # the partial file is not a prefix of this file: start over
                part.unlink(missing_ok=True)
                continue
            raise FetchError(f"cannot download {entry.name}: {url} answered HTTP {e.code} {e.reason}; "
                             + _by_hand(entry, path)) from None
        except (OSError, http.client.HTTPException) as e:  # refused, no route, DNS, timeout, reset (URLError too)
            reason = str(getattr(e, "reason", "") or e or type(e).__name__)
        if _size(part) <= start:  # no progress at all: offline, refused or stalled; retrying would not help
            raise FetchError(f"cannot download {entry.name} from {url} ({reason}); " + _by_hand(entry, path))
        logger.warning("download of %s interrupted after %d bytes (%s): resuming", entry.name, _size(part), reason)
    else:
        raise FetchError(f"the download of {entry.name} from {url} kept being interrupted ({reason}): run the same "
                         f"command to resume it from the partial file {part}, or download it by hand and put it at "
                         f"{path}")
    _verify(entry, part, url, final=path)
    try:
        os.replace(part, path)
    except OSError as e:
        raise storage_error(e, path) from e


def _transfer(url: str, part: Path, progress: bool) -> bool:
    """One connection appending to ``part`` from its current size; True when the whole file is there."""
    from tqdm.auto import tqdm

    start = _size(part)
    request = urllib.request.Request(url, headers={"User-Agent": "moco-retrieval"})
    if start:
        request.add_header("Range", f"bytes={start}-")
    with urllib.request.urlopen(request, timeout=TIMEOUT_S) as resp:
        if start and (resp.status != 206 or not resp.headers.get("Content-Range", "").startswith(f"bytes {start}-")):
            start = 0  # the server sent the whole file: start over
        length = resp.headers.get("Content-Length")
        total = start + int(length) if length and length.isdigit() else None
        try:
            f = open(part, "ab" if start else "wb")  # closed below
        except OSError as e:
            raise storage_error(e, part, "downloading to") from e
        with f, tqdm(total=total, initial=start, unit="B", unit_scale=True, unit_divisor=1024, leave=False,
                     desc=part.name.removesuffix(".part"), disable=not progress) as bar:
            while chunk := resp.read(CHUNK):  # network errors propagate to the caller, which resumes
                try:
                    f.write(chunk)
                except OSError as e:
                    raise storage_error(e, part, "downloading to") from e
                bar.update(len(chunk))
            try:
                f.flush()
                os.fsync(f.fileno())
            except OSError as e:
                raise storage_error(e, part, "downloading to") from e
    return total is None or _size(part) == total


def _digests(path: Path) -> tuple[str, str]:
    md5, sha = hashlib.md5(usedforsecurity=False), hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(CHUNK), b""):
            md5.update(chunk)
            sha.update(chunk)
    return md5.hexdigest(), sha.hexdigest()


def _incomplete(path: Path) -> str:
    """Why ``path`` is not a whole checkpoint, or "": a zip (torch.save since PyTorch 1.6) must pass its CRC checks,
    an older pickle file must load (a file refused only for needing pickled code is whole: its reader says so)."""
    import zipfile

    if zipfile.is_zipfile(path):
        try:
            with zipfile.ZipFile(path) as z:
                bad = z.testzip()
        except (zipfile.BadZipFile, OSError, EOFError) as e:
            return str(e)
        return f"its member {bad} fails its CRC check" if bad else ""
    import torch

    try:
        torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any failure to read it means a broken file
        text = str(e)
        if "Weights only load failed" in text or "Unsupported global" in text:
            return ""
        return (text.splitlines() or [type(e).__name__])[0][:200]
    return ""


def _verify(entry: Pretrained, path: Path, url: str, final: Path | None = None) -> None:
    """Check ``path`` against the published md5 prefix, else against the sha256 recorded on first download.

    A mismatch deletes the file (and its record) and raises FetchError. ``final``: the cache path a freshly
    downloaded ``path`` is about to become (its sha256 is recorded there).
    """
    final = final or path
    record = final.with_name(final.name + ".sha256")
    md5, sha = _digests(path)
    known = (record.read_text().split() or [""])[0] if record.is_file() else ""
    if entry.md5 and not md5.startswith(entry.md5):
        bad = f"its md5 starts {md5[:8]}, the official README publishes {entry.md5}"
    elif known and known != sha:
        bad = f"its sha256 {sha} differs from the one recorded in {record} at its first download"
    elif not entry.md5 and not known and (why := _incomplete(path)):  # never record a broken file's sha256
        path.unlink(missing_ok=True)
        raise FetchError(f"{entry.name}: {path} is incomplete or damaged ({why}); the file was deleted. Run the same "
                         f"command to download it again from {url}, or put a good copy at {final}")
    else:
        if not known:
            from moco.files import atomic_write

            atomic_write(record, lambda f: f.write(f"{sha}  {final.name}\n".encode()))
            if not entry.md5:
                logger.warning("%s: the official README publishes no checksum; recorded its sha256 %s in %s, and "
                               "every later use is checked against it", entry.name, sha, record)
        logger.info("%s: checksum verified (%s)", final, f"md5 {entry.md5}" if entry.md5 else "recorded sha256")
        return
    path.unlink(missing_ok=True)
    record.unlink(missing_ok=True)
    raise FetchError(f"{entry.name}: wrong checksum for {path} ({bad}); the file was deleted. Run the same command "
                     f"to download it again from {url}, or put a good copy at {final}")
