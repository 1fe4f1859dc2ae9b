"""ONNX Runtime's com.microsoft integer kernels as what they stand for: the weights dequantized,
then the float operation (DynamicQuantizeLSTM, DynamicQuantizeMatMul, MatMulIntegerToFloat,
and the weight-only MatMulNBits and GatherBlockQuantized of int4 LLMs).

These are not bit-exact emulations of ONNX Runtime: its DynamicQuantizeLSTM, for one,
quantizes the activations to uint8 at every step, which costs a 7e-3 error on a real model.
What the float64 oracle needs is the value the quantized model means (the float operation on
the dequantized weights, at the policy's precision), against which ONNX Runtime's kernel and
another runtime's are both measured: the side nearer to it is the more exact one.
"""

from __future__ import annotations

from typing import Any

import onnx
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


def _unpacked(q: torch.Tensor, bits: int) -> torch.Tensor:
    """Bytes packing ``8 // bits`` values each, low bits first, as one value per element
    along the last axis (int32)."""
    v = q.to(torch.int32)
    if bits == 8:
        return v
    shifts = torch.arange(0, 8, bits, dtype=torch.int32, device=q.device)
    v = (v.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    return v.reshape(*q.shape[:-1], q.shape[-1] * (8 // bits))


@register("MatMulNBits", since=1, domain=MS)
def matmul_nbits(ctx: OpContext, x: Inputs, attrs: dict[str, Any]) -> torch.Tensor:
    """A [..., K] × B (N rows of K ``bits``-wide integers packed in blocks of ``block_size``,
    a scale per block; zero points packed the same way, or floats, or absent: the middle of
    the range), transposed, plus an optional bias. ``g_idx`` maps each of the K rows to its
    block; ``accuracy_level`` (the kernel's quantized activations) is not emulated: this is
    the float product the int4 weights mean."""
    a, b, scales = need(x, 0), need(x, 1), need(x, 2)
    k, n, bits = int(attrs["K"]), int(attrs["N"]), int(attrs.get("bits", 4))
    block = int(attrs["block_size"])
    blocks = -(-k // block)
    work = _work(ctx, scales)
    q = _unpacked(b.reshape(n, blocks, -1), bits).reshape(n, -1)[:, :k].to(work)
    s = scales.to(work).reshape(n, blocks)
    zp = opt(x, 3)
    if zp is None:
        z = torch.full_like(s, float(1 << (bits - 1)))
    elif zp.dtype.is_floating_point:
        z = zp.to(work).reshape(n, blocks)
    else:
        z = _unpacked(zp.reshape(n, -1), bits)[:, :blocks].to(work)
    g_idx = opt(x, 4)
    at = (
        g_idx.to(torch.int64).reshape(-1)
        if g_idx is not None
        else torch.arange(k, device=q.device) // block
    )
    w = (q - z[:, at]) * s[:, at]  # [N, K]
    y = torch.matmul(a.to(work), w.transpose(0, 1))
    bias = opt(x, 5)
    return (y if bias is None else y + bias.to(work)).to(ctx.floating(a.dtype))


@register("GatherBlockQuantized", since=1, domain=MS)
def gather_block_quantized(ctx: OpContext, x: Inputs, attrs: dict[str, Any]) -> torch.Tensor:
    """Gather from ``data`` dequantized blockwise along ``quantize_axis`` (int4/uint4 data, or
    uint8 packing ``bits``-wide values along its last axis; zero points alike, absent: 0 for
    int4, the middle of the range otherwise), in the scales' type."""
    data, indices, scales = need(x, 0), need(x, 1), need(x, 2)
    block = int(attrs.get("block_size", 128))
    bits = int(attrs.get("bits", 4))
    kind = ctx.input_type(0)
    packed = kind == onnx.TensorProto.UINT8 and bits < 8
    q = _unpacked(data, bits) if packed else data.to(torch.int32)
    axis = int(attrs.get("quantize_axis", 1)) % q.dim()
    gather = int(attrs.get("gather_axis", 0)) % q.dim()
    work = _work(ctx, scales)
    size = q.shape[axis]
    s = scales.to(work).repeat_interleave(block, dim=axis).narrow(axis, 0, size)
    zp = opt(x, 3)
    if zp is None:
        signed = kind == onnx.TensorProto.INT4 or (not kind and data.dtype == torch.int8)
        z: torch.Tensor | float = 0.0 if signed else float(1 << (bits - 1))
    else:
        zq = _unpacked(zp, bits) if packed else zp.to(torch.int32)
        z = zq.to(work).repeat_interleave(block, dim=axis).narrow(axis, 0, size)
    w = (q.to(work) - z) * s
    at = indices.to(torch.int64)
    at = torch.where(at < 0, at + w.shape[gather], at)
    y = torch.index_select(w, gather, at.reshape(-1))
    shape = (*w.shape[:gather], *at.shape, *w.shape[gather + 1 :])
    return y.reshape(shape).to(ctx.floating(scales.dtype))
