"""Vision builders: the standard configurations (parameter counts equal the published ones) and small ones
for tests and demos. ``create_model("resnet50")`` etc.; keyword arguments override the defaults."""

from __future__ import annotations

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
from ..nn.vision import VisionTransformer, ViT
from .registry import register_configs

__all__: list[str] = []

globals().update(register_configs({
    "resnet18": (ResNet, "ResNet-18, 11,689,512 parameters at 1000 classes.",
                 dict(block=ResidualBlock, layers=(2, 2, 2, 2), num_classes=1000)),
    "resnet34": (ResNet, "ResNet-34, 21,797,672 parameters at 1000 classes.",
                 dict(block=ResidualBlock, layers=(3, 4, 6, 3), num_classes=1000)),
    "resnet50": (ResNet, "ResNet-50 (bottleneck blocks), 25,557,032 parameters at 1000 classes.",
                 dict(block=BottleneckBlock, layers=(3, 4, 6, 3), num_classes=1000)),
    "resnet_tiny": (ResNet, "One basic block per stage: a small ResNet for tests.",
                    dict(block=ResidualBlock, layers=(1, 1, 1, 1), num_classes=10)),
    "densenet121": (DenseNet, "DenseNet-121, 7,978,856 parameters at 1000 classes.",
                    dict(growth_rate=32, block_config=(6, 12, 24, 16), num_classes=1000)),
    "densenet_tiny": (DenseNet, "Growth 8, two layers per dense block.",
                      dict(growth_rate=8, block_config=(2, 2, 2, 2), num_classes=10)),
    "mobilenet_v2": (MobileNetV2, "MobileNetV2 1.0, 3,504,872 parameters at 1000 classes.", dict(num_classes=1000)),
    "mobilenet_v2_tiny": (MobileNetV2, "MobileNetV2 at width 0.25.", dict(num_classes=10, width_mult=0.25)),
    **{f"efficientnet_{v}": (EfficientNet, f"EfficientNet-{v.upper()} (width x{w}, depth x{d}, {res}px, "
                                           f"dropout {drop}).",
                             dict(width_mult=w, depth_mult=d, dropout_rate=drop, num_classes=1000))
       for v, (w, d, res, drop) in EFFICIENTNET_PARAMS.items()},
    "vit_b_16": (ViT, "ViT-B/16 at 224px, 86,567,656 parameters at 1000 classes (guide 001's ViT layout).",
                 dict(image_size=224, patch_size=16, embed_dim=768, num_heads=12, num_layers=12, ff_dim=3072)),
    "vit_s_16": (VisionTransformer, "ViT-S/16 at 224px with guide 000's blocks (the benchmark's ViT).",
                 dict(img_size=224, patch_size=16, num_classes=1000, embed_dim=384, depth=12, num_heads=6)),
    "vit_tiny": (VisionTransformer, "A 2-layer ViT on 32x32 images, patch 8, width 32.",
                 dict(img_size=32, patch_size=8, num_classes=10, embed_dim=32, depth=2, num_heads=4, dropout=0.0)),
    "swin_t": (SwinTransformer, "Swin-T (96, [2, 2, 6, 2], window 7), 28,288,354 parameters at 1000 classes.",
               dict(num_classes=1000)),
    "swin_tiny_test": (SwinTransformer, "A 2-stage Swin on 32x32 images (patch 2, window 4) for tests.",
                       dict(patch_size=2, num_classes=10, embed_dim=16, depths=(2, 2), num_heads=(2, 4),
                            window_size=4)),
    "cnn_small": (CNN, "Guide 000's 4-block CNN.", dict(num_classes=10)),
    "lenet": (LeNet, "LeNet-5 for 1x28x28 inputs (guide 002).", dict(num_classes=10)),
    "mlp_tiny": (MLP, "16 -> 32 -> 32 -> 4.", dict(input_dim=16, hidden_dims=(32, 32), output_dim=4)),
}))
