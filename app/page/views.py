"""What the page's tabs show, as plain values: the Negatives tab's galleries and table, the Collection tab's
near-duplicate groups, and the Status tab's refresh (which turns search on when the index arrives).

:mod:`app.page.blocks` wires them to components; the tests call them directly.
"""

from __future__ import annotations

import html
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from app.page.handlers import VIEW_PX, SearchApp, score_text
from app.page.negatives.view import NegativesView
from index.catalog import display_path
from index.image_index import ImageIndex

__all__ = ["negatives_outputs", "groups_html", "status_outputs", "READY_HINT", "PENDING_HINT"]

READY_HINT = "Upload a photo and press Search."  # the Search tab before a first search, search on ...
PENDING_HINT = "Search turns on by itself when the index is ready (see Status)."  # ... and off


def _view_image(view: np.ndarray) -> Image.Image:
    """A training view (s x s x 3 uint8) enlarged to at least VIEW_PX with square pixels (no smoothing)."""
    img = Image.fromarray(view)
    scale = max(1, -(-VIEW_PX // max(1, min(img.size))))
    return img.resize((img.size[0] * scale, img.size[1] * scale), Image.Resampling.NEAREST)


def negatives_outputs(v: NegativesView, note: str = "") -> tuple:
    """(views gallery, summary markdown, negatives gallery, table rows) for one InfoNCE view.

    Cosines have 3 decimals, softmax shares are percentages; counts come from all the negatives.
    """
    views = [(_view_image(v.view_q), "query view (q)"),
             (_view_image(v.view_k), f"positive key view (k+) · cos {score_text(v.positive)}")]
    source = "saved MoCo queue" if v.source == "queue" else "the index"
    lines = [
        f"**Source:** {source} — {v.space}.",
        f"**Positive:** cos {score_text(v.positive)} · logit {v.positive / v.temperature:.2f} · share "
        f"{v.positive_share:.1%} · **InfoNCE loss** {v.loss:.3f} (T = {v.temperature}) · **rank of the positive** "
        f"{v.positive_rank} of {v.count + 1}",
        f"**{v.above_positive} of {v.count} negatives** score at or above the positive.",
    ]
    if any(v.flagged.values()):
        reasons = ", ".join(f"{count} {reason}" for reason, count in v.flagged.items() if count)
        lines.append(f"**Likely false negatives, on evidence:** {reasons} (of all {v.count}).")
    else:
        lines.append("**No likely false negatives:** no negative is the same photo, a near-duplicate, or as close as "
                     "two views of one photo.")
    lines += [f"_{n}_" for n in [*v.notes, note] if n]
    gallery, table = [], []
    for r, neg in enumerate(v.negatives, 1):
        shown = display_path(neg.path) if neg.path else f"id {neg.id}"
        repeat = f" · key {neg.key_number} of {neg.keys_of_photo} of this photo" if neg.keys_of_photo > 1 else ""
        flag = f"⚠ {neg.reason} · " if neg.reason else ""
        if neg.thumb is not None:
            thumb = str(neg.thumb) if isinstance(neg.thumb, Path) else neg.thumb
            cos = score_text(neg.similarity)
            gallery.append((thumb, f"{flag}#{r} · cos {cos} · {neg.share:.1%} · {shown}{repeat}"))
        table.append([r, shown + repeat, score_text(neg.similarity), f"{neg.logit:.2f}", f"{neg.share:.2%}",
                      neg.reason or ""])
    return views, "\n\n".join(lines), gallery, table


def groups_html(groups: list[dict[str, Any]], index: ImageIndex, limit: int = 50) -> str:
    """Near-duplicate groups, each in its own panel, largest first: its size, the range of its members' cosines to
    its representative (shown first, marked) and every path with its cosine."""
    if not groups:
        return ""
    parts = []
    for g, group in enumerate(groups[:limit], 1):
        figures = []
        rep = (group.get("representative") or {}).get("id")  # a dedup.json from before representatives has none
        for m in group["members"]:
            row = index.catalog.row_by_path(m["path"])
            thumb = index.thumb_path(row) if row is not None else None
            img = f'<img src="gradio_api/file={html.escape(str(thumb))}" alt="">' if thumb else ""
            cos = score_text(m.get("similarity", m["best_similarity"]))
            label = "representative" if m["id"] == rep else f"cos {cos}"
            if isinstance(m.get("taken"), str):
                label += f" · {html.escape(m['taken'][:10])}"
            figures.append(f'<figure{" class=dup-rep" if m["id"] == rep else ""}>{img}<figcaption>{label} · '
                           f"{html.escape(display_path(m['path']))}</figcaption></figure>")
        spread = (f" · cos {score_text(group['loosest'])}–{score_text(group['tightest'])} to the first"
                  if "loosest" in group else "")
        parts.append(f'<div class="dup-group"><h4>Group {g} · {group["size"]} photos{spread}</h4>'
                     f'<div class="dup-thumbs">{"".join(figures)}</div></div>')
    more = f"<p>{len(groups) - limit} more groups in dedup.json</p>" if len(groups) > limit else ""
    return "".join(parts) + more


def status_outputs(app: SearchApp, was_ready: bool) -> tuple:
    """Status refresh: (status markdown, loss plot, kNN plot, title, 4 buttons, folders, collection x2, the
    near-duplicate threshold, the Search tab's hint, ready flag)."""
    import gradio as gr

    if app.status is None:
        text, frame = "Serving a finished index.", None
    else:
        from app.run.status import loss_frame, status_markdown

        snap = app.status.snapshot()
        text, frame = status_markdown(snap), loss_frame(snap)
        if snap.get("messages"):
            log = "\n".join(html.escape(m) for m in snap["messages"][-6:])
            text += f"\n\n<pre class='status-log'>{log}</pre>"
    loss = knn = gr.skip()
    if frame is not None:
        loss_rows, knn_rows = frame[frame["series"] == "loss"], frame[frame["series"] != "loss"]
        loss = gr.LinePlot(value=loss_rows, visible=len(loss_rows) > 0)
        knn = gr.LinePlot(value=knn_rows, visible=len(knn_rows) > 0)
    if app.ready and not was_ready:  # the index just arrived: turn search on
        on = gr.Button(interactive=True)
        stats, groups = app.collection()
        assert app.index is not None
        ready = (app.title(), on, on, on, on, gr.Dropdown(choices=app.folder_choices(), value=""), stats,
                 groups_html(groups, app.index), gr.Slider(value=app.index.dedup_threshold), READY_HINT,
                 True)
    else:
        ready = (gr.skip(),) * 10 + (was_ready,)
    return (text, loss, knn, *ready)
