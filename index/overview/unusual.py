"""Unusual photos: those farthest from any other photo of the collection (FiftyOne's "uniqueness", by the closest
neighbour): each photo's cosine to its closest other photo, as search scores it, lowest first.

A photo with an exact copy (the same bytes) is not unusual: the copy is another photo, at cosine 1. The closest
other photo is found by the index's own FAISS store (exact for a ``flat`` index, within its tuned recall for the
approximate kinds, where a photo may look a little more unusual than it is). Cached with the index's version
(:mod:`index.overview.cache`, ``IDX/unusual.npz``).
"""

from __future__ import annotations

import logging

import numpy as np

from index.overview.cache import Collection, cached, space_vectors

__all__ = ["unusual_photos", "closest_other"]

logger = logging.getLogger(__name__)

_ASK = 8  # neighbours asked for per photo: itself, and a few the catalog may no longer list


def closest_other(index: Collection, chunk: int = 2048) -> dict[str, np.ndarray]:
    """``{"ids": N int64 ascending, "closest": N float32}``: each photo's cosine to its closest other live photo
    (NaN for a photo alone in its collection)."""
    ids, x = space_vectors(index)  # N, N x D
    best = np.full(len(ids), np.nan, np.float32)  # N
    k = min(_ASK, index.store.ntotal)
    if k == 0 or len(ids) < 2:
        return {"ids": ids, "closest": best}
    for start in range(0, len(ids), chunk):
        scores, found = index.store.search(x[start : start + chunk], k)  # B x k
        own = ids[start : start + chunk, None]  # B x 1
        live = np.isin(found, ids) & (found != own)  # B x k: another photo the catalog lists
        first = live.argmax(1)  # the best such (scores are sorted)
        got = live.any(1)
        rows = np.flatnonzero(got)
        best[start + rows] = scores[rows, first[rows]]
    missing = np.flatnonzero(np.isnan(best))
    if len(missing):  # more than _ASK neighbours gone from the catalog, or missing from the store: exactly
        for start in range(0, len(missing), 256):
            at = missing[start : start + 256]
            s = x[at] @ x.T  # B x N
            s[np.arange(len(at)), at] = -np.inf
            best[at] = s.max(1)
    return {"ids": ids, "closest": best}


def unusual_photos(index: Collection, offset: int = 0, limit: int = 60,
                   refresh: bool = False) -> tuple[list[tuple[int, float]], int]:
    """A page of the collection's photos by their cosine to the closest other photo, lowest first (ties: the
    smaller id): ``[(photo id, cosine), ...]``, and how many photos there are (each photo of a collection of two or
    more)."""
    arrays, _ = cached(index, "unusual", {}, lambda: closest_other(index), refresh=refresh)
    ids, closest = arrays["ids"], arrays["closest"]
    has = np.flatnonzero(~np.isnan(closest))
    order = has[np.lexsort((ids[has], closest[has]))]
    offset, limit = max(0, int(offset)), max(0, int(limit))
    page = order[offset : offset + limit]
    return [(int(ids[i]), float(closest[i])) for i in page], len(order)
