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

Under ``torchrun`` (``python -m index.build ...``) rank 0 plans, every rank decodes and embeds its
share of each round of files (``files[rank::world]``), and rank 0 gathers the results, commits them
and writes the index: the same catalog and index as one process, in a fraction of the time.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import datetime
import errno
import logging
import os
import re
import shutil
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from index.catalog import Catalog, Row
from index.image_index import (
    CATALOG_FILE,
    FORMAT,
    INDEX_FILE,
    INDEX_ID_KEY,
    META_FILE,
    THUMBS_DIR,
    VECTORS,
    load_store,
    read_meta,
    write_meta,  # fmt: skip
)
from index.plan import Plan, Stat, file_hash, make_plan
from index.store import KINDS, VectorStore, choose_kind, read_index_id, read_space_arrays, require_faiss
from moco.data import ImageDecodeError, load_rgb, square_u8
from moco.errors import StorageError, UserError, storage_error
from moco.whiten import SPACE_FILE, Whitening, fit_space, save_space

__all__ = ["build_index", "update_index", "Summary", "default_memory_budget", "sample_ids", "is_our_failure",
           "write_failed", "THUMB_SIZE"]  # fmt: skip

logger = logging.getLogger(__name__)

THUMB_SIZE = 256
TUNE_QUERIES = 500
TARGET_RECALL = 0.95
MEAN_REFRESH = 1.5  # the space is fitted again (and index.faiss rebuilt) when the collection grew by half
DRIFT_REFIT = 0.05  # ... or when its mean moved by this share of the photos' mean squared distance to the centre
# An index whitens its own features from this many photos (and at least WHITEN_PER_DIM per dimension), else only
# centres them: measured on two sets with their own and a foreign backbone (960-d features), whitening on the
# collection first beat the best unwhitened space on every pair at 2,000 photos on one half of each set, and held
# on the other half; below it plain centring beat the run's training-time matrix (BENCHMARKS.md, "Whiten or centre").
WHITEN_FROM = 2000
WHITEN_PER_DIM = 2  # an extrapolation to wider features (2 x 960 ~ 2,000), as the training fit's stages rule
WEAK_PAIRS = 20_000  # random pairs whose chance level (chance_level) is the weak-match threshold
AUGMENT_SAMPLE = 64  # photos whose two augmented views measure the collection's same-photo level
AUGMENT_RECIPE = "v2"


def default_memory_budget() -> int:
    """Bytes an index may take in RAM by default: half the machine's memory, at most 8 GiB."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        total = 8 << 30
    return int(min(8 << 30, total // 2))


@dataclass
class Summary:
    """What a build/update did."""

    embedded: int = 0
    reembedded: int = 0
    moved: int = 0
    copied: int = 0
    touched: int = 0
    unchanged: int = 0
    removed: int = 0
    errors: list[tuple[str, str]] = field(default_factory=list)
    seconds: float = 0.0
    vectors: int = 0
    kind: str = ""
    recall_at_10: float | None = None
    params: dict[str, int] = field(default_factory=dict)

    @property
    def images_per_s(self) -> float:
        return (self.embedded + self.reembedded) / self.seconds if self.seconds else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {**{k: v for k, v in self.__dict__.items() if k != "errors"}, "images_per_s": self.images_per_s,
                "errors": [{"path": p, "reason": r} for p, r in self.errors]}  # fmt: skip


# ------------------------------------------------------------------------------------- distribution
class _Dist:
    """torch.distributed when launched by torchrun (WORLD_SIZE > 1), else a single process."""

    def __init__(self, device: str = "auto") -> None:
        from moco.device import init_distributed

        self.rank, self.world = init_distributed(device)
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        self.group = None
        if self.world > 1:
            import torch.distributed as dist

            self.group = dist.new_group(backend="gloo")  # objects travel over gloo on any backend

    def device(self, device: str) -> str:
        import torch

        if device == "auto" and self.world > 1 and torch.cuda.is_available():
            return f"cuda:{self.local_rank}"
        return device

    def broadcast(self, obj: Any) -> Any:
        if self.world == 1:
            return obj
        import torch.distributed as dist

        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def gather(self, obj: Any) -> list[Any]:
        if self.world == 1:
            return [obj]
        import torch.distributed as dist

        out: list[Any] = [None] * self.world if self.rank == 0 else None  # type: ignore[assignment]
        dist.gather_object(obj, out, dst=0, group=self.group)
        return out if self.rank == 0 else []

    def close(self) -> None:
        if self.world > 1:
            import torch.distributed as dist

            dist.barrier(group=self.group)
            dist.destroy_process_group()


# ------------------------------------------------------------------------------------------ prepare
@dataclass
class _Record:
    """One decoded (or failed) file, ready for the catalog."""

    id: int
    path: str
    stat: Stat
    hash: str | None
    square: np.ndarray | None = None  # resize x resize x 3 uint8, dropped after embedding
    vector: np.ndarray | None = None
    error: str | None = None
    thumb: str | None = None


_OUR_FAILURE = re.compile(r"\[Errno \d+\]|[A-Z]\w*(Error|Exception)\b")


def is_our_failure(reason: str | None) -> bool:
    """Whether an error row's reason is a failure on our side, not of the photo: retried by the next update.

    Photo decode reasons are short phrases ("truncated or corrupt: ...", "unreadable: ..."); older
    versions also stored any exception of theirs (a missing ``thumbs/``, a full disk) as
    ``"FileNotFoundError: ..."``, ``"OSError: [Errno 28] ..."``.
    """
    return bool(reason) and _OUR_FAILURE.match(reason) is not None


def write_failed(err: OSError, path: Path) -> StorageError:
    """The error for a failed write of ours into the index directory: the path, the cause and the fix."""
    if err.errno in (errno.ENOENT, errno.ENOTDIR, errno.EEXIST):  # a folder of the index is missing or a file
        return StorageError(f"cannot write {path} ({err.strerror or err}): {path.parent} is missing or not a folder; "
                            f"remove whatever is at that path (the next run makes {THUMBS_DIR}/ again) and run the "
                            "same command (nothing saved before this point is lost)")  # fmt: skip
    return storage_error(err, path)


def _write_jpeg(img: Any, dest: Path) -> None:
    tmp = dest.with_name(f".{dest.name}.{os.getpid()}.tmp")
    try:
        img.save(tmp, "JPEG", quality=85, optimize=True)
        os.replace(tmp, dest)
    except OSError as e:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        raise write_failed(e, dest) from e


def _write_thumb(img: Any, index_dir: Path, id_: int) -> str:
    """Write the thumbnail of photo ``id_`` (``img`` is shrunk in place); its path inside the index directory."""
    rel = f"{THUMBS_DIR}/{id_}.jpg"
    img.thumbnail((THUMB_SIZE, THUMB_SIZE))
    _write_jpeg(img, index_dir / rel)
    return rel


def _prepare(root: Path, index_dir: Path, item: tuple[int, str], resize: int) -> _Record:
    """Hash, decode once, make the model square and the thumbnail of one file.

    A photo that cannot be read or decoded becomes an error record with the reason; a failed write of
    ours (the thumbnail) raises :class:`StorageError` instead, so a good photo is never marked bad.
    """
    id_, name = item
    path = root / name
    try:
        content = file_hash(path)  # first: its reasons name special files, loops and dangling links
        st = os.stat(path)
        stat = Stat(st.st_size, st.st_mtime_ns)
    except OSError as e:
        return _Record(id_, name, Stat(0, 0), None, error=f"unreadable: {e.strerror or e}")
    try:
        img = load_rgb(path, min_short=resize)  # the same decode as Embedder.embed(path)
    except ImageDecodeError as e:
        return _Record(id_, name, stat, content, error=e.reason)
    square = square_u8(img, resize)
    return _Record(id_, name, stat, content, square=square, thumb=_write_thumb(img, index_dir, id_))


def _decode_round(items: list[tuple[int, str]], root: Path, index_dir: Path, resize: int,
                  pool: concurrent.futures.Executor) -> list[concurrent.futures.Future]:  # fmt: skip
    """Start decoding ``items`` in the pool (hash, model square, thumbnail): one future per file."""
    return [pool.submit(_prepare, root, index_dir, it, resize) for it in items]


def _embed_round(decoding: list[concurrent.futures.Future], embedder: Any, batch_size: int) -> list[_Record]:
    """Wait for a round's decodes and embed them in batches; vectors land on the records."""
    records = [f.result() for f in decoding]
    ok = [r for r in records if r.square is not None]
    for start in range(0, len(ok), batch_size):
        batch = ok[start : start + batch_size]
        vectors = embedder.embed_squares(np.stack([r.square for r in batch]))  # B x D
        for r, v in zip(batch, vectors):
            r.vector, r.square = v, None
    return records


def _commit(catalog: Catalog, records: list[_Record], summary: Summary, reembed_ids: set[int]) -> None:
    with catalog.transaction() as db:
        for r in sorted(records, key=lambda r: r.id):
            status = "ok" if r.vector is not None else "error"
            catalog.put(db, Row(r.id, r.path, r.stat.size, r.stat.mtime_ns, r.hash, status, r.error, r.thumb,
                                0.0, indexed=0, deleted=0), r.vector)  # fmt: skip
            if r.error:
                summary.errors.append((r.path, r.error))
                logger.warning("skipping %s: %s", r.path, r.error)
            elif r.id in reembed_ids:
                summary.reembedded += 1
            else:
                summary.embedded += 1


def _quick_ops(catalog: Catalog, plan: Plan, index_dir: Path, summary: Summary) -> None:
    """Touches, moves, copies and deletions: no decoding, one transaction."""
    with catalog.transaction() as db:
        for id_, st in plan.touch:
            db.execute("UPDATE images SET size=?, mtime_ns=?, indexed=CASE WHEN deleted=1 THEN 0 ELSE indexed END, "
                       "deleted=0 WHERE id=?", (st.size, st.mtime_ns, id_))  # fmt: skip
        for id_, path, st in plan.moves:
            catalog.move(db, id_, path, st.size, st.mtime_ns)
        for id_, path, st, content, src in plan.copies:
            _, vec = catalog.vectors([src])  # 1 x D
            src_row = catalog.rows_by_id([src]).get(src)
            thumb = None
            if src_row is not None and src_row.thumb and (index_dir / src_row.thumb).is_file():
                thumb = f"{THUMBS_DIR}/{id_}.jpg"
                try:
                    shutil.copyfile(index_dir / src_row.thumb, index_dir / thumb)
                except OSError as e:
                    raise write_failed(e, index_dir / thumb) from e
            catalog.put(db, Row(id_, path, st.size, st.mtime_ns, content, "ok", None, thumb), vec[0])
        db.executemany("UPDATE images SET deleted=1 WHERE id=?", [(i,) for i in plan.gone])
    summary.touched, summary.moved, summary.copied = len(plan.touch), len(plan.moves), len(plan.copies)
    summary.removed = len(plan.gone)


# ------------------------------------------------------------------------------------------- store
def sample_ids(ids: np.ndarray, n: int, rng: np.random.Generator) -> np.ndarray:
    """``n`` of ``ids`` at random, sorted (all of them when there are no more)."""
    return ids if len(ids) <= n else np.sort(rng.choice(ids, n, replace=False))


def _fresh_store(kind: str, ids: np.ndarray, vecs: np.ndarray, dim: int, use_gpu: str,
                 held_out: np.ndarray) -> VectorStore:  # fmt: skip
    store = VectorStore.create(kind, dim, max(1, len(ids)), use_gpu)
    if not store.is_trained and len(ids):
        import faiss

        nlist = faiss.extract_index_ivf(store._cpu).nlist
        pool = np.flatnonzero(~np.isin(ids, held_out))  # tuning queries stay out of training
        rows = sample_ids(pool, max(nlist * 64, 10_000), np.random.default_rng(0))
        store.train(vecs[rows])
    return store


def chance_level(cos: np.ndarray) -> float:
    """What unrelated pairs reach: median + 3 robust standard deviations (1.4826 MAD) of pair cosines ``cos``.

    Robust to related pairs among the random ones (a collection of a few tight families, bursts of shots): they
    move a percentile, not the median and MAD. For a normal spread of unrelated scores it is their 99.87th
    percentile.
    """
    med = float(np.median(cos))
    return med + 3 * 1.4826 * float(np.median(np.abs(cos - med)))


def _weak_below(vecs: np.ndarray) -> float | None:
    """The chance level of random pairs of (centred) ``vecs``: under it, a match is no closer than unrelated photos."""
    n = len(vecs)
    if n < 2:
        return None
    rng = np.random.default_rng(0)
    i = rng.integers(n, size=WEAK_PAIRS)
    j = (i + rng.integers(1, n, size=WEAK_PAIRS)) % n  # never i itself
    cos = np.einsum("pd,pd->p", vecs[i], vecs[j])  # P
    return round(min(1.0, chance_level(cos)), 4)


def _sample_square(root: Path, index_dir: Path, row: Row, resize: int) -> np.ndarray | None:
    """The model square of an indexed photo, decoded as the index does; its thumbnail when the original is gone."""
    for path in (root / row.path, index_dir / row.thumb if row.thumb else None):
        if path is None:
            continue
        try:
            return square_u8(load_rgb(path, min_short=resize), resize)
        except ImageDecodeError as e:
            logger.debug("augmentation level: skipping %s (%s)", path, e.reason)
    return None


def _augment_level(root: Path, index_dir: Path, catalog: Catalog, ids: np.ndarray, embedder: Any,
                   space: Whitening, batch_size: int = 32) -> dict[str, Any] | None:  # fmt: skip
    """How close two training views of one photo are: the centred cosine of two ``v2`` views of a seeded sample.

    Up to :data:`AUGMENT_SAMPLE` of ``ids`` (sorted, seed 0), decoded as the index decodes them, two views
    each from one generator (seed 0), embedded by ``embedder`` and centred on ``mean``. None without photos.
    """
    import torch

    from moco.augment import two_views

    rows = catalog.rows_by_id(sample_ids(ids, AUGMENT_SAMPLE, np.random.default_rng(0)))
    squares = [_sample_square(root, index_dir, rows[i], embedder.resize) for i in sorted(rows)]
    squares = [sq for sq in squares if sq is not None]
    if not squares:
        return None
    images = torch.from_numpy(np.stack(squares))  # B x R x R x 3 uint8
    g = torch.Generator().manual_seed(0)
    xq, xk = two_views(images, AUGMENT_RECIPE, embedder.image_size, embedder.pixel_mean, embedder.pixel_std,
                       g)  # B x 3 x s x s
    q = np.concatenate([embedder.embed_views(xq[s : s + batch_size]) for s in range(0, len(xq), batch_size)])  # B x D
    k = np.concatenate([embedder.embed_views(xk[s : s + batch_size]) for s in range(0, len(xk), batch_size)])  # B x D
    cos = np.einsum("bd,bd->b", space(q), space(k))  # B
    return {"median": round(float(np.median(cos)), 4), "p10": round(float(np.percentile(cos, 10)), 4),
            "pairs": len(cos), "recipe": AUGMENT_RECIPE,
            "space": "whitened (the index's space)" if space.whitened else "centred (the index's space)"}  # fmt: skip


def space_rule(n: int, dim: int) -> str:
    """How an index of ``n`` photos with ``dim``-d features maps them (:func:`moco.whiten.fit_space`): "whitened" on
    its own photos from :data:`WHITEN_FROM` photos and :data:`WHITEN_PER_DIM` per dimension, else "centred" (for a
    trained backbone too: its training-time matrix lost to centring on smaller collections)."""
    return "whitened" if n >= max(WHITEN_FROM, WHITEN_PER_DIM * dim) else "centred"


def space_drift(vecs: np.ndarray, mean: np.ndarray, matrix: np.ndarray | None, sample: int = 2000) -> float:
    """How far the collection's mean moved from the space's centre: ``|(m_now - mean) W|^2`` over the mean of
    ``|(v - mean) W|^2`` (a seeded sample of the features ``vecs``, N x D): about 1/N for photos of the same kind."""
    rows = vecs[sample_ids(np.arange(len(vecs)), sample, np.random.default_rng(0))]  # S x D
    shift = vecs.mean(0) - mean  # D
    spread = rows - mean  # S x D
    if matrix is not None:
        shift, spread = shift @ matrix, spread @ matrix  # D, S x D
    denom = float((spread**2).sum(1).mean())
    return float((shift**2).sum() / denom) if denom > 0 else 0.0


def _sync_store(index_dir: Path, catalog: Catalog, cmeta: dict[str, Any], use_gpu: str,
                embedder: Any | None = None) -> VectorStore:  # fmt: skip
    """Bring ``index.faiss`` in line with the catalog, tune it, write it and ``index.json``.

    The catalog keeps raw vectors; ``index.faiss`` holds them centred on the collection's mean embedding
    (:func:`moco.embed.center`), which ``index.json`` records with the count it was computed from. The mean
    is recomputed, and every vector re-added, on a new ``index.faiss``, for an index without one, and when
    the collection has grown by half since. With ``embedder``, the same-photo augmentation level
    (:func:`_augment_level`) and the near-duplicate threshold (:func:`index.calibrate.calibrate_index`) are
    measured again whenever the mean is, or when ``index.json`` lacks them.
    """
    dim = int(cmeta["dim"])
    ids, vecs = catalog.vectors(dim=dim)  # N, N x D (raw)
    kind = cmeta["kind"] if cmeta["kind"] != "auto" else choose_kind(len(ids), dim, int(cmeta["memory_budget"]))
    if cmeta["kind"] == "auto" and kind == "ivf" and len(ids) <= int(cmeta.get("flat_until") or 0):
        kind = "flat"  # an earlier tuning found that these vectors do not cluster (see below)
    rng = np.random.default_rng(len(ids))
    queries = sample_ids(ids, min(TUNE_QUERIES, len(ids) // 10), rng)  # held out of training (and of tuning)
    index_id, store = _own_store(index_dir, catalog, len(ids), dim, use_gpu)
    trusted = store is not None  # index.faiss and index.json are this index's own
    old = read_meta(index_dir) if trusted else {}
    old_mean, old_matrix = read_space_arrays(index_dir / INDEX_FILE, dim) if trusted else (None, None)
    info = old.get("space") if isinstance(old.get("space"), dict) else {}
    base = getattr(embedder, "export_space", None) if embedder is not None else None
    if base is None and cmeta.get("features"):  # no embedder (a removal only): the features the catalog records
        feats = cmeta["features"]
        base = Whitening(np.zeros(dim, np.float32), None, 1.0, 0, bool(feats.get("mirror")),
                         tuple((str(n), int(c)) for n, c in feats.get("stages") or []))  # fmt: skip
    rule = space_rule(len(ids), dim)
    mean_count = int(old.get("mean_count") or 0)
    fresh = store is None or store.kind != kind or not store.is_trained
    level, calibration = old.get("augment_level"), old.get("dedup_calibration")
    drift = space_drift(vecs, old_mean, old_matrix) if old_mean is not None and len(ids) else None
    why = ("a new index" if fresh else "it was uncentred" if old_mean is None
           else "its vectors were of an older version" if old.get("vectors") != VECTORS
           else f"the collection grew from {mean_count}" if len(ids) >= MEAN_REFRESH * mean_count
           else f"the rule now says {rule} (was {info.get('rule')})" if info.get("rule") not in (None, rule)
           else f"the collection drifted ({drift:.3f} > {DRIFT_REFIT})" if drift is not None and drift > DRIFT_REFIT
           else None)  # fmt: skip
    if why is not None:
        level = calibration = None  # measured in the space: measured again below
        if not fresh:
            logger.info("fitting the embedding space of %s again on its %d photos (%s): re-adding every vector",
                        index_dir, len(ids), why)  # fmt: skip
            store = None
        space = fit_space(vecs, rule, base, source=f"this collection ({len(ids)} photos)")
        mean_count, drift = len(ids), 0.0
    else:
        space = Whitening(old_mean, old_matrix, float(info.get("shrinkage") or 0.0), mean_count,
                          base.mirror if base else False, base.stages if base else (),
                          str(info.get("fitted_on") or "collection"))  # fmt: skip
    if level is None and embedder is not None and len(ids):
        level = _augment_level(Path(cmeta["root"]), index_dir, catalog, ids, embedder, space)
        if level:
            logger.info("two %s views of one photo score %.3f (median cosine in the index's space over %d photos)",
                        AUGMENT_RECIPE, level["median"], level["pairs"])  # fmt: skip
    if calibration is None and embedder is not None and len(ids):
        from index.calibrate import calibrate_index  # the near-duplicate threshold of this index's space

        calibration = calibrate_index(Path(cmeta["root"]), index_dir, catalog, ids, embedder.resize,
                                      lambda squares: space(embedder.embed_squares(squares)))  # fmt: skip
    mean = space.mean  # D
    vecs = space(vecs)  # N x D, what index.faiss holds
    pending, stale = catalog.pending(), catalog.stale()
    qv = vecs[np.searchsorted(ids, queries)]  # tuning queries, Q x D
    if store is None or store.kind != kind or not store.is_trained:
        logger.info("writing a new %s index of %d vectors", kind, len(ids))
        catalog.reset_indexed()
        store = _fresh_store(kind, ids, vecs, dim, use_gpu, queries)
        rest = ~np.isin(ids, queries)
        store.add(ids[rest], vecs[rest])
        pending = ids
    else:
        touched = np.concatenate([pending, stale])
        if store.can_remove():
            store.remove(np.concatenate([touched, queries]))  # remove-then-add: idempotent after a crash
            rest = pending[~np.isin(pending, queries)]
            store.add(rest, vecs[np.searchsorted(ids, rest)])
        elif store.contains_any(touched):
            logger.info("%s cannot remove in place: re-adding all %d vectors", kind, len(ids))
            store = store.emptied()
            rest = ~np.isin(ids, queries)
            store.add(ids[rest], vecs[rest])
            pending = ids
        else:
            store.add(pending, vecs[np.searchsorted(ids, pending)])
    held_out = store.ntotal < len(ids) or len(ids) == 0  # the queries are not in the index yet
    tuning = store.tune(vecs, ids, qv, queries, k=10, target=TARGET_RECALL, held_out=held_out)
    if held_out:
        store.add(queries, qv)
    if cmeta["kind"] == "auto" and store.kind == "ivf" and tuning.value and tuning.value * 4 > store._param_limit():
        # IVF must scan over a quarter of its lists to reach the target: no faster than exact search
        logger.warning("these vectors barely cluster: IVF needs nprobe=%d of %d lists for recall@10 %.3f; using "
                       "exact (flat) search instead", tuning.value, store._param_limit(), tuning.recall)  # fmt: skip
        set_catalog_meta(catalog, flat_until=2 * len(ids))  # ask again when the collection has doubled
        catalog.reset_indexed()
        store = _fresh_store("flat", ids, vecs, dim, use_gpu, queries)
        store.add(ids, vecs)
        tuning = store.tune(vecs, ids, qv, queries, k=10, target=TARGET_RECALL, held_out=False)
        kind, pending = "flat", ids
    store.save(index_dir / INDEX_FILE, index_id, mean, space.matrix)
    source = (embedder.config.get("source_sha256") if embedder is not None else None) or \
        (cmeta.get("backbone") or {}).get("source_sha256") or ""  # fmt: skip
    save_space(space, index_dir / SPACE_FILE, cmeta["backbone_sha256"], index_id=index_id,
               source_sha256=source)  # for the other doors: Embedder.load(B, space=DIR), moco export --space
    now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    import faiss

    write_meta(index_dir, {
        "format": FORMAT, "root": cmeta["root"], "backbone_path": cmeta["backbone_path"],
        "backbone_sha256": cmeta["backbone_sha256"], "backbone": cmeta["backbone"], "dim": dim,
        "metric": "centred cosine (inner product of L2-normalized v - mean)", "kind": kind,
        "kind_requested": cmeta["kind"],
        "factory": store.factory_string or old.get("factory", ""), "faiss_class": store.factory(),
        "ntotal": store.ntotal,
        "params": {tuning.param: tuning.value} if tuning.param else {}, "recall_at_10": round(tuning.recall, 4),
        "recall_queries": tuning.queries, "memory_budget": int(cmeta["memory_budget"]),
        "thumb_size": THUMB_SIZE, "faiss_version": faiss.__version__, "created": old.get("created", now),
        "updated": now, "index_id": index_id,
        "mean": [float(x) for x in mean], "mean_count": mean_count, "weak_below": _weak_below(vecs),
        "vectors": VECTORS, "features": {"mirror": space.mirror, "stages": [[n, int(c)] for n, c in space.stages]},
        "space": {**space.describe(), "rule": rule, "drift": None if drift is None else round(float(drift), 5),
                  "refit_when": f"the collection grows by half, drifts over {DRIFT_REFIT}, or the rule changes"},
        **({"augment_level": level} if level else {}), **({"dedup_calibration": calibration} if calibration else {}),
    })  # fmt: skip
    catalog.mark_indexed(pending, stale)
    return store


def _own_store(index_dir: Path, catalog: Catalog, n: int, dim: int, use_gpu: str) -> tuple[str, VectorStore | None]:
    """The index id (made at the first build) and ``index.faiss`` when it is this catalog's own.

    None when there is no ``index.faiss``, or when it cannot be trusted to hold the catalog's ``n`` vectors
    (``index.json`` lost, files of another index, an unreadable file, another dim): the caller rebuilds
    it from the catalog, which holds every vector.
    """
    index_id = catalog.get_meta(INDEX_ID_KEY)
    store = None
    if (index_dir / INDEX_FILE).is_file():
        why = _untrusted(index_dir, index_id)
        if why is None:
            try:
                store = load_store(index_dir, use_gpu)
            except UserError as e:
                why = str(e)
            if store is not None and store.dim != dim:
                why, store = f"{index_dir / INDEX_FILE} holds {store.dim}-d vectors, the catalog {dim}-d", None
        if why is not None:
            logger.warning("%s: rebuilding %s from the %d vectors in %s", why, INDEX_FILE, n, CATALOG_FILE)
    if index_id is None:  # the first build, or an index from before index ids
        index_id = uuid.uuid4().hex
        with catalog.transaction():
            catalog.set_meta(INDEX_ID_KEY, index_id)
    return index_id, store


def _untrusted(index_dir: Path, index_id: str | None) -> str | None:
    """Why ``index.faiss`` may not hold the vectors of the catalog whose id is ``index_id``; None when it does."""
    if not (index_dir / META_FILE).is_file():
        return f"{index_dir / META_FILE} is missing"
    try:
        meta = read_meta(index_dir)
    except UserError as e:
        return str(e)
    meta_id = meta.get("index_id")
    faiss_id = read_index_id(index_dir / INDEX_FILE)
    if faiss_id != index_id:
        if faiss_id is None:
            return f"{index_dir / INDEX_FILE} has no index id (the catalog's is {index_id})"
        return f"{index_dir / INDEX_FILE} belongs to another index (id {faiss_id}, the catalog's is {index_id})"
    if meta_id != index_id:
        return f"{index_dir / META_FILE} belongs to another index (id {meta_id}, the catalog's is {index_id})"
    return None


def _ensure_thumbs_dir(index_dir: Path) -> None:
    """Make ``thumbs/`` when it is missing (deleted, or never made by an interrupted first build)."""
    thumbs = index_dir / THUMBS_DIR
    if not thumbs.exists() and not thumbs.is_symlink():
        try:
            thumbs.mkdir()
        except OSError as e:
            raise write_failed(e, thumbs) from e


def _restore_thumbs(root: Path, index_dir: Path, catalog: Catalog, resize: int, workers: int) -> None:
    """Make the missing thumbnails of indexed photos again: decoded again, never re-embedded."""
    thumbs = index_dir / THUMBS_DIR
    have = {f"{THUMBS_DIR}/{n}" for n in os.listdir(thumbs)} if thumbs.is_dir() else set()
    todo = [r for r in catalog.rows().values() if r.status == "ok" and r.thumb not in have]
    if not todo:
        return
    logger.info("making %d missing thumbnails again", len(todo))

    def one(row: Row) -> tuple[str, int] | None:
        try:
            img = load_rgb(root / row.path, min_short=resize)
        except ImageDecodeError as e:  # changed since the scan: the next update re-embeds it
            logger.warning("no thumbnail for %s: %s", row.path, e.reason)
            return None
        return _write_thumb(img, index_dir, row.id), row.id

    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        made = [m for m in pool.map(one, todo) if m is not None]
    with catalog.transaction() as db:
        db.executemany("UPDATE images SET thumb = ? WHERE id = ?", made)


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
        plan.retried += len(again)


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
                 and p in plan.stats]  # fmt: skip
        if again:
            logger.info("%d photos were indexed by an older version (the backbone's whitened output): embedding "
                        "them again as features, in the index's own space", len(again))  # fmt: skip
            plan.embed = sorted(plan.embed + again, key=lambda t: t[1])
            plan.unchanged -= len(again)


def _clean_thumbs(index_dir: Path, catalog: Catalog) -> None:
    if not (index_dir / THUMBS_DIR).is_dir():
        return
    keep = {r.thumb for r in catalog.rows(include_deleted=True).values() if r.thumb}
    for f in (index_dir / THUMBS_DIR).iterdir():
        rel = f"{THUMBS_DIR}/{f.name}"
        if rel not in keep:
            f.unlink(missing_ok=True)


# -------------------------------------------------------------------------------------------- sync
def catalog_meta(catalog: Catalog) -> dict[str, Any]:
    """The build settings the catalog records: root, backbone path/sha256/metadata, dim, kind, memory budget."""
    import json

    return {k: json.loads(catalog.get_meta(k) or "null") for k in
            ("root", "backbone_path", "backbone_sha256", "backbone", "dim", "kind", "memory_budget",
             "flat_until", "features", "vectors")}  # fmt: skip


def set_catalog_meta(catalog: Catalog, **values: Any) -> None:
    import json

    with catalog.transaction():
        for k, v in values.items():
            catalog.set_meta(k, json.dumps(v))


def _sync(index_dir: Path, embedder: Any, dist: _Dist, batch_size: int, workers: int, progress: bool,
          use_gpu: str) -> Summary:  # fmt: skip
    t0 = time.perf_counter()
    summary = Summary()
    catalog = Catalog(index_dir / CATALOG_FILE) if dist.rank == 0 else None
    plan = None
    if dist.rank == 0:
        _ensure_thumbs_dir(index_dir)
        cmeta = catalog_meta(catalog)
        root = Path(cmeta["root"])
        plan = make_plan(root, catalog, workers)
        _retry_our_failures(catalog, plan)
        _reembed_older_vectors(catalog, plan, cmeta)
        _quick_ops(catalog, plan, index_dir, summary)
        summary.unchanged = plan.unchanged
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
            return _decode_round(mine, root, index_dir, embedder.resize, pool)

        ahead = decode(starts[0]) if starts else []
        for n, start in enumerate(starts):
            current, ahead = ahead, (decode(starts[n + 1]) if n + 1 < len(starts) else [])  # next round decodes
            records = _embed_round(current, embedder, batch_size)  # while this one is embedded
            gathered = dist.gather(records)
            if dist.rank == 0:
                _commit(catalog, [r for part in gathered for r in part], summary, reembed_ids)
                bar.update(min(round_size, len(todo) - start))
    bar.close()
    if dist.rank == 0:
        set_catalog_meta(catalog, vectors=VECTORS)  # every row is features now (older ones were queued above)
        store = _sync_store(index_dir, catalog, cmeta, use_gpu, embedder)
        _restore_thumbs(root, index_dir, catalog, embedder.resize, workers)
        _clean_thumbs(index_dir, catalog)
        meta = read_meta(index_dir)
        summary.errors = catalog.errors()
        summary.vectors, summary.kind = store.ntotal, store.kind
        summary.recall_at_10, summary.params = meta["recall_at_10"], meta["params"]
        catalog.close()
    summary.seconds = time.perf_counter() - t0
    return summary


def _load_embedder(backbone: Path, device: str) -> Any:
    from moco.embed import Embedder

    if not backbone.is_file():
        raise UserError(f"backbone {backbone} not found: make one with "
                        "`moco export RUN/checkpoint.pt -o B.safetensors`")  # fmt: skip
    return Embedder.load(backbone, device=device, space="features")  # the catalog keeps features; the index, its space


def _backbone_meta(embedder: Any) -> dict[str, Any]:
    """What ``index.json`` records of the backbone (``backbone_dim``: the backbone's own width; the index's ``dim``
    counts the pooled stages)."""
    meta = {k: embedder.config.get(k) for k in ("arch", "image_size", "resize", "moco_version", "whitening",
                                                "source_sha256")}  # fmt: skip
    return {**meta, "backbone_dim": int(embedder.config["embed_dim"])}


def _features_meta(embedder: Any) -> dict[str, Any]:
    """The catalog settings that say which features its vectors are (see ``ImageIndex.features``)."""
    return {"features": {"mirror": bool(embedder.mirror), "stages": [[n, int(c)] for n, c in embedder.stages]},
            "backbone_whitening": embedder.space is None and embedder.config.get("whitening") is not None}


def build_index(photos: str | Path, backbone: str | Path, out: str | Path, kind: str = "auto",
                memory_budget: int | None = None, batch_size: int = 64, workers: int | None = None,
                progress: bool = True, device: str = "auto", use_gpu: str = "auto") -> Summary:  # fmt: skip
    """Index every image under ``photos`` into the directory ``out`` (re-running resumes it).

    Args:
        photos: the collection root (searched recursively).
        backbone: a ``.safetensors`` backbone from ``moco export`` (or any supported checkpoint).
        out: the index directory (created; an interrupted build in it is completed).
        kind: auto, flat, ivf, ivfpq or hnsw (see :mod:`index.store`).
        memory_budget: bytes the index may use (``auto`` picks a compressed kind above it).
    """
    if kind not in KINDS:
        raise UserError(f"--kind {kind!r} is not one of {', '.join(KINDS)}")
    require_faiss()  # before any work: nothing is embedded or written without it
    dist = _Dist(device)
    workers = workers or min(8, os.cpu_count() or 1)
    photos, out, backbone = Path(photos).expanduser().resolve(), Path(out), Path(backbone).expanduser().resolve()
    embedder = _load_embedder(backbone, dist.device(device))
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
                           out, INDEX_FILE, CATALOG_FILE, INDEX_FILE, META_FILE)  # fmt: skip
            for name in (INDEX_FILE, META_FILE):
                (out / name).unlink(missing_ok=True)
        catalog = Catalog(out / CATALOG_FILE, create=True)
        if not fresh:
            cmeta = catalog_meta(catalog)
            if cmeta["root"] and cmeta["root"] != str(photos):
                raise UserError(f"{out} already indexes {cmeta['root']}, not {photos}: pick another -o, or run "
                                f"`moco index update {out} --root {photos}` if the collection moved")  # fmt: skip
            if cmeta["backbone_sha256"] and cmeta["backbone_sha256"] != embedder.sha256:
                raise UserError(f"{out} was built with backbone {cmeta['backbone_path']} (sha256 "
                                f"{cmeta['backbone_sha256'][:12]}...), not {backbone}: use a new -o directory "
                                "or delete it to rebuild with this backbone")  # fmt: skip
            logger.info("%s holds an earlier build: continuing it", out)
        set_catalog_meta(catalog, root=str(photos), backbone_path=str(backbone), backbone_sha256=embedder.sha256,
                          backbone=_backbone_meta(embedder),
                          dim=embedder.dim, kind=kind, features=_features_meta(embedder)["features"],
                          memory_budget=memory_budget or default_memory_budget())  # fmt: skip
        if fresh:
            set_catalog_meta(catalog, vectors=VECTORS)
        catalog.close()
    try:
        return _sync(out, embedder, dist, batch_size, workers, progress, use_gpu)
    finally:
        dist.close()


def update_index(index_dir: str | Path, backbone: str | Path | None = None, root: str | Path | None = None,
                 kind: str | None = None, batch_size: int = 64, workers: int | None = None, progress: bool = True,
                 device: str = "auto", use_gpu: str = "auto") -> Summary:  # fmt: skip
    """Re-scan the collection of ``index_dir``: embed new and changed files, drop deleted ones, keep moved ones.

    ``backbone`` defaults to the file recorded at build time and must be the same model (sha256);
    ``root`` re-points the index at a collection that moved; ``kind`` changes the index kind.
    """
    index_dir = Path(index_dir)
    if not (index_dir / CATALOG_FILE).is_file():
        raise UserError(f"{index_dir} is not an index directory (no {CATALOG_FILE}): build one with "
                        f"`moco index build PHOTOS --backbone B -o {index_dir}`")  # fmt: skip
    require_faiss()  # before any work: nothing is embedded or written without it
    dist = _Dist(device)
    workers = workers or min(8, os.cpu_count() or 1)
    catalog = Catalog(index_dir / CATALOG_FILE)
    cmeta = catalog_meta(catalog)
    path = Path(backbone).expanduser().resolve() if backbone else Path(cmeta["backbone_path"])
    embedder = _load_embedder(path, dist.device(device))
    if embedder.sha256 != cmeta["backbone_sha256"]:
        raise UserError(f"{index_dir} was built with backbone sha256 {cmeta['backbone_sha256'][:12]}... but "
                        f"{path} is {embedder.sha256[:12]}...: vectors of different backbones do not mix; rebuild "
                        f"with `moco index build {cmeta['root']} --backbone {path} -o NEW_DIR`")  # fmt: skip
    if dist.rank == 0:
        changes: dict[str, Any] = {"backbone_path": str(path)}
        if root is not None:
            new_root = Path(root).expanduser().resolve()
            if not new_root.is_dir():
                raise UserError(f"--root {root}: folder not found")
            changes["root"] = str(new_root)
        elif not Path(cmeta["root"]).is_dir():
            raise UserError(f"the collection root {cmeta['root']} is gone: if it moved, pass --root NEW_PLACE "
                            "(files are matched by content, nothing is re-embedded)")  # fmt: skip
        if kind is not None:
            if kind not in KINDS:
                raise UserError(f"--kind {kind!r} is not one of {', '.join(KINDS)}")
            changes["kind"] = kind
        changes["features"] = _features_meta(embedder)["features"]
        set_catalog_meta(catalog, **changes)
    catalog.close()
    try:
        return _sync(index_dir, embedder, dist, batch_size, workers, progress, use_gpu)
    finally:
        dist.close()


def main(argv: list[str] | None = None) -> int:
    """``torchrun ... -m index.build PHOTOS --backbone B -o IDX`` or ``-m index.build update IDX``; 2 on bad input."""
    import argparse

    from index import cli_args as a

    argv = list(sys.argv[1:] if argv is None else argv)
    update = bool(argv) and argv[0] == "update"
    if update:
        parser = argparse.ArgumentParser(prog="python -m index.build update", description=a.UPDATE_DESCRIPTION)
        a.add_update_arguments(parser)
    else:
        parser = argparse.ArgumentParser(prog="python -m index.build", description=a.BUILD_DESCRIPTION,
                                         epilog=f"python -m index.build update IDX: {a.UPDATE_HELP}")  # fmt: skip
        a.add_build_arguments(parser)
    args = parser.parse_args(argv[1:] if update else argv)
    rank = int(os.environ.get("RANK", "0"))
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, stream=sys.stderr,
                        format=f"[rank {rank}] %(levelname)s: %(message)s" if rank else "%(levelname)s: %(message)s")
    try:
        return a.run(args, update)
    except UserError as e:  # StorageError (disk full, read-only) exits 1: not bad input
        print(f"{parser.prog}: error: {e}", file=sys.stderr)
        return e.exit_code


if __name__ == "__main__":
    raise SystemExit(main())
