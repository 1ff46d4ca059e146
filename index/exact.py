"""Exact top-k by inner product in numpy: a flat store's search of a few queries, and the ground truth of tuning.

Vectors are L2-normalized, so the inner product is the cosine every index kind ranks by.
"""

from __future__ import annotations

import numpy as np

__all__ = ["few_topk", "exact_topk", "recall_at"]


def few_topk(q: np.ndarray, xb: np.ndarray, labels: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Exact search of a few queries ``q`` (Q x D) over ``xb`` (N x D) stored under ``labels`` (N int64): (scores
    Q x k float32, labels Q x k int64), by score, ties by position.

    One BLAS product over the stored vectors, then an exact top-k. The top-k avoids a full partition of N scores:
    the k-th best score of a strided sample is a lower bound of the true k-th best (a subset's k-th largest never
    exceeds the whole set's), so every true top-k score is at or above it, and only those few candidates are sorted.
    """
    n = len(xb)
    scores = q @ xb.T  # Q x N
    out_s = np.empty((len(q), k), np.float32)
    out_i = np.empty((len(q), k), np.int64)
    step = 16 if n >= 16 * 64 * k else 1  # a 1/16 sample: its k-th best bounds the top ~16k
    for r, row in enumerate(scores):
        sample = row[::step]
        bound = np.partition(sample, len(sample) - k)[len(sample) - k] if len(sample) >= k else -np.inf
        cand = np.flatnonzero(row >= bound)  # includes the true top-k
        best = cand[np.lexsort((cand, -row[cand]))[:k]]  # by score, ties by position
        out_s[r], out_i[r] = row[best], labels[best]
    return out_s, out_i


def exact_topk(vectors: np.ndarray, ids: np.ndarray, queries: np.ndarray, query_ids: np.ndarray,
               k: int, exclude: np.ndarray | None = None) -> np.ndarray:  # fmt: skip
    """Ground truth: each query's top-``k`` ids by inner product (numpy, chunked), own id excluded.

    ``exclude``: ids left out for every query (e.g. all the held-out queries).
    """
    gone = np.isin(ids, exclude) if exclude is not None and len(exclude) else None  # N
    out = []
    for start in range(0, len(queries), 64):
        q = queries[start : start + 64]
        scores = q @ vectors.T  # q x N
        own = query_ids[start : start + 64]
        scores[ids[None, :] == own[:, None]] = -np.inf
        if gone is not None:
            scores[:, gone] = -np.inf
        kk = min(k, scores.shape[1])
        top = np.argpartition(-scores, kk - 1, axis=1)[:, :kk]  # q x k, unordered
        out.append(ids[top])
    return np.concatenate(out)


def recall_at(found: np.ndarray, truth: np.ndarray) -> float:
    """Mean fraction of each row of ``truth`` present in the same row of ``found``."""
    hits = [len(np.intersect1d(f[f >= 0], t)) / max(1, len(t)) for f, t in zip(found, truth)]
    return float(np.mean(hits)) if hits else 1.0
