"""Uploads the page accepts, and our own message for each one it cannot use.

Gradio's ``Image`` opens an upload with PIL before any handler runs, so a text file named ``.jpg`` or an
empty file ends as a bare red "Error" with a traceback in the server log. ``QueryImage`` passes the
uploaded file's path through untouched; ``read_upload`` then decodes it with the same decoder as the index
and turns every failure into one line naming the file and the fix. Files over the size cap never reach
the server: Gradio refuses them in the browser, and ``SIZE_CHECK_JS`` writes our message on the page.
"""

from __future__ import annotations

import os
import types
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from moco.data import ImageDecodeError, load_rgb
from moco.errors import UserError

__all__ = ["MAX_UPLOAD_MB", "QueryImage", "read_upload", "size_check_js"]

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


def read_upload(image: Any, min_short: int | None = None) -> Image.Image:
    """An uploaded image as RGB (decoded reduced to twice ``min_short``), or UserError naming the file and the fix."""
    if image is None:
        raise UserError("no image: upload, paste or take a photo first")
    if isinstance(image, Image.Image):
        return image.convert("RGB")
    if isinstance(image, np.ndarray):
        if image.dtype != np.uint8 or image.ndim not in (2, 3):
            raise UserError(f"expected an RGB image, got an array of {image.dtype} {image.shape}")
        return Image.fromarray(image).convert("RGB")
    if not isinstance(image, (str, Path)):
        raise UserError("no image: upload, paste or take a photo first")
    name = Path(image).name
    try:
        size = os.stat(image).st_size
    except OSError as e:
        raise UserError(f"{name}: the upload is gone ({e.strerror}): upload it again") from e
    if size > MAX_UPLOAD_MB * 1024 * 1024:
        raise UserError(f"{name} is {size / 1e6:.1f} MB, over the {MAX_UPLOAD_MB} MB upload limit: upload a smaller "
                        "copy (for example exported at 4000 px on its long side)")  # fmt: skip
    try:
        return load_rgb(image, min_short=min_short)
    except ImageDecodeError as e:
        raise UserError(f"{name}: {e.reason}; upload a photo ({FORMATS})") from None


def size_check_js() -> str:
    """Page script: a file over the cap, picked or dropped on an upload box, gets our message beside it."""
    return f"""() => {{
  const cap = {MAX_UPLOAD_MB} * 1024 * 1024;
  const boxes = {{"query": "#search-info", "neg-query": "#neg-summary"}};
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
