"""The MoCo module: query/key encoders, heads, queue with image ids, momentum update, loss.

Symbols follow the papers: K queue size, m momentum, T temperature. One module covers
v1 (linear head), v2 (MLP head; optionally symmetric with one queue per view) and v3 (projector +
predictor, no queue, symmetric in-batch loss). Backbone and heads are separate submodules, so the
exported backbone is everything under ``backbone.``.
"""

from __future__ import annotations

import copy
import logging
import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from moco.model.backbones import convert_split_bn
from moco.model.loss import decorrelation, in_batch_loss, info_nce

__all__ = ["MoCo", "build_mlp", "momentum_schedule"]

logger = logging.getLogger(__name__)

HEADS = ("linear", "mlp", "v3")


def build_mlp(num_layers: int, in_dim: int, hidden: int, out_dim: int, last_bn: bool) -> nn.Sequential:
    """The MoCo v3 MLP: Linear (no bias) -> BN -> ReLU, ..., last Linear (+ BN without affine)."""
    layers: list[nn.Module] = []
    for i in range(num_layers):
        d_in = in_dim if i == 0 else hidden
        d_out = out_dim if i == num_layers - 1 else hidden
        layers.append(nn.Linear(d_in, d_out, bias=False))
        if i < num_layers - 1:
            layers += [nn.BatchNorm1d(d_out), nn.ReLU(inplace=True)]
        elif last_bn:
            layers.append(nn.BatchNorm1d(d_out, affine=False))
    return nn.Sequential(*layers)


def momentum_schedule(step: int, total_steps: int, m: float, cosine: bool) -> float:
    """Momentum m at ``step``: constant (v1/v2) or cosine from m0 to 1 (v3)."""
    if not cosine:
        return m
    return 1.0 - 0.5 * (1.0 + math.cos(math.pi * min(step, total_steps) / max(total_steps, 1))) * (1.0 - m)


class MoCo(nn.Module):
    """Momentum Contrast around any backbone ``N x 3 x H x W -> N x num_features``.

    Args:
        backbone: the query backbone (the key backbone is a deep copy of it).
        num_features: width of the backbone output.
        head: "linear" (v1), "mlp" (v2: Linear-ReLU-Linear, hidden = ``hidden`` or the backbone
            width) or "v3" (projector with BN + predictor).
        head_bn: the v2 head with batch norm after its hidden layer (Linear-BN-ReLU-Linear).
        projector_layers, predictor_layers: v3 MLP depths (official: projector 2 for ResNets, 3 for ViTs).
        predictor_last_bn: v3 predictor ends with an affine-free BN (official: ViTs yes, ResNets no).
        dim: output dimension C of the projection.
        K: queue size (0: no queue, v3 in-batch loss).
        T: softmax temperature.
        symmetric: both views are queries (v2: one queue per view; v3 is always symmetric).
        bn_splits: Shuffle BN simulated on one device with this many BN splits (1: off).
        mask_own_keys: stale queue keys of a query's own image are not counted as its negatives.
        decorrelation: weight of :func:`moco.model.loss.decorrelation` of the query backbone's features, added to
            the loss (0: off, the papers; the cpu preset's own term).
    """

    def __init__(
        self,
        backbone: nn.Module,
        num_features: int,
        head: str = "mlp",
        dim: int = 128,
        hidden: int = 0,
        head_bn: bool = False,
        projector_layers: int = 3,
        predictor_layers: int = 2,
        predictor_last_bn: bool = False,
        K: int = 65536,
        T: float = 0.2,
        symmetric: bool = False,
        bn_splits: int = 1,
        mask_own_keys: bool = True,
        decorrelation: float = 0.0,
    ) -> None:
        super().__init__()
        if head not in HEADS:
            raise ValueError(f"unknown head {head!r}; expected one of {HEADS}")
        if head != "v3" and K <= 0:
            raise ValueError(f"queue size K must be > 0 for the {head} head (v1/v2); got {K}")
        self.head, self.K, self.T, self.dim = head, K, T, dim
        self.symmetric = symmetric or head == "v3"
        self.bn_splits = bn_splits
        self.mask_own_keys = mask_own_keys
        self.decorrelation = decorrelation
        hidden = hidden or num_features

        self.backbone = convert_split_bn(backbone, bn_splits)
        if head == "linear":
            self.projector = nn.Sequential(nn.Linear(num_features, dim))
        elif head == "mlp":
            norm = [nn.BatchNorm1d(hidden)] if head_bn else []
            self.projector = nn.Sequential(
                nn.Linear(num_features, hidden, bias=not head_bn), *norm, nn.ReLU(inplace=True), nn.Linear(hidden, dim)
            )
        else:
            self.projector = build_mlp(projector_layers, num_features, hidden, dim, last_bn=True)
            self.predictor = build_mlp(predictor_layers, dim, hidden, dim, last_bn=predictor_last_bn)

        # the key (momentum) encoder starts as an exact copy and never receives gradients
        self.backbone_momentum = copy.deepcopy(self.backbone).requires_grad_(False)
        self.projector_momentum = copy.deepcopy(self.projector).requires_grad_(False)

        if K > 0:
            views = 2 if self.symmetric else 1
            queue = F.normalize(torch.randn(views, dim, K), dim=1)  # V x C x K
            self.register_buffer("queue", queue)
            self.register_buffer("queue_ids", torch.full((views, K), -1, dtype=torch.long))  # V x K
            self.register_buffer("queue_ptr", torch.zeros(1, dtype=torch.long))

    # ----------------------------------------------------------------------------------- pieces
    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """Backbone features of the query encoder: N x 3 x H x W -> N x D (not normalized)."""
        return self.backbone(x)

    def _query(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The normalized query (N x C) and the backbone features it came from (N x D)."""
        h = self.backbone(x)  # N x D
        z = self.projector(h)  # N x C
        if self.head == "v3":
            z = self.predictor(z)  # N x C
        return F.normalize(z.float(), dim=1), h

    def _regularized(self, loss: torch.Tensor, stats: dict, feats: list[torch.Tensor]) -> tuple[torch.Tensor, dict]:
        """``loss`` plus ``decorrelation`` times the mean redundancy of the query views' backbone features."""
        if self.decorrelation:
            r = torch.stack([decorrelation(h) for h in feats]).mean()
            loss = loss + self.decorrelation * r
            stats["decorrelation"] = r.detach()
        return loss, stats

    @torch.no_grad()
    def momentum_update(self, m: float) -> None:
        """theta_k <- m * theta_k + (1 - m) * theta_q for backbone and projector."""
        q = [p.detach() for p in (*self.backbone.parameters(), *self.projector.parameters())]
        k = [p for p in (*self.backbone_momentum.parameters(), *self.projector_momentum.parameters())]
        torch._foreach_mul_(k, m)
        torch._foreach_add_(k, q, alpha=1.0 - m)

    @torch.no_grad()
    def _key(self, x: torch.Tensor) -> torch.Tensor:
        """Momentum keys with Shuffle BN: N x 3 x H x W -> N x C, L2-normalized."""
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            x, restore = _shuffle_across_ranks(x)
        elif self.bn_splits > 1:
            perm = torch.randperm(x.shape[0], device=x.device)  # N
            x, restore = x[perm], torch.argsort(perm)
        else:
            restore = None
        k = self.projector_momentum(self.backbone_momentum(x))  # N x C
        k = F.normalize(k.float(), dim=1)
        if restore is None:
            return k
        return _unshuffle(k, restore)

    @torch.no_grad()
    def enqueue(self, keys: list[torch.Tensor], ids: torch.Tensor) -> None:
        """Write each view's keys (N x C, all ranks') and image ids (N) at the queue pointer, FIFO."""
        n = ids.shape[0]
        if n > self.K:
            raise ValueError(f"cannot enqueue {n} keys into a queue of K={self.K}: use --queue-size >= batch size")
        ptr = int(self.queue_ptr)
        idx = (ptr + torch.arange(n, device=ids.device)) % self.K  # N: wraps around, nothing dropped
        for v, k in enumerate(keys):
            self.queue[v][:, idx] = k.t().to(self.queue.dtype)  # C x N
            self.queue_ids[v][idx] = ids
        self.queue_ptr[0] = (ptr + n) % self.K

    def _negatives_mask(self, ids: torch.Tensor | None, view: int) -> torch.Tensor | None:
        if ids is None or not self.mask_own_keys:
            return None
        return ids[:, None] == self.queue_ids[view][None, :]  # N x K

    # ---------------------------------------------------------------------------------- forward
    def forward(
        self, x1: torch.Tensor, x2: torch.Tensor, m: float, ids: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """One MoCo step's loss for two views ``x1``, ``x2`` (N x 3 x H x W) of images ``ids`` (N).

        Updates the key encoder with momentum ``m`` before computing keys, and enqueues the new keys
        after the loss (v1/v2). Returns ``(loss, stats)``; stats hold detached scalars.
        """
        if self.head == "v3":
            return self._forward_v3(x1, x2, m)
        if ids is None:
            ids = torch.full((x1.shape[0],), -2, dtype=torch.long, device=x1.device)
        q1, h1 = self._query(x1)  # N x C, N x D
        self.momentum_update(m)
        k2 = self._key(x2)  # N x C
        queue = self.queue.clone().detach()  # V x C x K: a snapshot, so enqueue cannot touch the graph
        loss = info_nce(q1, k2, queue[0], self.T, self._negatives_mask(ids, 0))
        keys = [k2]
        if self.symmetric:
            q2, h2 = self._query(x2)  # N x C, N x D
            k1 = self._key(x1)  # N x C
            loss = 0.5 * (loss + info_nce(q2, k1, queue[1], self.T, self._negatives_mask(ids, 1)))
            keys.append(k1)
        all_keys, all_ids = _gather(keys), _gather([ids])[0]
        self.enqueue(all_keys, all_ids)
        pos = torch.einsum("nc,nc->n", q1.detach(), k2).mean()
        return self._regularized(loss, {"pos_sim": pos}, [h1, h2] if self.symmetric else [h1])

    def _forward_v3(self, x1: torch.Tensor, x2: torch.Tensor, m: float) -> tuple[torch.Tensor, dict]:
        (q1, h1), (q2, h2) = self._query(x1), self._query(x2)  # N x C, N x D each
        with torch.no_grad():
            self.momentum_update(m)
            k1 = F.normalize(self.projector_momentum(self.backbone_momentum(x1)).float(), dim=1)  # N x C
            k2 = F.normalize(self.projector_momentum(self.backbone_momentum(x2)).float(), dim=1)  # N x C
        offset = dist.get_rank() * q1.shape[0] if _distributed() else 0
        all_k1, all_k2 = _gather([k1, k2])  # (world N) x C each
        loss = in_batch_loss(q1, all_k2, self.T, offset) + in_batch_loss(q2, all_k1, self.T, offset)
        pos = torch.einsum("nc,nc->n", q1.detach(), k2).mean()
        return self._regularized(loss, {"pos_sim": pos}, [h1, h2])


# ------------------------------------------------------------------------------- distributed helpers
def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


@torch.no_grad()
def _gather(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """All-gather each tensor along dim 0 (no gradient); identity on one process."""
    if not _distributed():
        return tensors
    out = []
    for t in tensors:
        parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, t.contiguous())
        out.append(torch.cat(parts))
    return out


@torch.no_grad()
def _shuffle_across_ranks(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Shuffle BN across ranks: gather the batch, one permutation from rank 0, take this rank's slice."""
    x_all = _gather([x])[0]  # (world N) x 3 x H x W
    perm = torch.randperm(x_all.shape[0], device=x.device)  # world N
    dist.broadcast(perm, src=0)
    rank = dist.get_rank()
    return x_all[perm.view(dist.get_world_size(), -1)[rank]], torch.argsort(perm)


@torch.no_grad()
def _unshuffle(k: torch.Tensor, restore: torch.Tensor) -> torch.Tensor:
    """Undo the key shuffle: N x C (this rank's shuffled rows) -> N x C in the original order."""
    if not _distributed():
        return k[restore]
    k_all = _gather([k])[0]  # (world N) x C
    return k_all[restore.view(dist.get_world_size(), -1)[dist.get_rank()]]
