"""Convolutions and matrix products: Conv, ConvTranspose, ConvInteger, MatMul, MatMulInteger,
Gemm, Einsum.

ONNX pads may be asymmetric and ``auto_pad`` derives them from the input size; torch only
pads symmetrically, so uneven pads are applied with ``F.pad`` first. ``explicit_pads`` is
shared with the pooling operators.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from onnx_bisect.backends.torch.context import OpContext, cpu_channels_last
from onnx_bisect.backends.torch.ops.registry import register
from onnx_bisect.backends.torch.ops.shape import need, opt
from onnx_bisect.errors import BackendError

__all__: list[str] = []

_CONV: dict[int, Callable[..., torch.Tensor]] = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}
_CONV_T: dict[int, Callable[..., torch.Tensor]] = {
    1: F.conv_transpose1d,
    2: F.conv_transpose2d,
    3: F.conv_transpose3d,
}


def ints(attrs: dict[str, Any], name: str, default: int, n: int) -> list[int]:
    """An ints attribute with ``n`` entries, ``default`` for each when absent or empty."""
    value = attrs.get(name)
    return [int(v) for v in value] if value else [default] * n


def _split_pad(total: int, auto_pad: str, begin: list[int], end: list[int]) -> None:
    first = total // 2 if auto_pad == "SAME_UPPER" else total - total // 2
    begin.append(first)
    end.append(total - first)


def _given_pads(attrs: dict[str, Any], auto_pad: str, n: int) -> tuple[list[int], list[int]]:
    """VALID, or the ``pads`` attribute as written (NOTSET)."""
    if auto_pad == "VALID":
        return [0] * n, [0] * n
    if auto_pad != "NOTSET":
        raise BackendError(f"auto_pad={auto_pad!r} is not supported")
    pads = ints(attrs, "pads", 0, 2 * n)
    return pads[:n], pads[n:]


def explicit_pads(
    attrs: dict[str, Any],
    sizes: Sequence[int],
    kernel: Sequence[int],
    strides: Sequence[int],
    dilations: Sequence[int],
) -> tuple[list[int], list[int]]:
    """The (begin, end) pads of each spatial axis, ``auto_pad`` resolved."""
    n = len(sizes)
    auto_pad = attrs.get("auto_pad", "NOTSET") or "NOTSET"
    if auto_pad in ("SAME_UPPER", "SAME_LOWER"):
        begin: list[int] = []
        end: list[int] = []
        for size, k, s, d in zip(sizes, kernel, strides, dilations, strict=True):
            out = -(-size // s)
            total = max(0, (out - 1) * s + (k - 1) * d + 1 - size)
            # SAME_UPPER puts the odd pad at the end, SAME_LOWER at the beginning.
            _split_pad(total, auto_pad, begin, end)
        return begin, end
    return _given_pads(attrs, auto_pad, n)


def torch_pad(begin: Sequence[int], end: Sequence[int]) -> list[int]:
    """``F.pad``'s order: the last axis first, (begin, end) for each."""
    out: list[int] = []
    for b, e in zip(reversed(begin), reversed(end), strict=True):
        out += [b, e]
    return out


def _spatial_rank(x: torch.Tensor, op: str) -> int:
    n = x.dim() - 2
    if n not in _CONV:
        raise BackendError(f"{op} over {n} spatial dimensions is not supported")
    return n


def _conv(
    data: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, attrs: dict[str, Any]
) -> torch.Tensor:
    n = _spatial_rank(data, "Conv")
    strides = ints(attrs, "strides", 1, n)
    dilations = ints(attrs, "dilations", 1, n)
    kernel = list(weight.shape[2:])
    begin, end = explicit_pads(attrs, data.shape[2:], kernel, strides, dilations)
    padding: list[int] | int = begin
    if begin != end:
        data, padding = F.pad(data, torch_pad(begin, end)), 0
    group = int(attrs.get("group", 1))
    data, weight = cpu_channels_last(data), cpu_channels_last(weight)
    return _CONV[n](data, weight, bias, strides, padding, dilations, group)


@register("Conv", since=1)
def conv(ctx: OpContext, x: list[torch.Tensor | None], attrs: dict[str, Any]) -> torch.Tensor:
    data, weight = need(x, 0), need(x, 1)
    bias = opt(x, 2)
    return _conv(data, weight, bias, attrs)


@register("ConvInteger", since=10)
def conv_integer(
    ctx: OpContext, x: list[torch.Tensor | None], attrs: dict[str, Any]
) -> torch.Tensor:
    data, weight = need(x, 0), need(x, 1)
    # Exact in float64 for 8-bit operands; MPS has no float64.
    work = torch.float32 if data.device.type == "mps" else torch.float64
    data, weight = data.to(work), weight.to(work)
    x_zero = opt(x, 2)
    w_zero = opt(x, 3)
    if x_zero is not None:
        data = data - x_zero.to(work)
    if w_zero is not None:
        w_zero = w_zero.to(work)
        # A per-output-channel zero point: one per row of the weight.
        weight = weight - w_zero.reshape(-1, *[1] * (weight.dim() - 1))
    return _conv(data, weight, None, attrs).round().to(torch.int32)


def _transpose_pads(
    attrs: dict[str, Any], data: torch.Tensor, full: list[int], out_pad: list[int]
) -> tuple[list[int], list[int]]:
    n = len(full)
    auto_pad = attrs.get("auto_pad", "NOTSET") or "NOTSET"
    output_shape = attrs.get("output_shape")
    if output_shape or auto_pad in ("SAME_UPPER", "SAME_LOWER"):
        strides = ints(attrs, "strides", 1, n)
        sizes = list(data.shape[2:])
        target = (
            [int(v) for v in output_shape][-n:]
            if output_shape
            else [size * s for size, s in zip(sizes, strides, strict=True)]
        )
        begin: list[int] = []
        end: list[int] = []
        for f, p, t in zip(full, out_pad, target, strict=True):
            total = f + p - t
            # ONNX: only SAME_UPPER puts the smaller half first (floor division, as the spec).
            _split_pad(total, auto_pad, begin, end)
        return begin, end
    return _given_pads(attrs, auto_pad, n)


@register("ConvTranspose", since=1)
def conv_transpose(
    ctx: OpContext, x: list[torch.Tensor | None], attrs: dict[str, Any]
) -> torch.Tensor:
    data, weight = need(x, 0), need(x, 1)
    bias = opt(x, 2)
    n = _spatial_rank(data, "ConvTranspose")
    strides = ints(attrs, "strides", 1, n)
    dilations = ints(attrs, "dilations", 1, n)
    out_pad = ints(attrs, "output_padding", 0, n)
    kernel = list(weight.shape[2:])
    sizes = list(data.shape[2:])
    full = [
        s * (i - 1) + (k - 1) * d + 1
        for i, k, s, d in zip(sizes, kernel, strides, dilations, strict=True)
    ]
    begin, end = _transpose_pads(attrs, data, full, out_pad)
    group = int(attrs.get("group", 1))
    y = _CONV_T[n](data, weight, None, strides, 0, 0, group, dilations)
    # Negative F.pad crops: pads cut the full output, output_padding (and a target
    # larger than the full output) extend it with zeros that still receive the bias.
    y = F.pad(y, torch_pad([-b for b in begin], [p - e for p, e in zip(out_pad, end, strict=True)]))
    if bias is not None:
        y = y + bias.reshape(-1, *[1] * n)
    return y


def int_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """An exact integer matrix product in int64 (wrapping as ONNX integers do)."""
    a, b = a.to(torch.int64), b.to(torch.int64)
    if a.device.type == "cpu":
        return torch.matmul(a, b)
    # CUDA and MPS have no integer matmul kernels: a broadcast product summed over K.
    squeeze_a, squeeze_b = a.dim() == 1, b.dim() == 1
    if squeeze_a:
        a = a.unsqueeze(0)
    if squeeze_b:
        b = b.unsqueeze(-1)
    y = (a.unsqueeze(-1) * b.unsqueeze(-3)).sum(-2)
    if squeeze_a:
        y = y.squeeze(-2)
    if squeeze_b:
        y = y.squeeze(-1)
    return y


def _matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    if a.dtype.is_floating_point:
        return torch.matmul(a, b)
    return int_matmul(a, b).to(a.dtype)


@register("MatMul", since=1)
def matmul(ctx: OpContext, x: list[torch.Tensor | None], attrs: dict[str, Any]) -> torch.Tensor:
    a, b = need(x, 0), need(x, 1)
    return _matmul(a, b)


@register("MatMulInteger", since=10)
def matmul_integer(
    ctx: OpContext, x: list[torch.Tensor | None], attrs: dict[str, Any]
) -> torch.Tensor:
    a, b = need(x, 0), need(x, 1)
    a, b = a.to(torch.int64), b.to(torch.int64)
    a_zero = opt(x, 2)
    b_zero = opt(x, 3)
    if a_zero is not None:
        # A 1-D zero point of A has one entry per row (M), so it runs down the rows.
        a_zero = a_zero.to(torch.int64)
        a = a - (a_zero.unsqueeze(-1) if a_zero.dim() == 1 and a.dim() > 1 else a_zero)
    if b_zero is not None:
        b = b - b_zero.to(torch.int64)
    return int_matmul(a, b).to(torch.int32)


@register("Gemm", since=1)
def gemm(ctx: OpContext, x: list[torch.Tensor | None], attrs: dict[str, Any]) -> torch.Tensor:
    a, b = need(x, 0), need(x, 1)
    c = opt(x, 2)
    if attrs.get("transA", 0):
        a = a.transpose(0, 1)
    if attrs.get("transB", 0):
        b = b.transpose(0, 1)
    alpha, beta = float(attrs.get("alpha", 1.0)), float(attrs.get("beta", 1.0))
    dtype = a.dtype
    y = _matmul(a, b)
    if alpha != 1.0:
        y = y * alpha
    # Gemm 1 and 6 broadcast C only when `broadcast` is set; broadcasting always is a superset.
    if c is not None and beta != 0.0:
        y = y + (c * beta if beta != 1.0 else c)
    return y.to(dtype)


def _implicit_output(lhs: str) -> str:
    """ONNX's implicit Einsum output: the letters seen once, in ASCII order."""
    letters = lhs.replace("...", "").replace(",", "")
    once = sorted(c for c in set(letters) if letters.count(c) == 1)
    return ("..." if "..." in lhs else "") + "".join(once)


@register("Einsum", since=12)
def einsum(ctx: OpContext, x: list[torch.Tensor | None], attrs: dict[str, Any]) -> torch.Tensor:
    operands = [t for t in x if t is not None]
    equation = str(attrs["equation"]).replace(" ", "")
    if "->" not in equation:
        equation = f"{equation}->{_implicit_output(equation)}"
    dtype = operands[0].dtype
    if not dtype.is_floating_point and operands[0].device.type != "cpu":
        # No integer bmm on accelerators: float64 is exact below 2**53.
        work = [t.to(torch.float64) for t in operands]
        return torch.einsum(equation, *work).round().to(dtype)
    if not dtype.is_floating_point and dtype != torch.int64:
        return torch.einsum(equation, *[t.to(torch.int64) for t in operands]).to(dtype)
    return torch.einsum(equation, *operands)
