"""Elementwise arithmetic (a seed: the family's helper fills it in)."""

from __future__ import annotations

from typing import Any

import torch

from onnx_bisect.backends.torch.context import OpContext
from onnx_bisect.backends.torch.ops.registry import register

__all__: list[str] = []


@register("Add", since=7)
def add(ctx: OpContext, x: list[torch.Tensor | None], attrs: dict[str, Any]) -> torch.Tensor:
    a, b = x
    assert a is not None and b is not None
    return a + b
