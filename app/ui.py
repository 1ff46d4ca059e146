"""The Gradio search UI: Search, Negatives (the InfoNCE view) and Collection tabs.

``SearchApp`` holds the handlers as plain methods (tests call them directly); ``build_ui`` wires them
to Gradio components; ``serve`` launches it with the safety settings: bound to 127.0.0.1 unless told
otherwise, only the index's ``thumbs/`` folder served, upload size capped, one search at a time.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from app.negatives import IndexNegatives, NegativesView, QueueNegatives, _as_rgb
from index.catalog import display_path
from index.dedup import DEDUP_THRESHOLD, find_duplicates, load_duplicates
from index.image_index import CATALOG_FILE, DEDUP_FILE, INDEX_FILE, META_FILE, THUMBS_DIR, ImageIndex
from moco.errors import UserError

__all__ = ["SearchApp", "build_ui", "serve", "MAX_UPLOAD"]

logger = logging.getLogger(__name__)

MAX_UPLOAD = "25mb"
MAX_RESULTS = 500


def _error_text(e: BaseException) -> str:
    if isinstance(e, UserError):
        return f"**Error:** {e}"
    logger.exception("handler failed")
    return f"**Error:** {type(e).__name__}: {e}. The server is still running; details are in its log."


def _safe(n_outputs: int, message_at: int) -> Callable:
    """Turn any exception into a readable message in output ``message_at`` (never a stack trace)."""

    def wrap(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def inner(*args: Any, **kwargs: Any) -> Any:
            try:
                return fn(*args, **kwargs)
            except Exception as e:  # noqa: BLE001 - shown on the page, logged with its traceback
                out: list[Any] = [None] * n_outputs
                out[message_at] = _error_text(e)
                return tuple(out)

        return inner

    return wrap


class SearchApp:
    """Handlers of the UI over one index (and optionally a training checkpoint for the Negatives tab).

    Args:
        index: the opened index.
        embedder: the index's Embedder (``index.load_embedder()``).
        checkpoint: a ``moco train`` checkpoint: negatives from its saved queue; None: from the index.
    """

    def __init__(self, index: ImageIndex, embedder: Any, checkpoint: str | Path | None = None) -> None:
        self.index, self.embedder = index, embedder
        index.check_backbone(embedder.sha256)
        self.negatives_source: QueueNegatives | IndexNegatives
        self.negatives_note = ""
        self._folders: tuple[Any, list[str]] | None = None
        self._folder_names: dict[str, str] = {}
        if checkpoint is not None:
            try:
                self.negatives_source = QueueNegatives(checkpoint, index)
            except UserError as e:
                self.negatives_note = f"{e}; using the index instead"
                self.negatives_source = IndexNegatives(index, embedder)
        else:
            self.negatives_source = IndexNegatives(index, embedder)

    # ---------------------------------------------------------------------------------- search
    def folders(self) -> list[str]:
        """Sub-folders of the collection (two levels), for the filter; recomputed when the index changes."""
        stamp = self.index._stamp
        if self._folders is not None and self._folders[0] == stamp:
            return self._folders[1]
        out = set()
        for path in self.index.catalog.rows():
            parts = path.split("/")[:-1]
            for depth in (1, 2):
                if len(parts) >= depth:
                    out.add("/".join(parts[:depth]))
        self._folders = (stamp, sorted(display_path(f) for f in out))
        self._folder_names = {display_path(f): f for f in out}  # shown (escaped) -> on disk
        return self._folders[1]

    def _gallery(self, state: dict[str, Any]) -> list[tuple[str, str]]:
        items = []
        for r, (path, score, thumb) in enumerate(zip(state["paths"], state["scores"], state["thumbs"]), 1):
            weak = " · weak match" if self.index.weak_below is not None and score < self.index.weak_below else ""
            items.append((thumb, f"#{r} · {score:.3f}{weak} · {display_path(path)}"))
        return items

    def _run(self, vector: np.ndarray, k: int, folder: str | None, label: str, embed_ms: float) -> tuple:
        k = int(max(1, min(int(k), MAX_RESULTS)))
        self.index.refresh()  # `moco index update` may have replaced the files meanwhile
        self.index.check_backbone(self.embedder.sha256)  # ... or rebuilt them with another model
        folder = (folder or "").strip().strip("/") or None
        if folder and folder not in self.folders():
            raise UserError(f"no sub-folder {folder!r} in the collection: pick one from the list or leave it empty")
        folder = self._folder_names.get(folder, folder) if folder else None
        if len(self.index) == 0:
            raise UserError("the index is empty: add photos and run `moco index update`")
        t0 = time.perf_counter()
        hits = self.index.search(vector[None], k=k, folder=folder)
        search_ms = (time.perf_counter() - t0) * 1000
        rows = hits.rows[0]
        state = {"vector": vector, "k": k, "folder": folder, "label": label, "ids": [r.id for r in rows],
                 "paths": hits.paths[0], "scores": [float(s) for s in hits.scores[0][: len(rows)]],
                 "thumbs": [str(self.index.thumb_path(r)) if r.thumb else None for r in rows]}  # fmt: skip
        info = (f"**{len(rows)} results** for {label}{f' in `{display_path(folder)}/`' if folder else ''} · "
                f"embed {embed_ms:.0f} ms · search {search_ms:.1f} ms · {len(self.index)} images")  # fmt: skip
        weak = self.index.weak_below
        if weak is not None and state["scores"] and state["scores"][0] < weak:
            info += (f" · **no close match in the collection** (the best scores {state['scores'][0]:.3f}, under "
                     f"{weak:.3f}, the score of 1 in 100 random pairs)")  # fmt: skip
        return self._gallery(state), info, state

    def search(self, image: Any, k: int = 12, folder: str | None = None) -> tuple:
        """Upload -> (gallery items, info markdown, state)."""
        if image is None:
            raise UserError("no image: upload, paste or take a photo first")
        t0 = time.perf_counter()
        vector = self.embedder.embed(_as_rgb(image, self.embedder.resize))[0]  # D
        return self._run(vector, k, folder, "the uploaded image", (time.perf_counter() - t0) * 1000)

    def more(self, state: dict[str, Any] | None) -> tuple:
        """The next ``k`` results after those shown."""
        if not state:
            raise UserError("search first, then ask for more")
        t0 = time.perf_counter()
        hits = self.index.search(state["vector"][None], k=state["k"], folder=state["folder"],
                                 offset=len(state["ids"]))  # fmt: skip
        rows = hits.rows[0]
        state = dict(state)
        state["ids"] = state["ids"] + [r.id for r in rows]
        state["paths"] = state["paths"] + hits.paths[0]
        state["scores"] = state["scores"] + [float(s) for s in hits.scores[0][: len(rows)]]
        state["thumbs"] = state["thumbs"] + [str(self.index.thumb_path(r)) if r.thumb else None for r in rows]
        info = (f"**{len(state['ids'])} results** for {state['label']} · search "
                f"{(time.perf_counter() - t0) * 1000:.1f} ms" + ("" if rows else " · no more results"))  # fmt: skip
        return self._gallery(state), info, state

    def select(self, state: dict[str, Any] | None, position: int) -> tuple:
        """Search again with the result at ``position`` of the gallery (its stored vector, no re-embedding)."""
        if not state or not 0 <= int(position) < len(state["ids"]):
            raise UserError("that result is no longer on the page: search again")
        image_id, path = state["ids"][int(position)], state["paths"][int(position)]
        vector = self.index.vectors(np.array([image_id]))[0]
        return self._run(vector, state["k"], state["folder"], f"`{display_path(path)}`", 0.0)

    # ------------------------------------------------------------------------------- negatives
    def negatives(self, image: Any, n: int = 12, seed: int = 0) -> tuple:
        """Upload -> (views gallery, summary markdown, negatives gallery, table rows)."""
        if image is None:
            raise UserError("no image: upload, paste or take a photo first")
        view = self.negatives_source.compute(_as_rgb(image, max(256, self.embedder.resize)), n=int(n), seed=int(seed))
        return self._negatives_outputs(view)

    def _negatives_outputs(self, v: NegativesView) -> tuple:
        views = [(v.view_q, "query view (q)"), (v.view_k, f"positive key view (k+) · cos {v.positive:.3f}")]
        flagged = sum(n.suspicious for n in v.negatives)
        lines = [
            f"**Source:** {'saved MoCo queue' if v.source == 'queue' else 'the index'} — {v.space}.",
            f"**Positive:** cosine {v.positive:.4f}, logit {v.positive / v.temperature:.3f}, "
            f"share {v.positive_share:.2%} · **InfoNCE loss** {v.loss:.4f} (T = {v.temperature}) · "
            f"**rank of the positive** {v.positive_rank} of {v.count + 1}",
        ]
        if flagged:
            lines.append(f"**{flagged} negative(s) score at or above the positive**: likely false negatives "
                         "(the same scene) or near-duplicates.")  # fmt: skip
        lines += [f"_{note}_" for note in [*v.notes, self.negatives_note] if note]
        gallery, table = [], []
        for r, neg in enumerate(v.negatives, 1):
            flag = "⚠ " if neg.suspicious else ""
            shown = display_path(neg.path) if neg.path else f"id {neg.id}"
            if neg.thumb is not None:
                thumb = str(neg.thumb) if isinstance(neg.thumb, Path) else neg.thumb
                gallery.append((thumb, f"{flag}#{r} · cos {neg.similarity:.3f} · {neg.share:.2%} · {shown}"))
            table.append([r, shown, round(neg.similarity, 4), round(neg.logit, 3),
                          round(neg.share, 6), "likely false negative / near-duplicate" if neg.suspicious else ""])
        return views, "\n\n".join(lines), gallery, table

    # ------------------------------------------------------------------------------ collection
    def collection(self, threshold: float | None = None) -> tuple:
        """(stats markdown, near-duplicate gallery); ``threshold`` re-runs dedup first."""
        st = self.index.stats()
        if threshold is not None:
            find_duplicates(self.index, float(threshold))
        dup = load_duplicates(self.index.dir)
        recall = st["recall_at_10"]
        text = [
            f"**{st['vectors']} images** searchable · {st['error']} unreadable · {st['pending']} pending",
            f"**Index:** {st['kind']} ({st['factory'] or 'faiss'}, {st['params'] or 'exact'}) · measured "
            f"recall@10 {recall if recall is not None else 'n/a'} · {'GPU' if st['on_gpu'] else 'CPU'} · "
            f"{st['size_on_disk_bytes'] / 1e6:.1f} MB on disk",
            f"**Backbone:** {st['backbone_arch']} · sha256 `{str(st['backbone_sha256'])[:12]}…` · {st['dim']}-d",
            f"**Collection:** `{display_path(st['root'])}` · updated {st['updated']}",
        ]
        gallery = []
        if dup is None:
            text.append("_No near-duplicate search yet: press the button below._")
        else:
            groups = dup["groups"]
            text.append(f"**{len(groups)} near-duplicate groups** at cosine ≥ {dup['threshold']} ({dup['created']}), "
                        "largest first:")  # fmt: skip
            text.extend(f"- group {g} ({group['size']}): " + ", ".join(f"`{display_path(m['path'])}`"
                                                                     for m in group["members"])
                        for g, group in enumerate(groups[:50], 1))  # fmt: skip
            for g, group in enumerate(groups[:50], 1):
                for m in group["members"]:
                    row = self.index.catalog.row_by_path(m["path"])
                    if row is not None and row.thumb:
                        gallery.append((str(self.index.thumb_path(row)), f"group {g} · {display_path(m['path'])}"))
        return "\n\n".join(text), gallery


def build_ui(app: SearchApp) -> Any:
    """The Gradio Blocks of the three tabs."""
    import gradio as gr

    sources = ["upload", "clipboard", "webcam"]
    with gr.Blocks(title="moco-retrieval", analytics_enabled=False) as demo:
        gr.Markdown(f"## moco-retrieval · `{app.index.dir.name}` · {len(app.index)} images")
        with gr.Tab("Search"):
            with gr.Row():
                with gr.Column(scale=1):
                    query = gr.Image(type="filepath", image_mode=None, sources=sources, label="Query photo",
                                     elem_id="query")
                    k = gr.Slider(1, 100, value=12, step=1, label="k (results)", elem_id="k")
                    folder = gr.Dropdown([""] + app.folders(), value="", allow_custom_value=True,
                                         label="Only in sub-folder (optional)", elem_id="folder")  # fmt: skip
                    go = gr.Button("Search", variant="primary", elem_id="search-btn")
                with gr.Column(scale=3):
                    info = gr.Markdown("Upload a photo and press Search.", elem_id="search-info")
                    gallery = gr.Gallery(label="Nearest neighbours (click one to search with it)", columns=6,
                                         height="auto", allow_preview=False, elem_id="results")  # fmt: skip
                    more = gr.Button("More results", elem_id="more-btn")
            state = gr.State(None)
            search_fn = _safe(3, 1)(app.search)
            more_fn = _safe(3, 1)(app.more)

            def on_select(st: dict[str, Any] | None, evt: gr.SelectData) -> tuple:
                return _safe(3, 1)(app.select)(st, evt.index)

            on_select.__annotations__["evt"] = gr.SelectData  # resolvable without `from __future__` strings

            go.click(search_fn, [query, k, folder], [gallery, info, state], api_name="search",
                     concurrency_id="model")  # fmt: skip
            more.click(more_fn, [state], [gallery, info, state], api_name="more", concurrency_id="model")
            gallery.select(on_select, [state], [gallery, info, state], api_name=False, concurrency_id="model")
        with gr.Tab("Negatives"):
            gr.Markdown("The InfoNCE view: the two training views of a photo, and the negatives closest to its "
                        "query embedding, with their logits and share of the softmax over [positive + negatives].")
            with gr.Row():
                with gr.Column(scale=1):
                    neg_image = gr.Image(type="filepath", image_mode=None, sources=sources, label="Photo",
                                         elem_id="neg-query")
                    n = gr.Slider(1, 64, value=12, step=1, label="closest negatives to show")
                    seed = gr.Number(0, precision=0, label="augmentation seed")
                    neg_go = gr.Button("Inspect negatives", variant="primary", elem_id="neg-btn")
                with gr.Column(scale=3):
                    views = gr.Gallery(label="query view · positive key view", columns=2, height=220,
                                       allow_preview=False)  # fmt: skip
                    summary = gr.Markdown(elem_id="neg-summary")
                    negs = gr.Gallery(label="closest negatives (⚠ = at or above the positive)", columns=6,
                                      height="auto", allow_preview=False, elem_id="negatives")  # fmt: skip
                    table = gr.Dataframe(headers=["rank", "path", "cosine", "logit (cos/T)", "softmax share", "flag"],
                                         interactive=False, wrap=True)  # fmt: skip
            neg_go.click(_safe(4, 1)(app.negatives), [neg_image, n, seed], [views, summary, negs, table],
                         api_name="negatives", concurrency_id="model")  # fmt: skip
        with gr.Tab("Collection"):
            stats = gr.Markdown(elem_id="collection-stats")
            dups = gr.Gallery(label="near-duplicate groups", columns=8, height="auto", allow_preview=False)
            with gr.Row():
                threshold = gr.Slider(0.5, 1.0, value=DEDUP_THRESHOLD, step=0.005,
                                      label="near-duplicate threshold (centred cosine)")
                dedup = gr.Button("Find near-duplicates")
            collection_fn = _safe(2, 0)(app.collection)
            demo.load(collection_fn, None, [stats, dups], api_name="collection")
            dedup.click(collection_fn, [threshold], [stats, dups], api_name="dedup", concurrency_id="model")
    return demo


def _blocked_paths(index: ImageIndex) -> list[str]:
    """What the file route must refuse: the index's own files and the collection's originals.

    Blocked paths win over allowed ones in Gradio, so when the index lives inside the photo folder
    (``PHOTOS/.index``) the root itself cannot be blocked: every entry beside the path from the root
    down to ``thumbs/`` is blocked instead (files added later are not allowed either: only ``thumbs/`` is).
    """
    blocked = [str(index.dir / name) for name in (CATALOG_FILE, INDEX_FILE, META_FILE, DEDUP_FILE)]
    blocked += [str(index.dir / f"{CATALOG_FILE}-wal"), str(index.dir / f"{CATALOG_FILE}-shm")]
    root, thumbs = index.root.resolve(), (index.dir / THUMBS_DIR).resolve()
    if root not in thumbs.parents:
        return [*blocked, str(root)]
    here = root
    for part in thumbs.relative_to(root).parts:
        blocked += [str(entry) for entry in here.iterdir() if entry.name != part]
        here = here / part
    return blocked


def launch_kwargs(index: ImageIndex, host: str, port: int, auth: tuple[str, str] | None) -> dict[str, Any]:
    """``demo.launch`` settings: only thumbs/ is served; the catalog, index files and originals never are.

    With ``auth``, failed logins are throttled per client address (:mod:`app.throttle`).
    """
    from starlette.middleware import Middleware

    from app.throttle import LoginThrottleMiddleware

    return {"server_name": host, "server_port": port, "auth": auth, "allowed_paths": [str(index.dir / THUMBS_DIR)],
            "blocked_paths": _blocked_paths(index), "max_file_size": MAX_UPLOAD, "show_error": False, "quiet": True,
            "footer_links": ["api"], "app_kwargs": {"middleware": [Middleware(LoginThrottleMiddleware)]}}  # fmt: skip


def make_demo(index_dir: str | Path, checkpoint: str | Path | None = None, backbone: str | Path | None = None,
              device: str = "auto") -> tuple[Any, SearchApp]:  # fmt: skip
    """Open the index, load its backbone (sha-checked) and build the queued Blocks."""
    import torch

    index = ImageIndex.open(index_dir)
    app = SearchApp(index, index.load_embedder(backbone, device=device), checkpoint)
    demo = build_ui(app)
    gpus = torch.cuda.device_count()
    demo.queue(default_concurrency_limit=max(1, gpus) if gpus else 1, max_size=256)  # one search per device
    return demo, app


def serve(index_dir: str | Path, checkpoint: str | Path | None = None, host: str = "127.0.0.1", port: int = 7860,
          auth: tuple[str, str] | None = None, backbone: str | Path | None = None, device: str = "auto",
          block: bool = True) -> Any:  # fmt: skip
    """Launch the UI; returns the running Blocks when ``block`` is False."""
    logging.getLogger("httpx").setLevel(logging.WARNING)
    demo, app = make_demo(index_dir, checkpoint, backbone, device)
    demo.launch(prevent_thread_lock=not block, **launch_kwargs(app.index, host, port, auth))
    return demo
