"""Uploads the page accepts, and our own message for each one it cannot use.

Gradio's ``Image`` opens an upload with PIL before any handler runs, so a text file named ``.jpg`` or an
empty file ends as a bare red "Error" with a traceback in the server log. ``QueryImage`` passes the
uploaded file's path through untouched; ``read_upload`` then decodes it with the same decoder as the index
and turns every failure into one line naming the file and the fix: an image with too many pixels (from its
header, never decoded) or too few to search with (:func:`index.query.check_query_size`, the rule of every
door) included. Files over the size cap never reach the server: Gradio refuses them in the browser, and
``SIZE_CHECK_JS`` writes our message on the page.
"""

from __future__ import annotations

import math
import os
import types
import warnings
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from index.query import check_query_size
from moco.data.photos import DEFAULT_MAX_PIXELS, ImageDecodeError, load_rgb, open_regular
from moco.errors import UserError

__all__ = ["MAX_UPLOAD_MB", "QueryImage", "read_upload", "upload_suffix", "size_check_js"]

MAX_UPLOAD_MB = 25  # per uploaded file; Gradio enforces it before the upload, read_upload again after
FORMATS = "JPEG, PNG, WebP, GIF, BMP or TIFF"


def _pass_path(self: Any, payload: Any) -> str | None:
    """``preprocess`` of a QueryImage: the uploaded file's path, decodable or not (read_upload explains)."""
    return None if payload is None else str(payload.path)


def QueryImage(**kwargs: Any) -> Any:  # noqa: N802 - reads as the component it makes
    """A ``gr.Image(type="filepath", image_mode=None)`` that never rejects an upload before our handler.

    Only this instance's ``preprocess`` changes (a subclass would make Gradio write a ``.pyi`` beside this file).
    """
    import gradio as gr

    image = gr.Image(type="filepath", image_mode=None, **kwargs)
    image.preprocess = types.MethodType(_pass_path, image)
    return image


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
        raise UserError(f"{name}: {e.reason}; upload a photo ({FORMATS})") from None


def size_check_js() -> str:
    """Page script: a file over the cap, picked or dropped on an upload box, gets our message beside it."""
    return f"""() => {{
  const cap = {MAX_UPLOAD_MB} * 1024 * 1024;
  const boxes = {{"query": "#search-error", "neg-query": "#neg-summary"}};
  const check = (files, target) => {{
    const host = target && target.closest ? target.closest("#query, #neg-query") : null;
    if (!host || !files) return;
    for (const f of files) {{
      if (f.size <= cap) continue;
      const box = document.querySelector(boxes[host.id]);
      if (box) box.innerText = "Error: " + f.name + " is " + (f.size / 1e6).toFixed(1) + " MB, over the " +
        {MAX_UPLOAD_MB} + " MB upload limit: upload a smaller copy (for example exported at 4000 px on its long side)";
    }}
  }};
  document.addEventListener("change", e => check(e.target.files, e.target), true);
  document.addEventListener("drop", e => check(e.dataTransfer && e.dataTransfer.files, e.target), true);
}}"""
