"""The InfoNCE view of one image, whichever source its negatives come from: what the Negatives tab shows, the
numbers of the loss, and the evidence that flags a negative.

A negative is flagged as a likely false negative only on evidence, with the first reason that applies:

1. ``"same photo"``: it is a key of the very photo inspected (the queue keeps several keys of one photo);
2. ``"near-duplicate"``: its photo is a near-duplicate of the query by the dedup rule (centred cosine of
   the clean embeddings >= the index's :func:`index.duplicates.dedup.dedup_threshold`);
3. ``"as close as two views of one photo"``: it scores at or above the median cosine of two training
   views of one photo, measured on the collection (``index.json``'s ``augment_level``) or, for the queue,
   on training images of the checkpoint.

Scoring at or above the positive alone is no evidence (the positive is often weak): it is counted
(``NegativesView.above_positive``), not flagged. Counts are over all K negatives, not the rows shown.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from PIL import Image

from moco.data.photos import load_rgb
from moco.errors import UserError

__all__ = ["Negative", "NegativesView", "info_nce_numbers", "REASONS", "SAME_IMAGE", "to_u8", "check_args",
           "load_indexed", "reason_codes", "closeness_level", "build_view"]

SAME_IMAGE = 0.9999  # a negative this close to the query's clean embedding is the query image itself
REASONS = ("same photo", "near-duplicate", "as close as two views of one photo")  # in order of priority
SAME_PHOTO, NEAR_DUPLICATE, TWO_VIEWS = REASONS


@dataclass
class Negative:
    """One negative: where it came from, its part in the loss, and why it may be a false negative."""

    id: int
    path: str | None
    thumb: Any  # a Path inside the index's thumbs/, or a small PIL image, or None
    similarity: float
    logit: float
    share: float  # its probability in the softmax over [positive + all negatives]
    reason: str = ""  # "" without evidence, else one of REASONS (the first that applies)
    keys_of_photo: int = 1  # keys of this photo among all K negatives (the queue can hold several)
    key_number: int = 1  # 1 for the first shown key of this photo, 2 for the second...


@dataclass
class NegativesView:
    """Everything the Negatives tab shows for one image."""

    source: str  # "queue" or "index"
    space: str  # a sentence saying where the vectors live
    temperature: float
    view_q: np.ndarray  # s x s x 3 uint8, the query view
    view_k: np.ndarray  # s x s x 3 uint8, the positive key view
    positive: float  # cosine of q and k+
    positive_share: float
    loss: float
    positive_rank: int  # 1 when the positive beats every negative
    count: int  # negatives in the softmax
    negatives: list[Negative] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    above_positive: int = 0  # negatives with cosine >= the positive, over all K
    flagged: dict[str, int] = field(default_factory=dict)  # reason -> count over all K negatives (every reason)
    augment_level: float | None = None  # the "as close as two views of one photo" cosine; None: not measured


def info_nce_numbers(positive: float, negatives: np.ndarray, temperature: float) -> dict[str, Any]:
    """Logits, softmax shares, loss and the positive's rank for one query (float64, stable).

    ``negatives``: cosine similarities of the query to each of the K negatives (K).
    """
    sims = np.concatenate([[positive], np.asarray(negatives, np.float64)])  # 1+K
    logits = sims / temperature
    log_z = np.logaddexp.reduce(logits)
    shares = np.exp(logits - log_z)
    return {"logits": logits, "shares": shares, "loss": float(log_z - logits[0]),
            "rank": int(1 + np.sum(sims[1:] >= sims[0]))}


def to_u8(view: torch.Tensor, mean: Any, std: Any) -> np.ndarray:
    """A normalized 3 x s x s view back to s x s x 3 uint8 for display."""
    x = view.float().cpu() * torch.tensor(std)[:, None, None] + torch.tensor(mean)[:, None, None]
    return (x.clamp(0, 1) * 255).round().to(torch.uint8).permute(1, 2, 0).numpy()


def check_args(n: Any, seed: Any) -> tuple[int, int]:
    """``n`` (negatives to show, >= 1) and ``seed`` as ints, or a UserError naming the value."""
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
        raise UserError(f"n={n!r}: the number of negatives to show must be a whole number >= 1 (e.g. n=12)")
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
        raise UserError(f"seed={seed!r}: the seed of the two views must be a whole number (e.g. seed=0)")
    return int(n), int(seed)


def load_indexed(index: Any, image_id: Any, min_short: int) -> tuple[Any, Image.Image, list[str]]:
    """(row, RGB image, notes) of the indexed photo ``image_id``: its original decoded as the index decodes it,
    or its thumbnail (with a note) when the original cannot be read."""
    if isinstance(image_id, bool) or not isinstance(image_id, (int, np.integer)):
        raise UserError(f"image id {image_id!r} is not a catalog id: pass the id of a search result "
                        "(SearchResult.ids)")
    row = index.catalog.rows_by_id([int(image_id)]).get(int(image_id))
    if row is None or row.status != "ok":
        raise UserError(f"image id {image_id} is not a photo of the index {index.dir} (deleted, unreadable or never "
                        "indexed): pick a result of a new search")
    notes = [f"inspecting indexed photo #{row.id} ({row.path})"]
    try:
        return row, load_rgb(index.root / row.path, min_short=min_short), notes
    except UserError as e:
        reason = getattr(e, "reason", str(e))
        thumb = index.thumb_path(row)
        if thumb is None:
            raise UserError(f"the original of #{row.id} ({index.root / row.path}) cannot be read ({reason}) and it "
                            f"has no thumbnail: put the file back, or run `moco index update {index.dir}`") from e
        try:
            img = load_rgb(thumb)
        except UserError as e2:
            raise UserError(f"neither the original of #{row.id} ({reason}) nor its thumbnail {thumb} can be read: "
                            f"run `moco index update {index.dir}`") from e2
    notes.append(f"the original {row.path} cannot be read ({reason}): its thumbnail ({img.size[0]}x{img.size[1]}) "
                 "was inspected instead")
    return row, img, notes


def reason_codes(sims: np.ndarray, same: np.ndarray, duplicate: np.ndarray, level: float | None) -> np.ndarray:
    """Per negative (K): 0 without evidence, else 1 + the index in REASONS of the first reason that applies."""
    code = np.zeros(len(sims), np.int8)  # K
    if level is not None:
        code[sims >= level] = 3
    code[duplicate] = 2
    code[same] = 1
    return code


def closeness_level(level: float | None, chance: float | None, notes: list[str]) -> float | None:
    """The "as close as two views of one photo" threshold, or None when it is no evidence.

    Two views of one photo must score above what unrelated pairs reach (``chance``); a model that
    cannot yet tell one photo from another (its views no closer than random pairs) flags nothing by closeness.
    """
    if level is None or chance is None or level > chance:
        return level
    notes.append(f"two views of one photo score {level:.3f} (median), no higher than unrelated pairs reach "
                 f"({chance:.3f}): this model cannot tell photos apart by closeness yet, so negatives are flagged "
                 "only as the same photo or a near-duplicate")
    return None


def build_view(view: NegativesView, sims: np.ndarray, ids: np.ndarray, codes: np.ndarray, n: int,
               describe: Callable[[list[int]], list[tuple[str | None, Any]]]) -> NegativesView:
    """Fill the numbers of ``view`` from negative similarities ``sims`` (K), their image ``ids`` (K) and reason
    ``codes`` (K, from :func:`reason_codes`); ``describe`` gives (path, thumb) of the ids shown."""
    nums = info_nce_numbers(view.positive, sims, view.temperature)
    view.loss, view.positive_rank, view.count = nums["loss"], nums["rank"], len(sims)
    view.positive_share = float(nums["shares"][0])
    view.above_positive = int(np.sum(sims >= view.positive))
    by_code = np.bincount(codes, minlength=len(REASONS) + 1)  # 1+R
    view.flagged = {r: int(by_code[i + 1]) for i, r in enumerate(REASONS)}
    _, inverse, counts = np.unique(ids, return_inverse=True, return_counts=True)
    keys_of = counts[inverse.reshape(-1)]  # K: keys of each negative's photo among all K
    top = np.argsort(-sims, kind="stable")[:n]
    shown: dict[int, int] = {}
    for j, (path, thumb) in zip(top, describe([int(ids[j]) for j in top])):
        i = int(ids[j])
        shown[i] = shown.get(i, 0) + 1
        view.negatives.append(Negative(i, path, thumb, float(sims[j]), float(nums["logits"][1 + j]),
                                       float(nums["shares"][1 + j]), REASONS[codes[j] - 1] if codes[j] else "",
                                       int(keys_of[j]), shown[i]))
    return view
