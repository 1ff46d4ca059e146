"""Reading photos: a folder scanned for images (:func:`scan_photos`, :func:`scan_images`), one file opened safely (a
regular file, not too large: :func:`open_regular`) and decoded (EXIF orientation applied, decompression bombs refused,
reduced while decoding) into RGB (:func:`load_rgb`) or a square uint8 view (:func:`square_u8`), or only its header
read (:func:`photo_info`).

The formats: JPEG, PNG, WebP, BMP, TIFF and GIF with Pillow itself; AVIF with a Pillow built with libavif (its wheels
since 11.3); HEIC/HEIF with the ``heic`` extra (pillow-heif, whose opener is registered when it is first needed); RAW
(DNG, CR2, NEF, ARW) with the ``raw`` extra (rawpy, LibRaw), developed to RGB with the camera's white balance. A
photo of a known format whose package is missing is never read, but counted by the scan and named with the fix
(:meth:`Scan.notes`: "412 .heic files skipped: pip install 'pillow-heif>=1.0' (the heic extra; ...)").

Light on purpose: decoding workers import it without torch.
"""

from __future__ import annotations

import collections
import datetime
import errno
import functools
import importlib
import logging
import math
import os
import stat
import threading
import warnings
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
from PIL import Image, UnidentifiedImageError

from moco.errors import UserError
from moco.excludes import Excludes
from moco.extras import install_hint

__all__ = ["DEFAULT_MAX_PIXELS", "IMAGE_EXTENSIONS", "RAW_EXTENSIONS", "MAX_FILE_BYTES", "ImageDecodeError",
           "check_root", "short_sides", "load_rgb", "load_square_u8", "PhotoInfo", "photo_info", "open_regular",
           "read_image_bytes", "Scan", "scan_photos", "scan_images", "missing_support", "readable_extensions",
           "enable_formats", "square_u8", "readable_formats"]

logger = logging.getLogger(__name__)

_PILLOW_EXTENSIONS = frozenset({".jpg", ".jpeg", ".png", ".webp", ".bmp", ".tif", ".tiff", ".gif"})
HEIF_EXTENSIONS: frozenset[str] = frozenset({".heic", ".heif"})
RAW_EXTENSIONS: frozenset[str] = frozenset({".dng", ".cr2", ".nef", ".arw"})
NOT_PHOTOS = {ext: "vector drawings, not photos (export them as PNG to include them)" for ext in (".svg", ".svgz")}
"""Camera RAW files, developed by rawpy (LibRaw): the ``raw`` extra."""
IMAGE_EXTENSIONS: frozenset[str] = _PILLOW_EXTENSIONS | HEIF_EXTENSIONS | {".avif"} | RAW_EXTENSIONS
"""Lower-case file extensions of photos (matched case-insensitively); those whose decoder is missing are counted
by the scan, not read (:func:`readable_extensions`, :func:`missing_support`)."""

DEFAULT_MAX_PIXELS: int | None = Image.MAX_IMAGE_PIXELS
"""Largest ``width * height`` decoded (PIL's default bomb limit, about 89.5 M pixels)."""

MAX_FILE_BYTES: int = 1 << 30
"""Largest photo file read (1 GiB); a larger one is refused from its size, before any byte is read."""

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
               stat.S_IFSOCK: "socket"}
_PIL_LIMIT_LOCK = threading.RLock()
_OUT_OF_REACH = 1 << 62  # pixels: PIL's limit while ours governs (:func:`_pil_bomb_check_off`)



class ImageDecodeError(UserError):
    """A file could not be decoded as an image; ``reason`` is a short human explanation."""

    def __init__(self, path: str | Path, reason: str) -> None:
        super().__init__(f"{path}: {reason}")
        self.path = str(path)
        self.reason = reason

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.path, self.reason))


# ---------------------------------------------------------------------------------------- formats


@functools.cache
def _has_module(name: str) -> bool:
    try:
        importlib.import_module(name)
    except ImportError:  # not installed, or its native library is missing: either way it cannot decode
        return False
    return True


@functools.cache
def enable_formats() -> bool:
    """Register pillow-heif's opener with Pillow when it is installed (once per process), so that HEIC/HEIF files
    open like any photo; whether it is."""
    if not _has_module("pillow_heif"):
        return False
    from pillow_heif import register_heif_opener

    register_heif_opener()
    return True


@functools.cache
def _pillow_avif() -> bool:
    from PIL import features

    return bool(features.check("avif"))


def readable_formats() -> str:
    """The photo formats this process decodes, for a message: "JPEG, PNG, WebP, GIF, BMP, TIFF, AVIF or HEIC"
    (AVIF with a Pillow built with it, HEIC with the ``heic`` extra, RAW with the ``raw`` extra)."""
    names = ["JPEG", "PNG", "WebP", "GIF", "BMP", "TIFF"]
    names += ["AVIF"] * _pillow_avif() + ["HEIC"] * enable_formats()
    names += ["RAW (DNG, CR2, NEF, ARW)"] * _has_module("rawpy")
    return ", ".join(names[:-1]) + " or " + names[-1]


def _fix(ext: str) -> str:
    """What to install so that photos with extension ``ext`` can be read (or do, for :data:`NOT_PHOTOS`)."""
    if ext in NOT_PHOTOS:
        return NOT_PHOTOS[ext]
    if ext in HEIF_EXTENSIONS:
        return install_hint("heic")
    if ext in RAW_EXTENSIONS:
        return install_hint("raw")
    if ext == ".avif":
        return "pip install -U 'pillow>=11.3' (a Pillow built with AVIF)"
    return "pip install -U pillow"


def missing_support(ext: str) -> str | None:
    """The fix (what to install) when photos with extension ``ext`` (lower case, with its dot) cannot be read here
    for a missing package; None when they can (or ``ext`` is no photo's)."""
    if ext in HEIF_EXTENSIONS and not enable_formats():
        return _fix(ext)
    if ext in RAW_EXTENSIONS and not _has_module("rawpy"):
        return _fix(ext)
    if ext == ".avif" and not _pillow_avif():
        return _fix(ext)
    return None


def readable_extensions() -> frozenset[str]:
    """The photo extensions this process can decode now (:data:`IMAGE_EXTENSIONS` less those whose package is
    missing)."""
    return frozenset(e for e in IMAGE_EXTENSIONS if missing_support(e) is None)


# --------------------------------------------------------------------------------------- scanning


def check_root(root: str | Path) -> Path:
    path = Path(root).expanduser()
    if not path.exists():
        raise UserError(f"photo folder not found: {root}")
    if not path.is_dir():
        raise UserError(f"not a folder: {root} (expected a directory of photos)")
    return path


@dataclass
class Scan:
    """A photo folder scanned: the photos to read, those of a format this install cannot read, what was excluded.

    ``files``: sorted POSIX paths relative to the root; ``unsupported``: extension -> the paths of that format whose
    package is missing (never read); ``excluded``: files and folders left out by the ``--exclude`` patterns
    (``excludes``; an excluded folder counts once, its contents are never listed); ``unused``: patterns that left
    nothing out.
    """

    root: Path
    files: list[str]
    unsupported: dict[str, list[str]] = field(default_factory=dict)
    excluded: int = 0
    excludes: tuple[str, ...] = ()
    unused: list[str] = field(default_factory=list)
    not_photos: dict[str, int] = field(default_factory=dict)  # extension -> files of a picture format never read

    def unsupported_counts(self) -> dict[str, int]:
        """Extension -> how many of its files were skipped: for a missing package, or as pictures that are no photos
        (:data:`NOT_PHOTOS`)."""
        return dict(sorted({**self.not_photos, **{ext: len(paths) for ext, paths in self.unsupported.items()}}.items()))

    def notes(self) -> list[str]:
        """One line per format skipped, with the fix (:func:`skipped_notes`)."""
        return skipped_notes(self.unsupported_counts())


def skipped_notes(counts: dict[str, int]) -> list[str]:
    """``{".heic": 412}`` -> ``["412 .heic files skipped: pip install 'pillow-heif>=1.0' (...)"]``: the summaries' line
    for each format whose package is missing."""
    return [f"{n} {ext} file{'s' * (n != 1)} skipped: {_fix(ext)}" for ext, n in sorted(counts.items()) if n]


def scan_photos(root: str | Path, exclude: Iterable[str] | Excludes = ()) -> Scan:
    """The photos under ``root``, recursively (see :class:`Scan`); nothing is opened, only folders listed.

    Hidden files and folders (name starting with ``.``) are skipped, files with other extensions ignored,
    directories never listed as photos (a folder named ``x.jpg`` is just searched), symlinked folders not followed
    (symlinked files are listed). ``exclude``: ``--exclude`` patterns (:mod:`moco.excludes`); a folder they match is
    never listed.
    """
    base = check_root(root)
    rules = exclude if isinstance(exclude, Excludes) else Excludes(exclude, root=base)
    readable = readable_extensions()
    found: list[str] = []
    unsupported: dict[str, list[str]] = collections.defaultdict(list)
    not_photos: collections.Counter[str] = collections.Counter()
    ignored = excluded = 0

    def _on_error(err: OSError) -> None:
        logger.warning("cannot list %s: %s", err.filename, err.strerror or err)

    for dirpath, dirnames, filenames in os.walk(base, onerror=_on_error):
        rel_dir = Path(dirpath).relative_to(base)
        kept = []
        for d in dirnames:
            if d.startswith("."):
                continue
            if rules and rules.folder((rel_dir / d).as_posix()):
                excluded += 1
                continue
            kept.append(d)
        dirnames[:] = kept
        for name in filenames:
            if name.startswith("."):
                continue
            ext = os.path.splitext(name)[1].lower()
            rel = (rel_dir / name).as_posix()
            if ext not in IMAGE_EXTENSIONS:
                if ext in NOT_PHOTOS and not (rules and rules.file(rel)):
                    not_photos[ext] += 1  # a picture, but never a photo: said in the notes, not silently left out
                ignored += 1
                continue
            if rules and rules.file(rel):
                excluded += 1
            elif ext in readable:
                found.append(rel)
            else:
                unsupported[ext].append(rel)
    if ignored:
        logger.debug("ignored %d non-image files in %s", ignored, base)
    found.sort()
    for paths in unsupported.values():
        paths.sort()
    return Scan(base, found, dict(unsupported), excluded, rules.patterns, rules.unused(), dict(not_photos))


def scan_images(root: str | Path, exclude: Iterable[str] = ()) -> list[str]:
    """The photos under ``root`` this install can read: :func:`scan_photos`'s files, sorted POSIX paths relative to
    ``root``. Files of a format whose package is missing are left out with a warning naming the fix."""
    scan = scan_photos(root, exclude)
    for note in scan.notes():
        logger.warning("%s: %s", scan.root, note)
    return scan.files


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
                      "photo (moco.data.photos.MAX_FILE_BYTES)", str(path))


def _link_problem(path: str | Path, err: OSError) -> str | None:
    """A clearer reason than ``err`` for a symlink that leads nowhere, else None."""
    if err.errno == errno.ELOOP:
        return "symlink loop (too many levels of symbolic links)"
    if err.errno == errno.ENOENT and os.path.islink(path):
        return "broken symlink (its target does not exist)"
    return None


def short_sides(root: str | Path | Scan, limit: int = 200, exclude: Iterable[str] = ()) -> list[int]:
    """The shorter side in pixels of up to ``limit`` photos spread over the folder ``root`` (less ``exclude``), or
    over a :class:`Scan` already made, from their headers only.

    Unreadable files are left out (training reports them itself).
    """
    scan = root if isinstance(root, Scan) else scan_photos(Path(root), exclude)
    names = scan.files
    sides = []
    for name in names[:: max(1, len(names) // limit)][:limit]:
        try:
            sides.append(min(photo_info(scan.root / name).size))  # the header only
        except ImageDecodeError:  # unreadable files are reported by training itself
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
    """Temporarily lift PIL's own header-size check so that ``max_pixels`` governs (restored).

    The limit is raised out of reach, never set to None: PIL reads it twice in one check (``is None``, then ``2 *
    limit``), and another thread's crop or resize between the two reads would multiply None (a TypeError that ended
    an index build of 100,000 photos)."""
    with _PIL_LIMIT_LOCK:
        saved = Image.MAX_IMAGE_PIXELS
        if saved is None:  # off already
            yield
            return
        Image.MAX_IMAGE_PIXELS = _OUT_OF_REACH
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


def _missing(p: Path) -> ImageDecodeError | None:
    """The error for a photo whose format's package is missing (the fix named), else None."""
    ext = p.suffix.lower()
    fix = missing_support(ext)
    return None if fix is None else ImageDecodeError(p, f"{ext} photos need a package that is not installed: {fix}")


def _develop_raw(p: Path, fh: BinaryIO, max_pixels: int | None, target_short: int | None) -> Image.Image:
    """A camera RAW file developed by LibRaw (rawpy) into RGB: the camera's white balance, sRGB, 8 bits, oriented as
    the camera recorded; at half size (LibRaw's own, fast) when that keeps twice ``target_short``."""
    import rawpy

    try:
        with rawpy.imread(fh) as raw:
            size = (int(raw.sizes.width), int(raw.sizes.height))
            if max_pixels is not None and size[0] * size[1] > max_pixels:
                raise ImageDecodeError(p, _bomb_reason(size, max_pixels))
            half = target_short is not None and min(size) / 2 >= target_short * _DRAFT_GAP
            rgb = raw.postprocess(use_camera_wb=True, output_bps=8, half_size=half)  # H x W x 3 uint8
    except ImageDecodeError:
        raise
    except Exception as err:  # noqa: BLE001 - LibRaw raises its own types on files it cannot develop
        raise ImageDecodeError(p, f"not a RAW photo LibRaw can develop: {err or type(err).__name__}") from err
    img = Image.fromarray(np.ascontiguousarray(rgb), "RGB")
    if target_short is not None:
        img = _reduce(img, int(min(img.size) // (target_short * _DRAFT_GAP)))
    return img


def _decode(path: str | Path, max_pixels: int | None, target_short: int | None = None) -> Image.Image:
    """Open (regular files only), bomb-check, reduce (JPEG draft, else box average), load, orient, RGB."""
    p = Path(path)
    if (missing := _missing(p)) is not None:
        raise missing
    enable_formats()  # HEIC/HEIF open like any photo, whatever the file's name
    try:
        fh = open_regular(p)
    except OSError as err:
        raise _unreadable(p, err) from err
    if p.suffix.lower() in RAW_EXTENSIONS:
        with fh:
            if os.fstat(fh.fileno()).st_size == 0:
                raise ImageDecodeError(p, "empty file (0 bytes)")
            return _develop_raw(p, fh, max_pixels, target_short)
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


@dataclass(frozen=True)
class PhotoInfo:
    """What a photo's header says: its pixels (as stored; EXIF orientation does not change their count), when it
    was taken (EXIF DateTimeOriginal, in seconds since the epoch of its local clock; None without one) and the
    camera (EXIF Make and Model; None without them)."""

    width: int
    height: int
    taken: float | None
    camera: str | None

    @property
    def pixels(self) -> int:
        return self.width * self.height

    @property
    def size(self) -> tuple[int, int]:
        return self.width, self.height


_EXIF_IFD, _DATE_TAKEN, _MAKE, _MODEL = 0x8769, 0x9003, 0x010F, 0x0110
_RAW_HEADER_BYTES = 1 << 20  # a TIFF-based RAW file's IFD0 and EXIF IFD are read from its first MiB


def _raw_header(p: Path, fh: BinaryIO) -> tuple[int, int, Image.Exif]:
    """(width, height, EXIF) of a camera RAW file: its size from LibRaw (nothing developed), its EXIF from its
    TIFF structure (DNG, CR2, NEF and ARW are TIFF files; an unreadable one gives an empty EXIF)."""
    import rawpy

    try:
        with rawpy.imread(fh) as raw:
            width, height = int(raw.sizes.width), int(raw.sizes.height)
    except Exception as err:  # noqa: BLE001 - LibRaw raises its own types on files it cannot parse
        raise ImageDecodeError(p, f"not a RAW photo LibRaw can develop: {err or type(err).__name__}") from err
    exif = Image.Exif()
    try:
        fh.seek(0)
        exif.load(fh.read(_RAW_HEADER_BYTES))
    except Exception as err:  # noqa: BLE001 - malformed EXIF must not lose the photo
        logger.debug("ignoring unreadable EXIF in %s: %s", p, err)
    return width, height, exif


def photo_info(path: str | Path) -> PhotoInfo:
    """The header of the photo at ``path`` (no pixel is decoded): an :class:`ImageDecodeError` when it is no
    image (or its format's package is missing); a malformed date or camera is None."""
    p = Path(path)
    if (missing := _missing(p)) is not None:
        raise missing
    enable_formats()
    try:
        fh = open_regular(p)
    except OSError as err:
        raise _unreadable(p, err) from err
    with fh, _pil_bomb_check_off():
        if p.suffix.lower() in RAW_EXTENSIONS:
            width, height, exif = _raw_header(p, fh)
        else:
            try:
                img = Image.open(fh)
                width, height = img.size
                exif = img.getexif()
            except UnidentifiedImageError as err:
                raise ImageDecodeError(p, "not an image (cannot identify format)") from err
            except Exception as err:  # noqa: BLE001 - PIL plugins raise many types on corrupt headers
                raise ImageDecodeError(p, f"truncated or corrupt: {err or type(err).__name__}") from err
        taken, camera = None, None
        try:
            taken = _exif_time(exif.get_ifd(_EXIF_IFD).get(_DATE_TAKEN) or exif.get(_DATE_TAKEN))
            camera = " ".join(str(v).strip("\x00 ") for v in (exif.get(_MAKE), exif.get(_MODEL)) if v) or None
        except Exception as err:  # noqa: BLE001 - malformed EXIF must not lose the photo
            logger.debug("ignoring unreadable EXIF in %s: %s", p, err)
    return PhotoInfo(width, height, taken, camera[:200] if camera else None)


def _exif_time(value: Any) -> float | None:
    """EXIF's ``YYYY:MM:DD HH:MM:SS`` as seconds since the epoch (its clock read as UTC), or None."""
    if not isinstance(value, str):
        return None
    try:
        return datetime.datetime.strptime(value.strip("\x00 ")[:19], "%Y:%m:%d %H:%M:%S").replace(
            tzinfo=datetime.timezone.utc).timestamp()
    except ValueError:
        return None


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
