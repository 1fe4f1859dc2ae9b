"""The ``ai.onnx.ml`` operators that are plain tensor maths: Binarizer and
ArrayFeatureExtractor (the classical-ML converters' glue around a model)."""

from __future__ import annotations

from typing import Any

import torch

from onnx_bisect.backends.torch.context import OpContext
from onnx_bisect.backends.torch.ops.registry import register
from onnx_bisect.backends.torch.ops.shape import need

__all__: list[str] = []

Inputs = list[torch.Tensor | None]
_ML = "ai.onnx.ml"


@register("Binarizer", since=1, domain=_ML)
def binarizer(ctx: OpContext, x: Inputs, attrs: dict[str, Any]) -> torch.Tensor:
    data = need(x, 0)
    return (data > float(attrs.get("threshold", 0.0))).to(data.dtype)


@register("ArrayFeatureExtractor", since=1, domain=_ML)
def array_feature_extractor(ctx: OpContext, x: Inputs, attrs: dict[str, Any]) -> torch.Tensor:
    """The last axis's entries at ``indices`` (flattened); a vector gives one row, as ONNX
    Runtime does."""
    data, indices = need(x, 0), need(x, 1).reshape(-1).to(torch.int64)
    picked = data[..., indices]
    return picked.reshape(1, -1) if data.dim() == 1 else picked
