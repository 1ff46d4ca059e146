"""The page's upload boxes, and our own message for an upload they cannot take.

Gradio's ``Image`` opens an upload with PIL before any handler runs, so a text file named ``.jpg`` or an empty file
ends as a bare red "Error" with a traceback in the server log. ``QueryImage`` passes the uploaded file's path through
untouched; :func:`app.search.uploads.read_upload` then decodes it and says what is wrong. Files over the size cap
never reach the server: Gradio refuses them in the browser, and :func:`size_check_js` writes our message on the page.
"""

from __future__ import annotations

import types
from typing import Any

from app.search.uploads import MAX_UPLOAD_MB

__all__ = ["QueryImage", "size_check_js"]


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
