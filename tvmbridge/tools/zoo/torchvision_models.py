"""torchvision's classification models in the zoo, as PyTorch's own benchmark suite keeps them.

The architectures users take from ``torchvision.models`` carry ops the timm and transformers
entries do not: channel shuffles (a view through a transpose), squeeze-excitation with
hard-sigmoid, GoogLeNet's branch concatenations, stochastic depth drawn per sample,
torchvision's shifted-window attention. Built with random weights and 10 classes; the
transformers at a small size (torchvision's own classes, fewer and narrower layers).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .batches import NUM_LABELS


def _small_vit() -> torch.nn.Module:
    from torchvision.models.vision_transformer import VisionTransformer

    return VisionTransformer(
        image_size=64, patch_size=16, num_layers=2, num_heads=2, hidden_dim=32, mlp_dim=64,
        dropout=0.1, attention_dropout=0.1, num_classes=NUM_LABELS,
    )  # fmt: skip


def _small_swin() -> torch.nn.Module:
    from torchvision.models.swin_transformer import SwinTransformer

    return SwinTransformer(
        patch_size=[4, 4], embed_dim=32, depths=[2, 2], num_heads=[2, 4], window_size=[4, 4],
        stochastic_depth_prob=0.1, num_classes=NUM_LABELS,
    )  # fmt: skip


def torchvision_model(name: str, **kwargs: Any) -> Callable[[], torch.nn.Module]:
    """A builder of ``torchvision.models.<name>(num_classes=10, **kwargs)`` (or of the small
    transformers above, ``vit``/``swin``)."""

    def build() -> torch.nn.Module:
        from .models import ensure_torchvision

        ensure_torchvision()
        import torchvision

        small = {"vit": _small_vit, "swin": _small_swin}
        if name in small:
            return small[name]()
        return getattr(torchvision.models, name)(num_classes=NUM_LABELS, **kwargs)

    build.__qualname__ = f"torchvision.{name}"
    return build


SPECS: list[tuple[str, dict[str, Any], str]] = [  # (name, constructor arguments, note)
    ("resnet18", {}, ""),
    ("mobilenet_v2", {}, ""),
    ("mobilenet_v3_small", {}, "hard-swish, squeeze-excitation"),
    ("shufflenet_v2_x0_5", {}, "channel shuffle"),
    ("squeezenet1_1", {}, "ceil-mode pooling, dropout before the classifier convolution"),
    ("mnasnet0_5", {}, ""),
    ("googlenet", {"aux_logits": False, "init_weights": True}, "branch concatenations"),
    ("efficientnet_b0", {}, "stochastic depth per sample"),
    ("regnet_y_400mf", {}, "squeeze-excitation; at 64x64 a float32 step within noise of a ReLU kink"),
    ("convnext_tiny", {}, "layer scale, stochastic depth"),
    ("vit", {}, "torchvision's VisionTransformer, 2 narrow layers"),
    ("swin", {}, "torchvision's SwinTransformer, shifted windows"),
]
