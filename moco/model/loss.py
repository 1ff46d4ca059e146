"""The contrastive losses of MoCo: InfoNCE against a queue (v1/v2) and the symmetric in-batch form (v3); and
the cpu preset's decorrelation term on the backbone's features (not in the papers)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["info_nce", "queue_logits", "in_batch_loss", "decorrelation"]


def queue_logits(
    q: torch.Tensor, k: torch.Tensor, queue: torch.Tensor, T: float, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Logits ``[positive, negatives] / T`` of InfoNCE; column 0 is the positive.

    q, k: N x C L2-normalized queries and their positive keys; queue: C x K negatives;
    mask: optional N x K bool, True where a queue entry must not count as a negative
    (a stale key of the query's own image), whose logit becomes -inf.
    """
    l_pos = torch.einsum("nc,nc->n", q, k).unsqueeze(-1)  # N x 1
    l_neg = torch.einsum("nc,ck->nk", q, queue)  # N x K
    if mask is not None:
        l_neg = l_neg.masked_fill(mask, float("-inf"))  # N x K
    return torch.cat([l_pos, l_neg], dim=1) / T  # N x (1+K)


def info_nce(
    q: torch.Tensor, k: torch.Tensor, queue: torch.Tensor, T: float, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Mean InfoNCE loss of queries ``q`` against positives ``k`` and the ``queue`` (MoCo v1/v2, eq. 1)."""
    logits = queue_logits(q.float(), k.float(), queue.float(), T, mask)  # N x (1+K)
    labels = torch.zeros(logits.shape[0], dtype=torch.long, device=logits.device)  # positives at 0
    return F.cross_entropy(logits, labels)


def in_batch_loss(q: torch.Tensor, k: torch.Tensor, T: float, offset: int = 0) -> torch.Tensor:
    """MoCo v3 contrastive loss: the other keys of the batch are the negatives, scaled by 2T.

    q: N x C predictions of one view; k: M x C momentum keys of the other view (M = N on one device,
    or the keys gathered from all ranks, this rank's starting at row ``offset``); both L2-normalized.
    """
    logits = torch.einsum("nc,mc->nm", q.float(), k.float()) / T  # N x M
    labels = torch.arange(q.shape[0], device=q.device) + offset  # N: own key is the positive
    return F.cross_entropy(logits, labels) * (2 * T)


def decorrelation(h: torch.Tensor, eps: float = 1e-4) -> torch.Tensor:
    """Redundancy of the features ``h`` (N x D) over a batch: the squared off-diagonal entries of their correlation
    matrix, summed and divided by D; 0 when no two features are correlated.

    VICReg's covariance term (Bardes et al. 2022) on standardized features, i.e. Barlow Twins' redundancy
    reduction within one view, applied to the backbone's output (what kNN and the index search) rather than to
    a projection: it spreads the features over many directions, so a plain cosine compares more of them.
    """
    h = h.float()
    z = (h - h.mean(0)) / (h.std(0) + eps)  # N x D, each feature standardized over the batch
    r = z.t() @ z / (h.shape[0] - 1)  # D x D correlation matrix
    off = r - torch.diag_embed(r.diagonal())  # D x D, zero diagonal
    return off.pow(2).sum() / h.shape[1]
