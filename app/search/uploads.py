"""Uploads a search accepts (the page's, the API's), and our own message for each one it cannot use.

``read_upload`` decodes an upload with the same decoder as the index and turns every failure into one line naming
the file and the fix: an image over :data:`MAX_UPLOAD_MB`, with too many pixels (from its header, never decoded) or
too few to search with (:func:`index.search.query.check_query_size`, the rule of every door) included.
"""

from __future__ import annotations

import math
import os
import warnings
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from index.search.query import check_query_size
from moco.data.photos import DEFAULT_MAX_PIXELS, ImageDecodeError, load_rgb, open_regular, readable_formats
from moco.errors import UserError

__all__ = ["MAX_UPLOAD_MB", "read_upload", "upload_suffix"]

MAX_UPLOAD_MB = 25  # per uploaded file; Gradio enforces it before the upload, read_upload again after


def _header_size(path: str | Path) -> tuple[int, int] | None:
    """(width, height) from the file's header, nothing decoded; None when PIL cannot tell (load_rgb says why).

    PIL refuses to open an image of more than twice its pixel limit: that one is returned as (0, 0).
    """
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        try:
            with open_regular(path) as f, Image.open(f) as im:
                return im.size
        except Image.DecompressionBombError:
            return (0, 0)
        except Exception:  # noqa: BLE001 - unreadable or not an image: load_rgb explains
            return None


def _check_size(name: str, size: tuple[int, int]) -> None:
    """UserError for too many pixels (to decode safely) or too few (to search with), naming both numbers."""
    limit = DEFAULT_MAX_PIXELS
    if limit is not None and (size == (0, 0) or size[0] * size[1] > limit):
        # the image's count rounded up and the limit's down, so the one always reads above the other
        count = f"{math.ceil(size[0] * size[1] / 1e6)}" if size != (0, 0) else f"over {2 * limit // 10**6}"
        raise UserError(f"{name}: too many pixels ({count} megapixels, the limit is {limit // 10**6}): downscale it "
                        "(for example to 4000 px on its long side) and upload it again")
    check_query_size(name, size)


def upload_suffix(name: str) -> str:
    """The suffix of a client's file name when it is a plain one (``.jpg``, ``.webp``: what a temporary copy may be
    named with), else ""."""
    suffix = Path(name).suffix
    return suffix if 1 < len(suffix) <= 6 and suffix[1:].isascii() and suffix[1:].isalnum() else ""


def read_upload(image: Any, min_short: int | None = None, name: str | None = None) -> Image.Image:
    """An uploaded image as RGB (decoded reduced to twice ``min_short``), or UserError naming the file and the fix.

    ``name``: what messages call a file ``image`` (its client's name; default: the file's own name)."""
    if image is None:
        raise UserError("no image: upload, paste or take a photo first")
    if isinstance(image, Image.Image):
        _check_size("the image", image.size)
        return image.convert("RGB")
    if isinstance(image, np.ndarray):
        if image.dtype != np.uint8 or image.ndim not in (2, 3):
            raise UserError(f"expected an RGB image, got an array of {image.dtype} {image.shape}")
        _check_size("the image", (image.shape[1], image.shape[0]))
        return Image.fromarray(image).convert("RGB")
    if not isinstance(image, (str, Path)):
        raise UserError("no image: upload, paste or take a photo first")
    name = name or Path(image).name
    try:
        size = os.stat(image).st_size
    except OSError as e:
        raise UserError(f"{name}: the upload is gone ({e.strerror}): upload it again") from e
    if size > MAX_UPLOAD_MB * 1024 * 1024:
        raise UserError(f"{name} is {size / 1e6:.1f} MB, over the {MAX_UPLOAD_MB} MB upload limit: upload a smaller "
                        "copy (for example exported at 4000 px on its long side)")
    header = _header_size(image)
    if header is not None:
        _check_size(name, header)
    try:
        return load_rgb(image, min_short=min_short)
    except ImageDecodeError as e:
        raise UserError(f"{name}: {e.reason}; upload a photo ({readable_formats()})") from None
