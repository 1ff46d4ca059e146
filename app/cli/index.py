"""`moco index build|update|search|stats|dedup|map|themes|unusual|browse`: the batch indexing commands, and the views
of the whole collection (:mod:`index.overview`)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from index.building.args import IDX_HELP
from index.catalog import date_text, display_path, taken_bound
from index.duplicates.groups import DEFAULT_KINDS, KINDS, SIMILAR
from moco.errors import UserError, plural

if TYPE_CHECKING:
    from index.duplicates.groups import Group
    from index.search.image_index import ImageIndex

__all__ = ["add_index"]


def add_index(sub: argparse._SubParsersAction) -> None:
    """Register `moco index ...` on the top-level subparsers."""
    from index.building import (
        args as cli_args,  # build/update flags live in index/, shared with `python -m index.building`
    )

    top = sub.add_parser("index", help="build, update and query a FAISS index of a photo folder",
                         description="Batch indexing of a photo collection with an exported backbone.")
    cmds = top.add_subparsers(dest="index_command", required=True, metavar="ACTION")

    p = cmds.add_parser("build", help=cli_args.BUILD_HELP, description=cli_args.BUILD_DESCRIPTION)
    cli_args.add_build_arguments(p)
    p.set_defaults(handler=cmd_build)

    p = cmds.add_parser("update", help=cli_args.UPDATE_HELP, description=cli_args.UPDATE_DESCRIPTION)
    cli_args.add_update_arguments(p)
    p.set_defaults(handler=cmd_update)

    p = cmds.add_parser("search", help="nearest neighbours of an image, or of several", description="Rank the "
                        "collection by cosine similarity to IMAGE. With several photos (more IMAGEs, --id) and photos "
                        "to avoid (--not, --not-id), the query is one vector of the index's space: the mean of the "
                        "positives minus a tenth of the mean of the negatives (index.search.query; BENCHMARKS.md "
                        "'Search with several photos'). The query photos themselves (indexed files with an IMAGE's "
                        "very bytes, the "
                        "photos of --id and --not-id) are left out of the results unless --include-queries, one IMAGE "
                        "alone as several; a near-copy with other bytes is a result as any other.")
    p.add_argument("index_dir", metavar="IDX", help=IDX_HELP)
    p.add_argument("images", metavar="IMAGE", nargs="*", help="photos to search with (more like these)")
    p.add_argument("--not", dest="not_images", action="append", default=[], metavar="IMAGE",
                   help="a photo the results should be less like (repeat for more)")
    p.add_argument("--id", dest="ids", action="append", default=[], type=int, metavar="N",
                   help="an indexed photo (its id in --json results) to search with (repeat for more)")
    p.add_argument("--not-id", dest="not_ids", action="append", default=[], type=int, metavar="N",
                   help="an indexed photo the results should be less like (repeat for more)")
    p.add_argument("--deduplicate", action="store_true",
                   help="hide results within the index's near-copy threshold of a better result shown")
    p.add_argument("--include-queries", action="store_true",
                   help="keep the query photos (by id, or indexed files with an IMAGE's very bytes) among the "
                   "results: a photo of the collection then finds itself first")
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
    p.add_argument("index_dir", metavar="IDX", help=IDX_HELP)
    p.add_argument("--json", action="store_true")
    p.set_defaults(handler=cmd_stats)

    p = cmds.add_parser("dedup", help="groups of duplicates (exact, near, similar), and acting on them",
                        description="Groups of duplicates, saved to IDX/dedup.json: exact (the same bytes), near (the "
                        "same shot re-encoded, resized, cropped, recoloured) and, with --kind similar, similar "
                        "(bursts, the same scene). Each group has an id, a suggested keeper and the reason. --move-to "
                        "moves every other photo of the groups out of the collection (never deleting, never "
                        "overwriting), journalled; --undo puts them back.")
    p.add_argument("index_dir", metavar="IDX", help=IDX_HELP)
    p.add_argument("--threshold", type=float, default=None,
                   help="near: the centred cosine similarity (as search scores) at which the model proposes two photos "
                        "(default: the index's, calibrated at build time on copies of its photos, raised above the "
                        "collection's crowd level; the output says which rule set it). Each photo's closest photo "
                        "by the model, by its pixels and by a crop of them is proposed too. A proposed pair is "
                        "near only where its pixels show a copy: one re-encoded, resized, cropped (70%% of a side "
                        "or more), brightened or mirrored from the other (its copy score, listed per photo, at least "
                        "the one the summary states); alike distinct photos are not")
    p.add_argument("--similar-threshold", type=float, default=None, metavar="F",
                   help="similar: the same, for --kind similar (default: measured on the collection)")
    p.add_argument("--kind", action="append", choices=KINDS, default=None,
                   help="the groups to list and act on (repeatable; default: exact and near)")
    p.add_argument("--group", action="append", default=None, metavar="GROUP_ID",
                   help="act on this group only (repeatable; ids from the listing)")
    p.add_argument("--move-to", default=None, metavar="DIR",
                   help="move every photo of the groups but its keeper into DIR, keeping its path relative to the "
                        "collection (a taken name gets a suffix), then update the index; a folder inside the "
                        "collection must be hidden (like PHOTOS/.moco-duplicates); with --undo: a folder photos were "
                        "moved to that holds no mark of this index (undo takes photos back only from the folders moves "
                        "marked, and PHOTOS/.moco-duplicates)")
    p.add_argument("--dry-run", action="store_true", help="with --move-to: say what would move, move nothing")
    p.add_argument("--undo", action="store_true", help="put back every photo moved (the journal in the catalog), "
                   "then update the index")
    p.add_argument("--keep", action="append", type=int, default=None, metavar="PHOTO_ID",
                   help="keep this photo of its group (of the last search) now and in later searches (repeatable)")
    p.add_argument("--not-duplicates", action="append", default=None, metavar="GROUP_ID",
                   help="say that the photos of this group (of the last search) are not duplicates: never grouped "
                        "again (repeatable)")
    p.add_argument("--exclude-folder", action="append", default=[], metavar="FOLDER",
                   help="leave the photos under this sub-folder of the collection out (repeat for more)")
    p.add_argument("--device", default="auto", help="for the index update after a move: auto, cpu, cuda")
    p.add_argument("--workers", type=int, default=None, metavar="N",
                   help="processes of the pixel check (default: one a core; 0: this process alone)")
    p.add_argument("--json", action="store_true", help="JSON: the groups (a list), or what a move, an undo or a mark "
                   "did (an object)")
    p.set_defaults(handler=cmd_dedup)
    _add_views(cmds)


def _add_views(cmds: argparse._SubParsersAction) -> None:
    """`moco index map|themes|unusual|browse`: the whole collection, from the index's own vectors."""
    p = cmds.add_parser("map", help="a map of the collection: every photo a point, alike photos close",
                        description="A 2-D layout of every indexed photo from the index's centred features, "
                        "coloured by theme; kept in the index directory with the index's version (computed again "
                        "only after the index changed).")
    p.add_argument("index_dir", metavar="IDX", help=IDX_HELP)
    p.add_argument("-o", "--out", default=None, metavar="MAP.png",
                   help="draw the map as a PNG, coloured by theme, with a thumbnail of a photo in each part of it "
                   "(needs the plot extra: matplotlib)")
    p.add_argument("--method", choices=["pca", "umap"], default="pca",
                   help="pca (default: numpy only) or umap (the map extra: umap-learn; keeps neighbours together)")
    p.add_argument("--refresh", action="store_true", help="compute it again even if the index did not change")
    p.add_argument("--json", action="store_true",
                   help='JSON: [{"id", "path", "x", "y", "theme"}, ...], x and y in [0, 1]')
    p.set_defaults(handler=cmd_map)

    p = cmds.add_parser("themes", help="the collection's themes: groups of alike photos (k-means)",
                        description="Themes: spherical k-means on the index's centred features (FAISS), each theme "
                        "with its size, its most central photos and its top folders; the number of themes follows the "
                        "collection's size (round(sqrt(N/2)), from 2 to 64) unless --themes says.")
    p.add_argument("index_dir", metavar="IDX", help=IDX_HELP)
    p.add_argument("--themes", type=int, default=None, metavar="K", help="this many themes (default: from the size)")
    p.add_argument("--refresh", action="store_true", help="compute them again even if the index did not change")
    p.add_argument("--json", action="store_true", help='JSON: {"k", "version", "count", "themes": [{"id", "size", '
                   '"central": [{"id", "path"}], "folders": [{"folder", "count"}]}]}')
    p.set_defaults(handler=cmd_themes)

    p = cmds.add_parser("unusual", help="the photos farthest from any other photo of the collection",
                        description="Each photo's cosine to its closest other photo (as search scores it), lowest "
                        "first: the photos unlike anything else. A photo with an exact copy is never unusual.")
    p.add_argument("index_dir", metavar="IDX", help=IDX_HELP)
    p.add_argument("-n", type=int, default=20, help="photos to list (default: 20)")
    p.add_argument("--offset", type=int, default=0, help="photos to skip first")
    p.add_argument("--json", action="store_true", help='JSON: {"total", "offset", "limit", "next_offset", "photos": '
                   '[{"id", "path", "closest"}]}')
    p.set_defaults(handler=cmd_unusual)

    p = cmds.add_parser("browse", help="list the collection's photos by folder or theme, by name or date",
                        description="A page of the collection's photos: under --folder, of --theme, sorted.")
    p.add_argument("index_dir", metavar="IDX", help=IDX_HELP)
    p.add_argument("--folder", default=None, help="only photos under this sub-folder of the collection")
    p.add_argument("--theme", type=int, default=None, help="only photos of this theme (ids: `moco index themes`)")
    p.add_argument("--sort", choices=["name", "date", "-date"], default="name",
                   help="name (the path), date (taken, oldest first) or -date (newest first: --sort=-date)")
    p.add_argument("-n", type=int, default=60, help="photos to list (default: 60)")
    p.add_argument("--offset", type=int, default=0, help="photos to skip first")
    p.add_argument("--json", action="store_true", help='JSON: {"total", "offset", "limit", "next_offset", "folder", '
                   '"theme", "sort", "photos": [{"id", "path", "taken", "width", "height"}]}')
    p.set_defaults(handler=cmd_browse)


def cmd_build(args: argparse.Namespace) -> int:
    from index.building.runner import run_cli as run

    return run(args, update=False)


def cmd_update(args: argparse.Namespace) -> int:
    from index.building.runner import run_cli as run

    return run(args, update=True)


def cmd_search(args: argparse.Namespace) -> int:
    from index.search.query import check_query_file

    if args.k < 1:
        raise UserError(f"-k {args.k}: ask for at least one result")
    if not args.images and not args.ids:
        raise UserError("give a photo to search with: IMAGE, or --id N of an indexed photo")
    for image in (*args.images, *args.not_images):
        if not Path(image).exists():  # a folder, a pipe or a device gets its reason from the decoder
            raise UserError(f"image not found: {image}")
        check_query_file(image)  # no image, or too small: refused before torch, the index or the model loads
    taken = (taken_bound(args.taken_from, False, "--taken-from"), taken_bound(args.taken_to, True, "--taken-to"))
    if None not in taken and taken[0] >= taken[1]:
        raise UserError(f"--taken-from {args.taken_from} is after --taken-to {args.taken_to}: swap them")
    from index.search.image_index import ImageIndex

    idx = ImageIndex.open(args.index_dir)
    folder = _check_folder(idx, args.folder)
    away = [f for f in (_check_folder(idx, f, "--exclude-folder") for f in args.exclude_folder) if f]
    given = (*args.ids, *args.not_ids)
    unknown = sorted(set(given) - set(idx.catalog.rows_by_id(given)))
    if unknown:
        raise UserError(f"--id/--not-id {unknown[0]}: no indexed photo has this id (ids are in `moco index search "
                        "--json` results)")
    emb = idx.load_embedder(args.backbone)
    skip: list[int] = []  # the query photos, left out: by id, and indexed files with an image's very bytes
    if not args.include_queries:
        skip = [*given, *_twins(idx, [*args.images, *args.not_images])]
    one = len(args.images) == 1 and not (args.not_images or given)
    if one and not args.deduplicate:  # one photo (refused as at every door: too small)
        hits = idx.search_image(args.images[0], emb, k=args.k, folder=folder, exclude_folders=away, taken=taken,
                                exclude_ids=skip)
    else:
        query = idx.query_vector(_features(idx, emb, args.images, args.ids),
                                 _features(idx, emb, args.not_images, args.not_ids))  # D, in the index's space
        hits = idx.search(query, k=args.k, folder=folder, exclude_folders=away, taken=taken, centred=True,
                          exclude_ids=skip, deduplicate=args.deduplicate)
    weak = idx.weak_below  # None for an index from before centred scores
    out = [{"rank": r + 1, "id": int(i), "path": p, "score": round(float(s), 6),
            "weak": weak is not None and float(s) < weak, "taken": date_text(row.date)}
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


def _twins(idx: ImageIndex, images: list[str]) -> list[int]:
    """Ids of the indexed photos with one of these query files' very bytes (the query photos themselves); a file
    that cannot be hashed (a pipe, a device) matches none: the decoder says why it cannot be searched with."""
    from index.building.plan import file_hashes

    hashes = file_hashes(images)
    return idx.ids_of_files(hashes) if hashes else []


def _features(idx: ImageIndex, emb: Any, images: list[str], ids: list[int]) -> Any:
    """Features (N x D, as :meth:`ImageIndex.search` takes them) of query images and indexed photos, in that order."""
    import numpy as np

    parts = [idx.embed_queries(images, emb)] if images else []  # each n x D
    if ids:
        parts.append(idx.vectors(np.array(ids, np.int64)))
    return np.concatenate(parts) if parts else np.zeros((0, idx.dim), np.float32)


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
    from index.search.image_index import ImageIndex

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
    from index.search.image_index import ImageIndex

    if args.dry_run and (not args.move_to or args.undo):
        raise UserError("--dry-run goes with --move-to DIR: it says what a move would do")
    actions = [name for name, on in (("--move-to", args.move_to and not args.undo), ("--undo", args.undo),
                                     ("--not-duplicates", args.not_duplicates)) if on]
    if len(actions) > 1:
        raise UserError(f"{' and '.join(actions)}: one action at a time")
    idx = ImageIndex.open(args.index_dir)
    idx.catalog.check_writable()  # dedup.json goes beside the catalog
    if args.undo:
        return _undo(idx, args)
    if args.not_duplicates:
        return _not_duplicates(idx, args)
    if args.keep:
        _keep(idx, args)
    if args.move_to:
        from index.duplicates.resolve.actions import settle

        settle(idx, args.device)  # a move a kill cut off: finished, and the index updated, before the search
    return _search(idx, args)


def _search(idx: ImageIndex, args: argparse.Namespace) -> int:
    from index.calibrate import describe_threshold
    from index.duplicates.dedup import search_duplicates
    from index.duplicates.resolve.actions import select_groups

    kinds = args.kind or list(DEFAULT_KINDS)
    away = [f for f in (_check_folder(idx, f, "--exclude-folder") for f in args.exclude_folder) if f]
    found = search_duplicates(idx, args.threshold, kinds, args.similar_threshold, exclude_folders=away,
                              progress=sys.stderr.isatty() and not args.json,  # bars with time left
                              workers=args.workers)
    groups = select_groups(found.groups, kinds, args.group)
    if args.move_to:
        return _move(idx, args, groups)
    d = found.decision
    if args.json:
        print(json.dumps([g.to_json() for g in groups]))
        return 0
    for n, g in enumerate(groups, 1):
        rep = g.representative
        print(f"group {n} {g.id} ({g.kind}, {g.size} photos, {g.loosest:.4f}-{g.tightest:.4f} to "
              f"{display_path(rep.path or '') if rep else '?'}); keep {display_path(g.keep or '')}: {g.reason}")
        for m in g.members:
            marks = [w for w, on in (("representative", rep is not None and m.id == rep.id),
                                     ("keep", m.id == g.keep_id)) if on]
            copy = f"  copy score {m.copy_score:.4f}" if m.copy_score is not None else ""
            print(f"  {m.similarity:.4f}  {m.id:>6}  {display_path(m.path)}"
                  f"{'  (' + ', '.join(marks) + ')' if marks else ''}{copy}")
    counts = ", ".join(f"{sum(g.kind == k for g in groups)} {k}" for k in kinds)
    lines = [f"{plural(len(groups), 'group')} ({counts}), saved to "
             f"{display_path(str(Path(args.index_dir) / 'dedup.json'))}",
             f"  near: every photo a copy of its group's representative by its pixels (copy score >= "
             f"{d['copy_score']})",
             f"  proposed: {plural(d['proposed'], 'pair')}, by the model at cosine >= {d['threshold']} "
             f"({describe_threshold(d)}) and by each photo's {d['propose_k']} closest photos"
             + (f" ({plural(d['looked_up'], 'photo')} looked up among all, the others only among the photos new "
                "since the last search)" if d.get("looked_up", found.images) < found.images else ""),
             *([f"  taken apart: {plural(d['taken_apart'], 'pair')} whose files' dates taken or cameras say they "
                "are two shots (not checked)"] if d.get("taken_apart") else []),
             f"  turned down: {d['turned_down']} of the model's pairs at that cosine are no copies",
             f"  pixel check: {plural(d.get('checked', d['proposed']), 'pair')} checked, {d.get('reused', 0)} scored "
             "by an earlier search (kept in the index folder)",
             f"  left out: {plural(d['crowded'], 'photo')} matching 10 others or more by pixels (a sky, a gradient)"]
    if SIMILAR in kinds:
        lines.append(f"  similar: cosine >= {d['similar_threshold']}")
    print("\n".join(lines))
    return 0


def _print_outcome(out: Any, args: argparse.Namespace) -> None:
    if args.json:
        print(json.dumps(out.as_dict()))
        return
    verb = {"move": "would move" if out.dry_run else "moved", "undo": "put back"}[out.action]
    for d in out.done:
        print(f"{verb}  {d['from']}  ->  {d['to']}")
    for s in out.skipped:
        print(f"skipped  {s['path']}: {s['reason']}", file=sys.stderr)
    tail = (f"; finished {out.finished} cut off by an earlier kill" if out.finished else "") + (
        f"; index updated, {plural(out.groups, 'group')} left" if out.updated and out.groups is not None else "")
    what = f" (action {out.batch})" if out.batch else ""
    dest = f"; destination {out.destination}" if out.destination else ""
    print(f"{plural(len(out.done), 'photo')} {verb}{what}{tail}{dest}")


def _move(idx: ImageIndex, args: argparse.Namespace, groups: list[Group]) -> int:
    from index.duplicates.resolve.actions import move_duplicates

    out = move_duplicates(idx, groups, dest=args.move_to, dry_run=args.dry_run, device=args.device)
    _print_outcome(out, args)
    return 0


def _undo(idx: ImageIndex, args: argparse.Namespace) -> int:
    from index.duplicates.resolve.actions import undo_moves

    _print_outcome(undo_moves(idx, device=args.device, moved_to=args.move_to), args)
    return 0


def _not_duplicates(idx: ImageIndex, args: argparse.Namespace) -> int:
    from index.duplicates.resolve.actions import mark_not_duplicates

    groups = [mark_not_duplicates(idx, gid) for gid in args.not_duplicates]
    if args.json:
        print(json.dumps({"not_duplicates": [{"group": g.id, "ids": g.ids} for g in groups]}))
        return 0
    for g in groups:
        print(f"group {g.id} ({g.size} photos): not duplicates; they are never grouped again")
    return 0


def _keep(idx: ImageIndex, args: argparse.Namespace) -> None:
    from index.duplicates.dedup import load_duplicates
    from index.duplicates.resolve.actions import choose_keeper

    doc = load_duplicates(idx.dir)
    for photo in args.keep:
        group = next((g for g in (doc.groups if doc else ()) if photo in g.ids), None)
        if group is None:
            raise UserError(f"--keep {photo}: no group of the last search holds photo {photo}; find the duplicates "
                            f"(`moco index dedup {idx.dir}`) and give an id it lists")
        choose_keeper(idx, group.id, photo)
        print(f"keeping {photo} of group {group.id}", file=sys.stderr)


# ------------------------------------------------------------------------------- the whole collection
def cmd_map(args: argparse.Namespace) -> int:
    from index.overview.documents import map_document, map_rows
    from index.overview.layout import collection_map, save_map_png
    from index.search.image_index import ImageIndex

    idx = ImageIndex.open(args.index_dir)
    doc = map_document(idx, args.method, args.refresh)
    if args.out:
        m = collection_map(idx, args.method)  # the same map: read back from memory
        rows = idx.catalog.rows_by_id(m.ids)
        save_map_png(m, args.out, f"{display_path(idx.root.name)}: {doc.count} photos ({args.method}), "
                                  f"{len(set(doc.theme))} themes",
                     thumbs=lambda i: idx.thumb_path(rows[i]) if i in rows else None)
    if args.json:
        print(json.dumps([p.to_json() for p in map_rows(idx, doc)]))
    else:
        print(f"map of {doc.count} photos ({doc.method}, index version {doc.version})"
              + (f": drawn to {display_path(str(args.out))}" if args.out else ""))
    return 0


def cmd_themes(args: argparse.Namespace) -> int:
    from index.overview.documents import themes_document
    from index.search.image_index import ImageIndex

    idx = ImageIndex.open(args.index_dir)
    doc = themes_document(idx, args.themes, args.refresh)
    if args.json:
        print(json.dumps(doc.to_json()))
        return 0
    for t in doc.themes:
        folders = ", ".join(f"{f.folder or '(top)'} {f.count}" for f in t.folders)
        print(f"theme {t.id}: {t.size} photos; folders: {folders}")
        for c in t.central[:5]:
            print(f"  {c.id:>6}  {c.path}")
    print(f"{doc.k} themes of {doc.count} photos (spherical k-means on the index's centred features); "
          f"`moco index browse {args.index_dir} --theme ID` lists one")
    return 0


def cmd_unusual(args: argparse.Namespace) -> int:
    from index.overview.documents import MAX_PAGE, unusual_document
    from index.search.image_index import ImageIndex

    if not 1 <= args.n <= MAX_PAGE:
        raise UserError(f"-n {args.n}: list from 1 to {MAX_PAGE} photos at a time (--offset for the next ones)")
    idx = ImageIndex.open(args.index_dir)
    doc = unusual_document(idx, args.offset, args.n)
    if args.json:
        print(json.dumps(doc.to_json()))
        return 0
    for p in doc.photos:
        print(f"{p.closest:.4f}  {p.id:>6}  {p.path}")
    print(f"{len(doc.photos)} of {doc.total} photos, by the cosine to their closest other photo (lowest: the "
          "most unusual)", file=sys.stderr)
    return 0


def cmd_browse(args: argparse.Namespace) -> int:
    from index.overview.documents import MAX_PAGE, browse_document
    from index.search.image_index import ImageIndex

    if not 1 <= args.n <= MAX_PAGE:
        raise UserError(f"-n {args.n}: list from 1 to {MAX_PAGE} photos at a time (--offset for the next ones)")
    if args.offset < 0:
        raise UserError(f"--offset {args.offset}: give 0 or more photos to skip")
    idx = ImageIndex.open(args.index_dir)
    folder = _check_folder(idx, args.folder)
    doc = browse_document(idx, folder, args.theme, args.sort, args.offset, args.n)
    if args.json:
        print(json.dumps(doc.to_json()))
        return 0
    for p in doc.photos:
        print(f"{p.id:>6}  {(p.taken or '')[:10]:<10}  {p.path}")
    print(f"{len(doc.photos)} of {doc.total} photos", file=sys.stderr)
    return 0
