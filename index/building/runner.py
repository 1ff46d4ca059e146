"""Build and update an index directory: scan -> plan -> embed -> catalog -> FAISS index, crash-safe.

Every step commits before the next starts: embedded batches go into the catalog (SQLite
transactions), then the FAISS index is written to a temporary file and renamed over ``index.faiss``,
then ``index.json``, then the catalog records which rows the new file holds. Killing the process at
any moment leaves the previous index searchable; running the same command again finishes the work
(re-adding a row is remove-then-add, so nothing is ever in the index twice).

The catalog is the source of truth. An ``index.faiss`` that cannot be trusted to hold its vectors
(``index.json`` lost, either file from another index by their index id, an unreadable file) is
rebuilt from it, with a warning. A failed write of ours (thumbnail, disk full) stops the run with
:class:`~moco.errors.StorageError`; only a photo that cannot be read or decoded becomes an error row.

Under ``torchrun`` (``python -m index.building ...``) rank 0 plans, every rank decodes and embeds its
share of each round of files (``files[rank::world]``), and rank 0 gathers the results, commits them
and writes the index: the same catalog and index as one process, in a fraction of the time.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

from index.building.plan import Plan, Summary, make_plan
from index.building.prepare import (
    clean_thumbs,
    commit,
    decode_round,
    embed_round,
    ensure_thumbs_dir,
    fill_headers,
    is_our_failure,
    quick_ops,
    restore_thumbs,
)
from index.building.sync import store_is_current, sync_store
from index.catalog import Catalog, catalog_meta, set_catalog_meta
from index.search.index_dir import (
    CATALOG_FILE,
    INDEX_FILE,
    META_FILE,
    VECTORS,
    read_meta,
)
from index.search.store import KINDS, require_faiss
from moco.errors import UserError
from moco.excludes import check_patterns
from moco.runtime import Dist

__all__ = ["build_index", "update_index", "default_memory_budget", "run_cli"]

logger = logging.getLogger(__name__)

def default_memory_budget() -> int:
    """Bytes an index may take in RAM by default: half the machine's memory, at most 8 GiB."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        total = 8 << 30
    return int(min(8 << 30, total // 2))


# -------------------------------------------------------------------------------------------- plan
def _retry_our_failures(catalog: Catalog, plan: Plan) -> None:
    """Queue unchanged error rows whose reason was a failure on our side (:func:`is_our_failure`) to embed again."""
    queued = {i for i, _ in plan.embed}
    again = []
    for path, reason in catalog.errors():
        row = catalog.row_by_path(path)
        if row is not None and path in plan.stats and row.id not in queued and is_our_failure(reason):
            again.append((row.id, path))
    if again:
        logger.info("trying %d files again that an earlier run could not index for a reason of its own", len(again))
        plan.embed = sorted(plan.embed + again, key=lambda t: t[1])
        plan.unchanged -= len(again)


def _reembed_older_vectors(catalog: Catalog, plan: Plan, cmeta: dict[str, Any]) -> None:
    """An index of an older version stored the export's (whitened) output, not its features: queue every photo to
    be embedded again (its features are what the index's space is fitted on and applied to)."""
    if cmeta.get("vectors") == VECTORS:
        return
    feats = cmeta.get("features") or {}
    white = (cmeta.get("backbone") or {}).get("whitening")
    if white or feats.get("mirror") or feats.get("stages"):
        queued = {i for i, _ in plan.embed}
        again = [(r.id, p) for p, r in catalog.rows().items() if r.status == "ok" and r.id not in queued
                 and p in plan.stats]
        if again:
            logger.info("%d photos were indexed by an older version (the backbone's whitened output): embedding "
                        "them again as features, in the index's own space", len(again))
            plan.embed = sorted(plan.embed + again, key=lambda t: t[1])
            plan.unchanged -= len(again)


# -------------------------------------------------------------------------------------------- sync
def _sync(index_dir: Path, embedder: Any, dist: Dist, batch_size: int, workers: int, progress: bool,
          use_gpu: str, settings: dict[str, Any] | None = None) -> Summary:
    """Embed what the plan says, then bring ``index.faiss`` in line; ``settings``: catalog settings (unchanged) to
    write again once there is work (so a full disk stops the update at the catalog, before anything else)."""
    t0 = time.perf_counter()
    summary = Summary()
    catalog = Catalog(index_dir / CATALOG_FILE) if dist.rank == 0 else None
    plan = None
    if dist.rank == 0:
        ensure_thumbs_dir(index_dir)
        cmeta = catalog_meta(catalog)
        root = Path(cmeta["root"])
        summary.exclude = list(cmeta.get("exclude") or [])
        plan = make_plan(root, catalog, workers, summary.exclude)
        summary.unsupported, summary.excluded = plan.unsupported, plan.excluded
        _retry_our_failures(catalog, plan)
        _reembed_older_vectors(catalog, plan, cmeta)
        if settings and (plan.embed or plan.touch or plan.moves or plan.copies or plan.gone):
            set_catalog_meta(catalog, **settings)
        quick_ops(catalog, plan, index_dir, summary)
        summary.unchanged = plan.unchanged
        summary.headers_read = fill_headers(root, catalog, workers, present=set(plan.stats))
    todo, root_s = dist.broadcast((plan.embed, cmeta["root"]) if plan else None)
    root = Path(root_s)
    reembed_ids = {i for i, _ in todo} & (set(catalog.rows_by_id([i for i, _ in todo])) if catalog else set())
    from tqdm.auto import tqdm

    bar = tqdm(total=len(todo), disable=not progress or dist.rank != 0, unit="img", desc="indexing")
    round_size = dist.world * batch_size * 4
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        starts = list(range(0, len(todo), round_size))

        def decode(start: int) -> list[concurrent.futures.Future]:
            mine = todo[start : start + round_size][dist.rank :: dist.world]
            return decode_round(mine, root, index_dir, embedder.resize, pool)

        ahead = decode(starts[0]) if starts else []
        for n, start in enumerate(starts):
            current, ahead = ahead, (decode(starts[n + 1]) if n + 1 < len(starts) else [])  # next round decodes
            records = embed_round(current, embedder, batch_size)  # while this one is embedded
            gathered = dist.gather(records)
            if dist.rank == 0:
                commit(catalog, [r for part in gathered for r in part], summary, reembed_ids)
                bar.update(min(round_size, len(todo) - start))
    bar.close()
    if dist.rank == 0:
        if cmeta.get("vectors") != VECTORS:
            set_catalog_meta(catalog, vectors=VECTORS)  # every row is features now (older ones were queued above)
        if store_is_current(index_dir, catalog, cmeta, embedder):  # nothing new: its files are left as they are
            meta = read_meta(index_dir)
            summary.vectors, summary.kind = int(meta["ntotal"]), str(meta["kind"])
        else:
            store = sync_store(index_dir, catalog, cmeta, use_gpu, embedder)
            meta = read_meta(index_dir)
            summary.vectors, summary.kind = store.ntotal, store.kind
        restore_thumbs(root, index_dir, catalog, embedder.resize, workers)
        clean_thumbs(index_dir, catalog)
        summary.errors = catalog.errors()
        summary.recall_at_10, summary.params = meta["recall_at_10"], meta["params"]
        catalog.close()
    summary.seconds = time.perf_counter() - t0
    return summary


def _backbone_meta(embedder: Any) -> dict[str, Any]:
    """What ``index.json`` records of the backbone (``backbone_dim``: the backbone's own width; the index's ``dim``
    counts the pooled stages)."""
    stored = embedder.config.to_strings()  # as the backbone file stores them (image_size "32", whitening as JSON)
    meta = {k: stored.get(k) for k in ("arch", "image_size", "resize", "moco_version", "whitening", "source_sha256")}
    return {**meta, "backbone_dim": embedder.config.embed_dim}


def _features_meta(embedder: Any) -> dict[str, Any]:
    """The catalog settings that say which features its vectors are (see ``ImageIndex.features``)."""
    return {"features": {"mirror": bool(embedder.mirror), "stages": [[n, int(c)] for n, c in embedder.stages]},
            "backbone_whitening": embedder.space is None and embedder.config.whitening is not None}


def build_index(photos: str | Path, backbone: str | Path, out: str | Path, kind: str = "auto",
                memory_budget: int | None = None, batch_size: int = 64, workers: int | None = None,
                progress: bool = True, device: str = "auto", use_gpu: str = "auto",
                exclude: tuple[str, ...] | list[str] = ()) -> Summary:
    """Index every image under ``photos`` into the directory ``out`` (re-running resumes it).

    Args:
        photos: the collection root (searched recursively).
        backbone: a ``.safetensors`` backbone from ``moco export`` (or any supported checkpoint).
        out: the index directory (created; an interrupted build in it is completed).
        kind: auto, flat, ivf, ivfpq or hnsw (see :mod:`index.search.store`).
        memory_budget: bytes the index may use (``auto`` picks a compressed kind above it).
        exclude: ``--exclude`` patterns (:mod:`moco.excludes`): never read; the index keeps them for its updates.
    """
    if kind not in KINDS:
        raise UserError(f"--kind {kind!r} is not one of {', '.join(KINDS)}")
    exclude = check_patterns(exclude, root=photos)
    require_faiss()  # before any work: nothing is embedded or written without it
    dist = Dist.join(device)
    workers = workers or min(8, os.cpu_count() or 1)
    photos, out, backbone = Path(photos).expanduser().resolve(), Path(out), Path(backbone).expanduser().resolve()
    from moco.embed import Embedder

    # the catalog keeps the features, the index its space
    embedder = Embedder.load(backbone, device=dist.device(device), space="features")
    if dist.rank == 0:
        if not photos.is_dir():
            raise UserError(f"photo folder not found: {photos}")
        inside = out.resolve() == photos or photos in out.resolve().parents
        if inside and not any(part.startswith(".") for part in out.resolve().relative_to(photos).parts):
            raise UserError(f"the index directory {out} is inside the photo folder {photos}: its thumbnails "
                            "would be indexed as photos; use -o outside it, or a hidden folder like PHOTOS/.index")
        out.mkdir(parents=True, exist_ok=True)
        fresh = not (out / CATALOG_FILE).exists()
        if fresh and (out / INDEX_FILE).exists():  # nothing can tell which photos its vectors are
            logger.warning("%s has an %s but no %s: starting a clean index (the old %s and %s are replaced)",
                           out, INDEX_FILE, CATALOG_FILE, INDEX_FILE, META_FILE)
            for name in (INDEX_FILE, META_FILE):
                (out / name).unlink(missing_ok=True)
        catalog = Catalog(out / CATALOG_FILE, create=True)
        if not fresh:
            cmeta = catalog_meta(catalog)
            if cmeta["root"] and cmeta["root"] != str(photos):
                raise UserError(f"{out} already indexes {cmeta['root']}, not {photos}: pick another -o, or run "
                                f"`moco index update {out} --root {photos}` if the collection moved")
            if cmeta["backbone_sha256"] and cmeta["backbone_sha256"] != embedder.sha256:
                raise UserError(f"{out} was built with backbone {cmeta['backbone_path']} (sha256 "
                                f"{cmeta['backbone_sha256'][:12]}...), not {backbone}: use a new -o directory "
                                "or delete it to rebuild with this backbone")
            logger.info("%s holds an earlier build: continuing it", out)
        set_catalog_meta(catalog, root=str(photos), backbone_path=str(backbone), backbone_sha256=embedder.sha256,
                          backbone=_backbone_meta(embedder),
                          dim=embedder.dim, kind=kind, features=_features_meta(embedder)["features"],
                          memory_budget=memory_budget or default_memory_budget(), exclude=list(exclude))
        if fresh:
            set_catalog_meta(catalog, vectors=VECTORS)
        catalog.close()
    try:
        return _sync(out, embedder, dist, batch_size, workers, progress, use_gpu)
    finally:
        dist.close()


def update_index(index_dir: str | Path, backbone: str | Path | None = None, root: str | Path | None = None,
                 kind: str | None = None, batch_size: int = 64, workers: int | None = None, progress: bool = True,
                 device: str = "auto", use_gpu: str = "auto", exclude: tuple[str, ...] | list[str] = (),
                 clear_excludes: bool = False) -> Summary:
    """Re-scan the collection of ``index_dir``: embed new and changed files, drop deleted ones, keep moved ones.

    ``backbone`` defaults to the file recorded at build time and must be the same model (sha256);
    ``root`` re-points the index at a collection that moved; ``kind`` changes the index kind. The index keeps its
    ``--exclude`` patterns: ``exclude`` adds to them (the photos they name leave the index), ``clear_excludes``
    forgets the earlier ones first.
    """
    exclude = check_patterns(exclude)
    index_dir = Path(index_dir)
    if not (index_dir / CATALOG_FILE).is_file():
        raise UserError(f"{index_dir} is not an index directory (no {CATALOG_FILE}): build one with "
                        f"`moco index build PHOTOS --backbone B -o {index_dir}`")
    require_faiss()  # before any work: nothing is embedded or written without it
    dist = Dist.join(device)
    workers = workers or min(8, os.cpu_count() or 1)
    catalog = Catalog(index_dir / CATALOG_FILE)
    cmeta = catalog_meta(catalog)
    path = Path(backbone).expanduser().resolve() if backbone else Path(cmeta["backbone_path"])
    from moco.embed import Embedder

    # the catalog keeps the features, the index its space
    embedder = Embedder.load(path, device=dist.device(device), space="features")
    if embedder.sha256 != cmeta["backbone_sha256"]:
        raise UserError(f"{index_dir} was built with backbone sha256 {cmeta['backbone_sha256'][:12]}... but "
                        f"{path} is {embedder.sha256[:12]}...: vectors of different backbones do not mix; rebuild "
                        f"with `moco index build {cmeta['root']} --backbone {path} -o NEW_DIR`")
    settings = None  # unchanged settings: written only with other work (an update with nothing new writes nothing)
    if dist.rank == 0:
        changes: dict[str, Any] = {"backbone_path": str(path)}
        if root is not None:
            new_root = Path(root).expanduser().resolve()
            if not new_root.is_dir():
                raise UserError(f"--root {root}: folder not found")
            changes["root"] = str(new_root)
        elif not Path(cmeta["root"]).is_dir():
            raise UserError(f"the collection root {cmeta['root']} is gone: if it moved, pass --root NEW_PLACE "
                            "(files are matched by content, nothing is re-embedded)")
        if kind is not None:
            if kind not in KINDS:
                raise UserError(f"--kind {kind!r} is not one of {', '.join(KINDS)}")
            changes["kind"] = kind
        if exclude or clear_excludes:
            exclude = check_patterns(exclude, root=root if root is not None else cmeta["root"])
            earlier = [] if clear_excludes else list(cmeta.get("exclude") or [])
            changes["exclude"] = [*earlier, *(p for p in exclude if p not in earlier)]
        changes["features"] = _features_meta(embedder)["features"]
        if any(json.loads(json.dumps(v)) != cmeta.get(k) for k, v in changes.items()):
            set_catalog_meta(catalog, **changes)
        else:
            settings = changes
    catalog.close()
    try:
        return _sync(index_dir, embedder, dist, batch_size, workers, progress, use_gpu, settings)
    finally:
        dist.close()


def run_cli(args: argparse.Namespace, update: bool) -> int:
    """Build or update as the parsed ``args`` (:mod:`index.building.args`) say, print the summary (rank 0), return 0."""
    from index.building import args as a

    common = dict(batch_size=args.batch_size, workers=args.workers, progress=not args.quiet, device=args.device,
                  use_gpu=args.gpu, exclude=tuple(args.exclude or ()))
    if update:
        check_watch_arguments(args)
        s = update_index(args.index_dir, backbone=args.backbone, root=args.root, kind=args.kind,
                         clear_excludes=args.clear_excludes, **common)
        if args.watch:
            a.print_summary(s, args.json, args.index_dir)
            return _watch(args, common)
    else:
        s = build_index(args.photos, args.backbone, args.out, kind=args.kind, memory_budget=args.memory_budget,
                        **common)
    a.print_summary(s, args.json, args.index_dir if update else args.out)
    return 0


def check_watch_arguments(args: argparse.Namespace) -> None:
    """``--poll`` needs ``--watch`` and a positive number of seconds."""
    if getattr(args, "poll", None) is not None and (not args.watch or not 0 < args.poll <= 86400):
        raise UserError(f"--poll {args.poll}: give it with --watch, in seconds (more than 0, at most 86400)")


def _watch(args: argparse.Namespace, common: dict[str, Any]) -> int:
    """`moco index update IDX --watch`: update whenever the folder's changes settle, until Ctrl+C."""
    from index.building import args as a
    from index.building.watch import Watcher

    catalog = Catalog(Path(args.index_dir) / CATALOG_FILE)
    try:
        root = catalog_meta(catalog)["root"]
    finally:
        catalog.close()
    common = {**common, "progress": False, "exclude": ()}  # the patterns are the index's own from now on

    def update() -> Summary:
        s = update_index(args.index_dir, backbone=args.backbone, **common)
        a.print_summary(s, args.json, args.index_dir)
        return s

    watcher = Watcher(root, update, poll_s=args.poll).start()
    print(f"{watcher.state.describe()} (Ctrl+C to stop)", flush=True)
    try:
        threading.Event().wait()  # until Ctrl+C
    except KeyboardInterrupt:
        print("stopped watching", flush=True)
    finally:
        watcher.stop()
    return 0
