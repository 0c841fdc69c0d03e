"""Vision builders: the standard configurations (parameter counts equal the published ones) and small ones
for tests and demos. ``create_model("resnet50")`` etc.; keyword arguments override the defaults."""

from __future__ import annotations

from typing import Any

from ..nn.cnn import (
    CNN,
    EFFICIENTNET_PARAMS,
    BottleneckBlock,
    DenseNet,
    EfficientNet,
    LeNet,
    MobileNetV2,
    ResidualBlock,
    ResNet,
)
from ..nn.feedforward import MLP
from ..nn.swin import SwinTransformer
from ..nn.vision import VisionTransformer, VisionTransformer001
from .registry import register_model

__all__: list[str] = []


@register_model
def resnet18(num_classes: int = 1000, **kw: Any) -> ResNet:
    """ResNet-18, 11,689,512 parameters at 1000 classes."""
    return ResNet(ResidualBlock, [2, 2, 2, 2], num_classes, **kw)


@register_model
def resnet34(num_classes: int = 1000, **kw: Any) -> ResNet:
    """ResNet-34, 21,797,672 parameters at 1000 classes."""
    return ResNet(ResidualBlock, [3, 4, 6, 3], num_classes, **kw)


@register_model
def resnet50(num_classes: int = 1000, **kw: Any) -> ResNet:
    """ResNet-50 (bottleneck blocks), 25,557,032 parameters at 1000 classes."""
    return ResNet(BottleneckBlock, [3, 4, 6, 3], num_classes, **kw)


@register_model
def resnet_tiny(num_classes: int = 10, **kw: Any) -> ResNet:
    """One basic block per stage: a small ResNet for tests."""
    return ResNet(ResidualBlock, [1, 1, 1, 1], num_classes, **kw)


@register_model
def densenet121(num_classes: int = 1000, **kw: Any) -> DenseNet:
    """DenseNet-121, 7,978,856 parameters at 1000 classes."""
    return DenseNet(32, (6, 12, 24, 16), num_classes, **kw)


@register_model
def densenet_tiny(num_classes: int = 10, **kw: Any) -> DenseNet:
    return DenseNet(8, (2, 2, 2, 2), num_classes, **kw)


@register_model
def mobilenet_v2(num_classes: int = 1000, **kw: Any) -> MobileNetV2:
    """MobileNetV2 1.0, 3,504,872 parameters at 1000 classes."""
    return MobileNetV2(num_classes, **kw)


@register_model
def mobilenet_v2_tiny(num_classes: int = 10, **kw: Any) -> MobileNetV2:
    return MobileNetV2(num_classes, width_mult=0.25, **kw)


def _efficientnet(variant: str):
    w, d, _res, drop = EFFICIENTNET_PARAMS[variant]

    def build(num_classes: int = 1000, **kw: Any) -> EfficientNet:
        kw.setdefault("dropout_rate", drop)
        return EfficientNet(width_mult=w, depth_mult=d, num_classes=num_classes, **kw)

    build.__name__ = f"efficientnet_{variant}"
    build.__doc__ = f"EfficientNet-{variant.upper()} (width x{w}, depth x{d}, {_res}px, dropout {drop})."
    return build


for _v in EFFICIENTNET_PARAMS:
    register_model(_efficientnet(_v))


@register_model
def vit_b_16(num_classes: int = 1000, **kw: Any) -> VisionTransformer001:
    """ViT-B/16 at 224px, 86,567,656 parameters at 1000 classes (guide 001's ViT layout)."""
    cfg: dict[str, Any] = dict(image_size=224, patch_size=16, num_classes=num_classes, embed_dim=768, num_heads=12,
                               num_layers=12, ff_dim=3072)
    cfg.update(kw)
    return VisionTransformer001(**cfg)


@register_model
def vit_s_16(num_classes: int = 1000, **kw: Any) -> VisionTransformer:
    """ViT-S/16 at 224px with guide 000's blocks (the benchmark's ViT)."""
    cfg: dict[str, Any] = dict(img_size=224, patch_size=16, num_classes=num_classes, embed_dim=384, depth=12,
                               num_heads=6)
    cfg.update(kw)
    return VisionTransformer(**cfg)


@register_model
def vit_tiny(num_classes: int = 10, **kw: Any) -> VisionTransformer:
    """A 2-layer ViT on 32x32 images, patch 8, width 32."""
    cfg: dict[str, Any] = dict(img_size=32, patch_size=8, num_classes=num_classes, embed_dim=32, depth=2,
                               num_heads=4, dropout=0.0)
    cfg.update(kw)
    return VisionTransformer(**cfg)


@register_model
def swin_t(num_classes: int = 1000, **kw: Any) -> SwinTransformer:
    """Swin-T (96, [2, 2, 6, 2], window 7), 28,288,354 parameters at 1000 classes."""
    return SwinTransformer(num_classes=num_classes, **kw)


@register_model
def swin_tiny_test(num_classes: int = 10, **kw: Any) -> SwinTransformer:
    """A 2-stage Swin on 32x32 images (patch 2, window 4) for tests."""
    cfg: dict[str, Any] = dict(patch_size=2, num_classes=num_classes, embed_dim=16, depths=(2, 2), num_heads=(2, 4),
                               window_size=4)
    cfg.update(kw)
    return SwinTransformer(**cfg)


@register_model
def cnn_small(num_classes: int = 10, **kw: Any) -> CNN:
    """Guide 000's 4-block CNN."""
    return CNN(num_classes=num_classes, **kw)


@register_model
def lenet(num_classes: int = 10) -> LeNet:
    """LeNet-5 for 1x28x28 inputs (guide 002)."""
    return LeNet(num_classes)


@register_model
def mlp_tiny(input_dim: int = 16, hidden_dims: tuple[int, ...] = (32, 32), output_dim: int = 4, **kw: Any) -> MLP:
    return MLP(input_dim, list(hidden_dims), output_dim, **kw)
