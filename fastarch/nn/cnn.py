"""Convolutional families of the guides, drop-in: ConvBlock/CNN (000), ResidualBlock/ResNet (000, 001),
DenseNet (001), EfficientNet with MBConvBlock (001), MobileNetV2 with InvertedResidual and
DepthwiseSeparableConv (001), and LeNet (002's ``LeNetPyTorch``).

Class names, constructor arguments, ``state_dict`` keys and eval outputs are the guides'. Convolutions and
batch norms are PyTorch's own (oneDNN on CPU, cuDNN on GPU): fastarch has no faster convolution kernel, so
the value here is the complete, correct family (the guide's ResNet-50 refers to a ``BottleneckBlock`` it never
defines, and its ``ResNet`` ignores block expansion; both are fixed here, see ``BottleneckBlock``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from ._models_common import check_input
from .linear import Linear

__all__ = [
    "ConvBlock",
    "CNN",
    "LeNet",
    "LeNetPyTorch",
    "ResidualBlock",
    "BottleneckBlock",
    "Bottleneck",
    "ResNet",
    "DenseBlock",
    "TransitionLayer",
    "DenseNet",
    "MBConvBlock",
    "MBConv",
    "EfficientNet",
    "EFFICIENTNET_PARAMS",
    "DepthwiseSeparableConv",
    "InvertedResidual",
    "MobileNetV2",
]


def _check_image(x: object, channels: int, owner: str) -> torch.Tensor:
    check_input("x", x, ndim=4, owner=owner)
    assert isinstance(x, torch.Tensor)
    if x.shape[1] != channels:
        raise ValueError(f"{owner}: argument 'x' must have {channels} channels (B, {channels}, H, W), "
                         f"got shape {tuple(x.shape)}")
    return x


class ConvBlock(nn.Module):
    """Conv -> BatchNorm -> ReLU (guide 000). x (B, C_in, H, W) -> (B, C_out, H', W')."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int = 3, stride: int = 1,
                 padding: int = 1):
        super().__init__()
        self.conv = nn.Conv2d(in_channels, out_channels, kernel_size, stride, padding)
        self.bn = nn.BatchNorm2d(out_channels)
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.relu(self.bn(self.conv(x)))


class CNN(nn.Module):
    """Four ConvBlocks with 2x2 max pooling, global average pooling and a two-layer head (guide 000).

    x (B, in_channels, H, W), H and W >= 16 -> logits (B, num_classes).
    """

    def __init__(self, in_channels: int = 3, num_classes: int = 10):
        super().__init__()
        self.in_channels = in_channels
        self.conv1 = ConvBlock(in_channels, 64, kernel_size=3, padding=1)
        self.conv2 = ConvBlock(64, 128, kernel_size=3, padding=1)
        self.conv3 = ConvBlock(128, 256, kernel_size=3, padding=1)
        self.conv4 = ConvBlock(256, 512, kernel_size=3, padding=1)
        self.pool = nn.MaxPool2d(kernel_size=2, stride=2)
        self.global_pool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Sequential(Linear(512, 256), nn.ReLU(), nn.Dropout(0.5), Linear(256, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _check_image(x, self.in_channels, "CNN")
        x = self.pool(self.conv1(x))
        x = self.pool(self.conv2(x))
        x = self.pool(self.conv3(x))
        x = self.pool(self.conv4(x))
        x = self.global_pool(x)
        return self.fc(x.flatten(1))


class LeNet(nn.Module):
    """LeNet-5 as guide 002's ``LeNetPyTorch``: 1x28x28 input, returns class probabilities (softmax).

    x (B, 1, 28, 28) -> probabilities (B, num_classes). ``LeNetPyTorch`` is the same class.
    """

    def __init__(self, num_classes: int = 10):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 6, kernel_size=5)
        self.pool1 = nn.MaxPool2d(kernel_size=2)
        self.conv2 = nn.Conv2d(6, 16, kernel_size=5)
        self.pool2 = nn.MaxPool2d(kernel_size=2)
        self.fc1 = Linear(16 * 4 * 4, 120)
        self.fc2 = Linear(120, 84)
        self.fc3 = Linear(84, num_classes)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """The pre-softmax scores (B, num_classes); train on these with cross-entropy."""
        _check_image(x, 1, "LeNet")
        if x.shape[-2:] != (28, 28):
            raise ValueError(f"LeNet: argument 'x' must be (B, 1, 28, 28), got shape {tuple(x.shape)}")
        x = self.pool1(F.relu(self.conv1(x)))
        x = self.pool2(F.relu(self.conv2(x)))
        x = x.flatten(1)
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        return self.fc3(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.softmax(self.logits(x), dim=1)


LeNetPyTorch = LeNet


class ResidualBlock(nn.Module):
    """Basic ResNet block (two 3x3 convs) with an optional projection shortcut (guides 000/001)."""

    expansion = 1

    def __init__(self, in_channels: int, out_channels: int, stride: int = 1, downsample: nn.Module | None = None):
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, kernel_size=3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_channels)
        self.conv2 = nn.Conv2d(out_channels, out_channels, kernel_size=3, stride=1, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_channels)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = downsample

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + identity)


class BottleneckBlock(nn.Module):
    """ResNet-50/101/152 bottleneck: 1x1 reduce, 3x3 (stride here, as torchvision's v1.5), 1x1 expand x4.

    Guide 001 builds ResNet-50 from a ``BottleneckBlock`` it never defines; this is the standard one, with
    ``out_channels`` the bottleneck width (output has ``4 * out_channels`` channels).
    """

    expansion = 4

    def __init__(self, in_channels: int, out_channels: int, stride: int = 1, downsample: nn.Module | None = None):
        super().__init__()
        width = out_channels
        self.conv1 = nn.Conv2d(in_channels, width, kernel_size=1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, kernel_size=3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, out_channels * self.expansion, kernel_size=1, bias=False)
        self.bn3 = nn.BatchNorm2d(out_channels * self.expansion)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = downsample

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.relu(out + identity)


Bottleneck = BottleneckBlock


class ResNet(nn.Module):
    """ResNet (guide 000; default ``num_classes=10`` as there). ``block`` is ``ResidualBlock`` or
    ``BottleneckBlock``; ``layers`` the number of blocks per stage.

    Deviation from the guides: the stage widths are multiplied by ``block.expansion`` (1 for the basic block,
    so ResNet-18/34 are unchanged), which the guide's ResNet-50 needs and lacks.
    x (B, 3, H, W) -> logits (B, num_classes).
    """

    def __init__(self, block: type[nn.Module], layers: Sequence[int], num_classes: int = 10):
        super().__init__()
        if len(layers) != 4:
            raise ValueError(f"ResNet: argument 'layers' must list 4 stage depths, got {list(layers)}")
        self.in_channels = 64
        self.conv1 = nn.Conv2d(3, 64, kernel_size=7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        self.layer1 = self._make_layer(block, 64, layers[0])
        self.layer2 = self._make_layer(block, 128, layers[1], stride=2)
        self.layer3 = self._make_layer(block, 256, layers[2], stride=2)
        self.layer4 = self._make_layer(block, 512, layers[3], stride=2)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = Linear(512 * getattr(block, "expansion", 1), num_classes)

    def _make_layer(self, block: type[nn.Module], out_channels: int, blocks: int, stride: int = 1) -> nn.Sequential:
        expansion = getattr(block, "expansion", 1)
        downsample = None
        if stride != 1 or self.in_channels != out_channels * expansion:
            downsample = nn.Sequential(
                nn.Conv2d(self.in_channels, out_channels * expansion, kernel_size=1, stride=stride, bias=False),
                nn.BatchNorm2d(out_channels * expansion),
            )
        layers = [block(self.in_channels, out_channels, stride, downsample)]
        self.in_channels = out_channels * expansion
        for _ in range(1, blocks):
            layers.append(block(self.in_channels, out_channels))
        return nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _check_image(x, 3, "ResNet")
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


class DenseBlock(nn.Module):
    """DenseNet block: each layer (BN-ReLU-1x1-BN-ReLU-3x3) sees the concatenation of all earlier maps."""

    def __init__(self, num_layers: int, in_channels: int, growth_rate: int):
        super().__init__()
        self.layers = nn.ModuleList(
            self._make_dense_layer(in_channels + i * growth_rate, growth_rate) for i in range(num_layers)
        )

    def _make_dense_layer(self, in_channels: int, growth_rate: int) -> nn.Sequential:
        return nn.Sequential(
            nn.BatchNorm2d(in_channels),
            nn.ReLU(inplace=True),
            nn.Conv2d(in_channels, 4 * growth_rate, kernel_size=1, bias=False),
            nn.BatchNorm2d(4 * growth_rate),
            nn.ReLU(inplace=True),
            nn.Conv2d(4 * growth_rate, growth_rate, kernel_size=3, padding=1, bias=False),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        features = [x]
        for layer in self.layers:
            # The first BN-ReLU is in place on a fresh concatenation, never on a stored feature map.
            features.append(layer(torch.cat(features, 1)))
        return torch.cat(features, 1)


class TransitionLayer(nn.Module):
    """BN -> ReLU -> 1x1 conv -> 2x2 average pool, between dense blocks."""

    def __init__(self, in_channels: int, out_channels: int):
        super().__init__()
        self.bn = nn.BatchNorm2d(in_channels)
        self.conv = nn.Conv2d(in_channels, out_channels, kernel_size=1, bias=False)
        self.pool = nn.AvgPool2d(kernel_size=2, stride=2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.pool(self.conv(F.relu(self.bn(x))))


class DenseNet(nn.Module):
    """DenseNet-121/169/201/264 (guide 001). x (B, 3, H, W) -> logits (B, num_classes)."""

    def __init__(self, growth_rate: int = 32, block_config: Sequence[int] = (6, 12, 24, 16),
                 num_classes: int = 1000, compression: float = 0.5):
        super().__init__()
        num_features = 2 * growth_rate
        self.features = nn.Sequential(
            nn.Conv2d(3, num_features, kernel_size=7, stride=2, padding=3, bias=False),
            nn.BatchNorm2d(num_features),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(kernel_size=3, stride=2, padding=1),
        )
        for i, num_layers in enumerate(block_config):
            self.features.add_module(f"denseblock{i + 1}", DenseBlock(num_layers, num_features, growth_rate))
            num_features += num_layers * growth_rate
            if i != len(block_config) - 1:
                out = int(num_features * compression)
                self.features.add_module(f"transition{i + 1}", TransitionLayer(num_features, out))
                num_features = out
        self.features.add_module("norm5", nn.BatchNorm2d(num_features))
        self.classifier = Linear(num_features, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _check_image(x, 3, "DenseNet")
        out = F.relu(self.features(x))
        out = F.adaptive_avg_pool2d(out, 1).flatten(1)
        return self.classifier(out)


class MBConvBlock(nn.Module):
    """Mobile inverted bottleneck with squeeze-and-excitation (EfficientNet's block, guide 001)."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, stride: int, expand_ratio: int,
                 se_ratio: float = 0.25):
        super().__init__()
        self.stride = stride
        self.use_residual = stride == 1 and in_channels == out_channels
        hidden = in_channels * expand_ratio
        if expand_ratio != 1:
            self.expand_conv: nn.Module = nn.Sequential(
                nn.Conv2d(in_channels, hidden, 1, bias=False), nn.BatchNorm2d(hidden), nn.SiLU(inplace=True)
            )
        else:
            self.expand_conv = nn.Identity()
        self.depthwise_conv = nn.Sequential(
            nn.Conv2d(hidden, hidden, kernel_size, stride=stride, padding=kernel_size // 2, groups=hidden,
                      bias=False),
            nn.BatchNorm2d(hidden),
            nn.SiLU(inplace=True),
        )
        if se_ratio > 0:
            se = max(1, int(in_channels * se_ratio))
            self.se: nn.Module | None = nn.Sequential(
                nn.AdaptiveAvgPool2d(1), nn.Conv2d(hidden, se, 1), nn.SiLU(inplace=True), nn.Conv2d(se, hidden, 1),
                nn.Sigmoid(),
            )
        else:
            self.se = None
        self.project_conv = nn.Sequential(nn.Conv2d(hidden, out_channels, 1, bias=False),
                                          nn.BatchNorm2d(out_channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x
        h = self.depthwise_conv(self.expand_conv(x))
        if self.se is not None:
            h = h * self.se(h)
        h = self.project_conv(h)
        return h + identity if self.use_residual else h


MBConv = MBConvBlock

# (width_mult, depth_mult, resolution, dropout) of EfficientNet-B0..B7 (Tan & Le, 2019).
EFFICIENTNET_PARAMS: dict[str, tuple[float, float, int, float]] = {
    "b0": (1.0, 1.0, 224, 0.2),
    "b1": (1.0, 1.1, 240, 0.2),
    "b2": (1.1, 1.2, 260, 0.3),
    "b3": (1.2, 1.4, 300, 0.3),
    "b4": (1.4, 1.8, 380, 0.4),
    "b5": (1.6, 2.2, 456, 0.4),
    "b6": (1.8, 2.6, 528, 0.5),
    "b7": (2.0, 3.1, 600, 0.5),
}


class EfficientNet(nn.Module):
    """EfficientNet-B0..B7 by compound scaling of width and depth (guide 001).

    x (B, 3, H, W) -> logits (B, num_classes). ``EFFICIENTNET_PARAMS`` lists each variant's multipliers.
    """

    BLOCKS = [  # (expand_ratio, channels, num_blocks, stride, kernel_size)
        (1, 16, 1, 1, 3),
        (6, 24, 2, 2, 3),
        (6, 40, 2, 2, 5),
        (6, 80, 3, 2, 3),
        (6, 112, 3, 1, 5),
        (6, 192, 4, 2, 5),
        (6, 320, 1, 1, 3),
    ]

    def __init__(self, width_mult: float = 1.0, depth_mult: float = 1.0, dropout_rate: float = 0.2,
                 num_classes: int = 1000):
        super().__init__()
        out_channels = self._round_filters(32, width_mult)
        self.stem = nn.Sequential(nn.Conv2d(3, out_channels, 3, stride=2, padding=1, bias=False),
                                  nn.BatchNorm2d(out_channels), nn.SiLU(inplace=True))
        in_channels = out_channels
        blocks = []
        for expand_ratio, channels, num_blocks, stride, kernel_size in self.BLOCKS:
            out_channels = self._round_filters(channels, width_mult)
            for i in range(self._round_repeats(num_blocks, depth_mult)):
                blocks.append(MBConvBlock(in_channels if i == 0 else out_channels, out_channels, kernel_size,
                                          stride if i == 0 else 1, expand_ratio))
            in_channels = out_channels
        self.blocks = nn.Sequential(*blocks)
        out_channels = self._round_filters(1280, width_mult)
        self.head = nn.Sequential(nn.Conv2d(in_channels, out_channels, 1, bias=False), nn.BatchNorm2d(out_channels),
                                  nn.SiLU(inplace=True), nn.AdaptiveAvgPool2d(1), nn.Dropout(dropout_rate))
        self.classifier = Linear(out_channels, num_classes)

    @staticmethod
    def _round_filters(filters: int, width_mult: float) -> int:
        if width_mult == 1.0:
            return filters
        f = filters * width_mult
        new = max(8, int(f + 4) // 8 * 8)
        if new < 0.9 * f:
            new += 8
        return int(new)

    @staticmethod
    def _round_repeats(repeats: int, depth_mult: float) -> int:
        return int(math.ceil(depth_mult * repeats))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _check_image(x, 3, "EfficientNet")
        return self.classifier(torch.flatten(self.head(self.blocks(self.stem(x))), 1))


class DepthwiseSeparableConv(nn.Module):
    """3x3 depthwise conv -> BN -> ReLU, then 1x1 pointwise conv -> BN -> ReLU (MobileNet v1 unit)."""

    def __init__(self, in_channels: int, out_channels: int, stride: int = 1):
        super().__init__()
        self.depthwise = nn.Sequential(
            nn.Conv2d(in_channels, in_channels, kernel_size=3, stride=stride, padding=1, groups=in_channels,
                      bias=False),
            nn.BatchNorm2d(in_channels),
            nn.ReLU(inplace=True),
        )
        self.pointwise = nn.Sequential(nn.Conv2d(in_channels, out_channels, kernel_size=1, bias=False),
                                       nn.BatchNorm2d(out_channels), nn.ReLU(inplace=True))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.pointwise(self.depthwise(x))


class InvertedResidual(nn.Module):
    """MobileNetV2 block: 1x1 expand (ReLU6), 3x3 depthwise (ReLU6), linear 1x1 projection, residual."""

    def __init__(self, in_channels: int, out_channels: int, stride: int, expand_ratio: int):
        super().__init__()
        self.stride = stride
        hidden = in_channels * expand_ratio
        self.use_residual = stride == 1 and in_channels == out_channels
        layers: list[nn.Module] = []
        if expand_ratio != 1:
            layers += [nn.Conv2d(in_channels, hidden, 1, bias=False), nn.BatchNorm2d(hidden), nn.ReLU6(inplace=True)]
        layers += [
            nn.Conv2d(hidden, hidden, 3, stride=stride, padding=1, groups=hidden, bias=False),
            nn.BatchNorm2d(hidden),
            nn.ReLU6(inplace=True),
            nn.Conv2d(hidden, out_channels, 1, bias=False),
            nn.BatchNorm2d(out_channels),
        ]
        self.conv = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.conv(x) if self.use_residual else self.conv(x)


class MobileNetV2(nn.Module):
    """MobileNetV2 (guide 001). x (B, 3, H, W) -> logits (B, num_classes)."""

    CONFIG = [[1, 16, 1, 1], [6, 24, 2, 2], [6, 32, 3, 2], [6, 64, 4, 2], [6, 96, 3, 1], [6, 160, 3, 2],
              [6, 320, 1, 1]]

    def __init__(self, num_classes: int = 1000, width_mult: float = 1.0):
        super().__init__()
        input_channel = int(32 * width_mult)
        self.conv1 = nn.Sequential(nn.Conv2d(3, input_channel, kernel_size=3, stride=2, padding=1, bias=False),
                                   nn.BatchNorm2d(input_channel), nn.ReLU6(inplace=True))
        features: list[nn.Module] = [self.conv1]
        for t, c, n, s in self.CONFIG:
            out = int(c * width_mult)
            for i in range(n):
                features.append(InvertedResidual(input_channel, out, s if i == 0 else 1, t))
                input_channel = out
        features.append(nn.Sequential(nn.Conv2d(input_channel, 1280, kernel_size=1, bias=False),
                                      nn.BatchNorm2d(1280), nn.ReLU6(inplace=True)))
        self.features = nn.Sequential(*features)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.classifier = Linear(1280, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _check_image(x, 3, "MobileNetV2")
        return self.classifier(torch.flatten(self.avgpool(self.features(x)), 1))
