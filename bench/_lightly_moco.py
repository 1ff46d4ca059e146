"""The peer: MoCo v2 built from lightly's building blocks, the way lightly's own MoCo example does it.

MoCoProjectionHead, NTXentLoss with a memory bank (the queue), MoCoV2Transform in a torchvision
ImageFolder, update_momentum, a DataLoader with worker processes, SGD. Configured like ours: the same
ResNet (and small stem), batch, crop size, queue size, temperature, momentum and learning rate.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Iterator
from contextlib import nullcontext
from pathlib import Path

import torch
import torchvision
from lightly.loss import NTXentLoss
from lightly.models.modules import MoCoProjectionHead
from lightly.models.utils import deactivate_requires_grad, update_momentum
from lightly.transforms import MoCoV2Transform
from torch import nn

from moco.model.backbones import build_backbone


class LightlyMoCo(nn.Module):
    def __init__(self, arch: str, small_stem: bool, dim: int = 128) -> None:
        super().__init__()
        self.backbone, width = build_backbone(arch, small_stem)  # the same network as ours
        self.projection_head = MoCoProjectionHead(width, width, dim)
        self.backbone_momentum = copy.deepcopy(self.backbone)
        self.projection_head_momentum = copy.deepcopy(self.projection_head)
        deactivate_requires_grad(self.backbone_momentum)
        deactivate_requires_grad(self.projection_head_momentum)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.projection_head(self.backbone(x).flatten(start_dim=1))

    def forward_momentum(self, x: torch.Tensor) -> torch.Tensor:
        return self.projection_head_momentum(self.backbone_momentum(x).flatten(start_dim=1)).detach()


class _Unlabeled(torchvision.datasets.ImageFolder):
    """ImageFolder over a photo folder; lightly's transform returns the two views."""


def lightly_loader(data_dir: str | Path, image_size: int, batch_size: int, workers: int) -> torch.utils.data.DataLoader:
    transform = MoCoV2Transform(input_size=image_size)
    dataset = _Unlabeled(str(data_dir), transform=transform)
    return torch.utils.data.DataLoader(
        dataset,
        batch_size=batch_size,
        shuffle=True,
        drop_last=True,
        num_workers=workers,
        persistent_workers=workers > 0,
        pin_memory=False,
    )


def lightly_train(
    data_dir: str | Path,
    *,
    arch: str = "resnet18",
    small_stem: bool = True,
    image_size: int = 32,
    batch_size: int = 256,
    queue_size: int = 4096,
    temperature: float = 0.2,
    momentum: float = 0.999,
    lr: float = 0.03,
    workers: int = 2,
    bf16: bool = False,
    channels_last: bool = False,
    seed: int = 0,
) -> Iterator[tuple[int, float, LightlyMoCo]]:
    """Train forever; yields ``(step, seconds of this step incl. waiting for data, model)`` after each step."""
    torch.manual_seed(seed)
    model = LightlyMoCo(arch, small_stem)
    layout = torch.channels_last if channels_last else torch.contiguous_format
    model = model.to(memory_format=layout)
    criterion = NTXentLoss(temperature=temperature, memory_bank_size=(queue_size, 128))
    optimizer = torch.optim.SGD(model.parameters(), lr=lr * batch_size / 256, momentum=0.9, weight_decay=1e-4)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else nullcontext()
    loader = lightly_loader(data_dir, image_size, batch_size, workers)
    step = 0
    while True:
        t0 = time.perf_counter()
        for (x_query, x_key), _ in loader:
            update_momentum(model.backbone, model.backbone_momentum, m=momentum)
            update_momentum(model.projection_head, model.projection_head_momentum, m=momentum)
            x_query, x_key = (x.contiguous(memory_format=layout) for x in (x_query, x_key))
            with autocast:
                query = model(x_query)
                key = model.forward_momentum(x_key)
            loss = criterion(query.float(), key.float())
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            step += 1
            dt = time.perf_counter() - t0
            yield step, dt, model
            t0 = time.perf_counter()
