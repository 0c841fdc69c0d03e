"""Feed-forward and CNN families against the guides' own definitions (copied below as references)."""

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fastarch.nn as fnn
from fastarch.testing.dropin import assert_dropin, assert_trains


# ---- guide 000 reference code (verbatim apart from formatting) -------------------------------------------
class RefMLP(nn.Module):
    def __init__(self, input_dim, hidden_dims, output_dim, dropout=0.1):
        super().__init__()
        layers = []
        prev_dim = input_dim
        for hidden_dim in hidden_dims:
            layers.extend([nn.Linear(prev_dim, hidden_dim), nn.ReLU(), nn.Dropout(dropout)])
            prev_dim = hidden_dim
        layers.append(nn.Linear(prev_dim, output_dim))
        self.network = nn.Sequential(*layers)

    def forward(self, x):
        return self.network(x)


class RefConvBlock(nn.Module):
    def __init__(self, in_channels, out_channels, kernel_size=3, stride=1, padding=1):
        super().__init__()
        self.conv = nn.Conv2d(in_channels, out_channels, kernel_size, stride, padding)
        self.bn = nn.BatchNorm2d(out_channels)
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x):
        return self.relu(self.bn(self.conv(x)))


class RefCNN(nn.Module):
    def __init__(self, in_channels=3, num_classes=10):
        super().__init__()
        self.conv1 = RefConvBlock(in_channels, 64, kernel_size=3, padding=1)
        self.conv2 = RefConvBlock(64, 128, kernel_size=3, padding=1)
        self.conv3 = RefConvBlock(128, 256, kernel_size=3, padding=1)
        self.conv4 = RefConvBlock(256, 512, kernel_size=3, padding=1)
        self.pool = nn.MaxPool2d(kernel_size=2, stride=2)
        self.global_pool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Sequential(nn.Linear(512, 256), nn.ReLU(), nn.Dropout(0.5), nn.Linear(256, num_classes))

    def forward(self, x):
        x = self.pool(self.conv1(x))
        x = self.pool(self.conv2(x))
        x = self.pool(self.conv3(x))
        x = self.pool(self.conv4(x))
        x = self.global_pool(x)
        x = x.view(x.size(0), -1)
        return self.fc(x)


class RefResidualBlock(nn.Module):
    def __init__(self, in_channels, out_channels, stride=1, downsample=None):
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, kernel_size=3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_channels)
        self.conv2 = nn.Conv2d(out_channels, out_channels, kernel_size=3, stride=1, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_channels)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = downsample

    def forward(self, x):
        identity = x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        if self.downsample is not None:
            identity = self.downsample(x)
        out += identity
        return self.relu(out)


class RefResNet(nn.Module):
    def __init__(self, block, layers, num_classes=10):
        super().__init__()
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
        self.fc = nn.Linear(512, num_classes)

    def _make_layer(self, block, out_channels, blocks, stride=1):
        downsample = None
        if stride != 1 or self.in_channels != out_channels:
            downsample = nn.Sequential(
                nn.Conv2d(self.in_channels, out_channels, kernel_size=1, stride=stride, bias=False),
                nn.BatchNorm2d(out_channels))
        layers = [block(self.in_channels, out_channels, stride, downsample)]
        self.in_channels = out_channels
        for _ in range(1, blocks):
            layers.append(block(out_channels, out_channels))
        return nn.Sequential(*layers)

    def forward(self, x):
        x = self.relu(self.bn1(self.conv1(x)))
        x = self.maxpool(x)
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        x = self.avgpool(x)
        return self.fc(x.view(x.size(0), -1))


# ---- guide 001 reference code ----------------------------------------------------------------------------
class RefDenseBlock(nn.Module):
    def __init__(self, num_layers, in_channels, growth_rate):
        super().__init__()
        self.layers = nn.ModuleList()
        for i in range(num_layers):
            self.layers.append(self._make_dense_layer(in_channels + i * growth_rate, growth_rate))

    def _make_dense_layer(self, in_channels, growth_rate):
        return nn.Sequential(
            nn.BatchNorm2d(in_channels), nn.ReLU(inplace=True),
            nn.Conv2d(in_channels, 4 * growth_rate, kernel_size=1, bias=False),
            nn.BatchNorm2d(4 * growth_rate), nn.ReLU(inplace=True),
            nn.Conv2d(4 * growth_rate, growth_rate, kernel_size=3, padding=1, bias=False))

    def forward(self, x):
        features = [x]
        for layer in self.layers:
            features.append(layer(torch.cat(features, 1)))
        return torch.cat(features, 1)


class RefTransitionLayer(nn.Module):
    def __init__(self, in_channels, out_channels):
        super().__init__()
        self.bn = nn.BatchNorm2d(in_channels)
        self.conv = nn.Conv2d(in_channels, out_channels, kernel_size=1, bias=False)
        self.pool = nn.AvgPool2d(kernel_size=2, stride=2)

    def forward(self, x):
        x = self.bn(x)
        x = nn.ReLU(inplace=True)(x)
        return self.pool(self.conv(x))


class RefDenseNet(nn.Module):
    def __init__(self, growth_rate=32, block_config=(6, 12, 24, 16), num_classes=1000, compression=0.5):
        super().__init__()
        num_features = 2 * growth_rate
        self.features = nn.Sequential(
            nn.Conv2d(3, num_features, kernel_size=7, stride=2, padding=3, bias=False),
            nn.BatchNorm2d(num_features), nn.ReLU(inplace=True), nn.MaxPool2d(kernel_size=3, stride=2, padding=1))
        for i, num_layers in enumerate(block_config):
            self.features.add_module(f'denseblock{i+1}', RefDenseBlock(num_layers, num_features, growth_rate))
            num_features += num_layers * growth_rate
            if i != len(block_config) - 1:
                self.features.add_module(f'transition{i+1}',
                                         RefTransitionLayer(num_features, int(num_features * compression)))
                num_features = int(num_features * compression)
        self.features.add_module('norm5', nn.BatchNorm2d(num_features))
        self.classifier = nn.Linear(num_features, num_classes)

    def forward(self, x):
        out = nn.ReLU(inplace=True)(self.features(x))
        out = torch.flatten(nn.AdaptiveAvgPool2d((1, 1))(out), 1)
        return self.classifier(out)


class RefMBConvBlock(nn.Module):
    def __init__(self, in_channels, out_channels, kernel_size, stride, expand_ratio, se_ratio=0.25):
        super().__init__()
        self.stride = stride
        self.use_residual = (stride == 1 and in_channels == out_channels)
        hidden_dim = in_channels * expand_ratio
        if expand_ratio != 1:
            self.expand_conv = nn.Sequential(nn.Conv2d(in_channels, hidden_dim, 1, bias=False),
                                             nn.BatchNorm2d(hidden_dim), nn.SiLU(inplace=True))
        else:
            self.expand_conv = nn.Identity()
        self.depthwise_conv = nn.Sequential(
            nn.Conv2d(hidden_dim, hidden_dim, kernel_size, stride=stride, padding=kernel_size // 2,
                      groups=hidden_dim, bias=False),
            nn.BatchNorm2d(hidden_dim), nn.SiLU(inplace=True))
        if se_ratio > 0:
            se_channels = max(1, int(in_channels * se_ratio))
            self.se = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Conv2d(hidden_dim, se_channels, 1),
                                    nn.SiLU(inplace=True), nn.Conv2d(se_channels, hidden_dim, 1), nn.Sigmoid())
        else:
            self.se = None
        self.project_conv = nn.Sequential(nn.Conv2d(hidden_dim, out_channels, 1, bias=False),
                                          nn.BatchNorm2d(out_channels))

    def forward(self, x):
        identity = x
        x = self.depthwise_conv(self.expand_conv(x))
        if self.se is not None:
            x = x * self.se(x)
        x = self.project_conv(x)
        if self.use_residual:
            x = x + identity
        return x


class RefEfficientNet(nn.Module):
    """Guide 001's EfficientNet with one fix: the guide never advances ``in_channels`` between stages (so its
    second stage gets the wrong channel count and cannot run); ``in_channels = out_channels`` is added."""

    def __init__(self, width_mult=1.0, depth_mult=1.0, dropout_rate=0.2, num_classes=1000):
        super().__init__()
        blocks_config = [(1, 16, 1, 1, 3), (6, 24, 2, 2, 3), (6, 40, 2, 2, 5), (6, 80, 3, 2, 3), (6, 112, 3, 1, 5),
                         (6, 192, 4, 2, 5), (6, 320, 1, 1, 3)]
        out_channels = self._round_filters(32, width_mult)
        self.stem = nn.Sequential(nn.Conv2d(3, out_channels, 3, stride=2, padding=1, bias=False),
                                  nn.BatchNorm2d(out_channels), nn.SiLU(inplace=True))
        in_channels = out_channels
        blocks = []
        for expand_ratio, channels, num_blocks, stride, kernel_size in blocks_config:
            out_channels = self._round_filters(channels, width_mult)
            num_blocks = self._round_repeats(num_blocks, depth_mult)
            for i in range(num_blocks):
                blocks.append(RefMBConvBlock(in_channels if i == 0 else out_channels, out_channels, kernel_size,
                                             stride if i == 0 else 1, expand_ratio))
            in_channels = out_channels  # the fix
        self.blocks = nn.Sequential(*blocks)
        in_channels = out_channels
        out_channels = self._round_filters(1280, width_mult)
        self.head = nn.Sequential(nn.Conv2d(in_channels, out_channels, 1, bias=False), nn.BatchNorm2d(out_channels),
                                  nn.SiLU(inplace=True), nn.AdaptiveAvgPool2d(1), nn.Dropout(dropout_rate))
        self.classifier = nn.Linear(out_channels, num_classes)

    @staticmethod
    def _round_filters(filters, width_mult):
        if width_mult == 1.0:
            return filters
        filters *= width_mult
        new_filters = max(8, int(filters + 4) // 8 * 8)
        if new_filters < 0.9 * filters:
            new_filters += 8
        return int(new_filters)

    @staticmethod
    def _round_repeats(repeats, depth_mult):
        return int(math.ceil(depth_mult * repeats))

    def forward(self, x):
        return self.classifier(torch.flatten(self.head(self.blocks(self.stem(x))), 1))


class RefDepthwiseSeparableConv(nn.Module):
    def __init__(self, in_channels, out_channels, stride=1):
        super().__init__()
        self.depthwise = nn.Sequential(
            nn.Conv2d(in_channels, in_channels, kernel_size=3, stride=stride, padding=1, groups=in_channels,
                      bias=False), nn.BatchNorm2d(in_channels), nn.ReLU(inplace=True))
        self.pointwise = nn.Sequential(nn.Conv2d(in_channels, out_channels, kernel_size=1, bias=False),
                                       nn.BatchNorm2d(out_channels), nn.ReLU(inplace=True))

    def forward(self, x):
        return self.pointwise(self.depthwise(x))


class RefInvertedResidual(nn.Module):
    def __init__(self, in_channels, out_channels, stride, expand_ratio):
        super().__init__()
        self.stride = stride
        hidden_dim = in_channels * expand_ratio
        self.use_residual = stride == 1 and in_channels == out_channels
        layers = []
        if expand_ratio != 1:
            layers.extend([nn.Conv2d(in_channels, hidden_dim, 1, bias=False), nn.BatchNorm2d(hidden_dim),
                           nn.ReLU6(inplace=True)])
        layers.extend([nn.Conv2d(hidden_dim, hidden_dim, 3, stride=stride, padding=1, groups=hidden_dim, bias=False),
                       nn.BatchNorm2d(hidden_dim), nn.ReLU6(inplace=True)])
        layers.extend([nn.Conv2d(hidden_dim, out_channels, 1, bias=False), nn.BatchNorm2d(out_channels)])
        self.conv = nn.Sequential(*layers)

    def forward(self, x):
        return x + self.conv(x) if self.use_residual else self.conv(x)


class RefMobileNetV2(nn.Module):
    def __init__(self, num_classes=1000, width_mult=1.0):
        super().__init__()
        input_channel = int(32 * width_mult)
        self.conv1 = nn.Sequential(nn.Conv2d(3, input_channel, kernel_size=3, stride=2, padding=1, bias=False),
                                   nn.BatchNorm2d(input_channel), nn.ReLU6(inplace=True))
        cfg = [[1, 16, 1, 1], [6, 24, 2, 2], [6, 32, 3, 2], [6, 64, 4, 2], [6, 96, 3, 1], [6, 160, 3, 2],
               [6, 320, 1, 1]]
        features = [self.conv1]
        for t, c, n, s in cfg:
            output_channel = int(c * width_mult)
            for i in range(n):
                features.append(RefInvertedResidual(input_channel, output_channel, s if i == 0 else 1, t))
                input_channel = output_channel
        features.append(nn.Sequential(nn.Conv2d(input_channel, 1280, kernel_size=1, bias=False),
                                      nn.BatchNorm2d(1280), nn.ReLU6(inplace=True)))
        self.features = nn.Sequential(*features)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Linear(1280, num_classes)

    def forward(self, x):
        return self.classifier(torch.flatten(self.avgpool(self.features(x)), 1))


# ---- guide 002 ------------------------------------------------------------------------------------------
class RefLeNetPyTorch(nn.Module):
    def __init__(self, num_classes=10):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 6, kernel_size=5)
        self.pool1 = nn.MaxPool2d(kernel_size=2)
        self.conv2 = nn.Conv2d(6, 16, kernel_size=5)
        self.pool2 = nn.MaxPool2d(kernel_size=2)
        self.fc1 = nn.Linear(16 * 4 * 4, 120)
        self.fc2 = nn.Linear(120, 84)
        self.fc3 = nn.Linear(84, num_classes)

    def forward(self, x):
        x = self.pool1(F.relu(self.conv1(x)))
        x = self.pool2(F.relu(self.conv2(x)))
        x = x.view(x.size(0), -1)
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        return F.softmax(self.fc3(x), dim=1)


def _randomize_bn(m: nn.Module) -> None:
    # Non-trivial running statistics so that eval-mode batch norm is actually exercised.
    for mod in m.modules():
        if isinstance(mod, nn.BatchNorm2d):
            mod.running_mean.uniform_(-0.5, 0.5)
            mod.running_var.uniform_(0.5, 1.5)
            mod.weight.data.uniform_(0.5, 1.5)
            mod.bias.data.uniform_(-0.2, 0.2)


IMG = torch.randn(2, 3, 16, 16)


@pytest.mark.parametrize("name,ours,ref,x", [
    ("mlp", lambda: fnn.MLP(12, [16, 8], 3), lambda: RefMLP(12, [16, 8], 3), torch.randn(4, 12)),
    ("convblock", lambda: fnn.ConvBlock(3, 8), lambda: RefConvBlock(3, 8), IMG),
    ("cnn", lambda: fnn.CNN(3, 5), lambda: RefCNN(3, 5), IMG),
    ("resnet18", lambda: fnn.ResNet(fnn.ResidualBlock, [2, 2, 2, 2], 7),
     lambda: RefResNet(RefResidualBlock, [2, 2, 2, 2], 7), IMG),
    ("densenet", lambda: fnn.DenseNet(8, (2, 3), 5), lambda: RefDenseNet(8, (2, 3), 5), IMG),
    ("efficientnet", lambda: fnn.EfficientNet(0.5, 0.5, num_classes=5), lambda: RefEfficientNet(0.5, 0.5, num_classes=5),
     IMG),
    ("dwsep", lambda: fnn.DepthwiseSeparableConv(3, 8, 2), lambda: RefDepthwiseSeparableConv(3, 8, 2), IMG),
    ("mobilenet", lambda: fnn.MobileNetV2(5, 0.25), lambda: RefMobileNetV2(5, 0.25), IMG),
    ("mbconv", lambda: fnn.MBConvBlock(3, 3, 5, 1, 4), lambda: RefMBConvBlock(3, 3, 5, 1, 4), IMG),
    ("lenet", lambda: fnn.LeNetPyTorch(10), lambda: RefLeNetPyTorch(10), torch.randn(3, 1, 28, 28)),
])
def test_dropin_matches_guide(name, ours, ref, x):
    torch.manual_seed(1)
    r = ref()
    _randomize_bn(r)
    assert_dropin(ours(), r, x)


def test_resnet50_bottleneck_shapes_and_grad():
    m = fnn.ResNet(fnn.BottleneckBlock, [1, 1, 1, 1], num_classes=4)
    out = m(torch.randn(2, 3, 16, 16))
    assert out.shape == (2, 4)
    out.sum().backward()
    assert m.layer1[0].conv3.weight.grad is not None
    assert m.fc.in_features == 2048


def test_bad_inputs_raise():
    with pytest.raises(ValueError, match="channels"):
        fnn.ResNet(fnn.ResidualBlock, [1, 1, 1, 1])(torch.randn(1, 1, 32, 32))
    with pytest.raises(ValueError, match="'x'"):
        fnn.MLP(4, [8], 2)(torch.randn(3, 5))
    with pytest.raises(ValueError, match="28, 28"):
        fnn.LeNet()(torch.randn(1, 1, 32, 32))
    with pytest.raises(ValueError, match="layers"):
        fnn.ResNet(fnn.ResidualBlock, [1, 1])


@pytest.mark.parametrize("build", [
    lambda: fnn.MLP(8, [16], 3, dropout=0.0),
    lambda: fnn.ResNet(fnn.ResidualBlock, [1, 1, 1, 1], 3),
    lambda: fnn.DenseNet(4, (1, 1), 3),
])
def test_training_lowers_loss(build):
    torch.manual_seed(0)
    m = build()
    if isinstance(m, fnn.MLP):
        x = torch.randn(16, 8)
    else:
        x = torch.randn(4, 3, 16, 16)
    y = torch.randint(0, 3, (x.shape[0],))
    # BatchNorm: judge in train mode (batch statistics) to compare like with like.
    m.train()
    opt = torch.optim.Adam(m.parameters(), lr=1e-2)
    losses = []
    for _ in range(4):
        opt.zero_grad()
        loss = F.cross_entropy(m(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]


@pytest.mark.parametrize("build", [lambda: fnn.MobileNetV2(3, 0.25), lambda: fnn.EfficientNet(0.25, 0.25, 0.0, 3)])
def test_mobile_families_backward(build):
    m = build()
    m(torch.randn(2, 3, 16, 16)).sum().backward()
    grads = [p.grad for p in m.parameters()]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)


def test_lenet_trains():
    m = fnn.LeNet(4)
    x, y = torch.randn(8, 1, 28, 28), torch.randint(0, 4, (8,))
    assert_trains(m, lambda mod: F.cross_entropy(mod.logits(x), y), steps=4)
