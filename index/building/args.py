"""`moco index build|update` as flags and a printed summary: declared here so that
`python -m index.building` (torchrun) is the same command without importing app/."""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

from index.catalog import display_path
from index.search.store import KINDS

__all__ = ["BUILD_HELP", "BUILD_DESCRIPTION", "UPDATE_HELP", "UPDATE_DESCRIPTION", "add_build_arguments",
           "add_update_arguments", "memory_budget", "print_summary"]

BUILD_HELP = "index a photo folder"
BUILD_DESCRIPTION = (
    "Scan PHOTOS (recursively), embed every image, write IDX (index.faiss, index.json, catalog.sqlite, thumbs/). "
    "Re-running completes an interrupted build. Under torchrun (`python -m index.building`), ranks share the embedding."
)
UPDATE_HELP = "re-scan the collection: add new, re-embed changed, drop deleted"
UPDATE_DESCRIPTION = (
    "Embed only new and changed files (size+mtime, then content hash); moved or renamed files keep their vectors."
)


IDX_HELP = "the index folder (made by `moco index build PHOTOS -o IDX`)"

def memory_budget(text: str) -> int:
    """The argparse type of --memory-budget: GiB (e.g. 4 or 0.5) -> bytes."""
    try:
        gb = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of GiB (e.g. 4 or 0.5)") from None
    if gb <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: the memory budget must be positive")
    return int(gb * (1 << 30))


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--exclude", action="append", default=None, metavar="GLOB",
                   help="a folder or files never read, as a pattern relative to the collection root, e.g. "
                   "'private/**' or '*.gif' (repeat for more). The index keeps its patterns: an update adds these")
    p.add_argument("--batch-size", type=int, default=64, help="images per forward pass (default: 64)")
    p.add_argument("--workers", type=int, default=None, help="decoding threads (default: up to 8)")
    p.add_argument("--device", default="auto", help="embedding device: auto, cpu, cuda, cuda:1, mps (default: auto)")
    p.add_argument("--gpu", default="auto", choices=("auto", "yes", "no"), help="FAISS on a GPU (default: auto)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")


def add_build_arguments(p: argparse.ArgumentParser) -> None:
    """PHOTOS --backbone B -o IDX and the build options."""
    p.add_argument("photos", metavar="PHOTOS", help="folder of photos (searched recursively)")
    p.add_argument("--backbone", required=True, metavar="B", help="backbone from `moco export` (.safetensors)")
    p.add_argument("-o", "--out", required=True, metavar="IDX", help="index directory")
    p.add_argument("--kind", default="auto", choices=KINDS, help="index kind (default: auto, by size and budget)")
    p.add_argument("--memory-budget", type=memory_budget, default=None, metavar="GIB",
                   help="RAM the index may use; auto picks a compressed index above it (default: half the RAM, "
                   "at most 8)")
    _common(p)


def add_update_arguments(p: argparse.ArgumentParser) -> None:
    """IDX and the update options."""
    p.add_argument("index_dir", metavar="IDX", help=IDX_HELP)
    p.add_argument("--backbone", default=None, metavar="B", help="the build's backbone, if it moved")
    p.add_argument("--root", default=None, help="the collection's new place, if it moved")
    p.add_argument("--kind", default=None, choices=KINDS, help="switch the index kind (rebuilds the FAISS index)")
    p.add_argument("--clear-excludes", action="store_true",
                   help="forget the index's earlier --exclude patterns (the photos they left out are indexed, "
                   "unless this update's --exclude names them)")
    add_watch_arguments(p, "then keep updating: photos added, changed, moved or deleted are noticed and the index "
                        "updated once they settle, until Ctrl+C")
    _common(p)


def add_watch_arguments(p: argparse.ArgumentParser, what: str) -> None:
    """``--watch`` and ``--poll S`` (:mod:`index.building.watch`)."""
    p.add_argument("--watch", action="store_true", help=what + " (file system events with the `watch` extra, "
                   "else a scan every 10 s)")
    p.add_argument("--poll", type=float, default=None, metavar="S",
                   help="with --watch: scan the folder every S seconds instead of listening to events (network "
                   "drives, where events never come)")


def print_summary(s: Any, as_json: bool, index_dir: str) -> None:
    """What a build/update did, for people or as JSON; other torchrun ranks print nothing."""
    if int(os.environ.get("RANK", "0")) != 0:
        return
    if as_json:  # ensure_ascii (the default) keeps undecodable names exact, as \\udcXX escapes
        print(json.dumps({"index": index_dir, **s.as_dict()}))
        return
    index_dir = display_path(index_dir)
    print(f"{index_dir}: {s.vectors} images searchable ({s.kind}, recall@10 {s.recall_at_10}"
          f"{', ' + ', '.join(f'{k}={v}' for k, v in s.params.items()) if s.params else ''})")
    print(f"  embedded {s.embedded} new, {s.reembedded} changed; {s.moved} moved, {s.copied} copies, "
          f"{s.touched} touched, {s.unchanged} unchanged, {s.removed} removed; "
          f"{s.seconds:.1f} s ({s.images_per_s:.1f} images/s)")
    from moco.data.photos import skipped_notes

    for note in skipped_notes(s.unsupported):
        print(f"  {note}")
    if s.exclude:
        print(f"  excluded (--exclude {' --exclude '.join(repr(p) for p in s.exclude)}): {s.excluded} files and "
              "folders never read")
    if s.headers_read:
        print(f"  read the date taken, camera and size of {s.headers_read} photos indexed before they were kept")
    if s.errors:
        print(f"  skipped {len(s.errors)} files:")
        for path, reason in s.errors[:20]:
            print(f"    {display_path(path)}: {reason}")
        if len(s.errors) > 20:
            print(f"    ... and {len(s.errors) - 20} more (`moco index stats {index_dir} --json` lists them)")
