"""Negatives from the index: every other image of the index is a negative, in the index's space of search scores
(:meth:`index.search.image_index.ImageIndex.to_space`); both views go through the exported backbone."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import torch
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
from moco.data.augment import two_views
from moco.data.photos import square_u8
from moco.errors import UserError

__all__ = ["IndexNegatives"]

_CHUNK = 65_536  # rows centred at a time (bounds the temporary memory of a large index)


def _in_space(raw: np.ndarray, index: Any) -> np.ndarray:
    """``index.to_space(raw)`` (N x D, the vectors index.faiss holds), in chunks."""
    out = np.empty(raw.shape, np.float32)  # N x D
    for s in range(0, len(raw), _CHUNK):
        out[s : s + _CHUNK] = index.to_space(raw[s : s + _CHUNK])
    return out


class IndexNegatives:
    """Negatives from the index, in the centred backbone space of search scores: every other image is a negative."""

    def __init__(self, index: Any, embedder: Any, temperature: float | None = None, recipe: str = "v2") -> None:
        self.index, self.embedder, self.recipe = index, embedder, recipe
        trained = embedder.config.training or {}
        self.temperature = float(temperature or trained.get("temperature") or 0.2)
        self._cache: tuple[Any, np.ndarray, np.ndarray, np.ndarray] | None = None
        self._lock = threading.Lock()

    def _vectors(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(ids N, vectors N x D as index.faiss holds them, the stored features N x D), kept until the index
        changes."""
        self.index.refresh()
        with self._lock:
            key = (id(self.index.store), self.index.store.ntotal, self.index.meta.get("updated"))
            if self._cache is None or self._cache[0] != key:
                ids, raw = self.index.catalog.vectors(dim=self.index.dim)  # N, N x D
                self._cache = (key, ids, _in_space(raw, self.index), raw)
            return self._cache[1], self._cache[2], self._cache[3]

    @property
    def augment_level(self) -> float | None:
        """The median centred cosine of two views of one photo (``index.json``), or None for an older index."""
        level = self.index.augment_level
        return float(level["median"]) if level else None

    def compute(self, image: Any, n: int = 12, seed: int = 0) -> NegativesView:
        """The InfoNCE view of ``image`` (an upload) against the index."""
        return self._inspect(read_upload(image), *check_args(n, seed), None, [])

    def compute_for_id(self, image_id: int, n: int = 12, seed: int = 0) -> NegativesView:
        """The InfoNCE view of the indexed photo ``image_id`` (a search result) against the rest of the index."""
        n, seed = check_args(n, seed)
        row, img, notes = load_indexed(self.index, image_id, self.embedder.resize)
        return self._inspect(img, n, seed, row.id, notes)

    def _inspect(self, img: Image.Image, n: int, seed: int, image_id: int | None, notes: list[str]) -> NegativesView:
        emb, mean = self.embedder, self.index.mean
        ids, vecs, raw = self._vectors()  # N, N x D (in the index's space), N x D (features)
        if len(ids) == 0:
            raise UserError("the index is empty: nothing to compare with (run `moco index update`)")
        square = square_u8(img, emb.resize)
        g = torch.Generator().manual_seed(seed)
        xq, xk = two_views(torch.tensor(square)[None], self.recipe, emb.image_size, emb.pixel_mean, emb.pixel_std, g)
        q, k = self.index.to_space(emb.embed_views(torch.cat([xq, xk])))  # D, D (centred)
        clean = emb.embed_squares(np.array(square)[None])[0]  # D (raw)
        to = vecs @ np.stack([q, self.index.to_space(clean[None])[0]], axis=1)  # N x 2
        raw_to_clean = raw @ clean  # N: cosine of the features
        same = raw_to_clean >= SAME_IMAGE
        if image_id is not None:
            copies = int(np.sum(same & (ids != image_id)))
            same |= ids == image_id
            notes.append(f"left out the photo itself (#{image_id})"
                         + (f" and {copies} exact copy(ies) of it" if copies else ""))
        elif same.any():
            notes.append(f"left out {int(same.sum())} copy(ies) of the query image itself found in the index")
        keep = ~same
        ids, sims, duplicate = ids[keep], to[keep, 0], to[keep, 1] >= self.index.dedup_threshold  # K, K, K
        level = self.augment_level
        if level is None:
            notes.append(f"{self.index.dir} has no augmentation level (built before it was measured): run "
                         f"`moco index update {self.index.dir}` to flag negatives as close as two views of a photo")
        threshold = closeness_level(level, self.index.weak_below, notes)
        space = f"the index's space ({self.index.describe_space()})" if mean is not None else \
            "backbone space (uncentred: an older index)"
        view = NegativesView("index", f"{space}, as search scores; negatives: every other "
                             f"image of the index ({len(ids)}); views: the {self.recipe} training recipe",
                             self.temperature, to_u8(xq[0], emb.pixel_mean, emb.pixel_std),
                             to_u8(xk[0], emb.pixel_mean, emb.pixel_std),
                             float(q @ k), 0.0, 0.0, 0, 0, notes=notes, augment_level=level)
        codes = reason_codes(sims, np.zeros(len(sims), bool), duplicate, threshold)

        def describe(shown: list[int]) -> list[tuple[str | None, Any]]:
            rows = self.index.catalog.rows_by_id(shown)
            return [(rows[i].path, self.index.thumb_path(rows[i])) if i in rows else (None, None) for i in shown]

        return build_view(view, sims, ids, codes, n, describe)
