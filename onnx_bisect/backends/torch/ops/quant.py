"""Quantization: QuantizeLinear, DequantizeLinear (per tensor, per axis, blocked; every type
ONNX Runtime runs: 8/16-bit integers, int4/uint4/int2/uint2, float8, float4),
DynamicQuantizeLinear, QLinearMatMul, QLinearConv, and BitCast.

The float arithmetic (``x / scale``, ``(q - zero) * scale``) runs in the scale's dtype
under the policy, so the float64 oracle dequantizes and requantizes in float64; the
quantized values themselves still land on the quantized type's grid (``narrow.to_narrow``
or an integer clamp): a quantized model means those roundings.
"""

from __future__ import annotations

from typing import Any

import onnx
import torch

from onnx_bisect.backends.torch.context import OpContext, onnx_to_torch_dtype
from onnx_bisect.backends.torch.narrow import CARRIERS, INT_RANGES, to_narrow
from onnx_bisect.backends.torch.ops.linear import _conv
from onnx_bisect.backends.torch.ops.registry import register
from onnx_bisect.backends.torch.ops.shape import axis_of, need, opt
from onnx_bisect.errors import BackendError

__all__: list[str] = []

Inputs = list[torch.Tensor | None]
_T = onnx.TensorProto
_BY_DTYPE: dict[torch.dtype, int] = {
    torch.uint8: _T.UINT8, torch.int8: _T.INT8, torch.uint16: _T.UINT16, torch.int16: _T.INT16,
    torch.int32: _T.INT32, torch.float8_e4m3fn: _T.FLOAT8E4M3FN,
    torch.float8_e4m3fnuz: _T.FLOAT8E4M3FNUZ, torch.float8_e5m2: _T.FLOAT8E5M2,
    torch.float8_e5m2fnuz: _T.FLOAT8E5M2FNUZ,
}  # fmt: skip


def _shaped(v: torch.Tensor, like: torch.Tensor, axis: int, block: int) -> torch.Tensor:
    """A scale or zero point made broadcastable to ``like``: a scalar, one value per slice
    along ``axis``, or one per block of ``block`` slices."""
    if v.numel() == 1:
        return v.reshape(())
    axis = axis_of(axis, like.dim())
    if not block:
        dims = [1] * like.dim()
        dims[axis] = v.numel()
        return v.reshape(dims)
    return v.repeat_interleave(block, dim=axis).narrow(axis, 0, like.shape[axis])


def _quantized_type(ctx: OpContext, zero: torch.Tensor | None, attrs: dict[str, Any]) -> int:
    """The output type: the zero point's (as declared, since int4 travels as int8), else
    ``output_dtype``, else uint8."""
    if zero is not None:
        declared = ctx.input_type(2)
        if declared:
            return declared
        if zero.dtype in _BY_DTYPE:
            return _BY_DTYPE[zero.dtype]
    return int(attrs.get("output_dtype", 0)) or _T.UINT8


def quantize(
    scaled: torch.Tensor, zero: torch.Tensor | None, elem_type: int, saturate: bool = True
) -> torch.Tensor:
    """``scaled`` (x / scale) onto the quantized type: rounded half to even, offset by the
    zero point and clamped for integers; rounded onto the grid for float8 and float4."""
    if elem_type in INT_RANGES:
        lo, hi = INT_RANGES[elem_type]
        q = torch.round(scaled)
        if zero is not None:
            q = q + zero.to(q.dtype)
        q = q.clamp(lo, hi).to(torch.int64)
        return q.to(onnx_to_torch_dtype(elem_type))  # int4/int2 in their carriers
    if elem_type in CARRIERS:
        if elem_type == _T.FLOAT4E2M1 and zero is not None:
            scaled = scaled + zero.to(scaled.dtype)
        return to_narrow(scaled, elem_type, saturate=saturate)
    raise BackendError(f"QuantizeLinear to {_T.DataType.Name(elem_type)} is not supported")


def _work(ctx: OpContext, scale: torch.Tensor, attrs: dict[str, Any]) -> torch.dtype:
    precision = int(attrs.get("precision", 0))
    base = ctx.dtype(precision) if precision else scale.dtype
    return torch.promote_types(base, torch.float32)


@register("QuantizeLinear", since=10)
def quantize_linear(ctx: OpContext, x: Inputs, attrs: dict[str, Any]) -> torch.Tensor:
    data, scale, zero = need(x, 0), need(x, 1), opt(x, 2)
    axis, block = int(attrs.get("axis", 1)), int(attrs.get("block_size", 0))
    work = _work(ctx, scale, attrs)
    scaled = data.to(work) / _shaped(scale, data, axis, block).to(work)
    zero_b = None if zero is None else _shaped(_widen(zero), data, axis, block)
    out = quantize(
        scaled, zero_b, _quantized_type(ctx, zero, attrs), bool(attrs.get("saturate", 1))
    )
    return out.to(ctx.floating(out.dtype))


def _widen(t: torch.Tensor) -> torch.Tensor:
    """A quantized tensor's values in a dtype with arithmetic (float8 has none)."""
    if t.dtype.is_floating_point and t.dtype.itemsize == 1:
        return t.to(torch.float32)
    return t if t.dtype.is_floating_point else t.to(torch.int32)


def dequantize(
    q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, work: torch.dtype
) -> torch.Tensor:
    """(q - zero) * scale in ``work`` (scale and zero already broadcastable)."""
    v = _widen(q)
    if zero is not None and not q.dtype.is_floating_point:
        v = v - _widen(zero)
    return v.to(work) * scale.to(work)


@register("DequantizeLinear", since=10)
def dequantize_linear(ctx: OpContext, x: Inputs, attrs: dict[str, Any]) -> torch.Tensor:
    data, scale, zero = need(x, 0), need(x, 1), opt(x, 2)
    axis, block = int(attrs.get("axis", 1)), int(attrs.get("block_size", 0))
    out_type = int(attrs.get("output_dtype", 0))
    dtype = ctx.dtype(out_type) if out_type else scale.dtype
    zero_b = None if zero is None else _shaped(zero, data, axis, block)
    y = dequantize(
        data, _shaped(scale, data, axis, block), zero_b, torch.promote_types(dtype, torch.float32)
    )
    return y.to(dtype)


@register("DynamicQuantizeLinear", since=11)
def dynamic_quantize_linear(
    ctx: OpContext, x: Inputs, attrs: dict[str, Any]
) -> tuple[torch.Tensor, ...]:
    data = need(x, 0)
    # The scale and zero point are float32 arithmetic by the spec (for a float32 input): under
    # the oracle's float64 policy too, else a tie a float32 runtime rounds one way (a Tanh's
    # zero point, -min/scale = 127.5 exactly in float64) shifts every integer by a step.
    declared = ctx.input_type(0)
    exact = declared == _T.DOUBLE or (not declared and ctx.policy is None)
    work = torch.promote_types(data.dtype, torch.float32) if exact else torch.float32
    w = data.to(work)
    hi, lo = w.max().clamp(min=0), w.min().clamp(max=0)
    scale = torch.where(hi == lo, 1.0, hi - lo).to(work) / 255
    zero = torch.round((0 - lo / scale).clamp(0, 255))
    y = (torch.round(w / scale) + zero).clamp(0, 255).to(torch.uint8)
    return y, scale.to(data.dtype), zero.to(torch.uint8)


def _qlinear_inputs(
    x: Inputs, first: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    return need(x, first), need(x, first + 1), opt(x, first + 2)


def _requantize(ctx: OpContext, y: torch.Tensor, x: Inputs, at: int) -> torch.Tensor:
    scale, zero = need(x, at), opt(x, at + 1)
    elem_type = ctx.input_type(at + 1) or (_BY_DTYPE.get(zero.dtype) if zero is not None else 0)
    return quantize(y / scale.to(y.dtype), zero, elem_type or _T.UINT8)


def _per(t: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """A scale or zero point: a scalar as it is, a vector reshaped to ``shape``."""
    return t if t.numel() == 1 else t.reshape(shape)


def _per_opt(t: torch.Tensor | None, shape: tuple[int, ...]) -> torch.Tensor | None:
    return None if t is None else _per(t, shape)


@register("QLinearMatMul", since=10)
def qlinear_matmul(ctx: OpContext, x: Inputs, attrs: dict[str, Any]) -> torch.Tensor:
    a, a_scale, a_zero = _qlinear_inputs(x, 0)
    b, b_scale, b_zero = _qlinear_inputs(x, 3)
    work = torch.promote_types(ctx.floating(a_scale.dtype), torch.float32)
    # a's scale and zero point may be per row, b's per column.
    fa = dequantize(a, _per(a_scale, (-1, 1)), _per_opt(a_zero, (-1, 1)), work)
    fb = dequantize(b, _per(b_scale, (1, -1)), _per_opt(b_zero, (1, -1)), work)
    return _requantize(ctx, torch.matmul(fa, fb), x, 6)


@register("QLinearConv", since=10)
def qlinear_conv(ctx: OpContext, x: Inputs, attrs: dict[str, Any]) -> torch.Tensor:
    data, x_scale, x_zero = _qlinear_inputs(x, 0)
    weight, w_scale, w_zero = _qlinear_inputs(x, 3)
    bias = opt(x, 8)
    work = torch.promote_types(ctx.floating(x_scale.dtype), torch.float32)
    fx = dequantize(data, x_scale, x_zero, work)
    per_channel = (-1, *[1] * (weight.dim() - 1))  # one scale per output channel
    fw = dequantize(weight, _per(w_scale, per_channel), _per_opt(w_zero, per_channel), work)
    fb = None
    if bias is not None:
        fb = bias.to(work) * (x_scale.to(work) * w_scale.to(work)).reshape(-1)
    return _requantize(ctx, _conv(fx, fw, fb, attrs), x, 6)


@register("BitCast", since=26)
def bit_cast(ctx: OpContext, x: Inputs, attrs: dict[str, Any]) -> torch.Tensor:
    data = need(x, 0)
    exact = onnx_to_torch_dtype(int(attrs["to"]))
    if data.dtype.is_floating_point and data.dtype.itemsize != exact.itemsize:
        # Under the float64 policy a float32 tensor is float64: the bits are float32's.
        data = data.to({2: torch.float16, 4: torch.float32, 8: torch.float64}[exact.itemsize])
    out = data.view(exact)
    return out.to(ctx.floating(out.dtype))
