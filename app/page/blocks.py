"""The page's Gradio Blocks: the Search, Map, Themes, Browse, Unusual, Negatives, Collection and Status tabs wired to
:class:`app.page.handlers.SearchApp`, one function per tab (``search_tab`` ... ``status_tab``), composed by
:func:`build_ui`. What one tab hands to another (the Search tab's results and details panel, which a photo picked on
the Map, Themes, Browse or Unusual tab opens; the components the Status refresh turns on) travels in one namespace,
``page``.

Every handler is wrapped by ``_safe`` (an error is a message on the page, never a stack trace); the page's Search
goes through the batcher of the searches it shares with the JSON API when there is one
(:mod:`app.search.service`). What the tabs show is built in
:mod:`app.page.views`; :mod:`app.server.launch` launches the page.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

from app.collection.review import PAGE_SIZE
from app.page.handlers import Results, SearchApp
from app.page.map_view import THEME_CARDS_CSS, THEME_CARDS_JS, map_component
from app.page.overview import PAGE, SORTS
from app.page.uploads import QueryImage, size_check_js
from app.page.views import (
    KIND_CHOICES,
    PENDING_HINT,
    negatives_outputs,
    outcome_text,
    ready_hint,
    review_outputs,
    status_outputs,
)
from app.search.scope import FOLDER_MODES, folder_filter
from index.calibrate import DEDUP_THRESHOLD
from index.duplicates.groups import SIMILAR
from index.search.index_dir import THUMBS_DIR
from moco.errors import UserError

__all__ = ["build_ui", "search_tab", "map_tab", "themes_tab", "browse_tab", "unusual_tab", "negatives_tab",
           "collection_tab", "status_tab", "ticking", "CSS", "GRADIO_CACHE_S", "page_js"]

logger = logging.getLogger(__name__)

STATUS_EVERY_S = 2.0  # the Status tab's refresh period
# Gradio's copies of what the page hands out (thumbnails, uploads, exports, originals) live in its own cache:
# every GRADIO_CACHE_S[0] seconds it removes those older than GRADIO_CACHE_S[1], and all of them when it stops.
GRADIO_CACHE_S = (3600, 86400)

CSS = """
/* results: a responsive grid (2-3 columns on a phone), captions in full, no inner scroll box */
.results .grid-wrap, .results .gallery-container { height: auto !important; max-height: none !important;
  overflow: visible !important; }
.results .grid-container { grid-template-columns: repeat(auto-fill, minmax(150px, 1fr)) !important;
  grid-auto-rows: auto !important; height: auto !important; }
@media (max-width: 480px) { .results .grid-container { grid-template-columns: repeat(2, 1fr) !important; } }
.results .thumbnail-item { height: auto !important; aspect-ratio: auto !important; flex-direction: column; }
.results .thumbnail-item img { aspect-ratio: 1 / 1; object-fit: cover; width: 100%; }
.results .caption-label { position: static !important; white-space: normal !important; overflow: visible !important;
  text-overflow: clip !important; overflow-wrap: anywhere; max-width: none !important; font-size: 12px;
  line-height: 1.3; padding: 4px; text-align: left; background: none !important; color: var(--body-text-color); }
#views .grid-wrap, #views .gallery-container { height: auto !important; max-height: none !important;
  overflow: visible !important; min-height: 0 !important; }
#views .grid-container { grid-template-columns: repeat(2, minmax(180px, 240px)) !important; height: auto !important; }
@media (max-width: 480px) { #views .grid-container { grid-template-columns: minmax(180px, 1fr) !important; } }
.dup-group { border: 1px solid var(--border-color-primary); border-radius: 8px; padding: 8px; margin: 8px 0; }
.dup-thumbs { display: grid; grid-template-columns: repeat(auto-fill, minmax(150px, 1fr)); gap: 8px; }
.dup-thumbs figure { margin: 0; } .dup-thumbs img { width: 100%; aspect-ratio: 1 / 1; object-fit: cover; }
.dup-thumbs figcaption { font-size: 12px; overflow-wrap: anywhere; }
.dup-thumbs figure.dup-keep img { outline: 3px solid var(--color-accent); }
.dup-group h4 { margin: 0 0 4px 0; } .dup-why { margin: 0 0 6px 0; font-size: 13px; overflow-wrap: anywhere; }
/* galleries: the label above the first row, not over it */
.results > label.float, #views > label.float { position: static !important; margin-bottom: 4px; }
/* a path in the details panel breaks after a "/", never inside a name (unless one name is wider than the panel) */
#detail-info code { display: inline !important; white-space: normal !important; word-break: normal !important; }
#detail-info code .name { display: inline-block; max-width: 100%; overflow-wrap: anywhere; }
/* the Negatives table: every column in the width (each a share of it), headers and cells wrapped, no inner scroll */
#negatives-table { overflow: visible !important; }
#negatives-table .virtual-table-viewport, #negatives-table .table-wrap { overflow-x: hidden !important; }
#negatives-table .cell-wrap, #negatives-table .text.wrap { white-space: normal !important;
  overflow-wrap: anywhere !important; }
@media (max-width: 480px) {  /* a phone: a smaller proportional font, narrow padding, no column menus */
  #negatives-table .body-cell, #negatives-table th, #negatives-table td { font-size: 12px;
    font-family: var(--font) !important; }
  #negatives-table th { font-size: 10px; font-weight: 600 !important; }
  #negatives-table th * { font-weight: 600 !important; }
  #negatives-table .cell-wrap, #negatives-table .body-cell, #negatives-table th, #negatives-table td {
    padding-left: 1px !important; padding-right: 1px !important; }
  #negatives-table .cell-menu-button { display: none !important; }
}
/* the Status tab's log: lines wrap, no inner scroll box */
.status-log { white-space: pre-wrap !important; overflow-wrap: anywhere; overflow-x: visible !important; }
"""


# After a photo is opened: the focus off the clicked thumbnail, and on a narrow screen (a phone: one column, the
# details panel far below the results) the details scrolled into view once drawn.
SHOW_DETAILS = """() => { if (document.activeElement) document.activeElement.blur();
  const d = document.querySelector('#details');
  if (d && window.innerWidth < 800) setTimeout(() => d.scrollIntoView({block: 'start'}), 50); }"""


# A page built while the index was being made opens at Status; once its load has turned search on, the page goes to
# the Search tab, on the page itself: unless the person picked a tab before that answer came (a slow machine), which
# stays. TAB_WATCH (part of the page's script) notes such a pick: a click of theirs on the tab bar or its overflow.
TAB_WATCH = """document.addEventListener("click", e => {
  const bars = [...document.querySelectorAll("[role=tablist]")].map(t => t.parentElement);
  if (e.isTrusted && bars.some(b => b && b.contains(e.target))) window.mocoTabPicked = true; }, true);"""
TO_SEARCH = """(go) => { window.mocoTabChecked = true;  // (what a test waits for)
  if (!go || window.mocoTabPicked) return;
  const search = [...document.querySelectorAll('[role=tab]')].find(b => b.textContent.trim() === 'Search');
  if (search) search.click(); }"""


def page_js() -> str:
    """The page's own script, run once it is drawn: the upload size check and the watch on tab picks."""
    return f"() => {{ ({size_check_js()})();\n{TAB_WATCH} }}"


def _error_text(e: BaseException) -> str:
    if isinstance(e, UserError):
        logger.warning("%s", e)  # one line in the server log, no traceback: the page says the same
        return f"**Error:** {e}"
    logger.exception("handler failed")
    return f"**Error:** {type(e).__name__}: {e}. The server is still running; details are in its log."


def _safe(n_outputs: int, message_at: int) -> Callable:
    """Turn any exception into a readable message in output ``message_at`` (never a stack trace).

    The other outputs are left as they are (``gr.skip()``), so an error never wipes the results shown, nor
    their heading: the Search tab's errors have a place of their own.
    """

    def failed(e: Exception) -> tuple:
        out: list[Any] = [_skip()] * n_outputs
        out[message_at] = _error_text(e)
        return tuple(out)

    def wrap(fn: Callable) -> Callable:
        if inspect.iscoroutinefunction(fn):  # the batched Search: Gradio awaits it on its event loop

            @functools.wraps(fn)
            async def async_inner(*args: Any, **kwargs: Any) -> Any:
                try:
                    return await fn(*args, **kwargs)
                except Exception as e:  # noqa: BLE001 - shown on the page, logged (UserError: one line)
                    return failed(e)

            async_inner.n_outputs = n_outputs  # type: ignore[attr-defined]  # checked against the event's outputs
            return async_inner

        @functools.wraps(fn)
        def inner(*args: Any, **kwargs: Any) -> Any:
            try:
                return fn(*args, **kwargs)
            except Exception as e:  # noqa: BLE001 - shown on the page, logged (UserError: one line)
                return failed(e)

        inner.n_outputs = n_outputs  # type: ignore[attr-defined]  # checked against the event's outputs
        return inner

    return wrap


def _file_urls(gallery: list[tuple[str | None, str]], request: Any) -> list[tuple[str | None, str]]:
    """Gallery items with their thumbnails as absolute URLs of Gradio's file route (what the browser is sent anyway).

    Gradio passes an http URL through as it is, where a path is resolved against every static path on every
    search (two ``realpath`` calls per file and path: 12 ms of a page search's 43 ms of server CPU). The file route
    still checks each thumbnail when the browser fetches it (allowed paths, login). Without a request (a direct
    call) and for Gradio's own API clients (``gradio_client`` and MCP mark their requests with ``x-gradio-user``;
    they download a path through the file route, not a URL), the paths are kept.
    """
    from gradio import route_utils
    from gradio_client.utils import encode_file_path

    req = getattr(request, "request", None)
    if req is None or req.headers.get("x-gradio-user"):
        return gallery
    try:
        root = route_utils.get_root_url(request=req, route_path=route_utils.get_api_call_path(request=req),
                                        root_path=getattr(req.app, "root_path", None) or None)
    except ValueError:  # not an event's request (Gradio knows no root for it): the paths, checked as before
        return gallery
    return [(f"{root}/gradio_api/file={encode_file_path(t)}" if t else t, caption) for t, caption in gallery]


def _paths(files: Any) -> list[str]:
    """The paths of a ``gr.File(file_count="multiple")``'s files (Gradio gives paths, or file objects with a name)."""
    if not files:
        return []
    return [str(getattr(f, "name", None) or getattr(f, "path", None) or f) for f in files]


def _skip() -> Any:
    try:
        import gradio as gr
    except ModuleNotFoundError:
        return None
    return gr.skip()


def build_ui(app: SearchApp, service: Any = None) -> Any:
    """The Gradio Blocks of the tabs. With ``service`` (an :class:`app.search.service.SearchService`, the JSON API's),
    Search goes through its batcher: uploads decoded in its pool and embedded together, the page's and the API's
    alike."""
    import gradio as gr

    ready = app.ready
    gr.set_static_paths([str(app.files_dir)])  # result files served as they are: no check, hash and copy per search
    with gr.Blocks(title="moco-retrieval", analytics_enabled=False, delete_cache=GRADIO_CACHE_S) as demo:
        title = gr.Markdown(app.title(), elem_id="title")
        with gr.Tabs(selected="search" if ready else "status") as tabs:
            page = SimpleNamespace(ready=ready, tabs=tabs, title=title)  # what one tab hands to the others
            search_tab(app, service, page)
            map_tab(app, page)
            themes_tab(page)
            browse_tab(app, page)
            unusual_tab(app, page)
            negatives_tab(app, page)
            collection_tab(app, demo, page)
            status_tab(page)
        _refresh(app, demo, page)
    return demo


def search_tab(app: SearchApp, service: Any, page: SimpleNamespace) -> None:
    """The Search tab: the query, the filters, the results, More, the exports, "more like these", the details panel;
    and the opening of a photo picked on another tab (``page.open_photo``, ``page.wire_gallery``)."""
    import gradio as gr

    from app.page import inputs

    ready, tabs = page.ready, page.tabs
    sources = ["upload", "clipboard", "webcam"]
    with gr.Tab("Search", id="search"):
        with gr.Row():
            with gr.Column(scale=1, min_width=280):
                query = QueryImage(sources=sources, label="Query photo", elem_id="query")
                k = inputs.Slider(1, 100, value=12, step=1, label="k (results)", elem_id="k")
                folder = inputs.Dropdown(app.folder_choices(), value="", allow_custom_value=True,
                                     label="Folder", elem_id="folder")
                folder_mode = inputs.Radio(list(FOLDER_MODES), value=FOLDER_MODES[0], show_label=False,
                                       elem_id="folder-mode")
                with gr.Row():
                    taken_from = gr.Textbox("", label="Taken from", placeholder="YYYY-MM-DD", max_lines=1,
                                            elem_id="taken-from")
                    taken_to = gr.Textbox("", label="Taken to", placeholder="YYYY-MM-DD", max_lines=1,
                                          elem_id="taken-to")
                go = gr.Button("Search", variant="primary", elem_id="search-btn", interactive=False)
            with gr.Column(scale=3, min_width=300):
                error = gr.Markdown(elem_id="search-error")  # what went wrong, apart from the results
                info = gr.Markdown(ready_hint(app) if ready else PENDING_HINT, elem_id="search-info")
                gallery = inputs.Gallery(label="Nearest neighbours (click one to search with it)", columns=6,
                                     height="auto", allow_preview=False, elem_id="results",
                                     elem_classes=["results"])
                with gr.Row():
                    more = gr.Button("More results", elem_id="more-btn", interactive=False)
                    csv_btn = gr.DownloadButton("Export CSV", elem_id="export-csv", interactive=False)
                    json_btn = gr.DownloadButton("Export JSON", elem_id="export-json", interactive=False)
                with gr.Accordion("More like these, less like those", open=True, elem_id="multi"):
                    more_like = inputs.CheckboxGroup([], label="More like these (tick results)",
                                                 elem_id="more-like")
                    less_like = inputs.CheckboxGroup([], label="Less like these", elem_id="less-like")
                    with gr.Row():
                        add_photos = inputs.File(file_count="multiple", file_types=["image"], height=120,
                                             label="More photos to search with", elem_id="add-photos")
                        avoid_photos = inputs.File(file_count="multiple", file_types=["image"], height=120,
                                               label="Photos to be less like", elem_id="avoid-photos")
                    again = gr.Button("Search again with these", elem_id="again-btn", interactive=False)
                with gr.Column(visible=False, elem_id="details") as details:
                    gr.Markdown("### Selected photo")
                    with gr.Row():
                        preview = gr.Image(label="Preview", height=320, interactive=False,
                                           elem_id="detail-preview", buttons=[])
                        with gr.Column():
                            detail_md = gr.Markdown(elem_id="detail-info")
                            path_box = gr.Textbox(label="Full path", interactive=False, buttons=["copy"],
                                                  max_lines=1, elem_id="detail-path")  # one line: whole names
                            with gr.Row():
                                open_btn = gr.Button("Open original", elem_id="open-original")
                                inspect_btn = gr.Button("Inspect negatives", elem_id="inspect-btn")
                            original = inputs.File(label="Original", visible=False, elem_id="original-file")
        state = gr.State(None)
        picked = gr.State(None)  # the id of the photo in the details panel
        has_image = gr.State(False)  # a query photo is given (Search can act)

        def export_buttons(st: Results | None) -> tuple:  # on only with results to export
            files = app.export(st) if st and st.ids else (None, None)
            return tuple(gr.update(value=f, interactive=f is not None) for f in files)  # no new components

        def filters(folder_: str, mode_: str | None, from_: str | None, to_: str | None) -> dict[str, Any]:
            only, away = folder_filter(folder_, mode_)
            return {"folder": only, "exclude_folders": away, "taken_from": from_, "taken_to": to_}

        # the filters have defaults: Gradio's own API clients that send (image, k, folder) still search
        def do_search(image: Any, k_: int, folder_: str, mode_: str | None = None, from_: str | None = None,
                      to_: str | None = None, request: gr.Request = None) -> tuple:
            gal, *out = app.search(image, k_, **filters(folder_, mode_, from_, to_))
            return (_file_urls(gal, request), *out, *export_buttons(out[1]), "")

        async def do_batched_search(image: Any, k_: int, folder_: str, mode_: str | None = None,
                                    from_: str | None = None, to_: str | None = None,
                                    request: gr.Request = None) -> tuple:
            gal, *out = await app.search_with(service, image, k_, **filters(folder_, mode_, from_, to_))
            buttons = await asyncio.to_thread(export_buttons, out[1])  # file writes: off the event loop
            return (_file_urls(gal, request), *out, *buttons, "")

        def do_rerun(st: Results | None, k_: int, folder_: str, mode_: str, from_: str, to_: str,
                     request: gr.Request) -> tuple:
            if not st:
                return (gr.skip(),) * 6
            gal, *out = app.rerun(st, k_, **filters(folder_, mode_, from_, to_))
            return (_file_urls(gal, request), *out, *export_buttons(out[1]), "")

        def do_more(st: Results | None, request: gr.Request) -> tuple:
            gal, *out = app.more(st)
            return (_file_urls(gal, request), *out, *export_buttons(out[1]), "")

        def do_select(st: Results | None, evt: gr.SelectData, request: gr.Request) -> tuple:
            out = app.select(st, evt.index)
            d = app.details(out[2].source["id"])
            return (gr.Gallery(value=_file_urls(out[0], request), selected_index=None), out[1], out[2],
                    *export_buttons(out[2]), "",
                    d["thumb"], gr.Column(visible=True), d["preview"], d["markdown"], d["full_path"], d["id"],
                    gr.File(value=None, visible=False))

        def do_again(st: Results | None, more_: list[int] | None, less_: list[int] | None, add_: Any,
                     avoid_: Any, k_: int, folder_: str, mode_: str, from_: str, to_: str,
                     request: gr.Request) -> tuple:
            gal, *out = app.search_again(st, more_ or [], less_ or [], _paths(add_), _paths(avoid_), k_,
                                         **filters(folder_, mode_, from_, to_))
            return (_file_urls(gal, request), *out, *export_buttons(out[1]), "")

        def do_ticks(st: Results | None, more_: list[int] | None, less_: list[int] | None) -> tuple:
            choices = app.tick_choices(st)  # the results shown; a tick stays while its photo is shown
            shown = {i for _, i in choices}
            return (gr.CheckboxGroup(choices=choices, value=[i for i in more_ or [] if i in shown]),
                    gr.CheckboxGroup(choices=choices, value=[i for i in less_ or [] if i in shown]), gr.skip())

        for fn in (do_search, do_batched_search, do_rerun, do_more, do_select, do_again):  # resolvable without
            fn.__annotations__["request"] = gr.Request  # `from __future__` strings
        do_select.__annotations__["evt"] = gr.SelectData
        # an error goes to `error`: the results shown stay, and so does their heading (`info`)
        results = [gallery, info, state, csv_btn, json_btn, error]
        search_inputs = [k, folder, folder_mode, taken_from, taken_to]
        def do_buttons(st: Results | None, image: bool, more_: list[int] | None, less_: list[int] | None,
                       add_: Any, avoid_: Any) -> tuple:  # each of them on exactly when it can act
            on = app.search_buttons(st, True if image else None, more_ or [], less_ or [], _paths(add_),
                                    _paths(avoid_))
            return tuple(gr.Button(interactive=x) for x in on)

        buttons = ([state, has_image, more_like, less_like, add_photos, avoid_photos], [go, more, again])
        query.change(lambda img: img is not None, [query], [has_image], api_name=False, queue=False,
                     show_progress="hidden").then(do_buttons, *buttons, api_name=False, queue=False,
                                                  show_progress="hidden")
        for source in (more_like, less_like, add_photos, avoid_photos):
            source.change(do_buttons, *buttons, api_name=False, queue=False, show_progress="hidden")

        def do_ticks_then_buttons(st: Results | None, more_: list[int] | None, less_: list[int] | None,
                                  image: bool, add_: Any, avoid_: Any) -> tuple:
            ticked = do_ticks(st, more_, less_)
            shown = {c for _, c in app.tick_choices(st)}
            ticks_now = [[i for i in x or [] if i in shown] for x in (more_, less_)]
            return (*ticked, *do_buttons(st, image, *ticks_now, add_, avoid_))

        # after every search: the results shown, to tick, and the buttons that can act on them
        ticks = _safe(6, 2)(do_ticks_then_buttons)
        tick_io = ([state, more_like, less_like, has_image, add_photos, avoid_photos],
                   [more_like, less_like, error, go, more, again])
        if service is None:
            go.click(_safe(6, 5)(do_search), [query, *search_inputs], results, api_name="search",
                     concurrency_id="model").then(ticks, *tick_io, api_name=False)
        else:  # searches run together (the batcher holds the model); more wait in Gradio's queue
            go.click(_safe(6, 5)(do_batched_search), [query, *search_inputs], results, api_name="search",
                     concurrency_id="search", concurrency_limit=service.batcher.max_batch).then(
                ticks, *tick_io, api_name=False)
        for changed in (k.release, folder.input, folder_mode.input, taken_from.submit, taken_to.submit):
            changed(_safe(6, 5)(do_rerun), [state, *search_inputs], results, api_name=False,
                    concurrency_id="model").then(ticks, *tick_io, api_name=False)
        more.click(_safe(6, 5)(do_more), [state], results, api_name="more", concurrency_id="model").then(
            ticks, *tick_io, api_name=False)
        again.click(_safe(6, 5)(do_again), [state, more_like, less_like, add_photos, avoid_photos,
                                            *search_inputs], results, api_name="search_again",
                    concurrency_id="model").then(ticks, *tick_io, api_name=False)
        gallery.select(_safe(13, 5)(do_select), [state],
                       [*results, query, details, preview, detail_md, path_box, picked, original],
                       api_name=False, concurrency_id="model").then(
            None, None, None, js=SHOW_DETAILS).then(
            ticks, *tick_io, api_name=False)

        def do_open(image_id: int | None) -> Any:
            if image_id is None:
                raise UserError("click a result first")
            return gr.File(value=app.original(image_id), visible=True)

        open_btn.click(_safe(2, 1)(lambda i: (do_open(i), gr.skip())), [picked], [original, detail_md],
                       api_name=False).then(
            None, [original], None, js="(f) => { if (f && f.url) window.open(f.url, '_blank'); }")
    # ------------------------------------------------- the whole collection: Map, Themes, Browse, Unusual
    # A photo picked on one of them is searched with and shown in the Search tab, as a clicked result is.
    opened = [*results, query, details, preview, detail_md, path_box, picked, original, tabs]

    def open_photo(image_id: int, k_: int, folder_: str, mode_: str | None, from_: str | None,
                   to_: str | None, request: gr.Request) -> tuple:  # opened + the tab's message ("")
        gal, text, st = app.search_id(int(image_id), k_, **filters(folder_, mode_, from_, to_))
        d = app.details(int(image_id))
        return (_file_urls(gal, request), text, st, *export_buttons(st), "", d["thumb"],
                gr.Column(visible=True), d["preview"], d["markdown"], d["full_path"], d["id"],
                gr.File(value=None, visible=False), gr.Tabs(selected="search"), "")

    def open_shown(ids: list[int] | None, k_: int, folder_: str, mode_: str | None, from_: str | None,
                   to_: str | None, evt: gr.SelectData, request: gr.Request) -> tuple:
        if not ids or not 0 <= int(evt.index) < len(ids):
            raise UserError("that photo is no longer shown: load the page again")
        return open_photo(ids[int(evt.index)], k_, folder_, mode_, from_, to_, request)

    for fn in (open_photo, open_shown):
        fn.__annotations__["request"] = gr.Request
    open_shown.__annotations__["evt"] = gr.SelectData
    n_open = len(opened) + 1

    def wire_gallery(shown: Any, ids: Any, message: Any) -> None:  # a click on a photo searches with it
        shown.select(_safe(n_open, n_open - 1)(open_shown), [ids, *search_inputs], [*opened, message],
                     api_name=False, concurrency_id="model").then(
            None, None, None, js=SHOW_DETAILS)

    page.__dict__.update(query=query, k=k, folder=folder, info=info, picked=picked, inspect_btn=inspect_btn,
                         results=results, search_inputs=search_inputs, buttons=buttons, do_buttons=do_buttons,
                         filters=filters, export_buttons=export_buttons, opened=opened, n_open=n_open,
                         open_shown=open_shown, open_photo=open_photo, wire_gallery=wire_gallery, sources=sources)


def map_tab(app: SearchApp, page: SimpleNamespace) -> None:
    """The Map tab: every photo a point; a click searches with it, a box or a lasso shows the photos inside."""
    import gradio as gr
    from gradio_client.utils import encode_file_path

    from app.page import inputs

    search_inputs, opened, n_open, open_photo = page.search_inputs, page.opened, page.n_open, page.open_photo
    wire_gallery = page.wire_gallery
    with gr.Tab("Map", id="map") as tab:
        map_info = gr.Markdown(elem_id="map-info")
        cmap = map_component(elem_id="collection-map")
        map_message = gr.Markdown(elem_id="map-message")  # what went wrong, apart from the selection
        chosen_info = gr.Markdown(elem_id="map-selection-info")
        chosen = inputs.Gallery(label="Selected photos (click one to search with it)", columns=6, height="auto",
                            allow_preview=False, elem_id="map-selection", elem_classes=["results"])
        chosen_ids = gr.State([])
        map_shown = gr.State("")  # the map's version this page holds: not sent again while it is current

    def do_map(shown: str) -> tuple:
        index = app.ready_index()
        thumbs = f"gradio_api/file={encode_file_path(str(index.dir / THUMBS_DIR))}/"
        payload = app.overview.map(thumbs)
        if payload["version"] == shown:
            return gr.skip(), gr.skip(), shown
        return payload, app.overview.map_text(), payload["version"]

    def do_pick(k_: int, folder_: str, mode_: str | None, from_: str | None, to_: str | None,
                evt: gr.EventData, request: gr.Request) -> tuple:
        data = evt._data if isinstance(getattr(evt, "_data", None), dict) else {}
        if not isinstance(data.get("id"), int):
            raise UserError("click a point of the map")
        return open_photo(data["id"], k_, folder_, mode_, from_, to_, request)

    def do_region(evt: gr.EventData, request: gr.Request) -> tuple:
        data = evt._data if isinstance(getattr(evt, "_data", None), dict) else {}
        ids, total = app.overview.region(str(data.get("shape")), data.get("points") or [],
                                         version=str(data.get("version")))
        text = (f"**{total} photos selected**" + (f" (the first {len(ids)} shown)" if total > len(ids) else "")
                if total else "**No photos in the selection**: draw around some points.")
        return _file_urls(app.overview.gallery(ids), request), ids, text, ""

    for fn in (do_pick, do_region):
        fn.__annotations__["request"] = gr.Request
    do_pick.__annotations__["evt"] = gr.EventData
    do_region.__annotations__["evt"] = gr.EventData
    tab.select(_safe(3, 1)(do_map), [map_shown], [cmap, map_info, map_shown], api_name=False,
               concurrency_id="overview")
    cmap.pick(_safe(n_open, n_open - 1)(do_pick), search_inputs, [*opened, map_message], api_name=False,
              concurrency_id="model")
    cmap.region(_safe(4, 3)(do_region), None, [chosen, chosen_ids, chosen_info, map_message], api_name=False,
                concurrency_id="overview")
    wire_gallery(chosen, chosen_ids, map_message)


def themes_tab(page: SimpleNamespace) -> None:
    """The Themes tab: the collection's themes as cards; its events are :func:`browse_tab`'s, whose grid a card
    opens."""
    import gradio as gr

    with gr.Tab("Themes", id="themes") as tab:
        themes_message = gr.Markdown(elem_id="themes-message")
        theme_cards = gr.HTML(elem_id="theme-cards", js_on_load=THEME_CARDS_JS, css_template=THEME_CARDS_CSS)
    page.__dict__.update(themes=tab, themes_message=themes_message, theme_cards=theme_cards)


def browse_tab(app: SearchApp, page: SimpleNamespace) -> None:
    """The Browse tab: a page of the collection's grid by folder, theme and order; and the Themes tab's events (a
    card opens its theme here)."""
    import gradio as gr

    from app.page import inputs

    themes, themes_message, theme_cards = page.themes, page.themes_message, page.theme_cards
    tabs, wire_gallery = page.tabs, page.wire_gallery
    with gr.Tab("Browse", id="browse") as tab:
        with gr.Row():
            browse_folder = inputs.Dropdown(app.folder_choices(), value="", label="Folder",
                                            elem_id="browse-folder")
            browse_theme = inputs.Dropdown([("All themes", -1)], value=-1, label="Theme",
                                           elem_id="browse-theme")
            browse_sort = inputs.Radio(list(SORTS), value=next(iter(SORTS)), label="Sort by",
                                   elem_id="browse-sort")
        with gr.Row():
            browse_prev = gr.Button("◀ Previous", elem_id="browse-prev", scale=0)
            browse_where = gr.Markdown(elem_id="browse-where")
            browse_next = gr.Button("Next ▶", elem_id="browse-next", scale=0)
        browse_message = gr.Markdown(elem_id="browse-message")
        browse_grid = inputs.Gallery(label="Photos (click one to search with it)", columns=6, height="auto",
                                 allow_preview=False, elem_id="browse-grid", elem_classes=["results"])
        browse_ids, browse_offset = gr.State([]), gr.State(0)
    def theme_choices(choices: list[tuple[str, int]]) -> list[tuple[str, int]]:
        return [("All themes", -1), *choices]

    def do_themes() -> tuple:
        cards, choices = app.overview.themes()
        return cards, gr.update(choices=theme_choices(choices)), ""

    themes.select(_safe(3, 2)(do_themes), None, [theme_cards, browse_theme, themes_message],
                  api_name=False, concurrency_id="overview")
    browse_view = [browse_grid, browse_ids, browse_where, browse_offset, browse_message]

    def do_browse(folder_: str, theme_: int | None, sort_: str, offset_: int, request: gr.Request) -> tuple:
        theme_ = None if theme_ is None or int(theme_) < 0 else int(theme_)
        gal, ids, where, offset_ = app.overview.browse(app.folder_on_disk(folder_), theme_,
                                                       SORTS.get(sort_, "name"), offset_)
        return _file_urls(gal, request), ids, where, offset_, ""

    def do_theme_card(evt: gr.EventData, request: gr.Request) -> tuple:
        data = evt._data if isinstance(getattr(evt, "_data", None), dict) else {}
        if not isinstance(data.get("id"), int):
            raise UserError("click a theme")
        _, choices = app.overview.themes()
        return (*do_browse("", data["id"], next(iter(SORTS)), 0, request),
                gr.update(choices=theme_choices(choices), value=data["id"]), gr.update(value=""),
                gr.Tabs(selected="browse"), "")

    def browse_step(step: int) -> Callable:  # the Previous / Next buttons
        def show(f_: str, t_: int | None, s_: str, o_: int, request: gr.Request) -> tuple:
            return do_browse(f_, t_, s_, max(0, int(o_ or 0) + step), request)

        show.__annotations__["request"] = gr.Request
        return show

    def browse_first(f_: str, t_: int | None, s_: str, request: gr.Request) -> tuple:  # a filter changed
        return do_browse(f_, t_, s_, 0, request)

    for fn in (do_browse, do_theme_card, browse_first):
        fn.__annotations__["request"] = gr.Request
    do_theme_card.__annotations__["evt"] = gr.EventData
    browse_filters = [browse_folder, browse_theme, browse_sort]
    theme_cards.theme(_safe(9, 8)(do_theme_card), None,
                      [*browse_view, browse_theme, browse_folder, tabs, themes_message], api_name=False,
                      concurrency_id="overview")
    def browse_opened(f_: str, t_: int | None, s_: str, o_: int, request: gr.Request) -> tuple:
        _, choices = app.overview.themes()  # the theme filter's choices, also before the Themes tab
        return (*do_browse(f_, t_, s_, o_, request), gr.update(choices=theme_choices(choices)))

    browse_opened.__annotations__["request"] = gr.Request
    tab.select(_safe(6, 4)(browse_opened), [*browse_filters, browse_offset],
               [*browse_view, browse_theme], api_name=False, concurrency_id="overview")
    for changed in (browse_folder.input, browse_theme.input, browse_sort.input):
        changed(_safe(5, 4)(browse_first), browse_filters, browse_view, api_name=False,
                concurrency_id="overview")
    for button, step in ((browse_prev, -PAGE), (browse_next, PAGE)):
        button.click(_safe(5, 4)(browse_step(step)), [*browse_filters, browse_offset], browse_view,
                     api_name=False, concurrency_id="overview")
    wire_gallery(browse_grid, browse_ids, browse_message)


def unusual_tab(app: SearchApp, page: SimpleNamespace) -> None:
    """The Unusual tab: the photos least like any other, a page at a time."""
    import gradio as gr

    from app.page import inputs

    wire_gallery = page.wire_gallery
    with gr.Tab("Unusual", id="unusual") as tab:
        with gr.Row():
            unusual_prev = gr.Button("◀ Previous", elem_id="unusual-prev", scale=0)
            unusual_where = gr.Markdown(elem_id="unusual-where")
            unusual_next = gr.Button("Next ▶", elem_id="unusual-next", scale=0)
        unusual_message = gr.Markdown(elem_id="unusual-message")
        unusual_grid = inputs.Gallery(label="The photos least like any other (click one to search with it)",
                                  columns=6, height="auto", allow_preview=False, elem_id="unusual-grid",
                                  elem_classes=["results"])
        unusual_ids, unusual_offset = gr.State([]), gr.State(0)
    unusual_view = [unusual_grid, unusual_ids, unusual_where, unusual_offset, unusual_message]

    def unusual_step(step: int) -> Callable:  # the tab opened (0), Previous, Next
        def show(o_: int, request: gr.Request) -> tuple:
            gal, ids, where, shown = app.overview.unusual(max(0, int(o_ or 0) + step))
            return _file_urls(gal, request), ids, where, shown, ""

        show.__annotations__["request"] = gr.Request
        return show

    tab.select(_safe(5, 4)(unusual_step(0)), [unusual_offset], unusual_view, api_name=False,
               concurrency_id="overview")
    for button, step in ((unusual_prev, -PAGE), (unusual_next, PAGE)):
        button.click(_safe(5, 4)(unusual_step(step)), [unusual_offset], unusual_view, api_name=False,
                     concurrency_id="overview")
    wire_gallery(unusual_grid, unusual_ids, unusual_message)


def negatives_tab(app: SearchApp, page: SimpleNamespace) -> None:
    """The Negatives tab: the InfoNCE view of an upload, or of the photo in the Search tab's details panel."""
    import gradio as gr

    from app.page import inputs

    ready, sources, tabs, picked, inspect_btn = page.ready, page.sources, page.tabs, page.picked, page.inspect_btn
    with gr.Tab("Negatives", id="negatives"):
        gr.Markdown("The InfoNCE view: the two training views of a photo, and the negatives closest to its "
                    "query embedding, with their logits and share of the softmax over [positive + negatives]. "
                    "⚠ marks a likely false negative, with its evidence.")
        with gr.Row():
            with gr.Column(scale=1, min_width=280):
                neg_image = QueryImage(sources=sources, label="Photo", elem_id="neg-query")
                n = inputs.Slider(1, 64, value=12, step=1, label="closest negatives to show")
                seed = inputs.Number(0, precision=0, label="augmentation seed")
                neg_go = gr.Button("Inspect negatives", variant="primary", elem_id="neg-btn", interactive=ready)
            with gr.Column(scale=3, min_width=300):
                summary = gr.Markdown(elem_id="neg-summary")
                views = inputs.Gallery(label="query view · positive key view", columns=2, height="auto",
                                   allow_preview=False, elem_id="views", object_fit="contain")
                negs = inputs.Gallery(label="closest negatives", columns=6, height="auto", allow_preview=False,
                                  elem_id="negatives", elem_classes=["results"])
                table = gr.Dataframe(headers=["rank", "photo", "cosine", "logit (cos/T)", "softmax share",
                                              "likely false negative (evidence)"],
                                     interactive=False, wrap=True, elem_id="negatives-table", max_height=4000,
                                     column_widths=["10%", "25%", "13%", "14%", "16%", "22%"])

        def do_negatives(image: Any, n_: int, seed_: int) -> tuple:
            views_, text, gal, rows = negatives_outputs(app.negatives(image, n_, seed_), app.negatives_note)
            return views_, text, gal, rows

        def do_inspect(image_id: int | None, n_: int, seed_: int) -> tuple:
            if image_id is None:
                raise UserError("click a result first")
            out = negatives_outputs(app.negatives_for(image_id, n_, seed_), app.negatives_note)
            return (*out, gr.Tabs(selected="negatives"))

        neg_go.click(_safe(4, 1)(do_negatives), [neg_image, n, seed], [views, summary, negs, table],
                     api_name="negatives", concurrency_id="model")
        inspect_btn.click(_safe(5, 1)(do_inspect), [picked, n, seed], [views, summary, negs, table, tabs],
                          api_name=False, concurrency_id="model")
    page.neg_go = neg_go


def collection_tab(app: SearchApp, demo: Any, page: SimpleNamespace) -> None:
    """The Collection tab: the index's figures and the review of groups of duplicates, a page at a time."""
    import gradio as gr

    from app.page import inputs

    ready = page.ready
    with gr.Tab("Collection", id="collection"):
        stats = gr.Markdown(elem_id="collection-stats")
        with gr.Row():
            start = app.index.dedup_threshold if ready and app.index is not None else DEDUP_THRESHOLD
            threshold = inputs.Slider(0.5, 1.0, value=start, step=0.005, elem_id="dedup-threshold",
                                  label="near-duplicate threshold (centred cosine)")
            similar = gr.Checkbox(False, label="also similar photos (bursts, the same scene)",
                                  elem_id="dedup-similar")
            dup_away = gr.Textbox("", label="leave out folders (comma-separated)", elem_id="dedup-exclude",
                                  placeholder="e.g. screenshots, 2019/scans")
            dedup = gr.Button("Find duplicates", elem_id="dedup-btn", interactive=ready)
        with gr.Row():
            kind = inputs.Dropdown(list(KIND_CHOICES), value="exact and near", label="Show",
                               elem_id="dup-kind", scale=1)
            prev_btn = gr.Button("◀ Previous", elem_id="dup-prev", scale=0)
            where = gr.Markdown(elem_id="dup-where")
            next_btn = gr.Button("Next ▶", elem_id="dup-next", scale=0)
        dups = gr.HTML(elem_id="dup-groups")
        with gr.Row():
            group = inputs.Dropdown([], label="Group", elem_id="dup-group", scale=1)
            keeper = inputs.Radio([], label="Keep", elem_id="dup-keeper", scale=2)
        with gr.Row():
            keep_btn = gr.Button("Keep the one chosen", elem_id="dup-keep-btn", interactive=False)
            move_btn = gr.Button("Move the others", variant="primary", elem_id="dup-move-btn",
                                 interactive=False)
            not_btn = gr.Button("Not duplicates", elem_id="dup-not-btn", interactive=False)
        with gr.Row():
            bulk_btn = gr.Button("Move the others of every group shown (their keepers stay)",
                                 elem_id="dup-bulk-btn", interactive=False)
            undo_btn = gr.Button("Undo moves", elem_id="dup-undo-btn", interactive=False)
        with gr.Row():
            move_to = gr.Textbox(label="Move to", placeholder="empty: a hidden .moco-duplicates folder in the "
                                 "collection; or a folder outside it", elem_id="dup-move-to", scale=3)
            dry_run = gr.Checkbox(label="Dry run: only say what would move", elem_id="dup-dry-run", scale=1)
        dup_message = gr.Markdown(elem_id="dup-message")
        offset = gr.State(0)
        review = [dups, where, group, keeper, dup_message, offset, undo_btn, move_btn, not_btn, bulk_btn,
                  keep_btn]

        def do_collection(threshold_: float | None = None, similar_: bool = False, kind_: str = "",
                          away_: str = "", offset_: int = 0) -> tuple:
            text, _ = app.collection(threshold_, similar_, away_ or "")
            if threshold_ is not None:  # a new search: its kinds shown
                kind_ = "all kinds" if similar_ else "exact and near"
            elif not kind_:  # a page (re)loaded: the kinds of the saved search, as its counts say
                saved = app.duplicates.saved()
                kind_ = "all kinds" if saved and SIMILAR in (saved.kinds or ()) else "exact and near"
            return (text, gr.update(value=kind_) if kind_ else gr.skip(),
                    *review_outputs(app, kind_, 0 if threshold_ is not None else offset_))

        def do_page(kind_: str, offset_: int, step: int) -> tuple:
            return review_outputs(app, kind_, max(0, offset_ + step * PAGE_SIZE))

        def do_act(action: str, kind_: str, offset_: int, gid: str | None, photo: str | None, dest: str = "",
                   dry: bool = False) -> tuple:
            if action in ("keep", "move", "not") and not gid:
                raise UserError("choose a group first")
            message, keep_gid = "", gid
            if action == "keep":
                if not photo:
                    raise UserError("choose the photo to keep")
                app.duplicates.keep(gid, int(photo))
                message = f"keeping `{app.duplicates.group(gid).keep}` of this group"
            elif action == "move":
                keepers = {gid: int(photo)} if photo else None
                message = outcome_text(app.duplicates.move([gid], keepers=keepers, dry_run=dry, dest=dest))
                keep_gid = gid if dry else None
            elif action == "not":
                group_ = app.duplicates.not_duplicates(gid)
                message = f"group of {group_.size} photos: not duplicates, never grouped again"
                keep_gid = None
            elif action == "bulk":
                message = outcome_text(app.duplicates.move(kinds=KIND_CHOICES[kind_ or "exact and near"],
                                                           dry_run=dry, dest=dest))
            elif action == "undo":
                message = outcome_text(app.duplicates.undo())
            text, _ = app.collection()
            return (text, *review_outputs(app, kind_, offset_, keep_gid, message))

        def do_group(kind_: str, offset_: int, gid: str | None) -> tuple:
            return review_outputs(app, kind_, offset_, gid)

        collection_fn = _safe(13, 6)(do_collection)
        demo.load(lambda: collection_fn() if app.ready else (gr.skip(),) * 13, None,
                  [stats, kind, *review], api_name="collection")
        dedup.click(collection_fn, [threshold, similar, kind, dup_away], [stats, kind, *review],
                    api_name="dedup",
                    concurrency_id="dedup")
        kind.input(_safe(11, 4)(lambda k_: review_outputs(app, k_, 0)), [kind], review, api_name=False)
        prev_btn.click(_safe(11, 4)(lambda k_, o_: do_page(k_, o_, -1)), [kind, offset], review,
                       api_name=False)
        next_btn.click(_safe(11, 4)(lambda k_, o_: do_page(k_, o_, 1)), [kind, offset], review,
                       api_name=False)
        group.input(_safe(11, 4)(do_group), [kind, offset, group], review, api_name=False)

        def do_keeper(gid: str | None, photo: str | None) -> Any:  # Keep: a photo other than the keeper
            current = app.duplicates.group(gid).keep_id if gid else None
            return gr.Button(interactive=photo is not None and current is not None and int(photo) != current)

        keeper.input(_safe(2, 1)(lambda g, p: (do_keeper(g, p), gr.skip())), [group, keeper],
                     [keep_btn, dup_message], api_name=False, queue=False)
        acting = [kind, offset, group, keeper, move_to, dry_run]
        for button, action in ((keep_btn, "keep"), (move_btn, "move"), (not_btn, "not"), (bulk_btn, "bulk"),
                               (undo_btn, "undo")):
            button.click(_safe(12, 5)(functools.partial(do_act, action)), acting, [stats, *review],
                         api_name=False, concurrency_id="dedup")
    page.__dict__.update(stats=stats, dups=dups, threshold=threshold, dedup=dedup)


def status_tab(page: SimpleNamespace) -> None:
    """The Status tab: what ``moco run`` is doing, its loss and kNN curves (refreshed by the page: :func:`_refresh`)."""
    import gradio as gr

    with gr.Tab("Status", id="status"):
        status_md = gr.Markdown(elem_id="status-info")
        loss_plot = gr.LinePlot(x="step", y="value", title="training loss", height=260, elem_id="loss-plot",
                                visible=False)
        knn_plot = gr.LinePlot(x="step", y="value", title="kNN top-1 (val set)", height=220,
                               elem_id="knn-plot", visible=False)
    page.__dict__.update(status_md=status_md, loss_plot=loss_plot, knn_plot=knn_plot)


def ticking(app: SearchApp) -> bool:
    """Whether a page opened now refreshes every :data:`STATUS_EVERY_S`: while something it shows can change (a
    ``moco run``'s status, a watched folder's, an index still to come). A finished index served alone shows the same
    all along: its pages ask nothing more after they load (a tab left open costs the server nothing)."""
    return app.status is not None or app.watcher is not None or not app.ready


def _refresh(app: SearchApp, demo: Any, page: SimpleNamespace) -> None:
    """The page's refresh, at each load and every STATUS_EVERY_S while it is :func:`ticking`: the Status tab, and
    search turned on in every tab once the index is ready."""
    import gradio as gr

    ready, buttons, do_buttons = page.ready, page.buttons, page.do_buttons
    status_md, loss_plot, knn_plot, title = page.status_md, page.loss_plot, page.knn_plot, page.title
    neg_go, dedup, folder, info = page.neg_go, page.dedup, page.folder, page.info
    stats, dups, threshold = page.stats, page.dups, page.threshold
    was_ready = gr.State(ready)
    timer = gr.Timer(STATUS_EVERY_S)
    status_outs = [status_md, loss_plot, knn_plot, title, neg_go, dedup, folder, stats, dups, threshold, info,
                   was_ready]
    buttons_seen = gr.State(ready)  # the Search tab's buttons were set with the index ready (at build: so they are)

    def buttons_once(seen: bool, *search_state: Any) -> tuple:  # once the index is ready (a timer's tick)
        if seen or not app.ready:
            return (gr.skip(),) * 3 + (seen,)
        return (*do_buttons(*search_state), True)

    once = ([buttons_seen, *buttons[0]], [*buttons[1], buttons_seen])
    timer.tick(lambda r: status_outputs(app, r), [was_ready], status_outs, api_name=False,
               show_progress="hidden", queue=False).then(buttons_once, *once, api_name=False, queue=False,
                                                         show_progress="hidden")

    to_search = gr.Checkbox(False, visible=False)  # this page's load turned search on (TO_SEARCH reads it)

    def at_load(ready_: bool) -> tuple:  # the Status tab, search on where it is ready, and this page's ticks
        return (*status_outputs(app, ready_), app.ready and not ready_, gr.Timer(active=ticking(app)))

    demo.load(at_load, [was_ready], [*status_outs, to_search, timer], api_name="status", queue=False).then(
        buttons_once, *once, api_name=False, queue=False, show_progress="hidden").then(
        None, [to_search], None, js=TO_SEARCH)  # a page opened once search is on shows the Search tab
