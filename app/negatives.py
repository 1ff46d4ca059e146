"""The InfoNCE view of one image: its two training views, the positive, and the negatives that sit closest.

MoCo's loss for a query q with positive key k+ and negatives k_1..k_K is
``-log softmax([q.k+, q.k_1, ..., q.k_K] / T)[0]``. For an uploaded image this module computes exactly
those numbers, from one of two sources:

- ``QueueNegatives`` (a training checkpoint is given): the checkpoint's own augmentation recipe makes
  the query and key views; q comes from the query encoder (projector, and predictor for v3), k+ from
  the momentum (key) encoder, and the negatives are the saved queue of K keys, each with the id of
  the training image it came from. This is the space the loss lives in.
- ``IndexNegatives`` (no checkpoint, or one without a queue): both views go through the exported
  backbone, and every other image of the index is a negative, in backbone space.
"""

from __future__ import annotations

import json
import logging
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

from moco.augment import two_views
from moco.data import load_rgb, square_u8
from moco.errors import UserError

__all__ = ["Negative", "NegativesView", "QueueNegatives", "IndexNegatives", "info_nce_numbers"]

logger = logging.getLogger(__name__)

SAME_IMAGE = 0.9999  # a negative this close to the query's clean embedding is the query image itself


@dataclass
class Negative:
    """One negative: where it came from and its part in the loss."""

    id: int
    path: str | None
    thumb: Any  # a Path inside the index's thumbs/, or a small PIL image, or None
    similarity: float
    logit: float
    share: float  # its probability in the softmax over [positive + all negatives]
    suspicious: bool  # scores at or above the positive: a likely false negative or near-duplicate


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


def info_nce_numbers(positive: float, negatives: np.ndarray, temperature: float) -> dict[str, Any]:
    """Logits, softmax shares, loss and the positive's rank for one query (float64, stable).

    ``negatives``: cosine similarities of the query to each of the K negatives (K).
    """
    sims = np.concatenate([[positive], np.asarray(negatives, np.float64)])  # 1+K
    logits = sims / temperature
    log_z = np.logaddexp.reduce(logits)
    shares = np.exp(logits - log_z)
    return {"logits": logits, "shares": shares, "loss": float(log_z - logits[0]),
            "rank": int(1 + np.sum(sims[1:] >= sims[0]))}  # fmt: skip


def _to_u8(view: torch.Tensor, mean: Any, std: Any) -> np.ndarray:
    """A normalized 3 x s x s view back to s x s x 3 uint8 for display."""
    x = view.float().cpu() * torch.tensor(std)[:, None, None] + torch.tensor(mean)[:, None, None]
    return (x.clamp(0, 1) * 255).round().to(torch.uint8).permute(1, 2, 0).numpy()


def _as_rgb(image: Any, min_short: int | None = None) -> Image.Image:
    """An upload as RGB; a file is decoded reduced (never below twice ``min_short`` on its short side)."""
    if isinstance(image, Image.Image):
        return image.convert("RGB")
    if isinstance(image, np.ndarray):
        if image.dtype != np.uint8 or image.ndim not in (2, 3):
            raise UserError(f"expected an RGB image, got an array of {image.dtype} {image.shape}")
        return Image.fromarray(image).convert("RGB")
    if isinstance(image, (str, Path)):
        return load_rgb(image, min_short=min_short)
    raise UserError("no image: upload a photo first")


def _build(view: NegativesView, sims: np.ndarray, ids: np.ndarray, n: int, describe: Any) -> NegativesView:
    """Fill the numbers of ``view`` from negative similarities ``sims`` (K) and their image ``ids`` (K)."""
    nums = info_nce_numbers(view.positive, sims, view.temperature)
    view.loss, view.positive_rank, view.count = nums["loss"], nums["rank"], len(sims)
    view.positive_share = float(nums["shares"][0])
    top = np.argsort(-sims, kind="stable")[:n]
    for j in top:
        path, thumb = describe(int(ids[j]))
        view.negatives.append(Negative(int(ids[j]), path, thumb, float(sims[j]), float(nums["logits"][1 + j]),
                                       float(nums["shares"][1 + j]), bool(sims[j] >= view.positive)))  # fmt: skip
    return view


class IndexNegatives:
    """Negatives from the index, in the exported backbone's space: every other image is a negative."""

    def __init__(self, index: Any, embedder: Any, temperature: float | None = None, recipe: str = "v2") -> None:
        self.index, self.embedder, self.recipe = index, embedder, recipe
        trained = json.loads(embedder.config.get("training") or "{}")
        self.temperature = float(temperature or trained.get("temperature") or 0.2)
        self._cache: tuple[int, np.ndarray, np.ndarray] | None = None
        self._lock = threading.Lock()

    def _vectors(self) -> tuple[np.ndarray, np.ndarray]:
        with self._lock:
            n = self.index.store.ntotal
            if self._cache is None or self._cache[0] != n:
                ids, vecs = self.index.catalog.vectors(dim=self.index.dim)
                self._cache = (n, ids, vecs)
            return self._cache[1], self._cache[2]

    def compute(self, image: Any, n: int = 12, seed: int = 0) -> NegativesView:
        """The InfoNCE view of ``image`` against the index."""
        emb = self.embedder
        ids, vecs = self._vectors()  # N, N x D
        if len(ids) == 0:
            raise UserError("the index is empty: nothing to compare with (run `moco index update`)")
        square = square_u8(_as_rgb(image), emb.resize)
        g = torch.Generator().manual_seed(int(seed))
        xq, xk = two_views(torch.tensor(square)[None], self.recipe, emb.image_size, emb.mean, emb.std, g)
        q, k = emb.embed_views(torch.cat([xq, xk]))  # D, D
        clean = emb.embed_squares(np.array(square)[None])[0]  # D
        notes = []
        same = (vecs @ clean) >= SAME_IMAGE
        if same.any():
            notes.append(f"left out {int(same.sum())} copy(ies) of the query image itself found in the index")
        ids, vecs = ids[~same], vecs[~same]
        view = NegativesView("index", "backbone space of the exported model; negatives: every other image of the "
                             f"index ({len(ids)}); views: the {self.recipe} training recipe",
                             self.temperature, _to_u8(xq[0], emb.mean, emb.std), _to_u8(xk[0], emb.mean, emb.std),
                             float(q @ k), 0.0, 0.0, 0, 0, notes=notes)  # fmt: skip
        rows = self.index.catalog.rows_by_id(ids[np.argsort(-(vecs @ q))[:n]])

        def describe(i: int) -> tuple[str | None, Any]:
            row = rows.get(i)
            return (row.path, self.index.thumb_path(row)) if row else (None, None)

        return _build(view, vecs @ q, ids, n, describe)


class QueueNegatives:
    """Negatives from a training checkpoint's queue, in the projection space, with the key encoder."""

    def __init__(self, checkpoint: str | Path, index: Any | None = None, device: str = "cpu") -> None:
        from moco.checkpoint import load_checkpoint
        from moco.config import from_plain
        from moco.train import build_model, cache_size_for

        ckpt = load_checkpoint(checkpoint)
        if "config" not in ckpt or "model" not in ckpt:
            raise UserError(f"{checkpoint} is not a `moco train` checkpoint (no config/model): the Negatives tab "
                            "needs RUN/checkpoint.pt; without --checkpoint it uses the index instead")  # fmt: skip
        self.cfg = from_plain(ckpt["config"])
        self.model = build_model(self.cfg)
        self.model.load_state_dict(ckpt["model"])
        self.model.eval().to(device)
        self.device = torch.device(device)
        if getattr(self.model, "queue", None) is None:
            raise UserError(f"{checkpoint} has no queue (MoCo v3 uses in-batch negatives): use the index instead")
        self.queue = self.model.queue[0].float()  # C x K, the keys of the first view
        self.queue_ids = self.model.queue_ids[0].cpu().numpy()  # K; -1 = never filled
        self.files, self.root = list(ckpt.get("files", [])), Path(ckpt.get("data_root", "."))
        self.size = cache_size_for(self.cfg.image_size, self.cfg.cache_size)
        self.index = index
        self.name = Path(checkpoint).name
        self.step = int(ckpt.get("step", 0))

    @torch.inference_mode()
    def keys(self, xq: torch.Tensor, xk: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q from the query encoder (with the v3 predictor), k+ from the momentum encoder: 1 x C each."""
        m = self.model
        q = m._query(xq.to(self.device))  # 1 x C
        k = F.normalize(m.projector_momentum(m.backbone_momentum(xk.to(self.device))).float(), dim=1)  # 1 x C
        return q, k

    def _describe(self, image_id: int) -> tuple[str | None, Any]:
        if not 0 <= image_id < len(self.files):
            return None, None
        rel = self.files[image_id]
        if self.index is not None:
            try:
                rel_to_index = (self.root / rel).resolve().relative_to(self.index.root.resolve()).as_posix()
            except ValueError:
                rel_to_index = None
            if rel_to_index is not None:
                row = self.index.catalog.row_by_path(rel_to_index)
                if row is not None and row.thumb:
                    return rel, self.index.thumb_path(row)
        try:  # a training image the index does not hold: a small in-memory thumbnail
            img = load_rgb(self.root / rel, min_short=128)
            img.thumbnail((256, 256))
            return rel, img
        except UserError:
            return rel, None

    def compute(self, image: Any, n: int = 12, seed: int = 0) -> NegativesView:
        """The InfoNCE view of ``image`` against the saved queue."""
        cfg = self.cfg
        square = square_u8(_as_rgb(image), self.size)
        g = torch.Generator().manual_seed(int(seed))
        xq, xk = two_views(torch.tensor(square)[None], cfg.augment, cfg.image_size, cfg.mean, cfg.std, g)
        q, k = self.keys(xq, xk)
        filled = self.queue_ids >= 0
        sims = (q @ self.queue.to(q.device))[0].cpu().numpy()[filled]  # K'
        view = NegativesView("queue", f"MoCo {cfg.preset} projection space ({cfg.dim}-d); query encoder for q, key "
                             f"encoder for k+; negatives: the {int(filled.sum())} keys of the queue saved in "
                             f"{self.name} (step {self.step}); views: the {cfg.augment} training recipe",
                             cfg.temperature, _to_u8(xq[0], cfg.mean, cfg.std), _to_u8(xk[0], cfg.mean, cfg.std),
                             float((q * k).sum()), 0.0, 0.0, 0, 0)  # fmt: skip
        return _build(view, sims, self.queue_ids[filled], n, self._describe)
