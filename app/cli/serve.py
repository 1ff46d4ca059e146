"""`moco serve` and `moco run`: the commands that serve the page and its JSON API, with their shared flags (address,
login, proxies, the API's token and batching) and the checks made before any work starts."""

from __future__ import annotations

import argparse
import math
import os
import signal
import sys
from pathlib import Path

from index.building.args import IDX_HELP, add_watch_arguments
from moco.errors import UserError
from moco.extras import install_hint

__all__ = ["add_serve", "add_run", "cmd_serve", "cmd_run"]

PAGE_TABS = ("Search, Map, Themes, Browse, Unusual, Negatives (the InfoNCE view: which photos sit closest as "
             "negatives), Collection (duplicates, folders) and Status")  # the page's tabs, in order (a test holds it)
DEFAULT_PRETRAINED = "moco_v2_800ep"  # moco.weights.pretrained.DEFAULT, without importing torch for --help


def add_serve(sub: argparse._SubParsersAction) -> None:
    """Register `moco serve` on the top-level subparsers."""
    p = sub.add_parser(
        "serve",
        help="the search web UI (Gradio) over an index",
        description="The page's tabs over IDX: " + PAGE_TABS + ". Binds 127.0.0.1 by default.",
    )
    p.add_argument("index_dir", metavar="IDX", help=IDX_HELP)
    p.add_argument("--checkpoint", default=None, metavar="CKPT",
                   help="a `moco train` checkpoint (or official NAME): the Negatives tab then uses its saved queue and "
                   "key encoder")
    p.add_argument("--backbone", default=None, metavar="B", help="the index's backbone, if it moved")
    add_watch_arguments(p, "keep the index up with its photo folder while serving: photos added, changed, moved or "
                        "deleted are noticed and the index updated once they settle (the Status tab says so)")
    _serve_arguments(p)
    p.set_defaults(handler=cmd_serve)


def _serve_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1, this machine only)")
    p.add_argument("--allowed-host", action="append", default=[], metavar="NAME",
                   help="a name this server is reached by, e.g. photos.example behind a reverse proxy or a LAN name "
                   "(repeat or separate with commas; '*': any). Default: localhost, IP addresses and the --host "
                   "name; a request for another name gets 403 (against DNS rebinding)")
    p.add_argument("--port", type=int, default=7860)
    p.add_argument("--auth", default=os.environ.get("MOCO_AUTH"), metavar="USER:PASS", action=_OnCommandLine,
                   help="require this login (default: $MOCO_AUTH). On the command line every user of this machine "
                   "can read it (ps): prefer --auth-file or $MOCO_AUTH")
    p.add_argument("--auth-file", default=os.environ.get("MOCO_AUTH_FILE"), metavar="FILE",
                   help="read the login from FILE's first line, USER:PASS (default: $MOCO_AUTH_FILE; a Docker or "
                   "systemd secret)")
    p.add_argument("--device", default="auto", help="embedding device (default: auto)")
    p.add_argument("--trusted-proxy", action="append", default=[], metavar="ADDR",
                   help="a reverse proxy in front of this server (address or network; repeat or separate with "
                   "commas): its X-Forwarded-For names the client, for login throttling. Default: none, the "
                   "client is the connecting address")
    p.add_argument("--request-timeout", type=float, default=30.0, metavar="S",
                   help="a request must arrive within S seconds (its body may pause at most as long); slower ones "
                   "get 408 and are closed (default: 30)")
    p.add_argument("--max-connections", type=int, default=None, metavar="N",
                   help="connections open at once at most; one more closes the slowest half-sent request first "
                   "(default: half the files the process may still open when it starts, at most 1000)")
    api = p.add_argument_group("JSON API", "served beside the page at /api/v1 (docs: /api/v1/docs), with the "
                               "page's --auth")
    api.add_argument("--api-token", default=os.environ.get("MOCO_API_TOKEN"), metavar="TOKEN", action=_OnCommandLine,
                     help="programs may also call the server with `Authorization: Bearer TOKEN` (at least 16 "
                     "characters; default: $MOCO_API_TOKEN; prefer --api-token-file to the command line). With it "
                     "every route (the page too) needs the token or the --auth login, even without --auth: browsers "
                     "log in with the user name `token` and TOKEN as the password")
    api.add_argument("--api-token-file", default=os.environ.get("MOCO_API_TOKEN_FILE"), metavar="FILE",
                     help="read the token from FILE's first line (default: $MOCO_API_TOKEN_FILE)")
    api.add_argument("--api-cors-origin", action="append", default=[], metavar="ORIGIN",
                     help="another site's web page that may call this server (the API, the page's routes) from a "
                     "browser, as scheme://host[:port] (repeat or separate with commas). Default: none, only the "
                     "server's own page; programs are not browsers and need none")
    api.add_argument("--max-batch", type=int, default=16, metavar="N",
                     help="searches embedded together at most (default: 16)")
    api.add_argument("--batch-window-ms", type=float, default=2.0, metavar="MS",
                     help="how long a search waits for others to batch with (default: 2)")
    api.add_argument("--max-pending", type=int, default=32, metavar="N",
                     help="API searches in flight at most; more get 503 with Retry-After (default: 32)")


def _api_settings(args: argparse.Namespace) -> object:
    """The JSON API's settings from the flags (checked)."""
    from app.guard.access import ApiSettings, check_api_token
    from app.guard.origins import check_allowed_hosts, check_cors_origins

    if args.max_batch < 1 or args.max_pending < 1 or not 0 <= args.batch_window_ms <= 1000:
        raise UserError(f"--max-batch {args.max_batch}, --max-pending {args.max_pending}, --batch-window-ms "
                        f"{args.batch_window_ms}: the limits must be at least 1, the window 0 to 1000 ms")
    return ApiSettings(token=check_api_token(args.api_token), window_ms=args.batch_window_ms,
                       max_batch=args.max_batch, max_pending=args.max_pending,
                       cors_origins=check_cors_origins(args.api_cors_origin),
                       allowed_hosts=check_allowed_hosts(args.allowed_host))


def _limits(args: argparse.Namespace) -> object:
    """The connections' limits from the flags (checked)."""
    from app.guard.connections import ConnectionLimits

    if not 0 < args.request_timeout <= 3600 or (args.max_connections is not None and args.max_connections < 1):
        raise UserError(f"--request-timeout {args.request_timeout}, --max-connections {args.max_connections}: the "
                        "timeout must be more than 0 and at most 3600 s, the count at least 1")
    return ConnectionLimits(args.request_timeout, args.max_connections)


class _OnCommandLine(argparse.Action):
    """A secret's flag: its value, and that it was given on the command line (``args.on_command_line``), where every
    user of the machine can read it."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: object,
                 option_string: str | None = None) -> None:
        setattr(namespace, self.dest, values)
        namespace.on_command_line = [*getattr(namespace, "on_command_line", []), option_string]


def read_secret(path: str, flag: str) -> str:
    """The first line of a secret's file (``--auth-file``, ``--api-token-file``), its line end stripped; a
    :class:`UserError` naming the file and the fix when it cannot be read or is empty. A file other users may read
    is used, with a warning."""
    try:
        with open(path, encoding="utf-8") as f:
            first = f.readline().rstrip("\r\n")
        mode = os.stat(path).st_mode
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"{flag} {path}: cannot read it ({getattr(e, 'strerror', None) or e}): give a readable "
                        "file whose first line is the secret") from None
    if not first.strip():
        raise UserError(f"{flag} {path}: its first line is empty: write the secret on it")
    if mode & 0o077:
        print(f"WARNING: {flag} {path} can be read by other users (mode {mode & 0o777:o}): chmod 600 {path}",
              file=sys.stderr)
    return first


def _secrets_from_files(args: argparse.Namespace) -> None:
    """``--auth-file`` and ``--api-token-file`` read into ``args.auth`` and ``args.api_token`` (one source each: a
    file given with its flag's value too is an error); a secret given on the command line is used, with a warning."""
    given = getattr(args, "on_command_line", [])
    for flag, attr, file_attr, env in (("--auth", "auth", "auth_file", "MOCO_AUTH"),
                                       ("--api-token", "api_token", "api_token_file", "MOCO_API_TOKEN")):
        path = getattr(args, file_attr, None)
        if path:
            if getattr(args, attr):
                raise UserError(f"{flag} and {flag}-file both give the secret (${env} counts as {flag}): keep one")
            setattr(args, attr, read_secret(path, f"{flag}-file"))
        elif flag in given:
            print(f"WARNING: {flag} on the command line can be read by every user of this machine (ps, /proc): put "
                  f"it in a file only you can read and pass {flag}-file FILE, or set ${env}", file=sys.stderr)


def _check_serve_arguments(args: argparse.Namespace) -> tuple[str, str] | None:
    from app.guard.access import parse_trusted_proxies

    args.trusted_proxy = parse_trusted_proxies(args.trusted_proxy)
    _secrets_from_files(args)
    auth = None
    if args.auth:
        user, sep, password = args.auth.partition(":")
        if not sep or not user or not password:
            raise UserError("--auth: expected USER:PASS, e.g. --auth alice:long-secret")
        auth = (user, password)
    if not 0 < args.port < 65536:
        raise UserError(f"--port {args.port}: pick a port between 1 and 65535")
    return auth


def _announce(args: argparse.Namespace) -> None:
    if args.host not in ("127.0.0.1", "localhost", "::1") and not args.auth and not args.api_token:
        print(f"WARNING: serving on {args.host} without --auth or --api-token: anyone who can reach this machine can "
              "search your photos; add --auth USER:PASS", file=sys.stderr)
    print(f"serving on {_url(args)} (Ctrl+C to stop); JSON API: {_url(args)}/api/v1 (docs: {_url(args)}/api/v1/docs)",
          flush=True)


def _url(args: argparse.Namespace) -> str:
    shown = "127.0.0.1" if args.host in ("0.0.0.0", "::") else args.host
    return f"http://{shown}:{args.port}"


def _require_ui() -> None:
    """A UserError naming the `ui` extra when gradio or faiss is not installed (checked before any work)."""
    import importlib

    missing = []
    for module in ("gradio", "faiss"):
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as e:
            if (e.name or "").partition(".")[0] != module:  # installed, but broken: the real error says why
                raise
            missing.append(module)
    if missing:
        raise UserError(f"the web UI needs {' and '.join(missing)}, which {'is' if len(missing) == 1 else 'are'} "
                        f"not installed: {install_hint('ui')}")


def cmd_serve(args: argparse.Namespace) -> int:
    """`moco serve`: launch the UI and block until interrupted."""
    _require_ui()
    from app.server.launch import serve
    from index.building.runner import check_watch_arguments
    from moco.weights.pretrained import resolve

    auth = _check_serve_arguments(args)
    api = _api_settings(args)
    limits = _limits(args)
    check_watch_arguments(args)
    checkpoint = resolve(args.checkpoint) if args.checkpoint else None  # an official NAME: fetched first
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # stop as on Ctrl+C: the server's temp files go
    serve(args.index_dir, checkpoint, args.host, args.port, auth, args.backbone, args.device,
          trusted_proxies=args.trusted_proxy, api=api, limits=limits,
          announce=lambda: _announce(args), watch=args.poll or 0.0 if args.watch else None)
    return 0


def add_run(sub: argparse._SubParsersAction) -> None:
    """Register `moco run` on the top-level subparsers."""
    p = sub.add_parser(
        "run",
        help="the whole job: train (or take a checkpoint), export, index, serve",
        description="Photos to a served search engine in one command; re-running reuses what exists (resumes "
        "training, skips an up-to-date export, updates the index).",
    )
    p.add_argument("photos", metavar="PHOTOS", nargs="?", help="folder of photos (default: a generated sample)")
    p.add_argument("--work", default="runs/default", help="work directory (default: runs/default); each photo "
                   "folder gets its own directory in it (the sample: WORK/sample), never another's")
    group = p.add_mutually_exclusive_group()
    group.add_argument("--checkpoint", default=None, metavar="CKPT", help="use this model as is (an official NAME, "
                       "see `moco pretrained`; official MoCo .pth.tar or any supported checkpoint): no training")
    group.add_argument("--init", default=None, metavar="CKPT",
                       help="continue MoCo training from these weights (a file or an official NAME)")
    p.add_argument("--pretrained", default=DEFAULT_PRETRAINED, metavar="NAME",
                   help=f"with PHOTOS and no --checkpoint/--init/--minutes/--max-steps: use this official model as is "
                   f"when it is cached or can be downloaded, else train from scratch (default: {DEFAULT_PRETRAINED}; "
                   "'none': always train)")
    p.add_argument("--minutes", type=float, default=None, help="training time budget (default: 10 on a CPU, "
                   "the full recipe on a GPU)")
    p.add_argument("--max-steps", type=int, default=None, help="cap the training steps (for quick tries)")
    p.add_argument("--exclude", action="append", default=[], metavar="GLOB",
                   help="a folder or files never read (neither trained on nor indexed), as a pattern relative to "
                   "PHOTOS, e.g. 'private/**' or '*.gif' (repeat for more)")
    p.add_argument("--no-serve", action="store_true", help="stop after indexing")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    _serve_arguments(p)
    p.set_defaults(handler=cmd_run)


def cmd_run(args: argparse.Namespace) -> int:
    """`moco run`: serve the page at once (its Status tab follows the work), train/export/index, turn search on."""
    from app.run.pipeline import KEPT, collection_dir
    from index.search.store import require_faiss
    from moco.files import lock_dir, make_dirs

    require_faiss() if args.no_serve else _require_ui()  # before any training: the pipeline ends with them
    if args.minutes is not None and not 0 < args.minutes < math.inf:
        raise UserError(f"--minutes {args.minutes:g}: the training time budget is a positive number of minutes, "
                        "e.g. --minutes 10")
    if args.max_steps is not None and args.max_steps < 1:
        raise UserError(f"--max-steps {args.max_steps}: give at least 1 step, or leave it out")
    from moco.excludes import check_patterns

    args.exclude = check_patterns(args.exclude, root=args.photos) if args.photos else check_patterns(args.exclude)
    auth = _check_serve_arguments(args)
    api = None if args.no_serve else _api_settings(args)
    limits = None if args.no_serve else _limits(args)
    work = collection_dir(args.work, args.photos)  # this photo folder's own run, backbone and index
    undo = make_dirs(work)
    with lock_dir(work, "--work"):  # first: a second run of this folder is told who holds it, before any port is bound
        try:
            return _serve_and_run(args, work, auth, api, limits)
        except BaseException:
            if not any((work / name).exists() for name in KEPT):  # failed before writing what a rerun reuses
                undo()  # what this run created goes (an empty WORK ...), nothing else
            raise


def _serve_and_run(args: argparse.Namespace, work: Path, auth: tuple[str, str] | None, api: object,
                   limits: object) -> int:
    """`moco run`'s work, ``work`` locked: the page served at once, then train/export/index, then search on."""
    from app.run.pipeline import run_pipeline

    extra = {"max_steps": args.max_steps} if args.max_steps else {}
    # Asking for training (--minutes, --max-steps) or for the sample (no PHOTOS) never fetches a default model.
    asked_training = args.minutes is not None or args.max_steps is not None
    default = None if args.pretrained.lower() == "none" or not args.photos or asked_training else args.pretrained
    demo = app = status = None
    if not args.no_serve:
        from app.run.status import RunStatus
        from app.server.launch import serve_pending

        signal.signal(signal.SIGTERM, signal.default_int_handler)  # as in cmd_serve (training installs its own)
        status = RunStatus(work)
        photos = Path(args.photos).expanduser() if args.photos else work / "photos"
        demo, app = serve_pending(work / "index", photos, status, args.host, args.port, auth,
                                  args.trusted_proxy, api, limits)
        _announce(args)
        print("the page's Status tab follows training and indexing; search turns on when the index is ready",
              flush=True)
    try:
        out = run_pipeline(args.photos, args.work, args.checkpoint, args.init, args.minutes, extra,
                           say=lambda m: print(m, flush=True), progress=not args.quiet, pretrained=default,
                           status=status, locked=True, exclude=args.exclude)
        print(f"search it: moco index search {out['index']} PHOTO.jpg, or the UI", flush=True)
        if demo is None:
            return 0
        ckpt = out["checkpoint"] if out["trained"] else None  # a training checkpoint: the Negatives tab's queue
        app.attach(out["index"], out["backbone"], ckpt, args.device)
    except BaseException:
        if demo is not None:
            demo.close()
        raise
    print(f"search is on: {_url(args)}", flush=True)
    from app.server import heap

    heap.freeze()  # training and indexing are over: what is left lives as long as the server (app/heap.py)
    demo.block_thread()
    return 0
