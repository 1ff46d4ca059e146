"""What the page's tabs show, as plain values: the Negatives tab's galleries and table, the Collection tab's review
of groups of duplicates (a page of them, the choices of a group and its keeper, an action's result), and the Status
tab's refresh (which turns search on when the index arrives).

:mod:`app.page.blocks` wires them to components; the tests call them directly.
"""

from __future__ import annotations

import datetime
import html
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from app.page.handlers import VIEW_PX, SearchApp, score_text
from app.page.negatives.view import NegativesView
from index.catalog import display_path
from index.duplicates.groups import DEFAULT_KINDS, KINDS, SIMILAR, Group, Member
from index.search.image_index import ImageIndex
from moco.errors import UserError, plural

__all__ = ["negatives_outputs", "groups_html", "review_outputs", "outcome_text", "status_outputs",
           "KIND_CHOICES", "READY_HINT", "PENDING_HINT", "ready_hint"]

READY_HINT = "Upload a photo and press Search."  # the Search tab before a first search, search on ...


def ready_hint(app: SearchApp) -> str:
    """:data:`READY_HINT`, and where the index's model is too weak to trust alone (a run from scratch on few
    photos: :attr:`~index.search.image_index.ImageIndex.edges_share`), what its scores rest on."""
    share = app.index.edges_share if app.index is not None else None
    if not share:
        return READY_HINT
    return (f"{READY_HINT} The model was trained from scratch on few photos, too weak to trust alone: "
            f"{share:.0%} of each score is the photos' edge layout (light and dark versions of one scene find each "
            "other).")
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


def _when(m: Member) -> str:
    """A member's date: taken (EXIF) when it has one, else modified."""
    if m.taken is not None:
        return "taken " + datetime.datetime.fromtimestamp(m.taken, datetime.timezone.utc).strftime("%Y-%m-%d %H:%M")
    if m.mtime is not None:
        return "modified " + datetime.datetime.fromtimestamp(m.mtime).strftime("%Y-%m-%d %H:%M")
    return ""


def _size(n: int | None) -> str:
    return "" if n is None else f"{n / 1e6:.1f} MB" if n >= 1e6 else f"{n / 1e3:.0f} kB"


def _to_keeper(group: Group, index: ImageIndex) -> dict[int, tuple[float | None, float | None]]:
    """Each member's (copy score, centred cosine) to the group's keeper. The search measured both to the
    representative: they are the keeper's when the keeper is the representative, and the representative's own
    pair is the keeper's row. Another member's cosine to another keeper comes from their vectors in the index's space
    (its copy score to that keeper was never measured: None); a member no longer indexed gets (None, None)."""
    keep = group.keep_id
    rep = group.representative.id if group.representative else None
    by_id = {m.id: m for m in group.members}
    pair = lambda m: (m.copy_score, m.similarity)  # noqa: E731
    if keep == rep or keep not in by_id:
        return {i: pair(m) for i, m in by_id.items()}
    out = {i: (None, None) for i in by_id}
    out[rep] = pair(by_id[keep])
    others = [i for i in by_id if i not in (keep, rep)]
    if others:
        try:
            v = index.to_space(index.vectors(np.array([keep, *others], np.int64)))  # 1 + n x D, unit
        except KeyError:  # a member moved or deleted since the search
            return out
        for i, cos in zip(others, (v[1:] @ v[0]).tolist()):
            out[i] = (None, float(cos))
    return out


def groups_html(groups: list[Group], index: ImageIndex, start: int = 0, total: int | None = None) -> str:
    """Groups of duplicates, each in its own panel: its number (from ``start`` + 1, of ``total``), kind, size, id,
    keeper and why; each member with its thumbnail, its pixels, size and date, its path, and its copy score and
    cosine to the keeper (or "keep", or "identical to the keeper")."""
    if not groups:
        return ""
    total = len(groups) if total is None else total
    parts = []
    for n, group in enumerate(groups, start + 1):
        figures = []
        keep = group.keep_id
        to_keeper = _to_keeper(group, index)
        for m in group.members:
            thumb = index.dir / m.thumb if m.thumb else None
            img = (f'<img src="gradio_api/file={html.escape(str(thumb))}" alt="">' if thumb and thumb.is_file()
                   else "")
            copy_score, cosine = to_keeper[m.id]
            copy = f"copy {copy_score:.3f} · " if copy_score is not None else ""
            label = ("✓ keep" if m.id == keep else "identical to the keeper" if group.identical(m)
                     else f"{copy}cos {score_text(cosine)} to the keeper" if cosine is not None
                     else "no longer indexed")
            facts = " · ".join(x for x in (f"{m.width}×{m.height}" if m.width else "",
                                            _size(m.bytes), _when(m)) if x)
            figures.append(f'<figure data-id="{m.id}"{" class=dup-keep" if m.id == keep else ""}>{img}'
                           f"<figcaption><b>{html.escape(label)}</b> · {html.escape(facts)} · "
                           f"{'/<wbr>'.join(map(html.escape, display_path(m.path).split('/')))}</figcaption>"
                           "</figure>")
        spread = (f" · cos {score_text(group.loosest)}–{score_text(group.tightest)} to the first"
                  if group.loosest is not None and group.tightest is not None else "")
        reason = html.escape(group.reason)
        parts.append(f'<div class="dup-group" data-group="{html.escape(group.id)}"><h4>Group {n} of '
                     f'{total} · {html.escape(group.kind)} · {group.size} photos{spread}</h4>'
                     f'<p class="dup-why">keep <code>{html.escape(display_path(str(group.keep)))}</code>: '
                     f'{reason} · id <code>{html.escape(group.id)}</code></p>'
                     f'<div class="dup-thumbs">{"".join(figures)}</div></div>')
    return "".join(parts)


# The Collection tab's kind filter: its label -> the kinds it shows (index.duplicates.groups.KINDS, one by one and
# together).
KIND_CHOICES = {"exact and near": DEFAULT_KINDS, **{kind: (kind,) for kind in KINDS}, "all kinds": KINDS}


def review_outputs(app: SearchApp, kind: str, offset: int, gid: str | None = None, message: str = "") -> tuple:
    """The Collection tab's review of one page: (groups HTML, page markdown, group choice, keeper choice, message,
    offset, undo button, and the buttons Move the others, Not duplicates, Move every group shown and Keep the one
    chosen: each on only when there is what it acts on; Keep waits for another photo to be chosen). ``gid``: the
    group to choose a keeper of (default: the page's first)."""
    import gradio as gr

    kinds = KIND_CHOICES.get(kind or "exact and near", DEFAULT_KINDS)
    index = app.ready_index()
    if app.duplicates.saved() is None:
        empty, off = gr.update(choices=[], value=None), gr.update(interactive=False)
        return ("", "_No search for duplicates yet: press Find duplicates._", empty, empty, message, 0, off,
                off, off, off, off)
    page = app.duplicates.page(kinds, offset)
    if page.groups == [] and page.total and page.offset:  # past the end (groups left since): the last page
        page = app.duplicates.page(kinds, (page.total - 1) // page.limit * page.limit)
    first, last = page.offset + 1, page.offset + len(page.groups)
    where = (f"Groups {first}–{last} of **{page.total}** ({' and '.join(kinds)})" if page.total
             else f"No {' or '.join(kinds)} groups.")
    labels = [(f"Group {n} · {g.kind} · {g.size} photos", g.id) for n, g in enumerate(page.groups, first)]
    ids = [v for _, v in labels]
    gid = gid if gid in ids else (ids[0] if ids else None)
    group = next((g for g in page.groups if g.id == gid), None)
    keepers = [(f"{display_path(m.path)} ({m.width}×{m.height}, {_size(m.bytes)})", str(m.id))
               for m in group.members] if group else []
    moved = app.duplicates.moved()
    return (groups_html(page.groups, index, page.offset, page.total), where,
            gr.update(choices=labels, value=gid), gr.update(choices=keepers, value=str(group.keep_id) if group
                                                            else None),
            message, page.offset, gr.update(interactive=moved > 0, value=f"Undo moves ({plural(moved, 'photo')})"
                                            if moved
                                            else "Undo moves"),
            gr.update(interactive=group is not None), gr.update(interactive=group is not None),
            gr.update(interactive=bool(page.groups) and SIMILAR not in kinds), gr.update(interactive=False))


def outcome_text(out: Any) -> str:
    """A move's or an undo's result for the page: what moved, what did not and why."""
    verb = "moved" if out.action == "move" else "put back"
    if out.dry_run:  # what would move: each photo and where to, nothing moved
        text = f"**Dry run: {plural(len(out.done), 'photo')} would move** to `{out.destination}` (nothing moved)"
        text += "".join(f"\n- `{html.escape(d['from'])}` → `{html.escape(d['to'])}`" for d in out.done[:20])
        text += f"\n- ... and {len(out.done) - 20} more" if len(out.done) > 20 else ""
        return text + "".join(f"\n- would stay: `{html.escape(s['path'])}`: {html.escape(s['reason'])}"
                              for s in out.skipped[:20])
    text = f"**{plural(len(out.done), 'photo')} {verb}**" + (f" to `{out.destination}`" if out.destination and out.done
                                                  else "")
    if out.finished:
        text += f" · {out.finished} cut off by an earlier kill finished first"
    if out.updated:
        text += " · index updated"
    if out.skipped:
        text += "\n\n" + "\n".join(f"- not {verb}: `{html.escape(s['path'])}`: {html.escape(s['reason'])}"
                                     for s in out.skipped[:20])
    return text


def status_outputs(app: SearchApp, was_ready: bool) -> tuple:
    """Status refresh: (status markdown, loss plot, kNN plot, title, the Negatives' and the Collection's buttons,
    folders, collection x2, the near-duplicate threshold, the Search tab's hint, ready flag). The Search tab's
    buttons follow from what it holds (:meth:`SearchApp.search_buttons`)."""
    import gradio as gr

    if app.status is None:
        text, frame = "Serving a finished index.", None
        if app.watcher is not None:
            text = f"Serving the index. {app.watcher.state.describe()}."
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
        stats, _ = app.collection()
        assert app.index is not None
        try:
            first = review_outputs(app, "exact and near", 0)[0]  # the first page of groups
        except UserError as e:  # a damaged dedup.json: said by the tab's own events
            first = html.escape(str(e))
        ready = (app.title(), on, on, gr.Dropdown(choices=app.folder_choices(), value=""), stats,
                 first, gr.Slider(value=app.index.dedup_threshold), ready_hint(app), True)
    else:
        ready = (gr.skip(),) * 8 + (was_ready,)
    return (text, loss, knn, *ready)
