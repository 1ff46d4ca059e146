"""Tuning an approximate store: the smallest search parameter (nprobe, efSearch) whose recall@k reaches a target.

Recall is measured against exact search in numpy (:func:`index.exact.exact_topk`), tie-aware, on held-out queries
(sampled vectors left out of training, their own id removed from the answers) or on stored ones.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from index.exact import exact_topk

if TYPE_CHECKING:
    from index.store import VectorStore

__all__ = ["Tuning", "tune_store"]

logger = logging.getLogger("index.store")  # the one logger name of its step (filtered by users)

_PARAM = {"ivf": "nprobe", "ivfpq": "nprobe", "hnsw": "efSearch"}  # the search parameter each approximate kind tunes


@dataclass
class Tuning:
    """Outcome of tuning: the search parameter, its value, and the recall@k it measured."""

    param: str | None
    value: int | None
    recall: float
    queries: int


def tune_store(store: VectorStore, vectors: np.ndarray, ids: np.ndarray, queries: np.ndarray, query_ids: np.ndarray,
               k: int = 10, target: float = 0.95, held_out: bool = True) -> Tuning:  # fmt: skip
    """Smallest nprobe/efSearch of ``store`` whose recall@k on ``queries`` reaches ``target``, and that recall.

    ``vectors``/``ids``: the whole collection (ground truth by exact search in numpy, each query's
    own id left out). ``held_out``: the queries are not in the index yet (the honest measure, used
    when building); otherwise they are, and their own id is dropped from the answers.
    """
    param = _PARAM.get(store.kind)
    if len(queries) == 0 or store.ntotal < 2:
        return Tuning(None, None, 1.0, 0)
    order = np.argsort(ids)  # positions by id (no copy of the vectors: they may be most of the RAM)
    sorted_ids = ids[order]
    exclude = query_ids if held_out else None  # held-out queries are not in the index: not in the truth
    truth = exact_topk(vectors, ids, queries, query_ids, k, exclude)  # Q x k ids
    kth = np.einsum("qd,qkd->qk", queries, vectors[order[np.searchsorted(sorted_ids, truth)]]).min(1)  # Q

    def measure() -> float:
        found = store.search(queries, k if held_out else k + 1)[1]
        found = found if held_out else _drop_self(found, query_ids, k)
        # tie-aware: a result scoring at least the true k-th score counts, whichever tied id it is
        pos = np.clip(np.searchsorted(sorted_ids, found), 0, len(sorted_ids) - 1)  # Q x k
        score = np.einsum("qd,qkd->qk", queries, vectors[order[pos]])
        good = (found >= 0) & (sorted_ids[pos] == found) & (score >= kth[:, None] - 1e-5)
        return float(good.sum(1).clip(max=k).mean() / k)

    if param is None:
        return Tuning(None, None, measure(), len(queries))
    limit = store._param_limit()
    value = min(limit, 1 if param == "nprobe" else k)
    while True:
        store.set_param(param, value)
        recall = measure()
        logger.info("tuning %s=%d: recall@%d %.4f", param, value, k, recall)
        if recall >= target or value >= limit:
            break
        value = min(value * 2, limit)
    if recall < target:
        logger.warning("%s reaches recall@%d %.3f at most (%s=%d), below the target %.2f: consider --kind flat",
                       store.kind, k, recall, param, value, target)  # fmt: skip
    return Tuning(param, value, recall, len(queries))


def _drop_self(found: np.ndarray, self_ids: np.ndarray, k: int) -> np.ndarray:
    """Remove each row's own id, keeping the first ``k`` of the rest."""
    out = np.full((len(found), k), -1, np.int64)
    for i, (row, own) in enumerate(zip(found, self_ids)):
        rest = row[row != own][:k]
        out[i, : len(rest)] = rest
    return out
