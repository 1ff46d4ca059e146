"""A photo folder decoded once into a square uint8 cache on disk (:func:`build_cache`).

The cache is a raw ``N x size x size x 3`` uint8 file plus a JSON manifest next to it; later runs
reuse it as long as the folder's files (names, byte sizes, mtimes) are unchanged. Its size is known before the first
photo is decoded (photos x side x side x 3 bytes): it is logged, and a cache that the disk cannot hold is refused with
the figures and the fix. An interrupt (Ctrl+C, or SIGTERM through the CLI) stops the decoding workers at once and
removes the partial file; the workers die with their parent even if it is killed (``PR_SET_PDEATHSIG``), and a
partial file a killed run left is removed by the next. What one photo's decoding is:
:mod:`moco.data.photos`. The photos the cache could not decode are a run's ``skipped.txt``
(:func:`write_skipped`, :func:`read_skipped`), one ``PATH<tab>REASON`` line each, written so that any file name
(tabs, newlines, bytes that are not UTF-8) reads back exactly.
"""

from __future__ import annotations

import collections
import contextlib
import json
import logging
import os
import re
import shutil
import sys
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from moco.data.photos import (
    DEFAULT_MAX_PIXELS,
    IMAGE_EXTENSIONS,
    ImageDecodeError,
    check_root,
    load_square_u8,
    scan_photos,
    skipped_notes,
)
from moco.data.workers import chunks, in_workers
from moco.errors import UserError

__all__ = ["ImageCache", "build_cache", "cache_size_for", "read_skipped", "write_skipped"]

logger = logging.getLogger(__name__)

_MANIFEST_VERSION = 1
_MAX_LISTED = 5



# ------------------------------------------------------------------------------------------ cache


@dataclass
class ImageCache:
    """Decoded images of a folder: ``array[i]`` is ``files[i]`` (the dataset id is ``i``)."""

    root: Path
    size: int
    files: list[str]
    skipped: list[tuple[str, str]]
    array: np.ndarray = field(repr=False)
    unsupported: dict[str, int] = field(default_factory=dict)  # extension -> files never read: package missing
    excluded: int = 0  # files and folders the scan left out (``exclude``)

    def __len__(self) -> int:
        return len(self.files)


def _file_stat(path: Path) -> list[int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return [int(st.st_size), int(st.st_mtime_ns)]


def _cache_paths(cache_dir: Path, size: int) -> tuple[Path, Path]:
    return cache_dir / f"images-{size}.u8", cache_dir / f"images-{size}.json"


def _decode_job(job: tuple[str, int, int | None]) -> tuple[np.ndarray | None, str]:
    """Worker entry: ``(array, "")`` or ``(None, reason)``; never raises for bad files."""
    path, size, max_pixels = job
    try:
        return load_square_u8(path, size, max_pixels), ""
    except ImageDecodeError as err:
        return None, err.reason


def _decode_chunk(jobs: list[tuple[str, int, int | None]]) -> list[tuple[np.ndarray | None, str]]:
    return [_decode_job(job) for job in jobs]


def _iter_decoded(
    paths: list[str], size: int, max_pixels: int | None, workers: int
) -> Iterator[tuple[np.ndarray | None, str]]:
    """Decode ``paths`` in order, in-process or in ``workers`` processes, memory bounded. However the caller stops
    (an interrupt, an error, a generator closed early), the workers are stopped at once, not waited for."""
    jobs = [(p, size, max_pixels) for p in paths]
    if workers <= 0:
        for job in jobs:
            yield _decode_job(job)
        return
    chunk = max(1, min(16, len(jobs) // (workers * 4) or 1))
    for results in in_workers(_decode_chunk, chunks(jobs, chunk), workers, "photo-decoding"):
        yield from results


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        with contextlib.suppress(OSError):  # some filesystems refuse fsync on directories
            os.fsync(fd)
    finally:
        os.close(fd)


def _tmp_file(cache_dir: Path, final: Path) -> tuple[Any, Path]:
    """A temp file beside ``final`` (its name holds this process's id), open for writing; call it inside
    ``held_signals()`` and the caller's ``try``."""
    from moco.files import file_mode  # not at the top: decoding workers import this module without torch

    fd, name = tempfile.mkstemp(prefix=f".{final.name}.{os.getpid()}.", suffix=".tmp", dir=cache_dir)
    try:
        os.fchmod(fd, file_mode())  # mkstemp's is 0600; the cache gets the mode of every other file we write
    except BaseException:
        os.close(fd)
        Path(name).unlink(missing_ok=True)
        raise
    return os.fdopen(fd, "wb"), Path(name)


def _alive(pid: int) -> bool:
    """Whether process ``pid`` exists (another user's counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return pid > 0


_PARTIAL = re.compile(r"^\.images-\d+\.(u8|json)\.(?:(\d+)\.)?[^.]+\.tmp$")  # a partial file (its writer's id)


def _remove_stale(cache_dir: Path) -> None:
    """Remove the partial cache files that killed processes left (their writer's id, in the name, is gone; a name
    without one is from before ids were written: no process writes it now)."""
    for tmp in cache_dir.glob(".images-*.tmp"):
        match = _PARTIAL.match(tmp.name)
        if match and not (match[2] and _alive(int(match[2]))):
            with contextlib.suppress(OSError):
                size = tmp.stat().st_size
                tmp.unlink()
                logger.info("removed %s (%.1f MB), left by a run that was killed", tmp, size / 1e6)


def _bytes_text(n: int) -> str:
    """``n`` bytes for people: 38 MB, 12.1 GB."""
    return f"{n / 1e9:.1f} GB" if n >= 1e9 else f"{n / 1e6:.0f} MB" if n >= 1e6 else f"{n / 1e3:.0f} kB"


def _check_room(cache_dir: Path, n: int, size: int) -> None:
    """Log what a cache of ``n`` photos of ``size`` px takes, and refuse it when ``cache_dir``'s disk cannot hold
    it (a UserError with the figures and the fix)."""
    need = n * size * size * 3
    logger.info("decoding %d photos into a %s cache of %d px squares in %s", n, _bytes_text(need), size, cache_dir)
    free = shutil.disk_usage(cache_dir).free
    if need > free:
        raise UserError(f"the decoded cache of {n} photos at {size} px needs {_bytes_text(need)} in {cache_dir}, "
                        f"where {_bytes_text(free)} are free: free space there, or make it smaller with --cache-size "
                        f"(its side in pixels; {n} photos at 256 px take {_bytes_text(n * 256 * 256 * 3)})")


def _open_array(data_path: Path, n: int, size: int) -> np.ndarray | None:
    expected = n * size * size * 3
    try:
        actual = data_path.stat().st_size
    except OSError:
        return None
    if n < 1 or actual != expected:
        logger.info("image cache %s has %d bytes, expected %d: rebuilding", data_path, actual, expected)
        return None
    return np.memmap(data_path, dtype=np.uint8, mode="r", shape=(n, size, size, 3))


def _try_reuse(
    root: Path,
    size: int,
    cache_dir: Path,
    candidates: list[str],
    stats: dict[str, list[int] | None],
    max_pixels: int | None,
) -> ImageCache | None:
    data_path, manifest_path = _cache_paths(cache_dir, size)
    try:
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as err:
        logger.info("unreadable cache manifest %s (%s): rebuilding", manifest_path, err)
        return None
    try:
        if (
            manifest["version"] != _MANIFEST_VERSION
            or manifest["root"] != str(root)
            or manifest["size"] != size
            or manifest.get("max_pixels", DEFAULT_MAX_PIXELS) != max_pixels
        ):
            logger.info("image cache %s was built for other settings: rebuilding", manifest_path)
            return None
        files = [str(f) for f in manifest["files"]]
        skipped = [(str(p), str(r)) for p, r in manifest["skipped"]]
        recorded = dict(zip(files, manifest["stats"], strict=True))
        recorded.update(zip([p for p, _ in skipped], manifest["skipped_stats"], strict=True))
    except (KeyError, TypeError, ValueError) as err:
        logger.info("malformed cache manifest %s (%s): rebuilding", manifest_path, err)
        return None
    wanted = set(candidates)
    if len(recorded) != len(files) + len(skipped) or set(recorded) != wanted:
        logger.info("photo folder %s changed (files added or removed): rebuilding cache", root)
        return None
    if [c for c in candidates if c in set(files)] != files:
        logger.info("file order differs from image cache %s: rebuilding", manifest_path)
        return None
    changed = [c for c in candidates if recorded[c] != stats[c]]
    if changed:
        logger.info("%d files changed in %s (e.g. %s): rebuilding cache", len(changed), root, changed[0])
        return None
    array = _open_array(data_path, len(files), size)
    if array is None:
        return None
    logger.info("reusing image cache %s (%d images, %d skipped)", data_path, len(files), len(skipped))
    return ImageCache(root=root, size=size, files=files, skipped=skipped, array=array)


def _list_problems(skipped: list[tuple[str, str]]) -> str:
    shown = "; ".join(f"{p}: {r}" for p, r in skipped[:_MAX_LISTED])
    more = len(skipped) - _MAX_LISTED
    return shown + (f"; ... and {more} more" if more > 0 else "")


def _write_cache(
    root: Path,
    size: int,
    cache_dir: Path,
    candidates: list[str],
    stats: dict[str, list[int] | None],
    workers: int,
    max_pixels: int | None,
    progress: bool,
    strict: bool,
) -> ImageCache:
    from moco.files import held_signals

    data_path, manifest_path = _cache_paths(cache_dir, size)
    _remove_stale(cache_dir)
    _check_room(cache_dir, len(candidates), size)
    files: list[str] = []
    skipped: list[tuple[str, str]] = []
    paths = [str(root / c) for c in candidates]
    tmp_data: Path | None = None
    try:
        with held_signals():  # the temp file's name is ours before an interrupt can land
            out, tmp_data = _tmp_file(cache_dir, data_path)
        with (
            out,
            tqdm(
                total=len(candidates),
                disable=not progress,
                file=sys.stderr,
                unit="img",
                desc=f"decoding photos ({size}px)",
            ) as bar,
        ):
            decoded = _iter_decoded(paths, size, max_pixels, workers)
            with contextlib.closing(decoded):  # stopped early (an interrupt here): its workers are stopped too
                for rel, (arr, reason) in zip(candidates, decoded, strict=True):
                    if arr is None:
                        logger.warning("skipping %s: %s", rel, reason)
                        skipped.append((rel, reason))
                    else:
                        out.write(arr.tobytes())
                        files.append(rel)
                    bar.update(1)
            out.flush()
            os.fsync(out.fileno())
        if strict and skipped:
            raise UserError(
                f"{len(skipped)} of the {len(candidates)} files recorded for {root} can no longer "
                f"be decoded, so dataset ids would change (restore them or start a new run): " + _list_problems(skipped)
            )
        if not files:
            raise UserError(
                f"none of the {len(candidates)} image files in {root} could be read; "
                f"first problems: {_list_problems(skipped)}"
            )
        # the old manifest must never describe the new data file, even after a crash
        manifest_path.unlink(missing_ok=True)
        os.replace(tmp_data, data_path)
    except BaseException:
        if tmp_data is not None:
            tmp_data.unlink(missing_ok=True)
        raise
    manifest = {
        "version": _MANIFEST_VERSION,
        "root": str(root),
        "size": size,
        "max_pixels": max_pixels,
        "files": files,
        "stats": [stats[f] for f in files],
        "skipped": [[p, r] for p, r in skipped],
        "skipped_stats": [stats[p] for p, _ in skipped],
    }
    tmp_manifest: Path | None = None
    try:
        with held_signals():
            mf, tmp_manifest = _tmp_file(cache_dir, manifest_path)
        with mf:
            mf.write(json.dumps(manifest, indent=1).encode("utf-8"))
            mf.flush()
            os.fsync(mf.fileno())
        os.replace(tmp_manifest, manifest_path)
    except BaseException:
        if tmp_manifest is not None:
            tmp_manifest.unlink(missing_ok=True)
        raise
    _fsync_dir(cache_dir)
    logger.info("wrote image cache %s (%d images, %d skipped)", data_path, len(files), len(skipped))
    array = _open_array(data_path, len(files), size)
    if array is None:  # pragma: no cover - only if someone truncates it right now
        raise RuntimeError(f"image cache {data_path} changed while it was being written")
    return ImageCache(root=root, size=size, files=files, skipped=skipped, array=array)


def build_cache(
    root: str | Path,
    size: int,
    cache_dir: str | Path,
    files: list[str] | None = None,
    workers: int = 0,
    max_pixels: int | None = DEFAULT_MAX_PIXELS,
    progress: bool = False,
    strict: bool = False,
    exclude: Sequence[str] = (),
) -> ImageCache:
    """Decode every image of ``root`` once into ``cache_dir/images-{size}.u8`` (+ ``.json`` manifest).

    ``files=None`` scans ``root`` (less the ``exclude`` patterns, :mod:`moco.excludes`; photos of a format whose
    package is missing are counted in ``unsupported``, with a warning); otherwise exactly these relative paths are
    used, in order, and
    ``strict=True`` raises :class:`UserError` if any of them cannot be decoded. Unreadable files
    are skipped with one warning each. An up-to-date cache (same root, files, sizes and mtimes) is
    reused without decoding; a stale or corrupt one is rebuilt. ``workers`` > 0 decodes in that
    many processes.
    """
    if size < 1:
        raise UserError(f"image size must be a positive number of pixels, got {size}")
    root_path = check_root(root).resolve()
    unsupported: dict[str, int] = {}
    excluded = 0
    if files is None:
        scan = scan_photos(root_path, exclude)
        candidates, unsupported, excluded = scan.files, scan.unsupported_counts(), scan.excluded
        for note in scan.notes():
            logger.warning("%s: %s", root, note)
    else:
        candidates = [Path(f).as_posix() for f in files]
    if len(set(candidates)) != len(candidates):
        dups = sorted(c for c, k in collections.Counter(candidates).items() if k > 1)
        raise UserError(f"file list for {root} names some files twice: {', '.join(dups[:_MAX_LISTED])}")
    if not candidates:
        exts = ", ".join(sorted(IMAGE_EXTENSIONS))
        notes = skipped_notes(unsupported)
        why = f" ({'; '.join(notes)})" if notes else f" ({excluded} left out by --exclude)" if excluded else ""
        raise UserError(f"no images found in {root}{why}: expected files with extensions {exts}")
    cache_path = Path(cache_dir).expanduser()
    try:
        cache_path.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise UserError(f"cannot create cache folder {cache_dir}: {err.strerror or err}") from err
    stats = {c: _file_stat(root_path / c) for c in candidates}

    cache = _try_reuse(root_path, size, cache_path, candidates, stats, max_pixels)
    if cache is None:
        cache = _write_cache(root_path, size, cache_path, candidates, stats, workers, max_pixels, progress, strict)
        cache.unsupported, cache.excluded = unsupported, excluded
        return cache
    cache.unsupported, cache.excluded = unsupported, excluded
    for rel, reason in cache.skipped:
        logger.warning("skipping %s: %s", rel, reason)
    if strict and cache.skipped:
        raise UserError(
            f"{len(cache.skipped)} of the {len(candidates)} files recorded for {root} cannot be "
            f"decoded, so dataset ids would change: " + _list_problems(cache.skipped)
        )
    return cache


def cache_size_for(image_size: int, cache_size: int = 0) -> int:
    """Side of the decoded cache: the crop size for small images, else the usual resize (256 for 224)."""
    if cache_size:
        return cache_size
    return image_size if image_size < 96 else round(image_size * 8 / 7)


_ESCAPE = {"\\": "\\\\", "\t": "\\t", "\n": "\\n", "\r": "\\r"}
_UNESCAPE = {"\\": "\\", "t": "\t", "n": "\n", "r": "\r"}
_ESCAPED = re.compile(r"\\(.)", re.DOTALL)


def _escape(text: str) -> bytes:
    text = "".join(_ESCAPE.get(c, c) for c in text)
    try:
        return text.encode("utf-8", "surrogateescape")  # a name's bytes that are not UTF-8: written as they are
    except UnicodeEncodeError:  # a lone surrogate that no file name decodes to: shown escaped
        return text.encode("utf-8", "backslashreplace")


def _unescape(text: str) -> str:
    return _ESCAPED.sub(lambda m: _UNESCAPE.get(m[1], m[0]), text)


def write_skipped(path: str | Path, skipped: Sequence[tuple[str, str]]) -> None:
    r"""Write the files a run skipped to ``path`` (``RUN/skipped.txt``): one ``PATH<tab>REASON`` line each.

    UTF-8, except that the bytes of a name that are not UTF-8 are written as they are (the name as ``ls`` shows
    it); a backslash, tab, carriage return or newline in a name or reason is written ``\\``, ``\t``, ``\r``,
    ``\n``. :func:`read_skipped` reads back exactly the names given (``os.fsdecode`` of their bytes).
    """
    Path(path).write_bytes(b"".join(_escape(p) + b"\t" + _escape(r) + b"\n" for p, r in skipped))


def read_skipped(path: str | Path) -> list[tuple[str, str]]:
    """The (path, reason) pairs of a ``skipped.txt`` written by :func:`write_skipped`."""
    text = Path(path).read_bytes().decode("utf-8", "surrogateescape")
    lines = text.split("\n")  # not splitlines(): a name may hold U+0085 or U+2028
    return [(_unescape(p), _unescape(r)) for p, _, r in (line.partition("\t") for line in lines if line)]
