"""Cast, CastLike and Identity.

A Cast to a floating type goes through the backend's policy (``ctx.dtype``), so a float64
oracle keeps every ``Cast(to=FLOAT)`` or ``FLOAT16`` in float64: those are precision choices.
Casts to float8, float4 and the sub-byte integers round onto the type's grid (narrow.py, with
``saturate`` and ``round_mode``) under any policy: they quantize, like QuantizeLinear, and
the onnx.reference oracle and transforms/upcast.py treat them so too. As written the result
travels in the type's carrier; under a policy, in the policy's dtype. A Cast to string is
reported as unsupported.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import onnx
import torch

from onnx_bisect.backends.torch.context import OpContext
from onnx_bisect.backends.torch.narrow import CARRIERS, to_narrow
from onnx_bisect.backends.torch.ops.registry import register
from onnx_bisect.errors import BackendError

__all__: list[str] = []

Inputs = list[torch.Tensor | None]


def _convert(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # torch's float -> int conversion truncates toward zero, as C and ONNX do; to bool it
    # tests != 0 (NaN is True). Out-of-range values are undefined in ONNX.
    return t.to(dtype)


def _elem_type(to: Any) -> int:
    # Cast-1 named the type as a string ("FLOAT"); later versions use the enum value.
    return onnx.TensorProto.DataType.Value(to) if isinstance(to, str) else int(to)


def _cast_to(
    ctx: OpContext, t: torch.Tensor, elem_type: int, attrs: dict[str, Any]
) -> torch.Tensor:
    target = _target(ctx, elem_type)
    if elem_type in CARRIERS:  # under a policy, the grid's values in the policy's dtype
        saturate = bool(attrs.get("saturate", 1))
        narrow = to_narrow(
            t, elem_type, saturate=saturate, round_mode=attrs.get("round_mode", "up")
        )
        return narrow if target == narrow.dtype else _convert(_widened(narrow), target)
    return _convert(_widened(t), target)


def _widened(t: torch.Tensor) -> torch.Tensor:
    # torch converts E8M0 to float32 only.
    return t.to(torch.float32) if t.dtype == torch.float8_e8m0fnu else t


def _target(ctx: OpContext, elem_type: int) -> torch.dtype:
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
    return _cast_to(ctx, t, _elem_type(attrs["to"]), attrs)


@register("CastLike", since=15)
def cast_like(ctx: OpContext, x: Inputs, attrs: dict[str, Any]) -> torch.Tensor:
    t, like = x[0], x[1]
    if t is None or like is None:
        raise BackendError("CastLike needs both inputs")
    declared = ctx.input_type(1)
    if declared in CARRIERS:  # a carrier's dtype does not say which narrow type it carries
        return _cast_to(ctx, t, declared, attrs)
    return _convert(t, like.dtype)  # like's dtype is already under the policy


@register("Identity", since=1)
def identity(ctx: OpContext, x: Inputs, attrs: dict[str, Any]) -> Sequence[Any]:
    # A one-element list: a sequence value (Identity-14 accepts them) must stay one output.
    return [x[0]]
