"""Negatives from a training checkpoint's queue: the space the loss lives in.

The checkpoint's own augmentation recipe makes the query and key views; q comes from the query encoder (projector,
and predictor for v3), k+ from the momentum (key) encoder, and the negatives are the saved queue of K keys, each
with the id of the training image it came from. An index, when given, maps training images to its photos (for
thumbnails, and the evidence "same photo" and "near-duplicate").
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

from app.page.negatives.view import (
    SAME_IMAGE,
    NegativesView,
    build_view,
    check_args,
    closeness_level,
    load_indexed,
    reason_codes,
    to_u8,
)
from app.search.uploads import read_upload
from index.building.sync import chance_level
from moco.data.augment import two_views
from moco.data.photos import load_rgb, square_u8
from moco.errors import UserError

__all__ = ["QueueNegatives"]

logger = logging.getLogger(__name__)

LEVEL_SAMPLE = 32  # training images whose two views measure the queue's same-photo level


class QueueNegatives:
    """Negatives from a training checkpoint's queue, in the projection space, with the key encoder.

    ``index`` (optional) gives thumbnails, and the evidence "same photo" (for an upload) and "near-duplicate",
    compared in its space with ``embedder`` (by default the index's own backbone, loaded when first needed).
    """

    def __init__(self, checkpoint: str | Path, index: Any | None = None, device: str = "cpu",
                 embedder: Any | None = None) -> None:
        from moco.config import from_plain
        from moco.data.cache import cache_size_for
        from moco.training.setup import build_model
        from moco.weights.layouts import load_checkpoint

        ckpt = load_checkpoint(checkpoint)
        if "config" not in ckpt or "model" not in ckpt:
            raise UserError(f"{checkpoint} is not a `moco train` checkpoint (no config/model): the Negatives tab "
                            "needs RUN/checkpoint.pt; without --checkpoint it uses the index instead")
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
        self._root_abs = self.root.resolve()
        self.size = cache_size_for(self.cfg.image_size, self.cfg.cache_size)
        self.index = index
        self.name = Path(checkpoint).name
        self.step = int(ckpt.get("step", 0))
        self._embedder, self._embedder_error = embedder, ""
        self._lock = threading.Lock()
        self._level: tuple[float | None, str] | None = None  # (level, why not measured)
        self._chance: float | None = None  # chance level of q . queue keys over the level's sample
        self._in_index: tuple[Any, np.ndarray, np.ndarray] | None = None
        self._file_ids: dict[str, int] | None = None

    @torch.inference_mode()
    def keys(self, xq: torch.Tensor, xk: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q from the query encoder (with the v3 predictor), k+ from the momentum encoder: B x C each."""
        m = self.model
        q = m._query(xq.to(self.device))[0]  # B x C
        k = F.normalize(m.projector_momentum(m.backbone_momentum(xk.to(self.device))).float(), dim=1)  # B x C
        return q, k

    # ------------------------------------------------------------------------- training images <-> index
    def _index_path(self, train_id: int, index_root: Path) -> str | None:
        """The index path (relative to ``index_root``, resolved) of training image ``train_id``, if inside it."""
        if not 0 <= train_id < len(self.files):
            return None
        try:
            return (self._root_abs / self.files[train_id]).relative_to(index_root).as_posix()
        except ValueError:
            return None

    def _train_id(self, index_id: int) -> int | None:
        """The training-image id of indexed photo ``index_id``, or None when it is not a training image."""
        row = self.index.catalog.rows_by_id([index_id]).get(index_id)
        if row is None:
            return None
        if self._file_ids is None:
            self._file_ids = {f: i for i, f in enumerate(self.files)}
        try:
            rel = (self.index.root.resolve() / row.path).relative_to(self._root_abs).as_posix()
        except ValueError:
            return None
        return self._file_ids.get(rel)

    def _queue_in_index(self) -> tuple[np.ndarray, np.ndarray]:
        """For each filled queue key (K'), the row of its photo in the centred index vectors (M x D) or -1.

        Mapped once per instance (per distinct photo of the queue) and kept until the index changes.
        """
        self.index.refresh()
        with self._lock:
            key = (id(self.index.store), self.index.store.ntotal, self.index.meta.get("updated"), str(self.index.root))
            if self._in_index is None or self._in_index[0] != key:
                uniq, inverse = np.unique(self.queue_ids[self.queue_ids >= 0], return_inverse=True)  # U, K'
                index_root = self.index.root.resolve()
                want = np.full(len(uniq), -1, np.int64)  # U: index id of each distinct photo
                for u, t in enumerate(uniq):
                    path = self._index_path(int(t), index_root)
                    row = self.index.catalog.row_by_path(path) if path else None
                    want[u] = row.id if row is not None and row.status == "ok" else -1
                got, raw = self.index.catalog.vectors(want[want >= 0], self.index.dim)  # M, M x D (by id)
                row_of = np.full(len(uniq), -1, np.int64)  # U: row in raw, -1 when not indexed
                if len(got):
                    pos = np.searchsorted(got, want).clip(0, len(got) - 1)  # U
                    row_of = np.where((want >= 0) & (got[pos] == want), pos, -1)
                self._in_index = (key, row_of[inverse.reshape(-1)], self.index.to_space(raw))
            return self._in_index[1], self._in_index[2]

    def _index_embedder(self) -> Any | None:
        """The embedder of the index's space (given, or the index's backbone loaded once); None when unavailable."""
        with self._lock:
            if self._embedder is None and not self._embedder_error:
                try:
                    self._embedder = self.index.load_embedder(device=str(self.device))
                except UserError as e:
                    self._embedder_error = str(e)
            return self._embedder

    def _identify(self, img: Image.Image) -> tuple[int | None, np.ndarray | None, list[str]]:
        """(index id of an uploaded photo when the index holds it, its centred clean embedding, notes)."""
        if self.index is None:
            return None, None, ["no index given: the query is not identified among the training images and "
                                "near-duplicates are not looked for"]
        emb = self._index_embedder()
        if emb is None:
            return None, None, [f"cannot embed the query in the index's space ({self._embedder_error}): same-photo "
                                "and near-duplicate evidence is off"]
        clean = emb.embed_squares(np.array(square_u8(img, emb.resize))[None])  # 1 x D (raw)
        hits = self.index.search(clean, k=4)
        cand = hits.ids[0][hits.ids[0] >= 0]
        index_id = None
        if len(cand):
            raw = self.index.vectors(cand) @ clean[0]  # C: raw cosines
            index_id = int(cand[np.argmax(raw)]) if raw.max() >= SAME_IMAGE else None
        return index_id, self.index.to_space(clean)[0], []

    # -------------------------------------------------------------------------------- the level
    def _measure_level(self) -> tuple[float | None, str]:
        """The median cosine of q and k+ for two views of one training image, over up to LEVEL_SAMPLE of them."""
        cfg = self.cfg
        if not self.files:
            return None, f"{self.name} lists no training images: the same-photo level cannot be measured"
        picks = np.sort(np.random.default_rng(0).choice(len(self.files), min(LEVEL_SAMPLE, len(self.files)),
                                                        replace=False))
        squares = []
        for i in picks:
            try:
                squares.append(square_u8(load_rgb(self.root / self.files[i], min_short=self.size), self.size))
            except UserError as e:
                logger.debug("same-photo level: skipping %s (%s)", self.files[i], e)
        if not squares:
            return None, (f"the training images under {self.root} cannot be read: negatives are not compared with "
                          "two views of one photo")
        g = torch.Generator().manual_seed(0)
        xq, xk = two_views(torch.from_numpy(np.stack(squares)), cfg.augment, cfg.image_size, cfg.mean, cfg.std, g,
                            cfg.crop_min)
        q, k = self.keys(xq, xk)  # B x C, B x C
        level = float(np.median((q * k).sum(1).cpu().numpy()))
        filled = self.queue_ids >= 0
        if filled.any():  # what q reaches against the queue's keys by chance
            self._chance = chance_level((q @ self.queue.to(q.device)).cpu().numpy()[:, filled].ravel())
        logger.info("two %s views of one training image score %.3f (median over %d images)", cfg.augment, level,
                    len(squares))
        return level, ""

    @property
    def augment_level(self) -> float | None:
        """The median cosine (q from the query encoder, k+ from the key encoder) of two views of one training
        image: measured once, on up to LEVEL_SAMPLE training images of the checkpoint; None when unreadable."""
        return self._level_and_note()[0]

    def _level_and_note(self) -> tuple[float | None, str]:
        with self._lock:
            if self._level is None:
                self._level = self._measure_level()
            return self._level

    # ---------------------------------------------------------------------------------- compute
    def _describe(self, image_id: int) -> tuple[str | None, Any]:
        if not 0 <= image_id < len(self.files):
            return None, None
        rel = self.files[image_id]
        if self.index is not None:
            path = self._index_path(image_id, self.index.root.resolve())
            row = self.index.catalog.row_by_path(path) if path is not None else None
            if row is not None and row.thumb:
                return rel, self.index.thumb_path(row)
        try:  # a training image the index does not hold: a small in-memory thumbnail
            img = load_rgb(self.root / rel, min_short=128)
            img.thumbnail((256, 256))
            return rel, img
        except UserError:
            return rel, None

    def compute(self, image: Any, n: int = 12, seed: int = 0) -> NegativesView:
        """The InfoNCE view of ``image`` (an upload) against the saved queue."""
        n, seed = check_args(n, seed)
        img = read_upload(image)
        index_id, clean, notes = self._identify(img)
        return self._inspect(img, n, seed, index_id, clean, notes)

    def compute_for_id(self, image_id: int, n: int = 12, seed: int = 0) -> NegativesView:
        """The InfoNCE view of the indexed photo ``image_id`` (a search result) against the saved queue."""
        n, seed = check_args(n, seed)
        if self.index is None:
            raise UserError(f"image id {image_id!r}: inspecting a photo by id needs the index "
                            "(QueueNegatives(checkpoint, index)); pass the image itself to compute()")
        row, img, notes = load_indexed(self.index, image_id, self.size)
        clean = self.index.to_space(self.index.vectors(np.array([row.id])))[0]  # D, the stored vector centred
        return self._inspect(img, n, seed, row.id, clean, notes)

    def _inspect(self, img: Image.Image, n: int, seed: int, index_id: int | None, clean: np.ndarray | None,
                 notes: list[str]) -> NegativesView:
        cfg = self.cfg
        filled = self.queue_ids >= 0
        ids = self.queue_ids[filled]  # K
        train_id = self._train_id(index_id) if index_id is not None else None
        same = ids == train_id if train_id is not None else np.zeros(len(ids), bool)  # K
        if train_id is not None:
            note, keys = f"the query is training image #{train_id} ({self.files[train_id]})", int(same.sum())
            if keys == 1:
                note += ": its key in the queue is the same photo"
            elif keys > 1:
                note += f": its {keys} keys in the queue are the same photo"
            notes.append(note)
        elif index_id is not None:
            notes.append(f"the query is indexed photo #{index_id}, not one of the training images of {self.name}")
        duplicate = np.zeros(len(ids), bool)  # K
        if clean is not None:
            pos, vecs = self._queue_in_index()  # K, M x D
            near = vecs @ clean >= self.index.dedup_threshold  # M
            duplicate = (pos >= 0) & near[pos.clip(0)] if len(near) else duplicate
        level, why = self._level_and_note()
        if why:
            notes.append(why)
        threshold = closeness_level(level, self._chance, notes)
        square = square_u8(img, self.size)
        g = torch.Generator().manual_seed(seed)
        xq, xk = two_views(torch.tensor(square)[None], cfg.augment, cfg.image_size, cfg.mean, cfg.std, g, cfg.crop_min)
        q, k = self.keys(xq, xk)  # 1 x C, 1 x C
        sims = (q @ self.queue.to(q.device))[0].cpu().numpy()[filled]  # K
        view = NegativesView("queue", f"MoCo {cfg.preset} projection space ({cfg.dim}-d); query encoder for q, key "
                             f"encoder for k+; negatives: the {int(filled.sum())} keys of the queue saved in "
                             f"{self.name} (step {self.step}); views: the {cfg.augment} training recipe",
                             cfg.temperature, to_u8(xq[0], cfg.mean, cfg.std), to_u8(xk[0], cfg.mean, cfg.std),
                             float((q * k).sum()), 0.0, 0.0, 0, 0, notes=notes, augment_level=level)
        codes = reason_codes(sims, same, duplicate, threshold)
        return build_view(view, sims, ids, codes, n, lambda shown: [self._describe(i) for i in shown])
