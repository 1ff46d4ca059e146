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

from index.calibrate import (  # the threshold: re-exported here, where its users look for it
    dedup_threshold,
)
from index.catalog import taken_text
from index.image_index import ImageIndex, row_filter
from index.index_dir import DEDUP_FILE
from moco.errors import UserError
from moco.files import atomic_write

__all__ = ["find_duplicates", "load_duplicates", "tight_groups"]

def _neighbours(index: ImageIndex, ids: np.ndarray, vecs: np.ndarray, threshold: float,
                chunk: int) -> dict[int, dict[int, float]]:
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
                    chunk: int = 1024, exclude_folders: tuple[str, ...] | list[str] = ()) -> list[dict[str, Any]]:
    """Groups of near-duplicates (:func:`tight_groups`), largest first.

    Each group: ``size``, ``representative`` (id, path), ``tightest`` and ``loosest`` (the highest and lowest
    cosine of a member to the representative) and ``members`` (the representative first, then by that cosine),
    each with id, path, thumb, ``similarity`` (to the representative; 1.0 for itself) and ``best_similarity`` (to
    its closest neighbour, in the group or not) and ``taken`` (the date taken, ISO 8601). ``threshold``: None:
    :func:`dedup_threshold`. ``exclude_folders``: photos under these sub-folders are left out. Written to
    ``dedup.json`` in the index directory when ``save``.
    """
    threshold = dedup_threshold(index) if threshold is None else threshold
    if not -1.0 <= threshold <= 1.0:
        raise UserError(f"--threshold {threshold} must be a cosine similarity in [-1, 1] (e.g. "
                        f"{dedup_threshold(index)})")
    ids, vecs = index.catalog.vectors(dim=index.dim)  # N, N x D
    keep = row_filter(exclude_folders=exclude_folders)
    if keep is not None:
        kept = index.catalog.rows_by_id(ids)
        mask = np.array([int(i) in kept and keep(kept[int(i)]) for i in ids], bool)
        ids, vecs = ids[mask], vecs[mask]
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
             "best_similarity": round(max(graph[m].values()), 5), "taken": taken_text(rows[m].taken)}
            for m in sorted(live, key=lambda m: (m != rep, -sim[m], rows[m].path))]})
    groups.sort(key=lambda g: (-g["size"], g["representative"]["path"]))
    if save:
        doc = {"threshold": threshold, "grouping": "every member within the threshold of its representative",
               "groups": groups, "images": len(ids),
               "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
        data = (json.dumps(doc, indent=1) + "\n").encode()
        atomic_write(index.dir / DEDUP_FILE, lambda f: f.write(data))
    return groups


def load_duplicates(index_dir: str | Path) -> dict[str, Any] | None:
    """The last saved ``dedup.json``, or None when there is none; a file that is not what :func:`find_duplicates`
    writes (unreadable, not JSON, a key missing, a value of the wrong type) is a UserError naming it and the fix."""
    path = Path(index_dir) / DEDUP_FILE
    if not path.is_file():
        return None
    try:
        doc = json.loads(path.read_text())
        problem = _problem(doc)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        problem = f"not readable as JSON: {type(e).__name__}"
    if problem:
        raise UserError(f"{path} is damaged ({problem}): find the near-duplicates again (`moco index dedup "
                        f"{Path(index_dir)}` or the page's Find near-duplicates) to write it anew")
    return doc


def _number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x == x  # not NaN


def _problem(doc: Any) -> str | None:
    """What makes ``doc`` something else than a saved search of :func:`find_duplicates` (None: nothing)."""
    if not isinstance(doc, dict):
        return f"a {type(doc).__name__}, not an object"
    if not _number(doc.get("threshold")):
        return "no number 'threshold'"
    if not isinstance(doc.get("created"), (str, type(None))) or not isinstance(doc.get("groups"), list):
        return "'created' is not text or 'groups' is not a list"
    for n, g in enumerate(doc["groups"]):
        where = f"group {n}"
        if not isinstance(g, dict) or isinstance(g.get("size"), bool) or not isinstance(g.get("size"), int):
            return f"{where} has no whole 'size'"
        if not isinstance(g.get("members"), list) or not isinstance(g.get("representative", {}), (dict, type(None))):
            return f"{where}: 'members' is not a list or 'representative' is not an object"
        if not all(_number(g[key]) for key in ("tightest", "loosest") if key in g):
            return f"{where}: 'tightest' or 'loosest' is not a number"
        for m in g["members"]:
            if not isinstance(m, dict) or isinstance(m.get("id"), bool) or not isinstance(m.get("id"), int):
                return f"{where}: a member without a whole 'id'"
            if not isinstance(m.get("path"), str) or not _number(m.get("similarity", m.get("best_similarity"))):
                return f"{where}: member {m['id']} has no text 'path' or no number 'similarity'"
            if "best_similarity" in m and not _number(m["best_similarity"]):
                return f"{where}: member {m['id']}'s 'best_similarity' is not a number"
    return None
