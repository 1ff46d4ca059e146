"""The pixel check (:func:`index.duplicates.verify.copy_scores`) of a search's pairs on every core.

The check is most of a search's time, and one photo's check is numpy on small arrays: one core's work. So the pairs
go, :data:`PART` at a time (sorted: a photo's partners together, for its windows and templates to be reused),
to worker processes (:func:`moco.data.workers.in_workers`: spawned, one BLAS thread each, dying with the search),
which read the frames from the search's frames file themselves (:meth:`FrameFile.placed`); the scores come back in
the pairs' order, a part at a time, so the caller keeps each part as it comes (a killed search loses at most the parts
in flight). Fewer pairs than :data:`MIN_PAIRS`, one core, or frames held only in memory (the file could not be
written): the check runs in this process, with the same scores.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np

from index.duplicates.dedup_cache import FrameFile
from index.duplicates.verify import FineCheck, copy_scores
from moco.data.workers import ONE_THREAD, in_workers

__all__ = ["checked_parts", "check_workers", "core_workers", "PART", "MIN_PAIRS", "MAX_WORKERS"]

logger = logging.getLogger(__name__)

PART = 2048  # pairs a worker scores at a time
MIN_PAIRS = 4 * PART  # fewer pairs are checked in this process: starting the workers costs about a second
MAX_WORKERS = 8

_frames: FrameFile | None = None  # a worker's frames
_fine: FineCheck | None = None  # and its fine check of large photos


def check_workers(pairs: int, cores: int | None = None) -> int:
    """Worker processes for checking ``pairs`` pairs: every core this process may use (at most
    :data:`MAX_WORKERS`); 0 (this process) for fewer than :data:`MIN_PAIRS` or a single core."""
    return 0 if pairs < MIN_PAIRS else core_workers(cores)


def core_workers(cores: int | None = None) -> int:
    """Worker processes for work that fills every core this process may use (``cores``, None: as many as it may
    use), at most :data:`MAX_WORKERS`; 0 (this process) on a single core."""
    cores = cores if cores is not None else len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (
        os.cpu_count() or 1)
    return 0 if cores < 2 else min(cores, MAX_WORKERS)


def _open(path: Path, where: dict[int, int], fine: FineCheck | None) -> None:
    global _frames, _fine
    _frames, _fine = FrameFile.placed(path, where), fine


def _scores(frames_: FrameFile, part: np.ndarray, fine: FineCheck | None) -> np.ndarray:
    """The copy scores of ``part`` (B x 2): B, NaN for a pair one of whose photos has no frame; pairs of large photos
    near a copy checked again by ``fine``."""
    got = copy_scores([tuple(p) for p in part.tolist()], frames_)
    scores = np.array([got.get((a, b), np.nan) for a, b in part.tolist()], np.float64)
    return fine.rescore(part, scores, frames_) if fine is not None else scores


def _worker_scores(part: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    assert _frames is not None, "a pixel-check worker without its frames"
    return part, _scores(_frames, part, _fine)


def checked_parts(parts: Iterable[np.ndarray], frames_: FrameFile, workers: int,
                  fine: FineCheck | None = None) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """``(part, scores)`` for each part of pairs (B x 2, a < b) in order: its copy scores (B; NaN where a photo has
    no frame; pairs of large photos near a copy checked again by ``fine``), in ``workers`` processes (0: in this
    one)."""
    where = frames_.placement() if workers > 0 else None
    if where is None:
        for part in parts:
            yield part, _scores(frames_, part, fine)
        return
    logger.info("the pixel check in %d worker processes", workers)
    yield from in_workers(_worker_scores, parts, workers, "pixel-check", init=_open,
                          init_args=(frames_.path, where, fine), env=ONE_THREAD)
