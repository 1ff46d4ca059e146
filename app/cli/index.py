"""`moco index build|update|search|stats|dedup`: the batch indexing commands."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from index.catalog import display_path, taken_bound, taken_text
from moco.errors import UserError

if TYPE_CHECKING:
    from index.image_index import ImageIndex

__all__ = ["add_index"]


def add_index(sub: argparse._SubParsersAction) -> None:
    """Register `moco index ...` on the top-level subparsers."""
    from index.build import args as cli_args  # build/update flags live in index/, shared with `python -m index.build`

    top = sub.add_parser("index", help="build, update and query a FAISS index of a photo folder",
                         description="Batch indexing of a photo collection with an exported backbone.")
    cmds = top.add_subparsers(dest="index_command", required=True, metavar="ACTION")

    p = cmds.add_parser("build", help=cli_args.BUILD_HELP, description=cli_args.BUILD_DESCRIPTION)
    cli_args.add_build_arguments(p)
    p.set_defaults(handler=cmd_build)

    p = cmds.add_parser("update", help=cli_args.UPDATE_HELP, description=cli_args.UPDATE_DESCRIPTION)
    cli_args.add_update_arguments(p)
    p.set_defaults(handler=cmd_update)

    p = cmds.add_parser("search", help="nearest neighbours of an image", description="Rank the collection by "
                        "cosine similarity to IMAGE.")
    p.add_argument("index_dir", metavar="IDX")
    p.add_argument("image", metavar="IMAGE")
    p.add_argument("-k", type=int, default=10, help="results (default: 10)")
    p.add_argument("--folder", default=None, help="only results under this sub-folder of the collection")
    p.add_argument("--exclude-folder", action="append", default=[], metavar="FOLDER",
                   help="no results under this sub-folder of the collection (repeat for more)")
    p.add_argument("--taken-from", default=None, metavar="DATE",
                   help="only photos taken on or after this day (YYYY-MM-DD, or YYYY-MM-DDTHH:MM; EXIF "
                   "DateTimeOriginal, else the file's date)")
    p.add_argument("--taken-to", default=None, metavar="DATE", help="only photos taken on or before this day "
                   "(the whole day: --taken-from 2024-01-01 --taken-to 2024-12-31 is the year 2024)")
    p.add_argument("--backbone", default=None, metavar="B", help="the build's backbone, if it moved")
    p.add_argument("--json", action="store_true",
                   help='JSON: [{"rank", "id", "path", "score", "weak", "taken"}, ...]; taken: the date taken, '
                   "ISO 8601 on the camera's clock")
    p.set_defaults(handler=cmd_search)

    p = cmds.add_parser("stats", help="counts, kind, recall, backbone, size on disk, near-duplicate threshold")
    p.add_argument("index_dir", metavar="IDX")
    p.add_argument("--json", action="store_true")
    p.set_defaults(handler=cmd_stats)

    p = cmds.add_parser("dedup", help="near-duplicate groups (saved to IDX/dedup.json)")
    p.add_argument("index_dir", metavar="IDX")
    p.add_argument("--threshold", type=float, default=None,
                   help="centred cosine similarity (as search scores) of a group's photos to its representative "
                        "(default: the index's, calibrated at build time on copies of its photos; `moco index stats` "
                        "says which)")
    p.add_argument("--exclude-folder", action="append", default=[], metavar="FOLDER",
                   help="leave the photos under this sub-folder of the collection out (repeat for more)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(handler=cmd_dedup)


def cmd_build(args: argparse.Namespace) -> int:
    from index.build.runner import run_cli as run

    return run(args, update=False)


def cmd_update(args: argparse.Namespace) -> int:
    from index.build.runner import run_cli as run

    return run(args, update=True)


def cmd_search(args: argparse.Namespace) -> int:
    from index.image_index import ImageIndex

    if args.k < 1:
        raise UserError(f"-k {args.k}: ask for at least one result")
    if not Path(args.image).exists():  # a folder, a pipe or a device gets its reason from the decoder
        raise UserError(f"image not found: {args.image}")
    taken = (taken_bound(args.taken_from, False, "--taken-from"), taken_bound(args.taken_to, True, "--taken-to"))
    if None not in taken and taken[0] >= taken[1]:
        raise UserError(f"--taken-from {args.taken_from} is after --taken-to {args.taken_to}: swap them")
    idx = ImageIndex.open(args.index_dir)
    folder = _check_folder(idx, args.folder)
    away = [_check_folder(idx, f, "--exclude-folder") for f in args.exclude_folder]
    emb = idx.load_embedder(args.backbone)
    hits = idx.search_image(args.image, emb, k=args.k, folder=folder,  # refused as at every door: too small
                            exclude_folders=[f for f in away if f], taken=taken)
    weak = idx.weak_below  # None for an index from before centred scores
    out = [{"rank": r + 1, "id": int(i), "path": p, "score": round(float(s), 6),
            "weak": weak is not None and float(s) < weak, "taken": taken_text(row.taken)}
           for r, (i, s, p, row) in enumerate(zip(hits.ids[0], hits.scores[0], hits.paths[0], hits.rows[0]))]
    if args.json:
        print(json.dumps(out))
    else:
        for h in out:
            day = f"  {h['taken'][:10]}" if h["taken"] else ""
            print(f"{h['rank']:>4}  {h['score']:.4f}{day}  {display_path(h['path'])}"
                  f"{'  (weak match)' if h['weak'] else ''}")
        if out and out[0]["weak"]:
            print(f"no close match in the collection: every score is under {weak:.4f} (what "
                  "unrelated photos of the collection reach)", file=sys.stderr)
        if not out:
            print("no results (the index is empty, or nothing passes --folder, --exclude-folder and the dates)",
                  file=sys.stderr)
    return 0


def _check_folder(idx: ImageIndex, folder: str | None, flag: str = "--folder") -> str | None:
    """``--folder`` (or ``--exclude-folder``) as the search takes it (None: all), refused as the page and the API
    refuse it (400) when no indexed photo is under it: an unknown folder is a mistake, not a search with no
    results."""
    folder = (folder or "").strip().strip("/") or None
    if folder is None:
        return None
    paths = idx.catalog.rows()
    if any(path.startswith(folder + "/") for path in paths):
        return folder
    tops = sorted({path.split("/")[0] for path in paths if "/" in path})
    some = f" (its sub-folders: {', '.join(display_path(t) for t in tops[:8])}{', ...' if len(tops) > 8 else ''})"
    raise UserError(f"{flag}: no sub-folder {display_path(folder)!r} in the collection: give one that holds indexed "
                    f"photos{some if tops else ''}, or leave out {flag}")


def cmd_stats(args: argparse.Namespace) -> int:
    from index.image_index import ImageIndex

    idx = ImageIndex.open(args.index_dir)
    st = idx.stats()
    if args.json:
        print(json.dumps({**st, "errors": [{"path": p, "reason": r} for p, r in idx.catalog.errors()]}))
        return 0
    width = max(len(k) for k in st)
    for k, v in st.items():
        print(f"{k:<{width}}  {display_path(str(v))}")
    return 0


def cmd_dedup(args: argparse.Namespace) -> int:
    from index.calibrate import threshold_source
    from index.dedup import find_duplicates
    from index.image_index import ImageIndex

    idx = ImageIndex.open(args.index_dir)
    idx.catalog.check_writable()  # dedup.json goes beside the catalog
    threshold = idx.dedup_threshold if args.threshold is None else args.threshold
    away = [f for f in (_check_folder(idx, f, "--exclude-folder") for f in args.exclude_folder) if f]
    groups = find_duplicates(idx, threshold, exclude_folders=away)
    if args.json:
        print(json.dumps(groups))
        return 0
    for n, g in enumerate(groups, 1):
        print(f"group {n} ({g['size']} images, {g['loosest']:.4f}-{g['tightest']:.4f} to "
              f"{display_path(g['representative']['path'])}):")
        for m in g["members"]:
            mark = "  (representative)" if m["id"] == g["representative"]["id"] else ""
            print(f"  {m['similarity']:.4f}  {display_path(m['path'])}{mark}")
    source = "given" if args.threshold is not None else threshold_source(idx)
    print(f"{len(groups)} groups of near-duplicates, every photo at cosine >= {threshold} to its group's "
          f"representative ({source}); saved to {display_path(str(Path(args.index_dir) / 'dedup.json'))}")
    return 0
