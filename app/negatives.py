"""The InfoNCE view of one image: its two training views, the positive, and the negatives that sit closest.

MoCo's loss for a query q with positive key k+ and negatives k_1..k_K is
``-log softmax([q.k+, q.k_1, ..., q.k_K] / T)[0]``. For an uploaded image (or an indexed photo, by its
catalog id) this module computes exactly those numbers, from one of two sources:

- ``QueueNegatives`` (a training checkpoint is given): the checkpoint's own augmentation recipe makes
  the query and key views; q comes from the query encoder (projector, and predictor for v3), k+ from
  the momentum (key) encoder, and the negatives are the saved queue of K keys, each with the id of
  the training image it came from. This is the space the loss lives in.
- ``IndexNegatives`` (no checkpoint, or one without a queue): both views go through the exported
  backbone, and every other image of the index is a negative, in the centred backbone space of search
  scores (:meth:`index.image_index.ImageIndex.center`).

A negative is flagged as a likely false negative only on evidence, with the first reason that applies:

1. ``"same photo"``: it is a key of the very photo inspected (the queue keeps several keys of one photo);
2. ``"near-duplicate"``: its photo is a near-duplicate of the query by the dedup rule (centred cosine of
   the clean embeddings >= the index's :func:`index.dedup.dedup_threshold`);
3. ``"as close as two views of one photo"``: it scores at or above the median cosine of two training
   views of one photo, measured on the collection (``index.json``'s ``augment_level``) or, for the queue,
   on training images of the checkpoint.

Scoring at or above the positive alone is no evidence (the positive is often weak): it is counted
(``NegativesView.above_positive``), not flagged. Counts are over all K negatives, not the rows shown.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

from app.uploads import read_upload
from index.sync_store import chance_level
from moco.augment import two_views
from moco.data import load_rgb, square_u8
from moco.errors import UserError

__all__ = ["Negative", "NegativesView", "QueueNegatives", "IndexNegatives", "info_nce_numbers", "REASONS"]

logger = logging.getLogger(__name__)

SAME_IMAGE = 0.9999  # a negative this close to the query's clean embedding is the query image itself
REASONS = ("same photo", "near-duplicate", "as close as two views of one photo")  # in order of priority
SAME_PHOTO, NEAR_DUPLICATE, TWO_VIEWS = REASONS
LEVEL_SAMPLE = 32  # training images whose two views measure the queue's same-photo level
_CHUNK = 65_536  # rows centred at a time (bounds the temporary memory of a large index)


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

    @property
    def suspicious(self) -> bool:
        """Whether there is evidence that this negative is a false negative (compatibility with ``reason``)."""
        return bool(self.reason)


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
            "rank": int(1 + np.sum(sims[1:] >= sims[0]))}  # fmt: skip


def _to_u8(view: torch.Tensor, mean: Any, std: Any) -> np.ndarray:
    """A normalized 3 x s x s view back to s x s x 3 uint8 for display."""
    x = view.float().cpu() * torch.tensor(std)[:, None, None] + torch.tensor(mean)[:, None, None]
    return (x.clamp(0, 1) * 255).round().to(torch.uint8).permute(1, 2, 0).numpy()


def _check_args(n: Any, seed: Any) -> tuple[int, int]:
    """``n`` (negatives to show, >= 1) and ``seed`` as ints, or a UserError naming the value."""
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
        raise UserError(f"n={n!r}: the number of negatives to show must be a whole number >= 1 (e.g. n=12)")
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
        raise UserError(f"seed={seed!r}: the seed of the two views must be a whole number (e.g. seed=0)")
    return int(n), int(seed)


def _load_indexed(index: Any, image_id: Any, min_short: int) -> tuple[Any, Image.Image, list[str]]:
    """(row, RGB image, notes) of the indexed photo ``image_id``: its original decoded as the index decodes it,
    or its thumbnail (with a note) when the original cannot be read."""
    if isinstance(image_id, bool) or not isinstance(image_id, (int, np.integer)):
        raise UserError(f"image id {image_id!r} is not a catalog id: pass the id of a search result "
                        "(SearchResult.ids)")  # fmt: skip
    row = index.catalog.rows_by_id([int(image_id)]).get(int(image_id))
    if row is None or row.status != "ok":
        raise UserError(f"image id {image_id} is not a photo of the index {index.dir} (deleted, unreadable or never "
                        "indexed): pick a result of a new search")  # fmt: skip
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
                            f"run `moco index update {index.dir}`") from e2  # fmt: skip
    notes.append(f"the original {row.path} cannot be read ({reason}): its thumbnail ({img.size[0]}x{img.size[1]}) "
                 "was inspected instead")  # fmt: skip
    return row, img, notes


def _reason_codes(sims: np.ndarray, same: np.ndarray, duplicate: np.ndarray, level: float | None) -> np.ndarray:
    """Per negative (K): 0 without evidence, else 1 + the index in REASONS of the first reason that applies."""
    code = np.zeros(len(sims), np.int8)  # K
    if level is not None:
        code[sims >= level] = 3
    code[duplicate] = 2
    code[same] = 1
    return code


def _closeness_level(level: float | None, chance: float | None, notes: list[str]) -> float | None:
    """The "as close as two views of one photo" threshold, or None when it is no evidence.

    Two views of one photo must score above what unrelated pairs reach (``chance``); a model that
    cannot yet tell one photo from another (its views no closer than random pairs) flags nothing by closeness.
    """
    if level is None or chance is None or level > chance:
        return level
    notes.append(f"two views of one photo score {level:.3f} (median), no higher than unrelated pairs reach "
                 f"({chance:.3f}): this model cannot tell photos apart by closeness yet, so negatives are flagged "
                 "only as the same photo or a near-duplicate")  # fmt: skip
    return None


def _build(view: NegativesView, sims: np.ndarray, ids: np.ndarray, codes: np.ndarray, n: int,
           describe: Callable[[list[int]], list[tuple[str | None, Any]]]) -> NegativesView:  # fmt: skip
    """Fill the numbers of ``view`` from negative similarities ``sims`` (K), their image ``ids`` (K) and reason
    ``codes`` (K, from :func:`_reason_codes`); ``describe`` gives (path, thumb) of the ids shown."""
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
                                       int(keys_of[j]), shown[i]))  # fmt: skip
    return view


def _in_space(raw: np.ndarray, index: Any) -> np.ndarray:
    """``index.center(raw)`` (N x D, the vectors index.faiss holds), in chunks."""
    out = np.empty(raw.shape, np.float32)  # N x D
    for s in range(0, len(raw), _CHUNK):
        out[s : s + _CHUNK] = index.center(raw[s : s + _CHUNK])
    return out


class IndexNegatives:
    """Negatives from the index, in the centred backbone space of search scores: every other image is a negative."""

    def __init__(self, index: Any, embedder: Any, temperature: float | None = None, recipe: str = "v2") -> None:
        self.index, self.embedder, self.recipe = index, embedder, recipe
        trained = json.loads(embedder.config.get("training") or "{}")
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
        return self._inspect(read_upload(image), *_check_args(n, seed), None, [])

    def compute_for_id(self, image_id: int, n: int = 12, seed: int = 0) -> NegativesView:
        """The InfoNCE view of the indexed photo ``image_id`` (a search result) against the rest of the index."""
        n, seed = _check_args(n, seed)
        row, img, notes = _load_indexed(self.index, image_id, self.embedder.resize)
        return self._inspect(img, n, seed, row.id, notes)

    def _inspect(self, img: Image.Image, n: int, seed: int, image_id: int | None, notes: list[str]) -> NegativesView:
        emb, mean = self.embedder, self.index.mean
        ids, vecs, raw = self._vectors()  # N, N x D (in the index's space), N x D (features)
        if len(ids) == 0:
            raise UserError("the index is empty: nothing to compare with (run `moco index update`)")
        square = square_u8(img, emb.resize)
        g = torch.Generator().manual_seed(seed)
        xq, xk = two_views(torch.tensor(square)[None], self.recipe, emb.image_size, emb.pixel_mean, emb.pixel_std, g)
        q, k = self.index.center(emb.embed_views(torch.cat([xq, xk])))  # D, D (centred)
        clean = emb.embed_squares(np.array(square)[None])[0]  # D (raw)
        to = vecs @ np.stack([q, self.index.center(clean[None])[0]], axis=1)  # N x 2
        raw_to_clean = raw @ clean  # N: cosine of the features
        same = raw_to_clean >= SAME_IMAGE
        if image_id is not None:
            copies = int(np.sum(same & (ids != image_id)))
            same |= ids == image_id
            notes.append(f"left out the photo itself (#{image_id})"
                         + (f" and {copies} exact copy(ies) of it" if copies else ""))  # fmt: skip
        elif same.any():
            notes.append(f"left out {int(same.sum())} copy(ies) of the query image itself found in the index")
        keep = ~same
        ids, sims, duplicate = ids[keep], to[keep, 0], to[keep, 1] >= self.index.dedup_threshold  # K, K, K
        level = self.augment_level
        if level is None:
            notes.append(f"{self.index.dir} has no augmentation level (built before it was measured): run "
                         f"`moco index update {self.index.dir}` to flag negatives as close as two views of a photo")
        threshold = _closeness_level(level, self.index.weak_below, notes)
        space = f"the index's space ({self.index.describe_space()})" if mean is not None else \
            "backbone space (uncentred: an older index)"  # fmt: skip
        view = NegativesView("index", f"{space}, as search scores; negatives: every other "
                             f"image of the index ({len(ids)}); views: the {self.recipe} training recipe",
                             self.temperature, _to_u8(xq[0], emb.pixel_mean, emb.pixel_std),
                             _to_u8(xk[0], emb.pixel_mean, emb.pixel_std),
                             float(q @ k), 0.0, 0.0, 0, 0, notes=notes, augment_level=level)  # fmt: skip
        codes = _reason_codes(sims, np.zeros(len(sims), bool), duplicate, threshold)

        def describe(shown: list[int]) -> list[tuple[str | None, Any]]:
            rows = self.index.catalog.rows_by_id(shown)
            return [(rows[i].path, self.index.thumb_path(rows[i])) if i in rows else (None, None) for i in shown]

        return _build(view, sims, ids, codes, n, describe)


class QueueNegatives:
    """Negatives from a training checkpoint's queue, in the projection space, with the key encoder.

    ``index`` (optional) gives thumbnails, and the evidence "same photo" (for an upload) and "near-duplicate",
    compared in its space with ``embedder`` (by default the index's own backbone, loaded when first needed).
    """

    def __init__(self, checkpoint: str | Path, index: Any | None = None, device: str = "cpu",
                 embedder: Any | None = None) -> None:  # fmt: skip
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
                self._in_index = (key, row_of[inverse.reshape(-1)], self.index.center(raw))
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
                                "near-duplicates are not looked for"]  # fmt: skip
        emb = self._index_embedder()
        if emb is None:
            return None, None, [f"cannot embed the query in the index's space ({self._embedder_error}): same-photo "
                                "and near-duplicate evidence is off"]  # fmt: skip
        clean = emb.embed_squares(np.array(square_u8(img, emb.resize))[None])  # 1 x D (raw)
        hits = self.index.search(clean, k=4)
        cand = hits.ids[0][hits.ids[0] >= 0]
        index_id = None
        if len(cand):
            raw = self.index.vectors(cand) @ clean[0]  # C: raw cosines
            index_id = int(cand[np.argmax(raw)]) if raw.max() >= SAME_IMAGE else None
        return index_id, self.index.center(clean)[0], []

    # -------------------------------------------------------------------------------- the level
    def _measure_level(self) -> tuple[float | None, str]:
        """The median cosine of q and k+ for two views of one training image, over up to LEVEL_SAMPLE of them."""
        cfg = self.cfg
        if not self.files:
            return None, f"{self.name} lists no training images: the same-photo level cannot be measured"
        picks = np.sort(np.random.default_rng(0).choice(len(self.files), min(LEVEL_SAMPLE, len(self.files)),
                                                        replace=False))  # fmt: skip
        squares = []
        for i in picks:
            try:
                squares.append(square_u8(load_rgb(self.root / self.files[i], min_short=self.size), self.size))
            except UserError as e:
                logger.debug("same-photo level: skipping %s (%s)", self.files[i], e)
        if not squares:
            return None, (f"the training images under {self.root} cannot be read: negatives are not compared with "
                          "two views of one photo")  # fmt: skip
        g = torch.Generator().manual_seed(0)
        xq, xk = two_views(torch.from_numpy(np.stack(squares)), cfg.augment, cfg.image_size, cfg.mean, cfg.std, g,
                            cfg.crop_min)
        q, k = self.keys(xq, xk)  # B x C, B x C
        level = float(np.median((q * k).sum(1).cpu().numpy()))
        filled = self.queue_ids >= 0
        if filled.any():  # what q reaches against the queue's keys by chance
            self._chance = chance_level((q @ self.queue.to(q.device)).cpu().numpy()[:, filled].ravel())
        logger.info("two %s views of one training image score %.3f (median over %d images)", cfg.augment, level,
                    len(squares))  # fmt: skip
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
        n, seed = _check_args(n, seed)
        img = read_upload(image)
        index_id, clean, notes = self._identify(img)
        return self._inspect(img, n, seed, index_id, clean, notes)

    def compute_for_id(self, image_id: int, n: int = 12, seed: int = 0) -> NegativesView:
        """The InfoNCE view of the indexed photo ``image_id`` (a search result) against the saved queue."""
        n, seed = _check_args(n, seed)
        if self.index is None:
            raise UserError(f"image id {image_id!r}: inspecting a photo by id needs the index "
                            "(QueueNegatives(checkpoint, index)); pass the image itself to compute()")  # fmt: skip
        row, img, notes = _load_indexed(self.index, image_id, self.size)
        clean = self.index.center(self.index.vectors(np.array([row.id])))[0]  # D, the stored vector centred
        return self._inspect(img, n, seed, row.id, clean, notes)

    def _inspect(self, img: Image.Image, n: int, seed: int, index_id: int | None, clean: np.ndarray | None,
                 notes: list[str]) -> NegativesView:  # fmt: skip
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
        threshold = _closeness_level(level, self._chance, notes)
        square = square_u8(img, self.size)
        g = torch.Generator().manual_seed(seed)
        xq, xk = two_views(torch.tensor(square)[None], cfg.augment, cfg.image_size, cfg.mean, cfg.std, g, cfg.crop_min)
        q, k = self.keys(xq, xk)  # 1 x C, 1 x C
        sims = (q @ self.queue.to(q.device))[0].cpu().numpy()[filled]  # K
        view = NegativesView("queue", f"MoCo {cfg.preset} projection space ({cfg.dim}-d); query encoder for q, key "
                             f"encoder for k+; negatives: the {int(filled.sum())} keys of the queue saved in "
                             f"{self.name} (step {self.step}); views: the {cfg.augment} training recipe",
                             cfg.temperature, _to_u8(xq[0], cfg.mean, cfg.std), _to_u8(xk[0], cfg.mean, cfg.std),
                             float((q * k).sum()), 0.0, 0.0, 0, 0, notes=notes, augment_level=level)  # fmt: skip
        codes = _reason_codes(sims, same, duplicate, threshold)
        return _build(view, sims, ids, codes, n, lambda shown: [self._describe(i) for i in shown])
