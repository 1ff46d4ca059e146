"""Launching the search page: ``serve`` (an index that exists), ``serve_pending`` (``moco run``: the page before
the index exists; the Status tab follows training and indexing, and search turns on by itself when
``SearchApp.attach`` is called) and the safety settings of both: bound to 127.0.0.1 unless told otherwise, only
the index's ``thumbs/`` folder served (originals only as copies of indexed files), upload size capped, one search
at a time per device. The Blocks themselves are in :mod:`app.page.blocks`.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from app.page.blocks import CSS, build_ui, page_js
from app.page.handlers import SearchApp
from app.search.uploads import MAX_UPLOAD_MB
from app.server import heap
from index.search.image_index import ImageIndex
from index.search.index_dir import CATALOG_FILE, DEDUP_FILE, INDEX_FILE, META_FILE, THUMBS_DIR

__all__ = ["serve", "serve_pending", "make_demo", "launch_kwargs", "MAX_UPLOAD"]

logger = logging.getLogger(__name__)

MAX_UPLOAD = f"{MAX_UPLOAD_MB}mb"
_CHATTY = ("httpx",)  # third-party loggers whose INFO line per request (Gradio's own calls) would fill the log
# An idle keep-alive connection is kept this long (uvicorn's default: 5 s). Longer than a client's or a reverse
# proxy's own idle timeout (httpx 5 s, nginx's upstream keepalive 60 s), so the client or the proxy closes it first:
# otherwise one may send a request on a connection the server is closing at that moment, and that request fails
# (seen once under a 64-client overload).
KEEP_ALIVE_S = 75


def _blocked_paths(index_dir: Path, root: Path) -> list[str]:
    """What the file route must refuse: the index's own files and the collection's originals.

    Blocked paths win over allowed ones in Gradio, so when the index lives inside the photo folder
    (``PHOTOS/.index``) the root itself cannot be blocked: every entry beside the path from the root
    down to ``thumbs/`` is blocked instead (files added later are not allowed either: only ``thumbs/`` is).
    """
    blocked = [str(index_dir / name) for name in (CATALOG_FILE, INDEX_FILE, META_FILE, DEDUP_FILE)]
    blocked += [str(index_dir / f"{CATALOG_FILE}-wal"), str(index_dir / f"{CATALOG_FILE}-shm")]
    root, thumbs = root.resolve(), (index_dir / THUMBS_DIR).resolve()
    if root not in thumbs.parents:
        return [*blocked, str(root)]
    here = root
    for part in thumbs.relative_to(root).parts:
        if here.is_dir():
            blocked += [str(entry) for entry in here.iterdir() if entry.name != part]
        here = here / part
    return blocked


def launch_kwargs(index: ImageIndex | Path, host: str, port: int, auth: tuple[str, str] | None,
                  root: Path | None = None, trusted_proxies: Sequence[str] = (),
                  api: Any = None) -> dict[str, Any]:
    """``demo.launch`` settings: only thumbs/ is served; the catalog, index files and originals never are.

    ``index``: an open index, or the directory an index will be built in (then ``root``: its photo folder).
    Every route asks for the login or the token when the server has one (:mod:`app.guard.access`) and answers only
    to its own names (:mod:`app.guard.origins`); failed logins are throttled per address and per account, one count
    for the page and the API (:mod:`app.guard.access`). The client address is the socket peer, or what
    ``X-Forwarded-For`` says only when the peer is in ``trusted_proxies``: this sets ``$FORWARDED_ALLOW_IPS``,
    which uvicorn reads when ``demo.launch`` starts it. ``api``: an :class:`app.api.routes.Api`: its JSON
    API is served beside the page (``/api/v1``), under its settings, with its request bodies capped.
    """
    import gradio as gr
    from starlette.middleware import Middleware

    from app.guard.access import AccessMiddleware, ApiSettings, LoginThrottleMiddleware, page_login, trusted_proxy_env
    from app.guard.origins import HostGuardMiddleware, OriginGuardMiddleware

    os.environ.update(trusted_proxy_env(trusted_proxies))

    index_dir, root = (index.dir, index.root) if isinstance(index, ImageIndex) else (Path(index), Path(root or index))
    # thumbnails are served from thumbs/ as they are: without this Gradio checks, hashes and copies each one of a
    # gallery into its cache on every search, two thirds of a page search's time (bench/ui_load.py). Served to
    # the same logged-in users as before (thumbs/ is the one allowed path either way); global to the process.
    gr.set_static_paths([str(index_dir / THUMBS_DIR)])
    settings = api.settings if api is not None else ApiSettings(auth=auth)
    middleware = [  # the first is the outermost
        Middleware(HostGuardMiddleware, bind=host, names=settings.allowed_hosts),
        Middleware(OriginGuardMiddleware, allowed=settings.cors_origins),
        Middleware(AccessMiddleware, settings=settings),
        Middleware(LoginThrottleMiddleware, throttle=settings.throttle)]
    app_kwargs: dict[str, Any] = {"middleware": middleware}
    if api is not None:
        from app.api.routes import api_routes
        from app.guard.access import BodyCapMiddleware

        app_kwargs = {"routes": api_routes(api), "middleware": [*middleware, Middleware(BodyCapMiddleware)]}
    return {"server_name": host, "server_port": port, "auth": page_login(settings),
            "allowed_paths": [str(index_dir / THUMBS_DIR)],
            "blocked_paths": _blocked_paths(index_dir, root), "max_file_size": MAX_UPLOAD, "show_error": False,
            "quiet": True, "footer_links": ["api"], "css": CSS, "js": page_js(),
            "app_kwargs": app_kwargs}


def _queued(demo: Any) -> Any:
    import torch

    gpus = torch.cuda.device_count()
    demo.queue(default_concurrency_limit=max(1, gpus) if gpus else 1, max_size=256)  # one search per device
    return demo


def make_demo(index_dir: str | Path, checkpoint: str | Path | None = None, backbone: str | Path | None = None,
              device: str = "auto",
              service: Callable[[SearchApp], Any] | None = None) -> tuple[Any, SearchApp]:
    """Open the index, load its backbone (sha-checked) and build the queued Blocks; ``service(app)`` makes the
    JSON API (:class:`app.api.routes.Api`, ``demo.api_service``), whose searches the page's Search then shares."""
    index = ImageIndex.open(index_dir)
    app = SearchApp(index, index.load_embedder(backbone, device=device), checkpoint)
    api_service = service(app) if service is not None else None
    demo = _queued(build_ui(app, api_service.search if api_service is not None else None))
    demo.api_service = api_service
    return demo, app


def _service(app: SearchApp, auth: tuple[str, str] | None, api: Any) -> Any:
    """The JSON API over ``app`` (:class:`app.api.routes.Api`; ``api``: :class:`app.guard.access.ApiSettings`,
    None: defaults)."""
    from app.api.state import Api
    from app.guard.access import ApiSettings

    settings = api or ApiSettings()
    settings.auth = auth
    return Api(app, settings)


def _quiet_clients() -> None:
    for name in _CHATTY:
        logging.getLogger(name).setLevel(logging.WARNING)


def serve(index_dir: str | Path, checkpoint: str | Path | None = None, host: str = "127.0.0.1", port: int = 7860,
          auth: tuple[str, str] | None = None, backbone: str | Path | None = None, device: str = "auto",
          block: bool = True, trusted_proxies: Sequence[str] = (), api: Any = None,
          limits: Any = None, announce: Callable[[], None] | None = None) -> Any:
    """Launch the UI and the JSON API (``api``: :class:`app.guard.access.ApiSettings`; ``limits``: the connections'
    :class:`app.guard.connections.ConnectionLimits`); returns the running Blocks when ``block`` is False.
    ``announce()`` runs once it serves (the index opened, the port bound): the CLI's "serving on ..." is never said
    before an error.

    Blocking, it returns once interrupted (Ctrl+C, or SIGTERM where the CLI maps it so), the server and its
    temporary files gone.
    """
    _quiet_clients()
    demo, app = make_demo(index_dir, checkpoint, backbone, device, lambda app: _service(app, auth, api))
    service = demo.api_service  # for close(), and for tests
    try:
        _launch(demo, launch_kwargs(app.index, host, port, auth, trusted_proxies=trusted_proxies, api=service), limits)
        if block:  # the process is this server's from now on: its startup heap stays out of collections
            heap.freeze()  # before it is announced: a Ctrl+C or SIGTERM raised in a collection's callback is lost
        if announce is not None:
            announce()
        if block:
            demo.block_thread()
    finally:
        if block:
            demo.close()
            service.close()
            app.close()
    return demo


def serve_pending(index_dir: str | Path, photos: str | Path, status: Any, host: str = "127.0.0.1", port: int = 7860,
                  auth: tuple[str, str] | None = None, trusted_proxies: Sequence[str] = (),
                  api: Any = None, limits: Any = None) -> tuple[Any, SearchApp]:
    """Launch the page (and the JSON API) before the index exists (never blocks): Status shows ``status``;
    ``app.attach`` adds search."""
    _quiet_clients()
    _pyplot_first()
    app = SearchApp(status=status)
    service = _service(app, auth, api)
    demo = _queued(build_ui(app, service.search))
    demo.api_service = service
    _launch(demo, launch_kwargs(Path(index_dir), host, port, auth, Path(photos), trusted_proxies, api=service), limits)
    return demo, app


def _pyplot_first() -> None:
    """Import matplotlib's pyplot (Agg) before the page serves while training runs beside it.

    Gradio switches matplotlib's backend around every event, in the event's thread; the run writes its curves
    (``moco.training.metrics``) from its own. The first import of pyplot in one thread while the other switches the
    backend failed the event ("partially initialized module 'matplotlib.pyplot'"), and the Status tab's timer stopped
    with it.
    """
    with contextlib.suppress(ModuleNotFoundError):  # no matplotlib: neither Gradio nor the curves use it
        import matplotlib

        matplotlib.use("agg")
        import matplotlib.pyplot  # noqa: F401 - imported whole, here, once


def _launch(demo: Any, kwargs: dict[str, Any], limits: Any = None) -> None:
    """Start the server (never blocks), its idle connections kept KEEP_ALIVE_S (read per new connection), a request
    that does not arrive in time and connections past the limit closed (:mod:`app.guard.connections`), other sites'
    pages kept from reading it (:mod:`app.guard.origins`)."""
    from app.guard.connections import guard_connections
    from app.guard.origins import guard_page_origins

    demo.launch(prevent_thread_lock=True, **kwargs)
    demo.server.config.timeout_keep_alive = KEEP_ALIVE_S
    demo.connections = guard_connections(demo.server, limits)
    settings = getattr(getattr(demo, "api_service", None), "settings", None)
    origins, names = (settings.cors_origins, settings.allowed_hosts) if settings is not None else ((), ())
    guard_page_origins(demo.server_app, origins, kwargs["server_name"], names)
