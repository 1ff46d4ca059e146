"""The ResNet family (He et al. 2016; ResNeXt, Xie et al. 2017; Wide ResNet, Zagoruyko & Komodakis 2016), as the
official MoCo code trains it through torchvision: v1.5 (the stride on the 3 x 3 convolution), the same modules,
state-dict keys and initialization, so a torchvision checkpoint loads as it is and the same seed draws the same
weights (tests/test_resnet.py holds both, and equal outputs).

It is our own module rather than ``torchvision.models`` because importing torchvision imports ``torch._dynamo``
(through its detection ops), a cost that every command embedding one photo paid (``moco index search``; the
time: BENCHMARKS.md); nothing here imports more than torch.
"""

from __future__ import annotations

from torch import Tensor, nn

__all__ = ["ResNet", "resnet", "RESNETS"]

# name -> (block, layers, groups, width per group): torchvision's published configurations
RESNETS: dict[str, tuple[str, tuple[int, int, int, int], int, int]] = {
    "resnet18": ("basic", (2, 2, 2, 2), 1, 64),
    "resnet34": ("basic", (3, 4, 6, 3), 1, 64),
    "resnet50": ("bottleneck", (3, 4, 6, 3), 1, 64),
    "resnet101": ("bottleneck", (3, 4, 23, 3), 1, 64),
    "resnet152": ("bottleneck", (3, 8, 36, 3), 1, 64),
    "resnext50_32x4d": ("bottleneck", (3, 4, 6, 3), 32, 4),
    "resnext101_32x8d": ("bottleneck", (3, 4, 23, 3), 32, 8),
    "resnext101_64x4d": ("bottleneck", (3, 4, 23, 3), 64, 4),
    "wide_resnet50_2": ("bottleneck", (3, 4, 6, 3), 1, 128),
    "wide_resnet101_2": ("bottleneck", (3, 4, 23, 3), 1, 128),
}


def _conv3x3(cin: int, cout: int, stride: int = 1, groups: int = 1) -> nn.Conv2d:
    return nn.Conv2d(cin, cout, 3, stride, 1, groups=groups, bias=False)


def _conv1x1(cin: int, cout: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(cin, cout, 1, stride, bias=False)


class BasicBlock(nn.Module):
    """Two 3 x 3 convolutions and the shortcut (ResNet-18/34)."""

    expansion = 1

    def __init__(self, cin: int, planes: int, stride: int = 1, downsample: nn.Module | None = None,
                 groups: int = 1, base_width: int = 64) -> None:
        super().__init__()
        if groups != 1 or base_width != 64:
            raise ValueError("BasicBlock takes groups=1 and base_width=64 only")
        self.conv1 = _conv3x3(cin, planes, stride)
        self.bn1 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = _conv3x3(planes, planes)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample = downsample
        self.stride = stride

    def forward(self, x: Tensor) -> Tensor:
        identity = x if self.downsample is None else self.downsample(x)  # N x planes x H' x W'
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + identity)


class Bottleneck(nn.Module):
    """1 x 1 down, 3 x 3 (the stride, and ResNeXt's groups), 1 x 1 up by 4, and the shortcut (ResNet-50 and up)."""

    expansion = 4

    def __init__(self, cin: int, planes: int, stride: int = 1, downsample: nn.Module | None = None,
                 groups: int = 1, base_width: int = 64) -> None:
        super().__init__()
        width = int(planes * (base_width / 64.0)) * groups
        self.conv1 = _conv1x1(cin, width)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = _conv3x3(width, width, stride, groups)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = _conv1x1(width, planes * self.expansion)
        self.bn3 = nn.BatchNorm2d(planes * self.expansion)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = downsample
        self.stride = stride

    def forward(self, x: Tensor) -> Tensor:
        identity = x if self.downsample is None else self.downsample(x)  # N x 4 planes x H' x W'
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.relu(out + identity)


class ResNet(nn.Module):
    """Stem (7 x 7/2 conv, BN, ReLU, 3 x 3/2 max-pool), four stages, global average pool, ``fc``: images
    ``N x 3 x H x W`` to ``N x num_classes``."""

    def __init__(self, block: type[BasicBlock | Bottleneck], layers: tuple[int, int, int, int],
                 num_classes: int = 1000, zero_init_residual: bool = False, groups: int = 1,
                 width_per_group: int = 64, init: bool = True) -> None:
        super().__init__()
        self.inplanes, self.groups, self.base_width = 64, groups, width_per_group
        self.conv1 = nn.Conv2d(3, 64, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        self.layer1 = self._make_layer(block, 64, layers[0])
        self.layer2 = self._make_layer(block, 128, layers[1], stride=2)
        self.layer3 = self._make_layer(block, 256, layers[2], stride=2)
        self.layer4 = self._make_layer(block, 512, layers[3], stride=2)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(512 * block.expansion, num_classes)
        if not init:  # weights to be loaded, or a shape to be read (on the meta device: no init there, where it
            return  # runs through torch's reference ops, which import torch._dynamo)
        for m in self.modules():  # after every module is made: the draws come in torchvision's order
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.constant_(m.weight, 1)
                nn.init.constant_(m.bias, 0)
        if zero_init_residual:  # each residual branch starts as zero (Goyal et al. 2017; MoCo v3)
            for m in self.modules():
                if isinstance(m, Bottleneck):
                    nn.init.constant_(m.bn3.weight, 0)
                elif isinstance(m, BasicBlock):
                    nn.init.constant_(m.bn2.weight, 0)

    def _make_layer(self, block: type[BasicBlock | Bottleneck], planes: int, blocks: int,
                    stride: int = 1) -> nn.Sequential:
        downsample = None
        if stride != 1 or self.inplanes != planes * block.expansion:
            downsample = nn.Sequential(_conv1x1(self.inplanes, planes * block.expansion, stride),
                                       nn.BatchNorm2d(planes * block.expansion))
        layers = [block(self.inplanes, planes, stride, downsample, self.groups, self.base_width)]
        self.inplanes = planes * block.expansion
        layers += [block(self.inplanes, planes, groups=self.groups, base_width=self.base_width)
                   for _ in range(1, blocks)]
        return nn.Sequential(*layers)

    def forward(self, x: Tensor) -> Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))  # N x 64 x H/4 x W/4
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))  # N x 512 e x H/32 x W/32
        x = self.avgpool(x).flatten(1)  # N x 512 e
        return self.fc(x)  # N x num_classes


def resnet(name: str, zero_init_residual: bool = False, init: bool = True) -> ResNet:
    """The ResNet ``name`` (a key of :data:`RESNETS`), randomly initialized (``init``: else its parameters as
    PyTorch's layers make them, to be overwritten)."""
    kind, layers, groups, width = RESNETS[name]
    block = BasicBlock if kind == "basic" else Bottleneck
    return ResNet(block, layers, zero_init_residual=zero_init_residual, groups=groups, width_per_group=width,
                  init=init)
