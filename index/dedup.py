"""Near-duplicate groups: range search of every stored vector, then connected components.

Two images are linked when their centred cosine similarity (as search scores) is at least ``threshold``; a group is a
connected component of that graph (so a chain a~b~c is one group even if a and c differ more).
"""

from __future__ import annotations

import datetime
import json
from pathlib import Path
from typing import Any

from index.image_index import DEDUP_FILE, ImageIndex
from moco.checkpoint import atomic_write
from moco.errors import UserError

__all__ = ["find_duplicates", "load_duplicates", "dedup_threshold", "DEDUP_THRESHOLD", "WHITENED_DEDUP_THRESHOLD",
           "STAGED_DEDUP_THRESHOLD"]

# Centred cosine (see ImageIndex.center). Measured on the sample collection (240 photos) with the model `make run`
# trains (ResNet-18, 64 px, 10 minutes): resized (75%) and JPEG q=60 copies score 0.955-0.999 with their photo,
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


def dedup_threshold(index: ImageIndex) -> float:
    """The near-duplicate threshold for ``index``'s scores: :data:`STAGED_DEDUP_THRESHOLD` where its backbone
    whitens embeddings with pooled stages, :data:`WHITENED_DEDUP_THRESHOLD` where it whitens its last stage's
    features, else :data:`DEDUP_THRESHOLD`."""
    if not index.whitened:
        return DEDUP_THRESHOLD
    return STAGED_DEDUP_THRESHOLD if index.pooled_stages else WHITENED_DEDUP_THRESHOLD


def _find(parent: dict[int, int], x: int) -> int:
    while parent.setdefault(x, x) != x:
        parent[x] = parent[parent[x]]
        x = parent[x]
    return x


def find_duplicates(index: ImageIndex, threshold: float | None = None, save: bool = True,
                    chunk: int = 1024) -> list[dict[str, Any]]:  # fmt: skip
    """Groups of near-duplicates, largest first; each member has id, path, thumb and its best similarity.

    ``threshold``: None: :func:`dedup_threshold`. Written to ``dedup.json`` in the index directory when ``save``.
    """
    threshold = dedup_threshold(index) if threshold is None else threshold
    if not -1.0 <= threshold <= 1.0:
        raise UserError(f"--threshold {threshold} must be a cosine similarity in [-1, 1] (e.g. "
                        f"{dedup_threshold(index)})")  # fmt: skip
    ids, vecs = index.catalog.vectors(dim=index.dim)  # N, N x D
    parent: dict[int, int] = {}
    best: dict[int, float] = {}
    for start in range(0, len(ids), chunk):
        lims, scores, found = index.store.range_search(index.center(vecs[start : start + chunk]), threshold)
        for q in range(len(lims) - 1):
            own = int(ids[start + q])
            for j, s in zip(found[lims[q] : lims[q + 1]], scores[lims[q] : lims[q + 1]]):
                j = int(j)
                if j == own or j < 0:
                    continue
                parent[_find(parent, own)] = _find(parent, j)
                best[own] = max(best.get(own, -1.0), float(s))
                best[j] = max(best.get(j, -1.0), float(s))
    members: dict[int, list[int]] = {}
    for x in list(parent):
        members.setdefault(_find(parent, x), []).append(x)
    rows = index.catalog.rows_by_id(parent)
    groups = []
    for group in members.values():
        live = sorted(i for i in group if i in rows)
        if len(live) < 2:
            continue
        groups.append({"size": len(live), "members": [
            {"id": i, "path": rows[i].path, "thumb": rows[i].thumb, "best_similarity": round(best[i], 5)}
            for i in sorted(live, key=lambda i: rows[i].path)]})  # fmt: skip
    groups.sort(key=lambda g: (-g["size"], g["members"][0]["path"]))
    if save:
        doc = {"threshold": threshold, "groups": groups, "images": int(len(ids)),
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

