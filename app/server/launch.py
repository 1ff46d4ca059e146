"""Launching the search page: ``serve`` (an index that exists), ``serve_pending`` (``moco run``: the page before
the index exists; the Status tab follows training and indexing, and search turns on by itself when
``SearchApp.attach`` is called) and the safety settings of both: bound to 127.0.0.1 unless told otherwise, only
the index's ``thumbs/`` folder served (originals only as copies of indexed files), upload size capped, one search
at a time per device. The Blocks themselves are in :mod:`app.page.blocks`.

The server is ours, built from public APIs: one FastAPI app carrying the guard's outer layers
(:func:`app.guard.origins.guard_middleware`), the page mounted on it with ``gr.mount_gradio_app`` (the JSON API and
the access rule inside Gradio's app, whose login they share), run by ``uvicorn.Server`` in a thread of its own
(:class:`Server`), the connections' limits part of its ``uvicorn.Config`` from the first connection
(:func:`app.guard.connections.connection_settings`).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import socket
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from app.page.blocks import CSS, build_ui, page_js
from app.page.handlers import SearchApp
from app.search.uploads import MAX_UPLOAD_MB
from app.server import heap
from index.search.image_index import ImageIndex
from index.search.index_dir import CATALOG_FILE, DEDUP_FILE, INDEX_FILE, META_FILE, THUMBS_DIR

__all__ = ["serve", "serve_pending", "make_demo", "launch_kwargs", "Server", "MAX_UPLOAD"]

logger = logging.getLogger(__name__)

MAX_UPLOAD = f"{MAX_UPLOAD_MB}mb"
_CHATTY = ("httpx",)  # third-party loggers whose INFO line per request (Gradio's own calls) would fill the log
# An idle keep-alive connection is kept this long (uvicorn's default: 5 s). Longer than a client's or a reverse
# proxy's own idle timeout (httpx 5 s, nginx's upstream keepalive 60 s), so the client or the proxy closes it first:
# otherwise one may send a request on a connection the server is closing at that moment, and that request fails
# (seen once under a 64-client overload).
KEEP_ALIVE_S = 75
CLOSE_S = 5  # on close, responses under way (the page's event streams) get this long to end before they are cut


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
                  root: Path | None = None, api: Any = None) -> dict[str, Any]:
    """The page's settings (``gr.mount_gradio_app``'s keyword arguments; ``demo.launch`` takes them too): only
    thumbs/ is served; the catalog, index files and originals never are.

    ``index``: an open index, or the directory an index will be built in (then ``root``: its photo folder).
    Every route asks for the login or the token when the server has one (:mod:`app.guard.access`); failed logins are
    throttled per address and per account, one count for the page and the API (:mod:`app.guard.access`). ``api``:
    an :class:`app.api.state.Api`: its JSON API is served beside the page (``/api/v1``), under its settings, with
    its request bodies capped. The names the server answers to and the pages that may call it are the outer app's
    (:func:`_server_app`).
    """
    import gradio as gr
    from starlette.middleware import Middleware

    from app.guard.access import AccessMiddleware, ApiSettings, LoginThrottleMiddleware, page_login

    index_dir, root = (index.dir, index.root) if isinstance(index, ImageIndex) else (Path(index), Path(root or index))
    # thumbnails are served from thumbs/ as they are: without this Gradio checks, hashes and copies each one of a
    # gallery into its cache on every search, two thirds of a page search's time (bench/ui_load.py). Served to
    # the same logged-in users as before (thumbs/ is the one allowed path either way); global to the process.
    gr.set_static_paths([str(index_dir / THUMBS_DIR)])
    settings = api.settings if api is not None else ApiSettings(auth=auth)
    middleware = [  # the first is the outermost; inside Gradio's app, whose login cookies they read
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
            "ssr_mode": False, "footer_links": ["api"], "css": CSS, "js": page_js(), "app_kwargs": app_kwargs}


def _queued(demo: Any) -> Any:
    import torch

    gpus = torch.cuda.device_count()
    demo.queue(default_concurrency_limit=max(1, gpus) if gpus else 1, max_size=256)  # one search per device
    return demo


def make_demo(index_dir: str | Path, checkpoint: str | Path | None = None, backbone: str | Path | None = None,
              device: str = "auto",
              service: Callable[[SearchApp], Any] | None = None) -> tuple[Any, SearchApp]:
    """Open the index, load its backbone (sha-checked) and build the queued Blocks; ``service(app)`` makes the
    JSON API (:class:`app.api.state.Api`, ``demo.api_service``), whose searches the page's Search then shares."""
    index = ImageIndex.open(index_dir)
    app = SearchApp(index, index.load_embedder(backbone, device=device), checkpoint)
    api_service = service(app) if service is not None else None
    demo = _queued(build_ui(app, api_service.search if api_service is not None else None))
    demo.api_service = api_service
    return demo, app


def _service(app: SearchApp, auth: tuple[str, str] | None, api: Any) -> Any:
    """The JSON API over ``app`` (:class:`app.api.state.Api`; ``api``: :class:`app.guard.access.ApiSettings`,
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
          limits: Any = None, announce: Callable[[], None] | None = None, watch: float | None = None) -> Any:
    """Launch the UI and the JSON API (``api``: :class:`app.guard.access.ApiSettings`; ``limits``: the connections'
    :class:`app.guard.connections.ConnectionLimits`); returns the running :class:`Server` when ``block`` is False.
    ``watch``: keep the index up with its photo folder (:class:`index.building.watch.Watcher`, as ``app.watcher``;
    0: file system events, or a scan every 10 s without them; N: a scan every N seconds); None: no watch.
    ``announce()`` runs once it serves (the index opened, the port bound): the CLI's "serving on ..." is never said
    before an error.

    Blocking, it returns once interrupted (Ctrl+C, or SIGTERM where the CLI maps it so), the server and its
    temporary files gone.
    """
    _quiet_clients()
    demo, app = make_demo(index_dir, checkpoint, backbone, device, lambda app: _service(app, auth, api))
    service = demo.api_service  # for close(), and for tests
    server = None
    try:
        server = _launch(demo, launch_kwargs(app.index, host, port, auth, api=service), limits, trusted_proxies)
        if watch is not None:
            app.watcher = _watcher(app, index_dir, device, watch or None)
        if block:  # the process is this server's from now on: its startup heap stays out of collections
            heap.freeze()  # before it is announced: a Ctrl+C or SIGTERM raised in a collection's callback is lost
        if announce is not None:
            announce()
        if block:
            server.block_thread()
    finally:
        if block:
            if getattr(app, "watcher", None) is not None:
                app.watcher.stop()
            if server is not None:
                server.close()
            service.close()
            app.close()
    return server


def _watcher(app: SearchApp, index_dir: str | Path, device: str, poll_s: float | None) -> Any:
    """A started :class:`~index.building.watch.Watcher` of the served index's photo folder, updating the index in
    this process (the page and the API take each new version as a ``moco index update`` beside them would give it)."""
    from index.building.runner import update_index
    from index.building.watch import Watcher

    return Watcher(app.index.root, lambda: update_index(index_dir, progress=False, device=device),
                   poll_s=poll_s).start()


def serve_pending(index_dir: str | Path, photos: str | Path, status: Any, host: str = "127.0.0.1", port: int = 7860,
                  auth: tuple[str, str] | None = None, trusted_proxies: Sequence[str] = (),
                  api: Any = None, limits: Any = None) -> tuple[Any, SearchApp]:
    """Launch the page (and the JSON API) before the index exists (never blocks): Status shows ``status``;
    ``app.attach`` adds search. Returns the running :class:`Server` and ``app``."""
    _quiet_clients()
    _pyplot_first()
    app = SearchApp(status=status)
    service = _service(app, auth, api)
    demo = _queued(build_ui(app, service.search))
    demo.api_service = service
    server = _launch(demo, launch_kwargs(Path(index_dir), host, port, auth, Path(photos), api=service), limits,
                     trusted_proxies)
    return server, app


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


def _launch(demo: Any, kwargs: dict[str, Any], limits: Any = None, trusted_proxies: Sequence[str] = ()) -> Server:
    """Start the server (never blocks): the page with ``kwargs`` (:func:`launch_kwargs`) on our app
    (:func:`_server_app`), run by uvicorn with the connections' ``limits``."""
    settings = getattr(getattr(demo, "api_service", None), "settings", None)
    app = _server_app(demo, kwargs, settings)
    return Server.start(demo, app, kwargs["server_name"], kwargs["server_port"], limits, trusted_proxies)


def _server_app(demo: Any, kwargs: dict[str, Any], settings: Any) -> Any:
    """The app uvicorn runs: the guard's outer layers (:func:`app.guard.origins.guard_middleware`: the names it answers
    to, other sites' pages, CORS), and the page mounted on it with ``kwargs``. It has no route of its own (no
    FastAPI docs: the API's are under ``/api/v1``)."""
    import gradio as gr
    from fastapi import FastAPI

    from app.guard.origins import guard_middleware

    names, origins = (settings.allowed_hosts, settings.cors_origins) if settings is not None else ((), ())
    outer = FastAPI(openapi_url=None, docs_url=None, redoc_url=None,
                    middleware=guard_middleware(kwargs["server_name"], names, origins))
    return gr.mount_gradio_app(outer, demo, "/", **kwargs)


class Server:
    """The running server: ``server_app`` (the app uvicorn runs), ``server`` (the ``uvicorn.Server``), ``connections``
    (their registry, :func:`app.guard.connections.connection_settings`), ``demo`` (the page's Blocks) and its
    ``api_service``. :meth:`close` stops it; :meth:`block_thread` waits until it stops or the process is interrupted.

    ``stopped`` is set when the server's thread has run to its end, the app's shutdown (Gradio's deletion of its
    temporary files) done. It is what every wait here waits on, never ``Thread.join``/``is_alive``: before Python
    3.13 a ``join`` that a Ctrl+C or a SIGTERM (mapped to KeyboardInterrupt) interrupts marks the thread stopped while
    it still runs (the bpo-45274 handling in ``Thread._wait_for_tstate_lock`` releases the lock the living thread
    holds), so the next ``join`` returned at once, the process went on to exit, and the daemon thread died before the
    app's shutdown: the page's uploads stayed in the temporary directory.
    """

    def __init__(self, demo: Any, app: Any, server: Any, thread: threading.Thread, connections: Any,
                 stopped: threading.Event | None = None) -> None:
        self.demo, self.server_app, self.server, self.thread, self.connections = demo, app, server, thread, connections
        self.stopped = stopped if stopped is not None else threading.Event()
        self.api_service = getattr(demo, "api_service", None)
        self.closed = False

    @classmethod
    def start(cls, demo: Any, app: Any, host: str, port: int, limits: Any = None,
              trusted_proxies: Sequence[str] = ()) -> Server:
        """Bind ``host``:``port`` (a UserError naming the flag when it cannot), then serve ``app`` from a thread of its
        own; returns once it serves (its startup events run). The client address is the socket peer, or what
        ``X-Forwarded-For`` says only when the peer is in ``trusted_proxies``."""
        import uvicorn

        from app.guard.connections import connection_settings

        guard, connections = connection_settings(limits)
        config = uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="on",
                                timeout_keep_alive=KEEP_ALIVE_S, timeout_graceful_shutdown=CLOSE_S,
                                # X-Forwarded-For from these peers alone (uvicorn's default, loopback, would let
                                # any local process name its own address to the login throttle)
                                proxy_headers=True, forwarded_allow_ips=list(trusted_proxies), **guard)
        sockets = _bind(host, port)
        server = uvicorn.Server(config)
        stopped = threading.Event()

        def run() -> None:
            try:
                server.run(sockets=sockets)
            finally:
                stopped.set()  # after the app's shutdown (see the class's note: not the thread's own state)

        thread = threading.Thread(target=run, name=f"server:{port}", daemon=True)
        thread.start()
        while not server.started and not stopped.wait(0.01):  # until it serves, or stopped before it could
            continue
        if not server.started:  # uvicorn has logged why (a startup event failed)
            for sock in sockets:
                sock.close()
            raise RuntimeError(f"the server on port {port} stopped as it started: its error is in the log above")
        return cls(demo, app, server, thread, connections, stopped)

    def close(self) -> None:
        """Stop serving: the page's queue and event streams end, the connections close (responses under way get
        CLOSE_S), then the app's shutdown (Gradio's temporary files); returns once that has run."""
        if self.closed:
            return
        self.closed = True
        self.demo.close(verbose=False)  # its queue; `is_running` false
        mounted = [r.app for r in self.server_app.routes if hasattr(getattr(r, "app", None), "stop_event")]
        loops = {s.get_loop() for s in getattr(self.server, "servers", [])}
        for loop, app in ((loop, app) for loop in loops for app in mounted):
            with contextlib.suppress(RuntimeError):  # the loop has closed already
                loop.call_soon_threadsafe(app.stop_event.set)  # the page's streams end (Gradio's own close: launch's)
        self.server.should_exit = True
        if not self.stopped.wait(CLOSE_S + 30):
            logger.warning("the server's thread has not stopped %d s after it was told to", CLOSE_S + 30)

    def block_thread(self) -> None:
        """Wait until the server stops, or until Ctrl+C (or SIGTERM where the CLI maps it so); then close it."""
        try:
            while not self.stopped.wait(0.5):  # short waits: Ctrl+C (SIGTERM) is raised between two of them
                continue
        except KeyboardInterrupt:
            print("interrupted: closing the server", flush=True)
        finally:
            self.close()


def _bind(host: str, port: int) -> list[socket.socket]:
    """The listening sockets of ``host``:``port`` (each address the name has, as asyncio binds them), or a UserError
    naming the flag to change."""
    from moco.errors import UserError

    name = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    try:
        infos = socket.getaddrinfo(name or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise UserError(f"--host {host}: not a name or address of this machine ({e.strerror}): e.g. --host 127.0.0.1, "
                        "or --host 0.0.0.0 for every address") from None
    sockets: list[socket.socket] = []
    try:
        for family, kind, proto, _, address in dict.fromkeys(infos):
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(address)
    except OSError as e:
        for sock in sockets:
            sock.close()
        if e.errno == errno.EADDRINUSE:
            raise UserError(f"--port {port}: {host}:{port} is in use by another program (another moco serve?): stop "
                            "it, or pick another port with --port") from None
        if e.errno == errno.EADDRNOTAVAIL:
            raise UserError(f"--host {host}: not an address of this machine: e.g. --host 127.0.0.1, or --host 0.0.0.0 "
                            "for every address") from None
        if e.errno == errno.EACCES:
            raise UserError(f"--port {port}: this user may not listen on it (ports below 1024 need administrator "
                            "rights): pick another with --port, e.g. --port 7860") from None
        raise
    return sockets
