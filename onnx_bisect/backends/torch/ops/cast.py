"""Cast, CastLike and Identity.

A Cast to a floating type goes through the backend's policy (``ctx.dtype``), so a float64
oracle keeps every ``Cast(to=FLOAT)`` in float64. Casts to string, float8, float4 and the
sub-byte integer types have no torch dtype here and are reported as unsupported; ``saturate``
and ``round_mode`` only concern those types, so they are ignored.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import onnx
import torch

from onnx_bisect.backends.torch.context import OpContext
from onnx_bisect.backends.torch.ops.registry import register
from onnx_bisect.errors import BackendError

__all__: list[str] = []

Inputs = list[torch.Tensor | None]


def _convert(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # torch's float -> int conversion truncates toward zero, as C and ONNX do; to bool it
    # tests != 0 (NaN is True). Out-of-range values are undefined in ONNX.
    return t.to(dtype)


def _target(ctx: OpContext, to: Any) -> torch.dtype:
    # Cast-1 named the type as a string ("FLOAT"); later versions use the enum value.
    elem_type = onnx.TensorProto.DataType.Value(to) if isinstance(to, str) else int(to)
    try:
        return ctx.dtype(elem_type)
    except BackendError:
        name = onnx.TensorProto.DataType.Name(elem_type)
        raise BackendError(
            f"Cast to {name} is not supported by the torch backend (torch has no such dtype)"
        ) from None


@register("Cast", since=1)
def cast(ctx: OpContext, x: Inputs, attrs: dict[str, Any]) -> torch.Tensor:
    t = x[0]
    if t is None:
        raise BackendError("Cast needs an input")
    if "to" not in attrs:
        raise BackendError("Cast has no 'to' attribute")
    return _convert(t, _target(ctx, attrs["to"]))


@register("CastLike", since=15)
def cast_like(ctx: OpContext, x: Inputs, attrs: dict[str, Any]) -> torch.Tensor:
    t, like = x[0], x[1]
    if t is None or like is None:
        raise BackendError("CastLike needs both inputs")
    return _convert(t, like.dtype)  # like's dtype is already under the policy


@register("Identity", since=1)
def identity(ctx: OpContext, x: Inputs, attrs: dict[str, Any]) -> Sequence[Any]:
    # A one-element list: a sequence value (Identity-14 accepts them) must stay one output.
    return [x[0]]
