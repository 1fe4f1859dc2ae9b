"""ONNX Runtime's com.microsoft integer kernels as what they stand for: the weights dequantized,
then the float operation (DynamicQuantizeLSTM, DynamicQuantizeMatMul, MatMulIntegerToFloat).

These are not bit-exact emulations of ONNX Runtime: its DynamicQuantizeLSTM, for one,
quantizes the activations to uint8 at every step, which costs a 7e-3 error on a real model.
What the float64 oracle needs is the value the quantized model means (the float operation on
the dequantized weights, at the policy's precision), against which ONNX Runtime's kernel and
another runtime's are both measured: the side nearer to it is the more exact one.
"""

from __future__ import annotations

from typing import Any

import torch

from onnx_bisect.backends.torch.context import OpContext
from onnx_bisect.backends.torch.ops.registry import register
from onnx_bisect.backends.torch.ops.rnn import lstm
from onnx_bisect.backends.torch.ops.shape import need, opt

__all__: list[str] = []

Inputs = list[torch.Tensor | None]
MS = "com.microsoft"


def _work(ctx: OpContext, like: torch.Tensor) -> torch.dtype:
    """The float type the operation computes in: the policy's, else the scale's (float32+)."""
    return torch.promote_types(ctx.floating(like.dtype), torch.float32)


def _dequantized(
    q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, shape: tuple[int, ...]
) -> torch.Tensor:
    """``(q - zero) * scale``, the scale and zero point reshaped to ``shape`` unless scalars."""
    work = scale.dtype
    s = scale if scale.numel() == 1 else scale.reshape(shape)
    v = q.to(work)
    if zero is not None:
        v = v - (zero if zero.numel() == 1 else zero.reshape(shape)).to(work)
    return v * s


@register("DynamicQuantizeLSTM", since=1, domain=MS)
def dynamic_quantize_lstm(ctx: OpContext, x: Inputs, attrs: dict[str, Any]) -> Any:
    """W [dirs, input, 4H] and R [dirs, H, 4H] in int8 with a scale and zero point per
    direction or per direction and gate column (inputs 8-11): an ONNX LSTM on their dequantized
    values, transposed to its [dirs, 4H, ...] layout."""
    w_scale, r_scale = need(x, 8), need(x, 10)
    work = _work(ctx, w_scale)

    def weight(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None) -> torch.Tensor:
        shape = (q.shape[0], 1, -1)  # per direction, or per direction and output column
        return _dequantized(q, scale.to(work), zero, shape).transpose(1, 2)

    w = weight(need(x, 1), w_scale, opt(x, 9))
    r = weight(need(x, 2), r_scale, opt(x, 11))
    floats = [need(x, 0).to(work), w, r, *[None if t is None else _float(t, work) for t in x[3:8]]]
    return lstm(ctx, floats, {k: v for k, v in attrs.items() if k != "layout"})


def _float(t: torch.Tensor, work: torch.dtype) -> torch.Tensor:
    return t.to(work) if t.dtype.is_floating_point else t  # sequence_lens stays an integer


@register("DynamicQuantizeMatMul", since=1, domain=MS)
def dynamic_quantize_matmul(ctx: OpContext, x: Inputs, attrs: dict[str, Any]) -> torch.Tensor:
    """A (float) × B (int8/uint8, a scale and zero point per tensor or per column) + bias."""
    a, b, b_scale = need(x, 0), need(x, 1), need(x, 2)
    work = _work(ctx, b_scale)
    fb = _dequantized(b, b_scale.to(work), opt(x, 3), (1, -1))
    y = torch.matmul(a.to(work), fb)
    bias = opt(x, 4)
    return (y if bias is None else y + bias.to(work)).to(ctx.floating(a.dtype))


@register("MatMulIntegerToFloat", since=1, domain=MS)
def matmul_integer_to_float(ctx: OpContext, x: Inputs, attrs: dict[str, Any]) -> torch.Tensor:
    """A and B integers, each with its scale and zero point (A's per tensor or per row, B's per
    tensor or per column), multiplied in float, plus an optional bias."""
    a, b, a_scale, b_scale = need(x, 0), need(x, 1), need(x, 2), need(x, 3)
    work = _work(ctx, a_scale)
    fa = _dequantized(a, a_scale.to(work), opt(x, 4), (-1, 1))
    fb = _dequantized(b, b_scale.to(work), opt(x, 5), (1, -1))
    y = torch.matmul(fa, fb)
    bias = opt(x, 6)
    return (y if bias is None else y + bias.to(work)).to(ctx.floating(a_scale.dtype))
