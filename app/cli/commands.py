"""The `moco` command line: one small parser function per subcommand, handlers are plain functions.

Exit codes: 0 success, 2 bad input (message on stderr naming the file/value and the fix), 1 other errors (storage,
network), 130 interrupted.
"""

from __future__ import annotations

import argparse
import errno
import json
import logging
import os
import sys
from pathlib import Path

from app.guard import log_limits
from moco import __version__
from moco.errors import UserError, storage_error

__all__ = ["main", "build_parser"]

logger = logging.getLogger(__name__)


def _add_train(sub: argparse._SubParsersAction) -> None:
    from moco.training.command import DESCRIPTION, add_train_arguments

    p = sub.add_parser("train", help="train MoCo on a folder of photos", description=DESCRIPTION)
    add_train_arguments(p)
    p.set_defaults(handler=cmd_train)


def cmd_train(args: argparse.Namespace) -> int:
    """`moco train`: resolve the config (preset <- flags, or the checkpoint's on --resume) and train."""
    from moco.training.command import summary_line, train_from_args

    summary = train_from_args(args)
    if int(os.environ.get("RANK", "0")) == 0:
        print(summary_line(summary, Path(args.out)))
    return 128 + summary.signal if summary.signal else 0


def _add_export(sub: argparse._SubParsersAction) -> None:
    from moco.export import FORMATS

    p = sub.add_parser(
        "export",
        help="export a clean backbone (heads, key encoder, queue stripped)",
        description="Export the query backbone of a MoCo checkpoint (ours, official v1/v2/v3, lightly, solo-learn, "
        "torchvision/timm) with its preprocessing metadata.",
    )
    p.add_argument("checkpoint", metavar="CHECKPOINT", help="a checkpoint file or an official NAME (moco pretrained)")
    p.add_argument("-o", "--out", required=True, metavar="OUT", help="output file, e.g. backbone.safetensors")
    p.add_argument("--arch", default=None, help="backbone architecture (default: detected from the checkpoint)")
    p.add_argument("--format", default="safetensors", choices=(*FORMATS, "torchscript"),  # torchscript: names pt2
                   metavar="{" + ",".join(FORMATS) + "}", help="safetensors (for moco.Embedder, the default); "
                   "timm (OUT: a folder for timm.create_model('local-dir:OUT')); onnx; pt2 (torch.export)")
    p.add_argument("--image-size", type=int, default=None, help="input size (default: the run's, or 224)")
    p.add_argument("--space", default=None, metavar="INDEX_DIR",
                   help="onnx, pt2, timm: output the embedding space of this index (fitted on the photos it searches: "
                   "the same vectors as its search) instead of the one fitted on the training photos")
    p.set_defaults(handler=cmd_export)


def cmd_export(args: argparse.Namespace) -> int:
    """`moco export`: strip a checkpoint down to its backbone."""
    import signal

    from moco.export.exporter import export_backbone
    from moco.export.reader import embedding_dim

    old = signal.signal(signal.SIGTERM, signal.default_int_handler)  # stop as on Ctrl+C: its temporary files go
    try:
        meta = export_backbone(args.checkpoint, args.out, arch=args.arch, fmt=args.format,
                               image_size=args.image_size, space=args.space)
    finally:
        signal.signal(signal.SIGTERM, old)
    print(
        f"exported {meta.arch} ({embedding_dim(meta)}-d, {meta.image_size} px, MoCo {meta.moco_version}, "
        f"from {meta.source_format}) to {args.out}; stripped {json.dumps(meta.dropped, sort_keys=True)}"
    )
    return 0


def _add_embed(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "embed",
        help="a folder of photos to a file of vectors, for your own vector store",
        description="Embed every photo under PHOTOS (recursively) into FILE.npy (N x D float32) with FILE.paths.txt "
        "beside it (one path per line, relative to PHOTOS, in the rows' order; read it with errors="
        "'surrogateescape'), or FILE.parquet with pyarrow. The vectors are the index's: by default in the export's "
        "own space (Embedder.load(B)); --space IDX: that index's space, the vectors its search compares; "
        "--features: the raw features an index stores. Resumable: photos are embedded in chunks kept in "
        "FILE.npy.parts/; after an interruption the same command continues where it stopped (finished chunks are "
        "not embedded again), and the folder goes once the output is written.",
    )
    p.add_argument("photos", metavar="PHOTOS", help="folder of photos")
    p.add_argument("--backbone", required=True, metavar="B", help="a backbone made by `moco export`, a checkpoint or "
                   "an official NAME (`moco pretrained`)")
    p.add_argument("-o", "--out", required=True, metavar="FILE", help="FILE.npy (vectors; paths in FILE.paths.txt) "
                   "or FILE.parquet (columns path, vector; needs pyarrow)")
    space = p.add_mutually_exclusive_group()
    space.add_argument("--space", default=None, metavar="IDX", help="vectors in the space of this index (made "
                       "with the same backbone): equal to its stored vectors")
    space.add_argument("--features", action="store_true", help="the raw features (L2-normalized), as an index "
                       "stores them before mapping them into its space")
    p.add_argument("--exclude", action="append", default=[], metavar="GLOB",
                   help="a folder or files never read, as a pattern relative to PHOTOS, e.g. 'private/**' or "
                   "'*.gif' (repeat for more)")
    p.add_argument("--chunk-size", type=int, default=1024, metavar="N",
                   help="photos per resumable chunk (default: 1024)")
    p.add_argument("--batch-size", type=int, default=64, metavar="N", help="photos per forward pass (default: 64)")
    p.add_argument("--workers", type=int, default=None, metavar="N", help="decoding threads (default: up to 8)")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | mps (default: auto)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(handler=cmd_embed)


def cmd_embed(args: argparse.Namespace) -> int:
    """`moco embed`: photos -> FILE.npy + FILE.paths.txt (or FILE.parquet), resuming an interrupted run."""
    from app.cli.embed import embed_to_file

    s = embed_to_file(args.photos, args.backbone, args.out, space=args.space, features=args.features,
                      chunk_size=args.chunk_size, batch_size=args.batch_size, workers=args.workers,
                      device=args.device, progress=not args.quiet, exclude=args.exclude)
    skipped = f"; skipped {s['skipped']} unreadable (e.g. {s['skipped_examples'][0]})" if s["skipped"] else ""
    skipped += "".join(f"; {note}" for note in s["not_read"])
    resumed = (f"; {s['resumed_chunks']} of {s['chunks']} chunks came from the interrupted run"
               if s["resumed_chunks"] else "")
    where = f", paths in {s['paths']}" if s["paths"] else ""
    print(f"embedded {s['rows']} photos into {s['out']} ({s['rows']} x {s['dim']} float32, {s['space']}){where}"
          f"{skipped}{resumed}")
    return 0


def _add_pretrained(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "pretrained",
        help="official MoCo checkpoints by name, cached or not",
        description="The official MoCo v1/v2/v3 checkpoints known by NAME. A NAME goes wherever a checkpoint does "
        "(moco export NAME, --init NAME, moco run --checkpoint NAME); it is downloaded once into $MOCO_HOME "
        "(else $XDG_CACHE_HOME/moco-retrieval, else ~/.cache/moco-retrieval), verified, then read like any file.",
    )
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(handler=cmd_pretrained)


def cmd_pretrained(args: argparse.Namespace) -> int:
    """`moco pretrained`: list the names, with architecture, top-1, size and whether each is cached."""
    from moco.weights.pretrained import listing, moco_home

    rows = listing()
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    width = max(len(r["name"]) for r in rows)
    print(f"{'NAME':<{width}}  MOCO  {'ARCH':<22} TOP-1  {'SIZE':>8}  CACHED")
    for r in rows:
        size = f"{r['size'] / 2**20:.0f} MiB" if r["size"] else "?"
        print(f"{r['name']:<{width}}  {r['moco']:<4}  {r['arch']:<22} {r['top1']:>5.1f}  {size:>8}  "
              f"{'yes' if r['cached'] else 'no'}")
    print(f"\nTOP-1: ImageNet linear probe (official READMEs); SIZE: known once cached. Cache: "
          f"{moco_home() / 'checkpoints'} ($MOCO_HOME). Use a NAME as a checkpoint, e.g. moco export moco_v2_800ep "
          "-o backbone.safetensors")
    return 0


def _add_sample(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "sample",
        help="write a small generated sample photo collection",
        description="Write varied synthetic scenes in a few families (JPEG/PNG), for trying things out.",
    )
    p.add_argument("out_dir", metavar="OUT_DIR")
    p.add_argument("--per-family", type=int, default=40, help="images per family (default: 40)")
    p.add_argument("--size", type=int, default=96, help="image side in pixels (default: 96)")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(handler=cmd_sample)


def cmd_sample(args: argparse.Namespace) -> int:
    """`moco sample`: generate the sample collection."""
    from moco.data.sample import make_sample_collection

    if args.per_family < 1 or args.size < 16:
        raise UserError("--per-family must be >= 1 and --size >= 16")
    paths = make_sample_collection(args.out_dir, per_family=args.per_family, size=args.size, seed=args.seed)
    print(json.dumps({"out_dir": str(args.out_dir), "images": len(paths)}))
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The `moco` argument parser with all subcommands."""
    parser = argparse.ArgumentParser(prog="moco", description="MoCo on your own photos: train, export, index, search.")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    parser.add_argument("--version", action="version", version=f"moco {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_train(sub)
    _add_export(sub)
    _add_embed(sub)
    _add_pretrained(sub)
    _add_sample(sub)
    from app.cli.index import add_index

    add_index(sub)
    from app.cli.serve import add_run, add_serve

    add_serve(sub)
    add_run(sub)
    _verbose_everywhere(parser)
    return parser


def _verbose_everywhere(parser: argparse.ArgumentParser) -> None:
    """``-v`` after any subcommand too (``moco index stats IDX -v``), not only before it: each subcommand's parser
    takes it, and sets it only where given (so ``moco -v index stats IDX`` is not undone by the subcommand)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in dict.fromkeys(action.choices.values()):  # an alias names the same parser twice
                if not any("--verbose" in a.option_strings for a in child._actions):
                    child.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS,
                                       help="debug logging (as before the command)")
                _verbose_everywhere(child)


_STORAGE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EIO)


def _setup_logging(verbose: bool) -> None:
    rank = int(os.environ.get("RANK", "0"))
    level = logging.DEBUG if verbose else (logging.INFO if rank == 0 else logging.WARNING)
    fmt = "%(asctime)s %(levelname)s %(name)s: %(message)s" if verbose else "%(levelname)s: %(message)s"
    if rank:
        fmt = f"[rank {rank}] {fmt}"
    logging.basicConfig(level=level, format=fmt, stream=sys.stderr, force=True)


def _printable_paths() -> None:
    """Paths print as their own bytes (as ``ls`` prints them), even those that are not UTF-8, where stdout would
    refuse them (a UTF-8 locale other than C.UTF-8: errors="strict"); stderr already escapes them."""
    if getattr(sys.stdout, "errors", None) == "strict" and hasattr(sys.stdout, "reconfigure"):
        sys.stdout.reconfigure(errors="surrogateescape")


def _name(args: argparse.Namespace) -> str:
    sub = getattr(args, "index_command", None)
    return f"{args.command} {sub}" if sub else args.command


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; returns the exit code (0 ok, 2 bad input, 1 other error)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    _printable_paths()
    _setup_logging(args.verbose)
    from tqdm.contrib.logging import logging_redirect_tqdm

    try:
        with logging_redirect_tqdm():
            log_limits.install()  # on the handlers tqdm's redirect put in place
            return args.handler(args)
    except KeyboardInterrupt:
        print(f"moco {_name(args)}: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001 - the CLI reports, the traceback goes to --verbose
        if isinstance(e, OSError) and e.errno in _STORAGE_ERRNOS:  # a write of ours failed under us
            e = storage_error(e, e.filename or "?", "using")
        if isinstance(e, UserError):  # StorageError, NetworkError (disk full, offline) exit 1: not bad input
            print(f"moco {_name(args)}: error: {e}", file=sys.stderr)
            return e.exit_code
        if args.verbose:
            raise
        print(f"moco {_name(args)}: error: {type(e).__name__}: {e} (run with -v for the traceback)", file=sys.stderr)
        return 1

if __name__ == "__main__":
    raise SystemExit(main())
