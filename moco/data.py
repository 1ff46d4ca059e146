"""Scan a photo folder and decode it once into a square uint8 cache on disk.

The cache is a raw ``N x size x size x 3`` uint8 file plus a JSON manifest next to it; later runs
reuse it as long as the folder's files (names, byte sizes, mtimes) are unchanged.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import errno
import json
import logging
import math
import multiprocessing
import os
import re
import stat
import sys
import tempfile
import threading
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, TypeVar

import numpy as np
from PIL import Image, UnidentifiedImageError
from tqdm import tqdm

from moco.errors import UserError

__all__ = [
    "DEFAULT_MAX_PIXELS",
    "IMAGE_EXTENSIONS",
    "MAX_FILE_BYTES",
    "ImageCache",
    "ImageDecodeError",
    "build_cache",
    "short_sides",
    "load_rgb",
    "load_square_u8",
    "open_regular",
    "read_image_bytes",
    "read_skipped",
    "scan_images",
    "square_u8",
    "write_skipped",
]

logger = logging.getLogger(__name__)

IMAGE_EXTENSIONS: frozenset[str] = frozenset({".jpg", ".jpeg", ".png", ".webp", ".bmp", ".tif", ".tiff", ".gif"})
"""Lower-case file extensions treated as images (matched case-insensitively)."""

DEFAULT_MAX_PIXELS: int | None = Image.MAX_IMAGE_PIXELS
"""Largest ``width * height`` decoded (PIL's default bomb limit, about 89.5 M pixels)."""

MAX_FILE_BYTES: int = 1 << 30
"""Largest photo file read (1 GiB); a larger one is refused from its size, before any byte is read."""

_MANIFEST_VERSION = 1
_ORIENTATION_TAG = 0x0112
_TRANSPOSE_FOR_ORIENTATION = {
    2: Image.Transpose.FLIP_LEFT_RIGHT,
    3: Image.Transpose.ROTATE_180,
    4: Image.Transpose.FLIP_TOP_BOTTOM,
    5: Image.Transpose.TRANSPOSE,
    6: Image.Transpose.ROTATE_270,
    7: Image.Transpose.TRANSVERSE,
    8: Image.Transpose.ROTATE_90,
}
_DRAFT_GAP = 2.0  # reducing while decoding (JPEG DCT draft, box average) keeps this factor above the target size
_REDUCING_GAP = 3.0
_BAND_PIXELS = 1 << 22  # pixels converted to RGB at a time when a palette/bilevel image is reduced
_AVERAGED_NATIVELY = frozenset({"L", "LA", "RGB", "RGBA", "RGBX", "I", "F"})  # Image.reduce is meaningful
_FILE_KINDS = {stat.S_IFIFO: "named pipe", stat.S_IFCHR: "character device", stat.S_IFBLK: "block device",
               stat.S_IFSOCK: "socket"}  # fmt: skip
_PIL_LIMIT_LOCK = threading.RLock()
_MAX_LISTED = 5

_T = TypeVar("_T")
_R = TypeVar("_R")


class ImageDecodeError(UserError):
    """A file could not be decoded as an image; ``reason`` is a short human explanation."""

    def __init__(self, path: str | Path, reason: str) -> None:
        super().__init__(f"{path}: {reason}")
        self.path = str(path)
        self.reason = reason

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.path, self.reason))


# --------------------------------------------------------------------------------------- scanning


def _check_root(root: str | Path) -> Path:
    path = Path(root).expanduser()
    if not path.exists():
        raise UserError(f"photo folder not found: {root}")
    if not path.is_dir():
        raise UserError(f"not a folder: {root} (expected a directory of photos)")
    return path


def scan_images(root: str | Path) -> list[str]:
    """Image files under ``root``, recursively: sorted POSIX paths relative to ``root``.

    Hidden files and folders (name starting with ``.``) are skipped, files with other extensions
    are ignored, directories are never listed (a folder named ``x.jpg`` is just searched), and
    symlinked folders are not followed (symlinked files are listed).
    """
    base = _check_root(root)
    found: list[str] = []
    ignored = 0

    def _on_error(err: OSError) -> None:
        logger.warning("cannot list %s: %s", err.filename, err.strerror or err)

    for dirpath, dirnames, filenames in os.walk(base, onerror=_on_error):
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        rel_dir = Path(dirpath).relative_to(base)
        for name in filenames:
            if name.startswith("."):
                continue
            if os.path.splitext(name)[1].lower() in IMAGE_EXTENSIONS:
                found.append((rel_dir / name).as_posix())
            else:
                ignored += 1
    if ignored:
        logger.debug("ignored %d non-image files in %s", ignored, base)
    found.sort()
    return found


# ---------------------------------------------------------------------------------------- reading


def _check_regular(path: str | Path, st: os.stat_result) -> None:
    """Raise ``OSError`` with a short reason unless ``st`` is a regular file of at most MAX_FILE_BYTES."""
    if stat.S_ISDIR(st.st_mode):
        raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), str(path))
    if not stat.S_ISREG(st.st_mode):
        kind = _FILE_KINDS.get(stat.S_IFMT(st.st_mode), "unknown kind")
        raise OSError(errno.EINVAL, f"not a regular file ({kind})", str(path))
    if st.st_size > MAX_FILE_BYTES:
        raise OSError(errno.EFBIG, f"too large: {st.st_size} bytes, more than the {MAX_FILE_BYTES} read per "
                      "photo (moco.data.MAX_FILE_BYTES)", str(path))  # fmt: skip


def _link_problem(path: str | Path, err: OSError) -> str | None:
    """A clearer reason than ``err`` for a symlink that leads nowhere, else None."""
    if err.errno == errno.ELOOP:
        return "symlink loop (too many levels of symbolic links)"
    if err.errno == errno.ENOENT and os.path.islink(path):
        return "broken symlink (its target does not exist)"
    return None


def short_sides(root: str | Path, limit: int = 200) -> list[int]:
    """The shorter side in pixels of up to ``limit`` photos spread over the folder, from their headers only.

    Unreadable files are left out (training reports them itself).
    """
    root = Path(root)
    names = scan_images(root)
    sides = []
    for name in names[:: max(1, len(names) // limit)][:limit]:
        try:
            with open_regular(root / name) as f, Image.open(f) as im:  # the header only
                sides.append(min(im.size))
        except Exception:  # noqa: BLE001,S112 - unreadable files are reported by training itself
            continue
    return sides


def open_regular(path: str | Path) -> BinaryIO:
    """Open a photo file for binary reading, only if it is a regular file of at most MAX_FILE_BYTES.

    Never blocks: named pipes, devices and sockets are refused from a ``stat`` before any open, and the
    file is opened non-blocking and checked again (``fstat``) in case it was replaced in between.
    Raises ``OSError`` whose ``strerror`` is a short reason: "not a regular file (named pipe)",
    "symlink loop", "broken symlink ...", "too large: ...", or the system's message.
    """
    try:
        _check_regular(path, os.stat(path))  # a pipe or a device is never even opened
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as err:
        reason = _link_problem(path, err)
        if reason is None:
            raise
        raise OSError(err.errno, reason, str(path)) from err
    try:
        _check_regular(path, os.fstat(fd))  # the file opened is the file checked
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def _unreadable(path: str | Path, err: OSError) -> ImageDecodeError:
    return ImageDecodeError(path, f"unreadable: {err.strerror or err}")


def read_image_bytes(path: str | Path) -> bytes:
    """All bytes of a photo file (see :func:`open_regular`); :class:`ImageDecodeError` with the reason otherwise."""
    try:
        with open_regular(path) as f:
            return f.read()
    except OSError as err:
        raise _unreadable(path, err) from err


# --------------------------------------------------------------------------------------- decoding


def _bomb_reason(size: tuple[int, int], limit: int | None) -> str:
    return f"decompression bomb: {size[0]} x {size[1]} pixels exceeds limit {limit}"


@contextmanager
def _pil_bomb_check_off() -> Iterator[None]:
    """Temporarily disable PIL's own header-size check so that ``max_pixels`` governs (restored)."""
    with _PIL_LIMIT_LOCK:
        saved = Image.MAX_IMAGE_PIXELS
        Image.MAX_IMAGE_PIXELS = None
        try:
            yield
        finally:
            Image.MAX_IMAGE_PIXELS = saved


def _u16_to_u8(values: np.ndarray) -> np.ndarray:
    return np.rint(values.astype(np.float32) / 257.0).clip(0, 255).astype(np.uint8)


def _wide_to_u8(values: np.ndarray) -> np.ndarray:
    """Map 32-bit int / float pixels to 0..255: 8-bit, 16-bit or unit ranges, else min-max."""
    v = values.astype(np.float64)
    if v.size == 0:
        return np.zeros(v.shape, np.uint8)
    v = np.nan_to_num(v, nan=0.0, posinf=0.0, neginf=0.0)
    lo, hi = float(v.min()), float(v.max())
    if values.dtype.kind == "f" and lo >= 0.0 and hi <= 1.0:
        v = v * 255.0
    elif lo < 0.0 or hi > 65535.0:
        v = (v - lo) * (255.0 / (hi - lo))
    elif hi > 255.0:  # 16-bit range; values already in 0..255 are kept as they are
        v = v / 257.0
    return np.rint(v).clip(0, 255).astype(np.uint8)


def _to_rgb(img: Image.Image) -> Image.Image:
    """Convert any PIL mode to RGB; alpha is composited on white."""
    mode = img.mode
    if mode == "RGB":
        return img
    if mode.startswith("I;16") or mode in ("I", "F"):
        arr = np.asarray(img)
        gray = _u16_to_u8(arr) if mode.startswith("I;16") else _wide_to_u8(arr)
        return Image.fromarray(gray, "L").convert("RGB")
    has_alpha = mode in ("RGBA", "RGBa", "LA", "La", "PA") or (mode in ("P", "L") and "transparency" in img.info)
    if has_alpha:
        rgba = img.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return img.convert("RGB")


def _reduce(img: Image.Image, factor: int) -> Image.Image:
    """Box-average ``img`` by ``factor`` before it becomes RGB, so the cost is that of its own mode.

    Palette, bilevel and 16-bit images cannot be averaged in their own mode: they are converted to RGB
    a band of rows at a time (a multiple of ``factor``: the same blocks as one reduce), so their
    full-size RGB copy never exists.
    """
    if factor < 2:
        return img
    if img.mode in _AVERAGED_NATIVELY:
        return img.reduce(factor)
    w, h = img.size
    rows = factor * max(1, _BAND_PIXELS // (w * factor))
    out = Image.new("RGB", (-(-w // factor), -(-h // factor)))
    for top in range(0, h, rows):
        band = _to_rgb(img.crop((0, top, w, min(h, top + rows))))
        out.paste(band.reduce(factor), (0, top // factor))
    return out


def _orientation(img: Image.Image) -> int:
    try:
        value = img.getexif().get(_ORIENTATION_TAG, 1)
        return int(value)
    except Exception as err:  # malformed EXIF must not lose the photo
        logger.debug("ignoring unreadable EXIF in %s: %s", getattr(img, "filename", "?"), err)
        return 1


def _decode(path: str | Path, max_pixels: int | None, target_short: int | None = None) -> Image.Image:
    """Open (regular files only), bomb-check, reduce (JPEG draft, else box average), load, orient, RGB."""
    p = Path(path)
    try:
        fh = open_regular(p)
    except OSError as err:
        raise _unreadable(p, err) from err
    size: tuple[int, int] | None = None
    with fh, warnings.catch_warnings():
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        try:
            if os.fstat(fh.fileno()).st_size == 0:
                raise ImageDecodeError(p, "empty file (0 bytes)")
            with _pil_bomb_check_off():
                img = Image.open(fh)
            size = img.size
            if max_pixels is not None and size[0] * size[1] > max_pixels:
                raise ImageDecodeError(p, _bomb_reason(size, max_pixels))
            if target_short is not None and min(size) > 0:
                scale = target_short * _DRAFT_GAP / min(size)
                if scale < 1.0:
                    want = (max(1, math.ceil(size[0] * scale)), max(1, math.ceil(size[1] * scale)))
                    img.draft(None, want)
            img.load()
            orientation = _orientation(img)
            if target_short is not None:  # other formats: reduce the decoded pixels before they become RGB
                img = _reduce(img, int(min(img.size) // (target_short * _DRAFT_GAP)))
            img = _to_rgb(img)
            method = _TRANSPOSE_FOR_ORIENTATION.get(orientation)
            if method is not None:
                img = img.transpose(method)
            return img
        except ImageDecodeError:
            raise
        except (Image.DecompressionBombError, Image.DecompressionBombWarning) as err:
            limits = [n for n in (max_pixels, Image.MAX_IMAGE_PIXELS) if n is not None]
            limit = min(limits) if limits else None
            reason = _bomb_reason(size, limit) if size else f"decompression bomb: {err}"
            raise ImageDecodeError(p, reason) from err
        except UnidentifiedImageError as err:
            raise ImageDecodeError(p, "not an image (cannot identify format)") from err
        except OSError as err:
            if err.errno is not None:  # a real I/O error, not PIL's "truncated" OSError
                raise _unreadable(p, err) from err
            raise ImageDecodeError(p, f"truncated or corrupt: {err}") from err
        except Exception as err:  # PIL plugins raise many types on corrupt data
            raise ImageDecodeError(p, f"truncated or corrupt: {err or type(err).__name__}") from err


def load_rgb(
    path: str | Path, max_pixels: int | None = DEFAULT_MAX_PIXELS, min_short: int | None = None
) -> Image.Image:
    """Decode one image file fully into an RGB PIL image.

    ``min_short``: the image may be reduced while decoding (JPEG: DCT draft; other formats: box average
    in their own mode) as long as the short side stays at least twice this size, which is much faster
    and smaller for thumbnails and model inputs.

    Takes the first frame of animations, applies the EXIF orientation, composites alpha onto
    white, and scales 16-bit grayscale to 8 bits (``value / 257``). Images larger than
    ``max_pixels`` (``None``: no limit) are rejected from their header, before decoding.
    Raises :class:`ImageDecodeError` with a short reason on any failure.
    """
    return _decode(path, max_pixels, target_short=min_short)


def load_square_u8(path: str | Path, size: int, max_pixels: int | None = DEFAULT_MAX_PIXELS) -> np.ndarray:
    """Decode ``path`` as a ``size x size x 3`` uint8 array: short side resized to ``size``, center crop."""
    if size < 1:
        raise ValueError(f"size must be positive, got {size}")
    return square_u8(_decode(path, max_pixels, target_short=size), size)


def square_u8(img: Image.Image, size: int) -> np.ndarray:
    """An RGB image as ``size x size x 3`` uint8: short side resized to ``size``, center crop.

    Only the centre region is resampled (a box in source coordinates), so the cost is bounded by
    ``size`` whatever the aspect ratio: a 4000 x 2 strip never becomes a 448000 x 224 image.
    """
    w, h = img.size
    if w <= h:
        new = (size, max(size, round(h * size / w)))
    else:
        new = (max(size, round(w * size / h)), size)
    left, top = (new[0] - size) // 2, (new[1] - size) // 2  # the crop, in resized coordinates
    if new == (w, h):
        img = img.crop((left, top, left + size, top + size))
    else:
        sx, sy = w / new[0], h / new[1]  # source pixels per resized pixel
        box = (left * sx, top * sy, (left + size) * sx, (top + size) * sy)
        img = img.resize((size, size), Image.Resampling.BICUBIC, box=box, reducing_gap=_REDUCING_GAP)
    out = np.asarray(img, dtype=np.uint8)
    assert out.shape == (size, size, 3), out.shape
    return np.ascontiguousarray(out)


# ------------------------------------------------------------------------------------------ cache


@dataclass
class ImageCache:
    """Decoded images of a folder: ``array[i]`` is ``files[i]`` (the dataset id is ``i``)."""

    root: Path
    size: int
    files: list[str]
    skipped: list[tuple[str, str]]
    array: np.ndarray = field(repr=False)

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


def _ordered_window(
    submit: Callable[[_T], concurrent.futures.Future[_R]], items: Iterable[_T], window: int
) -> Iterator[_R]:
    """Results of ``submit(item)`` in input order, with at most ``window`` tasks in flight."""
    pending: collections.deque[concurrent.futures.Future[_R]] = collections.deque()
    it = iter(items)
    try:
        for item in it:
            pending.append(submit(item))
            if len(pending) >= window:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()
    finally:
        for fut in pending:
            fut.cancel()


def _chunks(items: Sequence[_T], n: int) -> Iterator[list[_T]]:
    for i in range(0, len(items), n):
        yield list(items[i : i + n])


def _iter_decoded(
    paths: list[str], size: int, max_pixels: int | None, workers: int
) -> Iterator[tuple[np.ndarray | None, str]]:
    """Decode ``paths`` in order, in-process or in ``workers`` processes, memory bounded."""
    jobs = [(p, size, max_pixels) for p in paths]
    if workers <= 0:
        for job in jobs:
            yield _decode_job(job)
        return
    chunk = max(1, min(16, len(jobs) // (workers * 4) or 1))
    # spawn: never fork a process that may hold torch/CUDA threads
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(max_workers=workers, mp_context=ctx) as pool:
        for results in _ordered_window(
            lambda c: pool.submit(_decode_chunk, c), _chunks(jobs, chunk), window=workers * 3
        ):
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
    from moco.checkpoint import file_mode  # not at the top: decoding workers import this module without torch

    fd, name = tempfile.mkstemp(prefix=f".{final.name}.", suffix=".tmp", dir=cache_dir)
    try:
        os.fchmod(fd, file_mode())  # mkstemp's is 0600; the cache gets the mode of every other file we write
    except BaseException:
        os.close(fd)
        Path(name).unlink(missing_ok=True)
        raise
    return os.fdopen(fd, "wb"), Path(name)


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
    data_path, manifest_path = _cache_paths(cache_dir, size)
    files: list[str] = []
    skipped: list[tuple[str, str]] = []
    paths = [str(root / c) for c in candidates]
    out, tmp_data = _tmp_file(cache_dir, data_path)
    try:
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
            for rel, (arr, reason) in zip(candidates, _iter_decoded(paths, size, max_pixels, workers), strict=True):
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
    mf, tmp_manifest = _tmp_file(cache_dir, manifest_path)
    try:
        with mf:
            mf.write(json.dumps(manifest, indent=1).encode("utf-8"))
            mf.flush()
            os.fsync(mf.fileno())
        os.replace(tmp_manifest, manifest_path)
    except BaseException:
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
) -> ImageCache:
    """Decode every image of ``root`` once into ``cache_dir/images-{size}.u8`` (+ ``.json`` manifest).

    ``files=None`` scans ``root``; otherwise exactly these relative paths are used, in order, and
    ``strict=True`` raises :class:`UserError` if any of them cannot be decoded. Unreadable files
    are skipped with one warning each. An up-to-date cache (same root, files, sizes and mtimes) is
    reused without decoding; a stale or corrupt one is rebuilt. ``workers`` > 0 decodes in that
    many processes.
    """
    if size < 1:
        raise UserError(f"image size must be a positive number of pixels, got {size}")
    root_path = _check_root(root).resolve()
    candidates = scan_images(root_path) if files is None else [Path(f).as_posix() for f in files]
    if len(set(candidates)) != len(candidates):
        dups = sorted(c for c, k in collections.Counter(candidates).items() if k > 1)
        raise UserError(f"file list for {root} names some files twice: {', '.join(dups[:_MAX_LISTED])}")
    if not candidates:
        exts = ", ".join(sorted(IMAGE_EXTENSIONS))
        raise UserError(f"no images found in {root}: expected files with extensions {exts}")
    cache_path = Path(cache_dir).expanduser()
    try:
        cache_path.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise UserError(f"cannot create cache folder {cache_dir}: {err.strerror or err}") from err
    stats = {c: _file_stat(root_path / c) for c in candidates}

    cache = _try_reuse(root_path, size, cache_path, candidates, stats, max_pixels)
    if cache is None:
        return _write_cache(root_path, size, cache_path, candidates, stats, workers, max_pixels, progress, strict)
    for rel, reason in cache.skipped:
        logger.warning("skipping %s: %s", rel, reason)
    if strict and cache.skipped:
        raise UserError(
            f"{len(cache.skipped)} of the {len(candidates)} files recorded for {root} cannot be "
            f"decoded, so dataset ids would change: " + _list_problems(cache.skipped)
        )
    return cache
