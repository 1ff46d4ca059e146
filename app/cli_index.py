"""`moco index build|update|search|stats|dedup`: the batch indexing commands."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from moco.errors import UserError

__all__ = ["add_index"]


def _budget(text: str) -> int:
    try:
        gb = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of GiB (e.g. 4 or 0.5)") from None
    if gb <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: the memory budget must be positive")
    return int(gb * (1 << 30))


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--batch-size", type=int, default=64, help="images per forward pass (default: 64)")
    p.add_argument("--workers", type=int, default=None, help="decoding threads (default: up to 8)")
    p.add_argument("--device", default="auto", help="embedding device: auto, cpu, cuda, cuda:1 (default: auto)")
    p.add_argument("--gpu", default="auto", choices=("auto", "yes", "no"), help="FAISS on a GPU (default: auto)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")


def add_index(sub: argparse._SubParsersAction) -> None:
    """Register `moco index ...` on the top-level subparsers."""
    from index.store import KINDS

    top = sub.add_parser("index", help="build, update and query a FAISS index of a photo folder",
                         description="Batch indexing of a photo collection with an exported backbone.")  # fmt: skip
    cmds = top.add_subparsers(dest="index_command", required=True, metavar="ACTION")

    p = cmds.add_parser("build", help="index a photo folder", description="Scan PHOTOS (recursively), embed every "
                        "image, write IDX (index.faiss, index.json, catalog.sqlite, thumbs/). Re-running completes "
                        "an interrupted build. Under torchrun (`python -m index.build`), ranks share the embedding.")
    p.add_argument("photos", metavar="PHOTOS")
    p.add_argument("--backbone", required=True, metavar="B", help="backbone from `moco export` (.safetensors)")
    p.add_argument("-o", "--out", required=True, metavar="IDX", help="index directory")
    p.add_argument("--kind", default="auto", choices=KINDS, help="index kind (default: auto, by size and budget)")
    p.add_argument("--memory-budget", type=_budget, default=None, metavar="GIB",
                   help="RAM the index may use; auto picks a compressed index above it (default: half the RAM, "
                   "at most 8)")
    _common(p)
    p.set_defaults(handler=cmd_build)

    p = cmds.add_parser("update", help="re-scan the collection: add new, re-embed changed, drop deleted",
                        description="Embed only new and changed files (size+mtime, then content hash); moved or "
                        "renamed files keep their vectors.")  # fmt: skip
    p.add_argument("index_dir", metavar="IDX")
    p.add_argument("--backbone", default=None, metavar="B", help="the build's backbone, if it moved")
    p.add_argument("--root", default=None, help="the collection's new place, if it moved")
    p.add_argument("--kind", default=None, choices=KINDS, help="switch the index kind (rebuilds the FAISS index)")
    _common(p)
    p.set_defaults(handler=cmd_update)

    p = cmds.add_parser("search", help="nearest neighbours of an image", description="Rank the collection by "
                        "cosine similarity to IMAGE.")  # fmt: skip
    p.add_argument("index_dir", metavar="IDX")
    p.add_argument("image", metavar="IMAGE")
    p.add_argument("-k", type=int, default=10, help="results (default: 10)")
    p.add_argument("--folder", default=None, help="only results under this sub-folder of the collection")
    p.add_argument("--backbone", default=None, metavar="B", help="the build's backbone, if it moved")
    p.add_argument("--json", action="store_true", help='JSON: [{"rank", "id", "path", "score"}, ...]')
    p.set_defaults(handler=cmd_search)

    p = cmds.add_parser("stats", help="counts, kind, recall, backbone, size on disk")
    p.add_argument("index_dir", metavar="IDX")
    p.add_argument("--json", action="store_true")
    p.set_defaults(handler=cmd_stats)

    p = cmds.add_parser("dedup", help="near-duplicate groups (saved to IDX/dedup.json)")
    p.add_argument("index_dir", metavar="IDX")
    p.add_argument("--threshold", type=float, default=0.95, help="cosine similarity that links two images")
    p.add_argument("--json", action="store_true")
    p.set_defaults(handler=cmd_dedup)


def _print_summary(s: Any, as_json: bool, index_dir: str) -> None:
    if as_json:
        print(json.dumps({"index": index_dir, **s.as_dict()}))
        return
    if int(os.environ.get("RANK", "0")) != 0:
        return
    print(f"{index_dir}: {s.vectors} images searchable ({s.kind}, recall@10 {s.recall_at_10}"
          f"{', ' + ', '.join(f'{k}={v}' for k, v in s.params.items()) if s.params else ''})")  # fmt: skip
    print(f"  embedded {s.embedded} new, {s.reembedded} changed; {s.moved} moved, {s.copied} copies, "
          f"{s.touched} touched, {s.unchanged} unchanged, {s.removed} removed; "
          f"{s.seconds:.1f} s ({s.images_per_s:.1f} images/s)")  # fmt: skip
    if s.errors:
        print(f"  skipped {len(s.errors)} files:")
        for path, reason in s.errors[:20]:
            print(f"    {path}: {reason}")
        if len(s.errors) > 20:
            print(f"    ... and {len(s.errors) - 20} more (`moco index stats {index_dir} --json` lists them)")


def cmd_build(args: argparse.Namespace) -> int:
    from index.build import build_index

    s = build_index(args.photos, args.backbone, args.out, kind=args.kind, memory_budget=args.memory_budget,
                    batch_size=args.batch_size, workers=args.workers, progress=not args.quiet,
                    device=args.device, use_gpu=args.gpu)  # fmt: skip
    _print_summary(s, args.json, args.out)
    return 0


def cmd_update(args: argparse.Namespace) -> int:
    from index.build import update_index

    s = update_index(args.index_dir, backbone=args.backbone, root=args.root, kind=args.kind,
                     batch_size=args.batch_size, workers=args.workers, progress=not args.quiet,
                     device=args.device, use_gpu=args.gpu)  # fmt: skip
    _print_summary(s, args.json, args.index_dir)
    return 0


def cmd_search(args: argparse.Namespace) -> int:
    from index.image_index import ImageIndex

    if args.k < 1:
        raise UserError(f"-k {args.k}: ask for at least one result")
    if not Path(args.image).is_file():
        raise UserError(f"image not found: {args.image}")
    idx = ImageIndex.open(args.index_dir)
    emb = idx.load_embedder(args.backbone)
    hits = idx.search(emb.embed(args.image), k=args.k, folder=args.folder)
    out = [{"rank": r + 1, "id": int(i), "path": p, "score": round(float(s), 6)}
           for r, (i, s, p) in enumerate(zip(hits.ids[0], hits.scores[0], hits.paths[0]))]  # fmt: skip
    if args.json:
        print(json.dumps(out))
    else:
        for h in out:
            print(f"{h['rank']:>4}  {h['score']:.4f}  {h['path']}")
        if not out:
            print("no results (the index is empty, or nothing under --folder)", file=sys.stderr)
    return 0


def cmd_stats(args: argparse.Namespace) -> int:
    from index.image_index import ImageIndex

    idx = ImageIndex.open(args.index_dir)
    st = idx.stats()
    if args.json:
        print(json.dumps({**st, "errors": [{"path": p, "reason": r} for p, r in idx.catalog.errors()]}))
        return 0
    width = max(len(k) for k in st)
    for k, v in st.items():
        print(f"{k:<{width}}  {v}")
    return 0


def cmd_dedup(args: argparse.Namespace) -> int:
    from index.dedup import find_duplicates
    from index.image_index import ImageIndex

    idx = ImageIndex.open(args.index_dir)
    groups = find_duplicates(idx, args.threshold)
    if args.json:
        print(json.dumps(groups))
        return 0
    for n, g in enumerate(groups, 1):
        print(f"group {n} ({g['size']} images):")
        for m in g["members"]:
            print(f"  {m['best_similarity']:.4f}  {m['path']}")
    print(f"{len(groups)} groups of near-duplicates at cosine >= {args.threshold}; saved to "
          f"{Path(args.index_dir) / 'dedup.json'}")  # fmt: skip
    return 0
