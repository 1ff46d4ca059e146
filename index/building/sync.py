"""``index.faiss`` kept in step with the catalog: the collection's own space fitted (centred, or whitened where the
collection is large enough: :func:`space_rule`) and fitted again when it grew or drifted (:func:`space_drift`), the
FAISS index chosen, trained and tuned to its target recall, its levels measured (weak match, same-photo level,
near-duplicate threshold), then written with ``index.json`` (:func:`sync_store`)."""

from __future__ import annotations

import datetime
import logging
import uuid
from pathlib import Path
from typing import Any

import numpy as np

from index.building.prepare import THUMB_SIZE
from index.catalog import Catalog, Row, sample_ids, set_catalog_meta
from index.search.index_dir import (
    CATALOG_FILE,
    INDEX_FILE,
    INDEX_ID_KEY,
    INDEX_VERSION,
    META_FILE,
    VECTORS,
    load_store,
    read_meta,
    write_meta,
)
from index.search.store import VectorStore, choose_kind
from index.search.trailer import read_index_id, read_space_arrays
from moco.data.photos import ImageDecodeError, load_rgb, square_u8
from moco.errors import UserError
from moco.whiten import SPACE_FILE, Whitening, fit_space, save_space

logger = logging.getLogger(__name__)

__all__ = ["sync_store", "store_is_current", "space_rule", "space_drift", "chance_level", "WHITEN_FROM",
           "WHITEN_PER_DIM", "DRIFT_REFIT", "MEAN_REFRESH", "TUNE_QUERIES", "TARGET_RECALL"]


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


def _fresh_store(kind: str, ids: np.ndarray, vecs: np.ndarray, dim: int, use_gpu: str,
                 held_out: np.ndarray) -> VectorStore:
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
                   space: Whitening, batch_size: int = 32) -> dict[str, Any] | None:
    """How close two training views of one photo are: the centred cosine of two ``v2`` views of a seeded sample.

    Up to :data:`AUGMENT_SAMPLE` of ``ids`` (sorted, seed 0), decoded as the index decodes them, two views
    each from one generator (seed 0), embedded by ``embedder`` and centred on ``mean``. None without photos.
    """
    import torch

    from moco.data.augment import two_views

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
            "space": "whitened (the index's space)" if space.whitened else "centred (the index's space)"}


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


def sync_store(index_dir: Path, catalog: Catalog, cmeta: dict[str, Any], use_gpu: str,
                embedder: Any | None = None) -> VectorStore:
    """Bring ``index.faiss`` in line with the catalog, tune it, write it and ``index.json``.

    The catalog keeps the backbone's features; ``index.faiss`` holds them in the collection's own space: centred on
    its mean, and whitened by its covariance where :func:`space_rule` says the collection is large enough, the
    space recorded in ``index.json`` and ``space.safetensors`` with the count it was fitted on. The space is fitted
    again, and every vector re-added, on a new ``index.faiss``, for an index without one, when the collection has
    grown by half (:data:`MEAN_REFRESH`) or drifted (:func:`space_drift` over :data:`DRIFT_REFIT`) since, and when
    the rule's choice changes. With ``embedder``, the same-photo augmentation level
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
                         tuple((str(n), int(c)) for n, c in feats.get("stages") or []))
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
           else None)
    if why is not None:
        level = calibration = None  # measured in the space: measured again below
        if not fresh:
            logger.info("fitting the embedding space of %s again on its %d photos (%s): re-adding every vector",
                        index_dir, len(ids), why)
            store = None
        space = fit_space(vecs, rule, base, source=f"this collection ({len(ids)} photos)")
        mean_count, drift = len(ids), 0.0
    else:
        space = Whitening(old_mean, old_matrix, float(info.get("shrinkage") or 0.0), mean_count,
                          base.mirror if base else False, base.stages if base else (),
                          str(info.get("fitted_on") or "collection"))
    if level is None and embedder is not None and len(ids):
        level = _augment_level(Path(cmeta["root"]), index_dir, catalog, ids, embedder, space)
        if level:
            logger.info("two %s views of one photo score %.3f (median cosine in the index's space over %d photos)",
                        AUGMENT_RECIPE, level["median"], level["pairs"])
    if calibration is None and embedder is not None and len(ids):
        from index.calibrate import calibrate_index  # the near-duplicate threshold of this index's space

        calibration = calibrate_index(Path(cmeta["root"]), index_dir, catalog, ids, embedder.resize,
                                      lambda squares: space(embedder.embed_squares(squares)))
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
                       "exact (flat) search instead", tuning.value, store._param_limit(), tuning.recall)
        set_catalog_meta(catalog, flat_until=2 * len(ids))  # ask again when the collection has doubled
        catalog.reset_indexed()
        store = _fresh_store("flat", ids, vecs, dim, use_gpu, queries)
        store.add(ids, vecs)
        tuning = store.tune(vecs, ids, qv, queries, k=10, target=TARGET_RECALL, held_out=False)
        kind, pending = "flat", ids
    store.save(index_dir / INDEX_FILE, index_id, mean, space.matrix)
    source = (embedder.config.source_sha256 if embedder is not None else None) or \
        (cmeta.get("backbone") or {}).get("source_sha256") or ""
    save_space(space, index_dir / SPACE_FILE, cmeta["backbone_sha256"], index_id=index_id,
               source_sha256=source)  # for the other doors: Embedder.load(B, space=DIR), moco export --space
    now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    import faiss

    write_meta(index_dir, {
        "format": INDEX_VERSION, "root": cmeta["root"], "backbone_path": cmeta["backbone_path"],
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
    })
    catalog.mark_indexed(pending, stale)
    return store


def store_is_current(index_dir: Path, catalog: Catalog, cmeta: dict[str, Any], embedder: Any | None) -> bool:
    """Whether :func:`sync_store` would write nothing new: ``index.faiss`` and ``index.json`` are this catalog's
    own, hold every row (none pending or stale), record its settings and the measures it takes. Then an update with
    nothing changed leaves the index's files as they are (bytes and times)."""
    if len(catalog.pending()) or len(catalog.stale()) or not (index_dir / SPACE_FILE).is_file():
        return False
    if not (index_dir / INDEX_FILE).is_file() or _untrusted(index_dir, catalog.get_meta(INDEX_ID_KEY)) is not None:
        return False
    meta = read_meta(index_dir)
    same = all(meta.get(k) == cmeta.get(c) for k, c in (("root", "root"), ("backbone_path", "backbone_path"),
                                                        ("backbone_sha256", "backbone_sha256"), ("dim", "dim"),
                                                        ("kind_requested", "kind"),
                                                        ("memory_budget", "memory_budget")))
    whole = all(meta.get(k) is not None for k in ("mean", "mean_count", "space", "ntotal", "params", "features"))
    measured = embedder is None or not meta.get("ntotal") or ("augment_level" in meta and "dedup_calibration" in meta)
    if not (same and whole and measured and meta.get("vectors") == VECTORS and meta.get("format") == INDEX_VERSION):
        return False
    if meta["ntotal"] != catalog.counts()["ok"]:
        return False
    return read_space_arrays(index_dir / INDEX_FILE, int(cmeta["dim"]))[0] is not None  # centred: its mean inside


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
