"""One query from several photos: "more like these, less like those" as a single vector of the index's space.

Positives and negatives are vectors of the index's space (rows as :meth:`index.search.image_index.ImageIndex.to_space`
gives
them: centred, whitened where the space whitens, L2-normalized). Every rule here is linear, so its result ``q`` is one
inner-product query: FAISS ranks the collection by ``q . x`` exactly as it ranks it for one photo. The rules measured
(``bench/multi_query.py``, BENCHMARKS.md "Search with several photos"):

- ``mean``: ``normalize(mean(P))``; negatives are ignored;
- ``difference``: ``normalize(mean(P) - beta * mean(N))`` (Rocchio's rule without a starting query);
- ``rocchio``: ``normalize(unit(mean(P)) - beta * unit(mean(N)))``, both means made unit first;
- ``logistic``: the weights of an L2-regularized logistic regression of the positives against the negatives and
  ``background`` (random photos of the collection), fitted by Newton's method.

One positive and no negative is that photo's own vector, bit for bit: a search with one photo is the search of today.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np

from moco.errors import UserError

__all__ = ["combine", "check_query_vector", "check_query_size", "check_query_file", "query_size", "MIN_SIDE_PX",
           "RULES", "RULE", "BETA", "LOGISTIC_L2", "BACKGROUND"]

logger = logging.getLogger(__name__)

RULES = ("mean", "difference", "rocchio", "logistic")
RULE = "difference"  # the rule every door uses: the best mean precision@10 on the tuning split (bench/multi_query.py)
BETA = 0.1  # the weight of the negatives' mean: larger weights lost precision (BENCHMARKS.md)
LOGISTIC_L2 = 1.0  # the logistic rule's L2 penalty (per unit of sample weight)
BACKGROUND = 256  # random photos of the collection the logistic rule takes as unlabelled negatives


MIN_SIDE_PX = 16  # a query image smaller than this on a side has too little in it to search with


def check_query_size(name: str, size: tuple[int, int]) -> None:
    """The one size rule of every door that searches with an image (the CLI's ``moco index search``, the page, the
    JSON API, :meth:`ImageIndex.search_image`): a UserError naming ``name``, its size and the fix when a side of
    ``size`` (width, height) is under MIN_SIDE_PX."""
    if min(size) < MIN_SIDE_PX:
        raise UserError(f"{name} is {size[0]} x {size[1]} pixels: too small to search with (at least {MIN_SIDE_PX} px "
                        "on each side): upload a larger photo (or give one to `moco index search`)")


def query_size(image: Any) -> tuple[str, tuple[int, int]] | None:
    """(name, (width, height)) of a query image: a path's from its header (nothing decoded), None when its header
    cannot be read (the decoder then says why)."""
    import warnings

    from PIL import Image

    from moco.data.photos import ImageDecodeError, photo_info

    if isinstance(image, Image.Image):
        return "the image", image.size
    if isinstance(image, np.ndarray):
        return "the image", (image.shape[1] if image.ndim > 1 else 0, image.shape[0])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        try:
            return str(image), photo_info(image).size  # any photo's header: HEIC and RAW too
        except (ImageDecodeError, TypeError):  # unreadable or not an image: the embedder's decoder explains
            return None


def check_query_file(path: str | Path) -> None:
    """A query photo's file checked from its header before any model loads (nothing decoded): an
    :class:`~moco.data.photos.ImageDecodeError` naming it when it is no image (or unreadable), the rule of
    :func:`check_query_size` when it is too small."""
    from moco.data.photos import photo_info

    check_query_size(str(path), photo_info(path).size)


def _unit(v: np.ndarray) -> np.ndarray:
    """``v`` (D) scaled to length 1 (float32)."""
    return (v / max(float(np.linalg.norm(v)), 1e-12)).astype(np.float32)


def _logistic(pos: np.ndarray, neg: np.ndarray, background: np.ndarray, l2: float) -> np.ndarray:
    """Weights (D) of a weighted L2-regularized logistic regression with a free bias: the positives (total weight 1)
    against the negatives (1/2, or none) and the background (1/2, or 1 without negatives).

    Fitted by Newton's method in the samples' span (the weights are ``X^T a``: the L2 penalty keeps them there), so a
    step solves M+1 equations for M samples instead of D+1: the same optimum, far fewer operations when M < D."""
    x = np.concatenate([pos, neg, background]).astype(np.float64)  # M x D
    y = np.concatenate([np.ones(len(pos)), np.zeros(len(neg) + len(background))])  # M
    share_neg = 0.5 if len(neg) and len(background) else (1.0 if len(neg) else 0.0)
    s = np.concatenate([np.full(len(pos), 1 / len(pos)),
                        np.full(len(neg), share_neg / max(len(neg), 1)),
                        np.full(len(background), (1 - share_neg) / max(len(background), 1))])  # M: sample weights
    k = x @ x.T  # M x M
    m = len(x)
    a, b = np.zeros(m), 0.0  # M, the bias
    for _ in range(50):  # Newton's method on a convex problem: a few steps
        p = 1 / (1 + np.exp(-(k @ a + b)))  # M
        r = s * (p - y)  # M: the loss's gradient in the scores
        w = s * p * (1 - p)  # M
        # the Newton system with the samples' Gram matrix factored out of the weights' rows
        lhs = np.zeros((m + 1, m + 1))  # M+1 x M+1
        lhs[:m, :m] = w[:, None] * k + l2 * np.eye(m)
        lhs[:m, m] = w
        lhs[m, :m] = w @ k
        lhs[m, m] = w.sum() + 1e-12
        step = np.linalg.solve(lhs, np.concatenate([r + l2 * a, [r.sum()]]))  # M+1
        a, b = a - step[:m], b - step[m]
        if float(np.abs(step).max()) < 1e-9:
            break
    return x.T @ a  # D


def combine(positives: np.ndarray, negatives: np.ndarray | None = None, rule: str = RULE, beta: float = BETA,
            background: np.ndarray | None = None, l2: float = LOGISTIC_L2) -> np.ndarray:
    """One unit query (D, float32) of the index's space from ``positives`` (P x D, P >= 1) and ``negatives`` (N x D,
    or None), all rows in the index's space, by ``rule`` (one of RULES; ``background``: B x D random photos of the
    collection, which ``logistic`` needs). One positive without negatives is returned as it is."""
    pos = np.ascontiguousarray(np.atleast_2d(positives), np.float32)  # P x D
    neg = np.zeros((0, pos.shape[1]), np.float32) if negatives is None else np.atleast_2d(negatives)  # N x D
    if rule not in RULES:
        raise UserError(f"unknown query rule {rule!r}: use one of {', '.join(RULES)}")
    if len(pos) == 0:
        raise UserError("a search needs at least one positive photo (negatives alone say only what to avoid)")
    if neg.shape[1] != pos.shape[1]:
        raise UserError(f"negatives have dimension {neg.shape[1]}, positives {pos.shape[1]}")
    if len(pos) == 1 and len(neg) == 0 and rule != "logistic":
        return pos[0]  # the one-photo search, unchanged
    mean_p = pos.mean(axis=0)  # D
    if rule == "mean" or (len(neg) == 0 and rule != "logistic"):
        return _unit(mean_p)
    if rule == "difference":
        return _unit(mean_p - beta * neg.mean(axis=0))
    if rule == "rocchio":
        return _unit(_unit(mean_p) - beta * _unit(neg.mean(axis=0)))
    if background is None or len(background) == 0:
        raise UserError("the logistic rule needs background photos of the collection")
    return _unit(_logistic(pos, neg, np.atleast_2d(background), l2))


def check_query_vector(vector: object, dim: int) -> np.ndarray:
    """A raw query vector (``dim`` numbers, in the index's space) as a unit float32 vector (D); a UserError naming
    what is wrong when it is not a list of ``dim`` finite numbers, not all zero."""
    try:
        v = np.asarray(vector, np.float64)  # D
    except (TypeError, ValueError):
        raise UserError(f"vector must be a list of {dim} numbers") from None
    if v.ndim != 1 or len(v) != dim:
        raise UserError(f"vector has {v.size if v.ndim == 1 else v.shape} numbers, this index's space has {dim}: "
                        f"give {dim} numbers")
    if not np.isfinite(v).all():
        raise UserError("vector holds a NaN or an infinity: give finite numbers")
    norm = float(np.linalg.norm(v))
    if norm == 0.0 or not np.isfinite(norm):
        raise UserError("vector is all zeros (or too small to have a direction): a query needs a direction")
    return (v / norm).astype(np.float32)
