"""The layout of a photo's edges: in each cell of a grid, a histogram of its gradients' orientations (HOG, Dalal &
Triggs 2005, without their overlapping blocks), a feature of the pixels beside the network's.

A network trained from scratch on a small folder learns to tell its photos apart, not what a person would call the
same scene: on the 16 desktop backgrounds of GNOME (8 light/dark pairs of one design) a run of `moco run` put the
twin first for 0 of 16, and ten minutes of training did not help (the twin is in every batch, as a negative). The
orientations of a grey photo's edges do not change when its colours or brightness do, nor when light turns dark:
alone they put the twin first for 14 of 16 (``bench/twins.py``; BENCHMARKS.md). A run from scratch on few photos
(``--whiten-edges``, :mod:`moco.training.whitening`) adds them to the features its embeddings are made of
(:func:`moco.whiten.embedding_features`), weighted against the network's by the space (:data:`WEIGHT`).

Everything here is matrix products, differences of shifted slices, square roots and an arc cosine: an ONNX or
``torch.export`` program with a space holds it as it is (``moco export --format onnx --space IDX``).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch

__all__ = ["EDGES", "SIDE", "CELLS", "BINS", "DIM", "WEIGHT", "LUMA", "box_weights", "edge_layout"]

EDGES = "edges"  # its name among a space's stages (:attr:`moco.whiten.Whitening.stages`), always the last
SIDE = 64  # the grey view is shrunk to this many pixels a side (box filter) ...
CELLS = 8  # ... and cut into CELLS x CELLS cells (8 px each) ...
BINS = 8  # ... each a histogram of BINS unsigned orientations (0..180 degrees)
DIM = CELLS * CELLS * BINS  # its width: 512
WEIGHT = 0.8  # its share of a vector's squared length in a space with it (the network's: 1 - WEIGHT)
LUMA = (0.299, 0.587, 0.114)  # the grey of the view's (normalized) channels: ITU-R BT.601


@functools.lru_cache(maxsize=16)
def box_weights(n: int, side: int = SIDE) -> np.ndarray:
    """side x n: how much each of ``n`` pixels counts in each of ``side`` box-filtered pixels (a pixel cut by a
    box's edge by its share inside; each row sums to 1): ``W @ grey @ W.T`` shrinks an n x n grey to side x side."""
    edges = np.linspace(0.0, n, side + 1)  # side + 1
    p = np.arange(n)
    inside = np.clip(np.minimum(p + 1, edges[1:, None]) - np.maximum(p, edges[:-1, None]), 0, None)  # side x n
    return (inside / inside.sum(1, keepdims=True)).astype(np.float32)


def edge_layout(x: torch.Tensor) -> torch.Tensor:
    """The edge layout of views ``x`` (N x 3 x s x s, normalized as the backbone's input): N x :data:`DIM`
    float32, each cell's histogram (orientations, each pixel's gradient length shared between its two nearest
    bins) L2-normalized and square-rooted (Hellinger's kernel), cells row by row; all zeros for a flat view.
    Always in float32: under an autocast (the Embedder's bf16 on a CPU) the grey's products would round it to 8
    bits of mantissa, and the gradients of its flat parts with it (entries up to 0.12 off)."""
    import torch
    import torch.nn.functional as F

    if torch.is_autocast_enabled(x.device.type):  # (never while a program is exported: no branch in it)
        with torch.autocast(x.device.type, enabled=False):
            return edge_layout(x)
    n, s = x.shape[0], x.shape[-1]
    luma = torch.tensor(LUMA, dtype=torch.float32, device=x.device)  # 3
    grey = torch.einsum("nchw,c->nhw", x.float(), luma)  # N x s x s
    w = torch.from_numpy(box_weights(s)).to(x.device)  # S x s
    g = w @ grey @ w.T  # N x S x S
    gx = F.pad(g[:, :, 2:] - g[:, :, :-2], (1, 1))  # N x S x S: central differences, 0 at the borders
    gy = F.pad(g[:, 2:, :] - g[:, :-2, :], (0, 0, 1, 1))  # N x S x S
    sq = gx * gx + gy * gy  # N x S x S
    mag = torch.sqrt(sq)  # N x S x S
    safe = torch.clamp(sq, min=1e-12)  # N x S x S
    cos2, sin2 = (gx * gx - gy * gy) / safe, 2 * gx * gy / safe  # N x S x S: the doubled angle (unsigned)
    centre = (torch.arange(BINS, dtype=torch.float32, device=x.device) + 0.5) * (2 * torch.pi / BINS)  # B doubled
    r = cos2[:, None] * torch.cos(centre)[None, :, None, None] + sin2[:, None] * torch.sin(centre)[None, :, None, None]
    apart = torch.acos(torch.clamp(r, -1.0, 1.0))  # N x B x S x S: doubled angle to each bin's centre, 0..pi
    share = torch.relu(1 - apart * (BINS / (2 * torch.pi)))  # N x B x S x S: 1 at a centre, 0 a bin away
    hist = F.avg_pool2d(share * mag[:, None], SIDE // CELLS)  # N x B x C x C
    hist = hist.permute(0, 2, 3, 1)  # N x C x C x B
    hist = hist / (torch.linalg.vector_norm(hist, dim=3, keepdim=True) + 1e-6)  # N x C x C x B
    return torch.sqrt(hist).reshape(n, DIM)  # N x DIM
