"""The near-duplicate threshold of one index, measured on its own photos.

A seeded sample of the collection (up to :data:`CALIBRATION_SAMPLE` photos, decoded as the index decodes them) gets
two copies each, as a collection's duplicates usually are: resized to 75% and re-encoded as JPEG quality 60, and
cropped to its central 90%. Every copy is scored against its photo in the index's space (centred cosines, as
search scores), and every photo against its nearest other photo of the sample. The threshold lies halfway between
the copies' low end (their 10th percentile) and the closest other photo::

    threshold = (copies_p10 + others_max) / 2      clamped to [0.5, 0.99]

Where the copies' low end does not clear the closest other photo, their median stands in for it. A photo of the
sample whose nearest other photo scores at least as close as the median copy is one of the collection's own
near-duplicates, not another photo: it is left out of ``others_max`` and counted (``sample_duplicates``); where
every photo is, the threshold is the copies' 10th percentile (``others_max`` None). Under
:data:`MIN_PHOTOS` decodable photos there is no calibration, and :func:`dedup_threshold` keeps the
defaults of the backbone's kind.

The sample is a few dozen photos, so the closest other photo of the whole collection is usually closer than
``others_max``: the halfway point leaves that margin.

A weak model, or a collection of very alike photos (planes against blue sky), can put distinct photos as close as
copies. The near threshold of a search (:func:`near_threshold`) is therefore never under the collection's own
*crowd level*: for a seeded sample of up to :data:`GUARD_SAMPLE` photos, the score of each one's
:data:`CROWD`-th closest other photo (photos with its bytes are not other photos) over the whole collection, at
the :data:`CROWD_QUANTILE` quantile. Above it, 99 photos in 100 have fewer than 10 other photos, so no group of
distinct photos grows large; a photo may have a few copies, never ten. Its rule says which of the two set it:
``calibrated`` (or ``default``) or ``crowd``. A random-pair quantile was not used: a collection's copies are its
highest-scoring pairs, so any quantile deep enough to keep distinct photos apart is made of copies.
"""

from __future__ import annotations

import io
import logging
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, Protocol

import numpy as np
from PIL import Image

from index.catalog import Catalog, Row, sample_ids
from moco.data.photos import ImageDecodeError, load_rgb, square_u8

__all__ = ["calibrate_dedup", "calibrate_index", "dedup_threshold", "threshold_source", "neighbour_levels",
           "near_threshold", "describe_threshold", "CALIBRATION_SAMPLE", "MIN_PHOTOS", "RECIPE", "DEDUP_THRESHOLD",
           "WHITENED_DEDUP_THRESHOLD", "STAGED_DEDUP_THRESHOLD", "CROWD", "CROWD_QUANTILE", "GUARD_SAMPLE"]

logger = logging.getLogger(__name__)

CALIBRATION_SAMPLE = 64  # photos of the collection whose copies are measured
MIN_PHOTOS = 8  # fewer decodable photos: no calibration (the backbone kind's default threshold)
RECIPE = "resize 75% + JPEG q60; centre crop 90%"
SCALE, QUALITY, CROP = 0.75, 60, 0.9
LOW, HIGH = 0.5, 0.99  # the calibrated threshold stays in this range
CROWD = 10  # more other photos than this within the near threshold of a photo: a crowd of alike photos, not copies
CROWD_QUANTILE = 0.99  # the near threshold is above the CROWD-th closest other photo of this share of the photos
GUARD_SAMPLE = 512  # photos whose neighbours over the whole collection measure the crowd level
SIMILAR_QUANTILE = 0.9  # the similar threshold: the closest other photo of 1 photo in 10 scores above it


# The defaults of an index without a calibration (built before it, or of fewer than 8 photos). Centred cosine (see
# ImageIndex.to_space). Measured on the sample collection (240 photos) with the model `make run` trains (ResNet-18,
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


class Scored(Protocol):
    """What an index's near-duplicate threshold depends on (an :class:`~index.search.image_index.ImageIndex` has it):
    its
    ``index.json`` and whether its space whitens, with pooled stages or not."""

    meta: dict[str, Any]
    whitened: bool
    pooled_stages: bool


def _calibration(index: Scored) -> dict[str, Any] | None:
    value = index.meta.get("dedup_calibration")
    return value if isinstance(value, dict) and isinstance(value.get("threshold"), (int, float)) else None


def dedup_threshold(index: Scored) -> float:
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


def threshold_source(index: Scored) -> str:
    """Where :func:`dedup_threshold` comes from, in words (for ``stats`` and the page)."""
    calibration = _calibration(index)
    if calibration is not None:
        return (f"calibrated on {calibration.get('photos')} photos of the collection: copies score "
                f"{calibration.get('copies_p10')} (10th percentile), the closest other photo "
                f"{calibration.get('others_max')}")
    kind = "backbone" if not index.whitened else "whitened backbone" + (" with pooled stages" if index.pooled_stages
                                                                          else "")
    return f"the default for a {kind} (no dedup_calibration in index.json: an older index, or under 8 photos)"


def _copies(img: Image.Image) -> list[Image.Image]:
    """The two copies of a decoded photo that the calibration scores: resized to 75% and saved as JPEG quality 60
    (decoded again), and its central 90%."""
    w, h = img.size
    small = img.resize((max(1, round(w * SCALE)), max(1, round(h * SCALE))), Image.Resampling.BICUBIC)
    buf = io.BytesIO()
    small.save(buf, "JPEG", quality=QUALITY)
    with Image.open(io.BytesIO(buf.getvalue())) as im:
        jpeg = im.convert("RGB")
    dx, dy = round(w * (1 - CROP) / 2), round(h * (1 - CROP) / 2)
    return [jpeg, img.crop((dx, dy, w - dx, h - dy))]


def calibrate_dedup(images: Iterable[Image.Image], embed: Callable[[np.ndarray], np.ndarray], resize: int,
                    batch_size: int = 32) -> dict[str, Any] | None:
    """The near-duplicate threshold for the space of ``embed``, from ``images`` (decoded photos of the collection,
    read once: each is dropped once its model squares are made).

    ``embed``: uint8 squares (B x resize x resize x 3) to L2-normalized vectors (B x D) in the index's space;
    every image and copy goes through :func:`moco.data.square_u8` first, as the index's photos. Returns
    ``{"threshold", "copies_p10", "copies_median", "others_max", "others_median", "sample_duplicates", "photos",
    "recipe"}`` (see the module docstring), or None under :data:`MIN_PHOTOS` images.
    """
    squares = [[square_u8(im, resize), *(square_u8(c, resize) for c in _copies(im))] for im in images]
    n = len(squares)
    if n < MIN_PHOTOS:
        return None
    x = np.stack([sq[0] for sq in squares] + [c for sq in squares for c in sq[1:]])  # 3n x R x R x 3 uint8
    v = np.concatenate([embed(x[s : s + batch_size]) for s in range(0, len(x), batch_size)])  # 3n x D
    orig, cop = v[:n], v[n:].reshape(n, 2, -1)  # n x D, n x 2 x D
    to_copy = np.einsum("nd,ncd->nc", orig, cop).ravel()  # 2n: each copy with its photo
    sim = orig @ orig.T  # n x n
    np.fill_diagonal(sim, -np.inf)
    nearest = sim.max(1)  # n: each photo's closest other photo of the sample
    p10, median = float(np.percentile(to_copy, 10)), float(np.median(to_copy))
    others = nearest[nearest < median]  # closer than the median copy: the collection's own duplicates
    if len(others):
        others_max = float(others.max())
        threshold = ((p10 if p10 > others_max else median) + others_max) / 2
    else:  # every photo of the sample has a copy-like neighbour: the copies alone
        others_max, threshold = None, p10
    threshold = min(HIGH, max(LOW, threshold))
    return {"threshold": round(threshold, 4), "copies_p10": round(p10, 4), "copies_median": round(median, 4),
            "others_max": None if others_max is None else round(others_max, 4),
            "others_median": round(float(np.median(nearest)), 4),
            "sample_duplicates": int(n - len(others)), "photos": n, "recipe": RECIPE}


def _sample_image(root: Path, index_dir: Path, row: Row, resize: int) -> Image.Image | None:
    """An indexed photo decoded as the index does; its thumbnail when the original is gone."""
    for path in (root / row.path, index_dir / row.thumb if row.thumb else None):
        if path is None:
            continue
        try:
            return load_rgb(path, min_short=resize)
        except ImageDecodeError as e:
            logger.debug("dedup calibration: skipping %s (%s)", path, e.reason)
    return None


def calibrate_index(root: Path, index_dir: Path, catalog: Catalog, ids: np.ndarray, resize: int,
                    embed: Callable[[np.ndarray], np.ndarray]) -> dict[str, Any] | None:
    """:func:`calibrate_dedup` on up to :data:`CALIBRATION_SAMPLE` of ``ids`` (sorted, seed 0) of an index."""
    rows = catalog.rows_by_id(sample_ids(ids, CALIBRATION_SAMPLE, np.random.default_rng(0)))
    images = (_sample_image(root, index_dir, rows[i], resize) for i in sorted(rows))  # decoded one at a time
    result = calibrate_dedup((im for im in images if im is not None), embed, resize)
    if result:
        logger.info("near-duplicate threshold %s: copies score %s (10th percentile), the closest other photo %s, "
                    "over %d photos", result["threshold"], result["copies_p10"], result["others_max"],
                    result["photos"])
    return result


LEVEL_SCORES_AT_ONCE = 1 << 23  # photo-photo scores :func:`neighbour_levels` holds at once (32 MB, and as much again)


def neighbour_levels(vecs: np.ndarray, content: np.ndarray, sample: np.ndarray, k: int = CROWD,
                     chunk: int = 64) -> tuple[np.ndarray, np.ndarray]:
    """The closest and the ``k``-th closest other photo of each photo of ``sample``, over every photo of ``vecs``.

    ``vecs``: N x D centred, L2-normalized vectors (search scores); ``content``: N ints, equal for photos with the
    same bytes (they are not other photos of each other); ``sample``: S positions in ``vecs``. Returns (S, S)
    scores, -inf where a photo has fewer other photos. At most ``chunk`` photos of the sample at a time, fewer where
    their scores with every photo would pass :data:`LEVEL_SCORES_AT_ONCE`.
    """
    n = len(vecs)
    chunk = max(1, min(chunk, LEVEL_SCORES_AT_ONCE // max(n, 1)))
    first = np.full(len(sample), -np.inf, np.float32)
    kth = np.full(len(sample), -np.inf, np.float32)
    for s in range(0, len(sample), chunk):
        rows = sample[s : s + chunk]
        sim = vecs[rows] @ vecs.T  # B x N
        sim[content[rows][:, None] == content[None, :]] = -np.inf  # itself and its exact copies
        first[s : s + len(rows)] = sim.max(1)
        if n > k:
            kth[s : s + len(rows)] = np.partition(sim, n - k, axis=1)[:, n - k]  # the k-th highest
    return first, kth


def near_threshold(base: float, base_rule: str, first: np.ndarray, kth: np.ndarray,
                   similar: float | None = None) -> dict[str, Any]:
    """The near threshold of a search: ``base`` (the index's, :func:`dedup_threshold`; its rule ``calibrated`` or
    ``default``), raised above the crowd level of :func:`neighbour_levels` ``kth`` where it is lower (rule
    ``crowd``), and the similar threshold (``similar``, else the closest other photo of 1 photo in 10 of the sample,
    among those under the near threshold, at most 0.01 under it).

    Returns ``{"threshold", "rule", "base", "base_rule", "crowd_level", "crowd_k", "crowd_quantile", "sample",
    "similar_threshold"}``; ``crowd_level`` None under :data:`MIN_PHOTOS` measured photos."""
    finite = kth[np.isfinite(kth)]
    crowd = (round(float(np.ceil(np.quantile(finite.astype(np.float64), CROWD_QUANTILE) * 1e4)) / 1e4, 4)
             if len(finite) >= MIN_PHOTOS else None)
    threshold, rule = float(base), base_rule
    if crowd is not None and crowd >= threshold:
        threshold, rule = min(1.0, round(crowd + 1e-4, 4)), "crowd"
    if similar is None:
        below = first[np.isfinite(first) & (first < threshold)]
        similar = float(np.quantile(below.astype(np.float64), SIMILAR_QUANTILE)) if len(below) >= MIN_PHOTOS \
            else threshold - 0.05
        similar = round(min(similar, threshold - 0.01), 4)
    return {"threshold": round(threshold, 4), "rule": rule, "base": float(base), "base_rule": base_rule,
            "crowd_level": crowd, "crowd_k": CROWD, "crowd_quantile": CROWD_QUANTILE, "sample": int(len(first)),
            "similar_threshold": float(similar)}


def describe_threshold(decision: dict[str, Any]) -> str:
    """What set the near threshold of :func:`near_threshold`, in words (for the CLI, stats and the page)."""
    crowd = decision.get("crowd_level")
    level = (f"the collection's crowd level {crowd} (the {decision.get('crowd_k')}th closest other photo of "
             f"{decision.get('crowd_quantile', 0) * 100:g}% of {decision.get('sample')} photos)"
             if crowd is not None else "no crowd level (too few photos)")
    rule, base = decision.get("rule"), decision.get("base_source") or f"{decision.get('base_rule')}"
    if rule == "given":
        return f"given; {level}"
    if rule == "crowd":
        return (f"raised from {decision.get('base')} ({base}) to above {level}: this model puts distinct photos of "
                "the collection that close")
    return f"{base}; above {level}"
