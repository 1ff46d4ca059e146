"""The end of a finished run: the whitening of its backbone's features (``--whiten``), fitted on its photos and
saved into its last checkpoint, which the export carries."""

from __future__ import annotations

import logging
import time
from dataclasses import replace

import numpy as np
import torch
from torch import nn

from moco.config import TrainConfig
from moco.data.cache import ImageCache
from moco.edges import DIM as EDGE_DIM
from moco.edges import EDGES
from moco.training.stop import Interrupted, StopFlag
from moco.training.summary import WhiteningSummary
from moco.whiten import STAGES, Whitening, feature_widths, features_text, fit_features, fit_whitening, resnet_stages

__all__ = ["WHITEN_ROWS", "STAGE_ROWS_PER_DIM", "EDGE_PHOTOS", "takes_edges", "whitening_stages", "fit_run_whitening",
           "end_of_run_fit", "whitening_summary"]

logger = logging.getLogger(__name__)


# Photos the end-of-training whitening is fitted on (--whiten): 1,000 gave the same kNN as 20,000 on Fashion-MNIST
# (Ledoit-Wolf shrinks what fewer rows cannot estimate); 5,000 cost 2.4 s on one core for resnet10t at 32 px.
WHITEN_ROWS = 5000
# --whiten-stages auto pools the earlier stages only when the whitening is fitted on at least this many photos per
# dimension of the pooled features: a whitening fitted on the collection it searches (as an index's is) lost 3.3
# points of kNN with the stages on 240 Fashion-MNIST images (960-d), 0.5-0.7 on 500-1,000, broke even at 2,000
# and gained 0.9 at 5,000 (BENCHMARKS.md, ninth round).
STAGE_ROWS_PER_DIM = 2
# --whiten-edges auto adds the photos' edge layout after a run from scratch on fewer photos than this: on 16 and 19
# photos the network learned to tell them apart, not which are one scene (no light/dark twin first; with the edges
# 12 of 16 and 7 of 8); from 160 photos on it learned what the edges would drown (kNN by source picture 3.5-12 points
# lower with them at 0.8 on crops of desktop pictures; bench/NOTES.md, twenty-second session).
EDGE_PHOTOS = 100


def whitening_stages(backbone: nn.Module, choice: str, rows: int, image_size: int
                     ) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """The stages (names, channels) a whitening fitted on ``rows`` photos pools for ``--whiten-stages choice``:
    a ResNet's layer1-3 when on, or when auto and ``rows`` >= ``STAGE_ROWS_PER_DIM`` x their total width; else none."""
    stages = resnet_stages(backbone) if choice != "off" else ()
    if choice != "off" and not stages:
        logger.info("whitening: the backbone has no stages %s; its output alone is whitened", "/".join(STAGES))
    widths, width = feature_widths(backbone, stages, image_size)
    dim = width + sum(widths)
    if stages and choice == "auto" and rows < STAGE_ROWS_PER_DIM * dim:
        logger.info("whitening: %d photos are too few to whiten %d-d features with the pooled %s (%d needed; "
                    "--whiten-stages on forces them): the last stage's alone", rows, dim, "/".join(stages),
                    STAGE_ROWS_PER_DIM * dim)
        return (), ()
    return stages, widths


def takes_edges(choice: str, init: str, photos: int) -> bool:
    """Whether a run's whitening takes its photos' edge layout (:mod:`moco.edges`) for ``--whiten-edges choice``:
    on, or auto for a run from scratch (no ``init``) on fewer than :data:`EDGE_PHOTOS` photos."""
    return choice == "on" or (choice == "auto" and not init and photos < EDGE_PHOTOS)


def fit_run_whitening(backbone: nn.Module, cache: ImageCache, cfg: TrainConfig, device: torch.device, precision: str,
                   channels_last: bool) -> Whitening:
    """The whitening (:mod:`moco.whiten`, Ledoit-Wolf) of the trained backbone's mirror-averaged features of up to
    ``WHITEN_ROWS`` photos (a seeded draw), in the view the export embeds (resize, center crop); with
    ``whiten_stages`` (on; auto: given ``STAGE_ROWS_PER_DIM`` photos per dimension), a ResNet's pooled layer1-3
    outputs before its own."""
    from moco.training.knn import extract_features

    n = len(cache)
    rows = np.sort(np.random.default_rng(cfg.seed).choice(n, min(n, WHITEN_ROWS), replace=False))  # R
    stages, widths = whitening_stages(backbone, cfg.whiten_stages, len(rows), cfg.image_size)
    if takes_edges(cfg.whiten_edges, cfg.init, n):
        stages, widths = (*stages, EDGES), (*widths, EDGE_DIM)
        if cfg.whiten_edges == "auto":
            logger.info("whitening: a run from scratch on %d photos (under %d): its embeddings take the photos' edge "
                        "layout beside the network's features (--whiten-edges off: the network's alone)", n,
                        EDGE_PHOTOS)
    feats = extract_features(backbone, np.asarray(cache.array[rows]), cfg.image_size, cfg.mean, cfg.std, device,
                             precision=precision, channels_last=channels_last, mirror=True, stages=stages)  # R x D'
    # embeddings average each photo with its mirror image, and pool the same stages
    whitening = replace(fit_features(feats.numpy(), tuple(zip(stages, widths)), fit_whitening), mirror=True,
                        stages=tuple(zip(stages, widths)))
    logger.info("whitening: fitted on %d of %d photos and their mirror images, %d-d features%s (Ledoit-Wolf "
                "shrinkage %.3f); the export carries it", len(rows), n, whitening.dim,
                features_text(stages), whitening.shrinkage)
    return whitening


def end_of_run_fit(backbone: nn.Module, cache: ImageCache, cfg: TrainConfig, device: torch.device, precision: str,
                   channels_last: bool, stop: StopFlag) -> tuple[Whitening | None, float]:
    """The finished run's whitening and the seconds it took; None where a signal came during the fit (the
    checkpoint stays without it, and the next run fits it)."""
    start, whitening = time.monotonic(), None
    try:
        with stop.at_once():
            whitening = fit_run_whitening(backbone, cache, cfg, device, precision, channels_last)
    except Interrupted as e:
        logger.warning("received %s during the whitening's fit: stopping; the next run fits it", e)
    return whitening, time.monotonic() - start


def whitening_summary(whitening: Whitening | None, seconds: float) -> WhiteningSummary | None:
    """The run summary's part about ``whitening``, fitted in ``seconds``; None where none was fitted."""
    if whitening is None:
        return None
    return WhiteningSummary(rows=whitening.count, shrinkage=whitening.shrinkage, mirror=whitening.mirror,
                            dim=whitening.dim, stages=whitening.stage_names, seconds=round(seconds, 2))
