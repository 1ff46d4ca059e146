"""Near-duplicate groups in which every photo is within the threshold of its group's representative.

Two photos are neighbours when their centred cosine similarity (as search scores) is at least ``threshold`` (a range
search of every stored vector). Groups are picked greedily (:func:`tight_groups`): the photo with the most
ungrouped neighbours (ties: the smallest id) is a representative, its group is it and those neighbours, and the
rest is grouped the same way until no ungrouped photo has an ungrouped neighbour. A chain a~b~c~d of photos each
a small step from the last is therefore never one group: a photo joins a group only by being close to its
representative, not to any member (single linkage once merged 90 different airplane photos of one collection).

The threshold is the index's own (:func:`dedup_threshold`): calibrated on copies of its photos at build time
(:mod:`index.calibrate`, ``index.json``'s ``dedup_calibration``), else a default for the backbone's kind.
"""

from __future__ import annotations

import datetime
import heapq
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from index.image_index import DEDUP_FILE, ImageIndex
from moco.checkpoint import atomic_write
from moco.errors import UserError

__all__ = ["find_duplicates", "load_duplicates", "dedup_threshold", "threshold_source", "tight_groups",
           "DEDUP_THRESHOLD", "WHITENED_DEDUP_THRESHOLD", "STAGED_DEDUP_THRESHOLD"]

# The defaults of an index without a calibration (built before it, or of fewer than 8 photos). Centred cosine (see
# ImageIndex.center). Measured on the sample collection (240 photos) with the model `make run` trains (ResNet-18,
# 64 px, 10 minutes): resized (75%) and JPEG q=60 copies score 0.955-0.999 with their photo,
# 90%-cropped ones 0.86-0.99 (median 0.97), while the nearest other photo of a family scores 0.55-0.97 (median
# 0.72-0.92 by family; only the near-uniform "stars" family reaches 0.97-0.99). At 0.9 whole families merged
# (12 groups of 114 photos); at 0.95, 4 groups of 44, 35 of them the stars.
DEDUP_THRESHOLD = 0.95
# The same for an index of whitened embeddings (a backbone trained with --whiten, as the cpu preset): whitening
# spreads every photo apart, copies included. Measured as above (the cpu preset, 64 px, 5 minutes, its whitening
# fitted on the 240 photos): resized+JPEG copies score 0.70-0.99 (median 0.96) with their photo, 90%-crops 0.76-0.97
# (median 0.935), the nearest other photo at most 0.745 (median 0.18; the stars family included). At 0.8: 96.7% of
# the JPEG copies and 95.4% of the crops linked, no two different photos (at 0.95: 57% / 35%); centred, at 0.95:
# 97.9% / 96.3%, and 0.8% of the photos linked to another one.
WHITENED_DEDUP_THRESHOLD = 0.8
# Whitened embeddings with the pooled earlier stages (--whiten-stages, the cpu preset's since the ninth round): the
# fine maps of layer1-2 see JPEG artefacts and resampling, so copies spread further. Measured as above on one
# model (the cpu preset, 64 px, 200 steps on the 240 photos, mirror image included; the stages forced with
# --whiten-stages on, as auto pools them only from 1,920 photos up for resnet10t), centred cosines with and
# without the stages: resized+JPEG copies median 0.936 / 0.961, 90%-crops 0.953 / 0.974, the nearest other photo
# at most 0.663 / 0.751. At 0.7 with the stages: 91.7% of the JPEG copies and 100% of the crops linked, no two
# different photos (at 0.8: 83.8% / 96.7%); without them at 0.8: 94.2% / 100%, none.
STAGED_DEDUP_THRESHOLD = 0.7


def _calibration(index: ImageIndex) -> dict[str, Any] | None:
    value = index.meta.get("dedup_calibration")
    return value if isinstance(value, dict) and isinstance(value.get("threshold"), (int, float)) else None


def dedup_threshold(index: ImageIndex) -> float:
    """The near-duplicate threshold for ``index``'s scores: the one calibrated on its collection (``index.json``'s
    ``dedup_calibration``, :mod:`index.calibrate`); without it :data:`STAGED_DEDUP_THRESHOLD` where its backbone
    whitens embeddings with pooled stages, :data:`WHITENED_DEDUP_THRESHOLD` where it whitens its last stage's
    features, else :data:`DEDUP_THRESHOLD`."""
    calibration = _calibration(index)
    if calibration is not None:
        return float(calibration["threshold"])
    if not index.whitened:
        return DEDUP_THRESHOLD
    return STAGED_DEDUP_THRESHOLD if index.pooled_stages else WHITENED_DEDUP_THRESHOLD


def threshold_source(index: ImageIndex) -> str:
    """Where :func:`dedup_threshold` comes from, in words (for ``stats`` and the page)."""
    calibration = _calibration(index)
    if calibration is not None:
        return (f"calibrated on {calibration.get('photos')} photos of the collection: copies score "
                f"{calibration.get('copies_p10')} (10th percentile), the closest other photo "
                f"{calibration.get('others_max')}")  # fmt: skip
    kind = "backbone" if not index.whitened else "whitened backbone" + (" with pooled stages" if index.pooled_stages
                                                                          else "")  # fmt: skip
    return f"the default for a {kind} (no dedup_calibration in index.json: an older index, or under 8 photos)"


def _neighbours(index: ImageIndex, ids: np.ndarray, vecs: np.ndarray, threshold: float,
                chunk: int) -> dict[int, dict[int, float]]:  # fmt: skip
    """The neighbours of photos ``ids`` (raw vectors ``vecs``) at centred cosine >= ``threshold``: ``{id: {other id:
    cosine}}``, symmetric (a pair an approximate index finds one way only is kept both ways); photos without one
    are left out."""
    live = set(ids.tolist())
    graph: dict[int, dict[int, float]] = {}
    for start in range(0, len(ids), chunk):
        lims, scores, found = index.store.range_search(index.center(vecs[start : start + chunk]), threshold)
        for q in range(len(lims) - 1):
            own = int(ids[start + q])
            for j, s in zip(found[lims[q] : lims[q + 1]].tolist(), scores[lims[q] : lims[q + 1]].tolist()):
                if j == own or j not in live or s < threshold:
                    continue
                s = max(s, graph.get(j, {}).get(own, -1.0))
                graph.setdefault(own, {})[j] = graph.setdefault(j, {})[own] = s
    return graph


def tight_groups(graph: Mapping[int, Mapping[int, float]]) -> list[tuple[int, list[int]]]:
    """Greedy groups of a symmetric neighbour graph: ``[(representative, [representative, *members]), ...]``.

    The ungrouped photo with the most ungrouped neighbours (ties: the smallest id) represents a group of itself and
    those neighbours (sorted by id); repeated until no ungrouped photo has an ungrouped neighbour. Every member is
    a neighbour of its representative: any two members are at most two steps apart through it, never a chain.
    """
    left = {i: len(n) for i, n in graph.items() if n}  # ungrouped photo -> its ungrouped neighbours
    heap = [(-d, i) for i, d in left.items()]  # counts only fall: a stale entry is pushed again when popped
    heapq.heapify(heap)
    groups = []
    while heap:
        d, i = heapq.heappop(heap)
        if i not in left:
            continue
        if -d != left[i]:
            if left[i]:
                heapq.heappush(heap, (-left[i], i))
            continue
        members = [i, *sorted(j for j in graph[i] if j in left)]
        for m in members:
            del left[m]
        for m in members:
            for j in graph[m]:
                if j in left:
                    left[j] -= 1
        groups.append((i, members))
    return groups


def find_duplicates(index: ImageIndex, threshold: float | None = None, save: bool = True,
                    chunk: int = 1024) -> list[dict[str, Any]]:  # fmt: skip
    """Groups of near-duplicates (:func:`tight_groups`), largest first.

    Each group: ``size``, ``representative`` (id, path), ``tightest`` and ``loosest`` (the highest and lowest
    cosine of a member to the representative) and ``members`` (the representative first, then by that cosine),
    each with id, path, thumb, ``similarity`` (to the representative; 1.0 for itself) and ``best_similarity`` (to
    its closest neighbour, in the group or not). ``threshold``: None: :func:`dedup_threshold`. Written to
    ``dedup.json`` in the index directory when ``save``.
    """
    threshold = dedup_threshold(index) if threshold is None else threshold
    if not -1.0 <= threshold <= 1.0:
        raise UserError(f"--threshold {threshold} must be a cosine similarity in [-1, 1] (e.g. "
                        f"{dedup_threshold(index)})")  # fmt: skip
    ids, vecs = index.catalog.vectors(dim=index.dim)  # N, N x D
    graph = _neighbours(index, ids, vecs, threshold, chunk)
    rows = index.catalog.rows_by_id(graph)
    groups = []
    for rep, members in tight_groups(graph):
        live = [m for m in members if m in rows]
        if rep not in rows or len(live) < 2:
            continue  # deleted since the vectors were read
        sim = {m: 1.0 if m == rep else round(graph[rep][m], 5) for m in live}
        others = [sim[m] for m in live if m != rep]
        groups.append({"size": len(live), "representative": {"id": rep, "path": rows[rep].path},
                       "tightest": max(others), "loosest": min(others), "members": [
            {"id": m, "path": rows[m].path, "thumb": rows[m].thumb, "similarity": sim[m],
             "best_similarity": round(max(graph[m].values()), 5)}
            for m in sorted(live, key=lambda m: (m != rep, -sim[m], rows[m].path))]})  # fmt: skip
    groups.sort(key=lambda g: (-g["size"], g["representative"]["path"]))
    if save:
        doc = {"threshold": threshold, "grouping": "every member within the threshold of its representative",
               "groups": groups, "images": len(ids),
               "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}  # fmt: skip
        data = (json.dumps(doc, indent=1) + "\n").encode()
        atomic_write(index.dir / DEDUP_FILE, lambda f: f.write(data))
    return groups


def load_duplicates(index_dir: str | Path) -> dict[str, Any] | None:
    """The last saved ``dedup.json``, or None."""
    path = Path(index_dir) / DEDUP_FILE
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
