"""kNN monitor: weighted k-nearest-neighbour top-1 on backbone features (k=200, T=0.1, cosine).

As in the MoCo papers' monitors (Wu et al. 2018): each of the k most similar bank images votes for
its class with weight ``exp(sim / T)``; the class with the largest vote wins. The monitor also scores
the same features whitened on the bank (:mod:`moco.whiten`, fitted without labels, as a retrieval
system would fit it on the collection it searches), and both for the pixels.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from moco.data.augment import center_view
from moco.data.cache import ImageCache, build_cache
from moco.errors import UserError
from moco.runtime import autocast_for
from moco.whiten import Whitening, embedding_features, fit_whitening

__all__ = ["knn_predict", "knn_top1", "extract_features", "pixel_features", "whitened", "LabeledImages", "KnnMonitor"]

logger = logging.getLogger(__name__)
WHITEN_PIXELS_UP_TO = 4096  # pixel vectors of more dimensions (crops over 36 px) get no whitened baseline
WHITEN_FIT_ROWS = 20_000  # a larger bank is whitened by a fit on this many of its vectors (bounded memory)


def knn_predict(
    feats: torch.Tensor,
    bank: torch.Tensor,
    bank_labels: torch.Tensor,
    num_classes: int,
    k: int = 200,
    t: float = 0.1,
    leave_one_out: bool = False,
    chunk: int = 1024,
) -> torch.Tensor:
    """Predicted class per query. feats: N x D and bank: M x D, L2-normalized; bank_labels: M.

    ``leave_one_out``: the bank is the query set itself and each query ignores its own entry.
    """
    k = min(k, bank.shape[0] - int(leave_one_out))
    preds = []
    for start in range(0, feats.shape[0], chunk):
        sim = feats[start : start + chunk] @ bank.t()  # n x M
        if leave_one_out:
            rows = torch.arange(sim.shape[0], device=sim.device)
            sim[rows, rows + start] = float("-inf")
        weight, idx = sim.topk(k, dim=1)  # n x k
        labels = bank_labels[idx]  # n x k
        votes = torch.zeros(sim.shape[0], num_classes, device=sim.device, dtype=weight.dtype)  # n x classes
        votes.scatter_add_(1, labels, (weight / t).exp())
        preds.append(votes.argmax(dim=1))
    return torch.cat(preds)


def knn_top1(feats, labels, bank=None, bank_labels=None, num_classes=None, k=200, t=0.1) -> float:
    """Top-1 accuracy of ``knn_predict``; without a bank, leave-one-out on ``feats`` itself."""
    loo = bank is None
    bank, bank_labels = (feats, labels) if loo else (bank, bank_labels)
    num_classes = num_classes or int(max(labels.max(), bank_labels.max())) + 1
    pred = knn_predict(feats, bank, bank_labels, num_classes, k, t, leave_one_out=loo)
    return (pred == labels).float().mean().item()


@torch.no_grad()
def extract_features(
    backbone: nn.Module,
    images: np.ndarray,
    size: int,
    mean,
    std,
    device: torch.device,
    batch_size: int = 256,
    precision: str = "fp32",
    channels_last: bool = False,
    mirror: bool = False,
    stages: Sequence[str] = (),
) -> torch.Tensor:
    """L2-normalized backbone features (N x D, float32) of uint8 images (N x S x S x 3), eval view; ``mirror``:
    of each view averaged with its mirror image; ``stages``: the pooled outputs of these stages before the
    backbone's (:func:`moco.whiten.embedding_features`)."""
    was_training = backbone.training
    backbone.eval()
    autocast = autocast_for(device, precision)
    out = []
    for start in range(0, len(images), batch_size):
        batch = torch.from_numpy(np.array(images[start : start + batch_size])).to(device)  # b x S x S x 3 uint8
        x = center_view(batch, size, mean, std)  # b x 3 x s x s
        if channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        with autocast:
            f = embedding_features(backbone, x, mirror, stages)  # b x D
        out.append(F.normalize(f.float(), dim=1).cpu())
    backbone.train(was_training)
    return torch.cat(out)


def pixel_features(images: np.ndarray, size: int, mean, std, center_on: torch.Tensor | None = None,
                   batch_size: int = 1024) -> tuple[torch.Tensor, torch.Tensor]:
    """The pixel baseline: the eval view's pixels (N x 3·s·s), centred and L2-normalized; returns (feats, mean).

    Centred on ``center_on`` (a mean from the bank), else on these images' own mean, as the index centres
    embeddings: a raw-pixel cosine is dominated by overall brightness.
    """
    flat = torch.cat([center_view(torch.from_numpy(np.array(images[i : i + batch_size])), size, mean, std)
                      .flatten(1) for i in range(0, len(images), batch_size)])  # N x 3·s·s
    mu = flat.mean(0) if center_on is None else center_on  # 3·s·s
    return F.normalize(flat - mu, dim=1), mu


def whitened(feats: torch.Tensor, bank: torch.Tensor | None = None,
             shrinkage: float | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``feats`` (and ``bank``) whitened on the bank, or on ``feats`` themselves without one (leave-one-out);
    ``shrinkage`` as :func:`moco.whiten.fit_whitening` (None: Ledoit-Wolf)."""
    w = fit_whitening((feats if bank is None else bank).numpy(), shrinkage, max_rows=WHITEN_FIT_ROWS)
    return torch.from_numpy(w(feats.numpy())), None if bank is None else torch.from_numpy(w(bank.numpy()))


class LabeledImages:
    """A folder with one sub-folder per class, decoded into a uint8 cache; labels from the sub-folder."""

    def __init__(
        self, root: str | Path, size: int, cache_dir: Path, workers: int = 0, classes: list[str] | None = None
    ) -> None:
        self.cache: ImageCache = build_cache(root, size, cache_dir, workers=workers)
        names = [f.split("/")[0] for f in self.cache.files]
        if any("/" not in f for f in self.cache.files):
            loose = next(f for f in self.cache.files if "/" not in f)
            raise UserError(
                f"{root} must hold one sub-folder per class (found the loose file {loose}); "
                "move images into class folders, e.g. cat/1.jpg, dog/2.jpg"
            )
        self.classes = classes or sorted(set(names))
        index = {c: i for i, c in enumerate(self.classes)}
        unknown = sorted(set(names) - set(index))
        if unknown:
            raise UserError(
                f"{root} has classes {unknown} that the kNN bank does not have: use the same class "
                "folders in --val-dir and --knn-train-dir"
            )
        self.labels = torch.tensor([index[n] for n in names])  # N


class KnnMonitor:
    """Evaluates the query backbone by kNN top-1 on ``val_dir`` against ``train_dir`` (or leave-one-out)."""

    def __init__(
        self,
        val_dir: str,
        train_dir: str,
        size: int,
        cache_root: Path,
        image_size: int,
        mean,
        std,
        k: int = 200,
        t: float = 0.1,
        workers: int = 0,
    ) -> None:
        self.bank = LabeledImages(train_dir, size, cache_root / "knn_bank", workers) if train_dir else None
        classes = self.bank.classes if self.bank else None
        self.val = LabeledImages(val_dir, size, cache_root / "knn_val", workers, classes)
        self.image_size, self.mean, self.std, self.k, self.t = image_size, mean, std, k, t
        logger.info(
            "kNN monitor: %d val images, %s, %d classes",
            len(self.val.cache),
            f"bank of {len(self.bank.cache)}" if self.bank else "leave-one-out",
            len(self.val.classes),
        )

    def pixels_top1(self) -> float:
        """kNN top-1 of the centred pixels of the same images, the same k and T: the floor a model must beat.

        Computed once per monitor (it does not change while training), with :meth:`pixels_whitened_top1`.
        """
        if getattr(self, "_pixels", None) is None:
            args = (self.image_size, self.mean, self.std)
            bank, mu = pixel_features(self.bank.cache.array, *args) if self.bank else (None, None)
            feats, _ = pixel_features(self.val.cache.array, *args, center_on=mu)
            self._pixels = self._top1(feats, bank)
            small = feats.shape[1] <= WHITEN_PIXELS_UP_TO  # a D x D covariance and its eigenvectors
            self._pixels_whitened = self._top1(*whitened(feats, bank)) if small else None
            white = f"{100 * self._pixels_whitened:.2f}%" if small else f"n/a (over {WHITEN_PIXELS_UP_TO} dims)"
            logger.info("kNN monitor: centred pixels score %.2f%%, whitened %s", 100 * self._pixels, white)
        return self._pixels

    def pixels_whitened_top1(self) -> float | None:
        """kNN top-1 of the whitened pixels (None for pixel vectors over ``WHITEN_PIXELS_UP_TO`` dimensions)."""
        self.pixels_top1()
        return self._pixels_whitened

    def _top1(self, feats: torch.Tensor, bank: torch.Tensor | None) -> float:
        """kNN top-1 against ``bank`` (the bank's features), or leave-one-out without one."""
        bank_labels = self.bank.labels if bank is not None else None  # val's classes are the bank's
        return knn_top1(feats, self.val.labels, bank, bank_labels, len(self.val.classes), self.k, self.t)

    def _features(self, backbone: nn.Module, device: torch.device, precision: str, channels_last: bool,
                  whitening: Whitening | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The val images' features (N x D) and the bank's (M x D, None for leave-one-out): the backbone's, or
        those ``whitening`` applies to (with its mirror image and stages), not whitened."""
        args = (self.image_size, self.mean, self.std, device)
        kw = dict(precision=precision, channels_last=channels_last)
        if whitening is not None:
            kw.update(mirror=whitening.mirror, stages=whitening.stage_names)
        bank = extract_features(backbone, self.bank.cache.array, *args, **kw) if self.bank else None
        return extract_features(backbone, self.val.cache.array, *args, **kw), bank

    def evaluate(
        self, backbone: nn.Module, device: torch.device, precision: str = "fp32", channels_last: bool = False
    ) -> tuple[float, float]:
        """kNN top-1 accuracy (0..1) of ``backbone``'s features, as they are and whitened on the bank."""
        feats, bank = self._features(backbone, device, precision, channels_last)
        return self._top1(feats, bank), self._top1(*whitened(feats, bank))

    def evaluate_exported(self, backbone: nn.Module, whitening: Whitening, device: torch.device,
                          precision: str = "fp32", channels_last: bool = False) -> float:
        """kNN top-1 (0..1) of what the export embeds: ``backbone``'s features (mirror-averaged, with the pooled
        stages, as ``whitening`` was fitted) whitened by ``whitening`` (fitted on the training photos), where
        :meth:`evaluate` fits its whitening on the bank."""
        feats, bank = self._features(backbone, device, precision, channels_last, whitening)
        white = torch.from_numpy(whitening(feats.numpy()))
        return self._top1(white, None if bank is None else torch.from_numpy(whitening(bank.numpy())))
