"""Indexing operators: Gather/GatherElements/GatherND, ScatterElements/ScatterND/Scatter,
NonZero, TopK, ArgMax/ArgMin, OneHot, CumSum, Trilu, Compress, Unique.

ONNX indices may be negative (counting from the end) and int32; torch wants non-negative
int64, so every index input is normalised first. uint16/32/64 data, for which torch has few
kernels, is moved as same-width signed bits and compared through an order-preserving key.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from onnx_bisect.backends.torch.context import OpContext
from onnx_bisect.backends.torch.ops.registry import register
from onnx_bisect.backends.torch.ops.shape import (
    as_bits,
    axis_of,
    from_bits,
    ints,
    need,
    opt,
    order_key,
)
from onnx_bisect.errors import BackendError

__all__: list[str] = []

_Inputs = list[torch.Tensor | None]
_Attrs = dict[str, Any]

_REDUCE = {"add": "sum", "mul": "prod", "max": "amax", "min": "amin"}


def _wrap(index: torch.Tensor, n: int | torch.Tensor) -> torch.Tensor:
    index = index.to(torch.int64)
    return torch.where(index < 0, index + n, index)


# ---------------------------------------------------------------------------------------
# Gather family


@register("Gather", since=1)
def gather(ctx: OpContext, x: _Inputs, attrs: _Attrs) -> torch.Tensor:
    data, index = need(x, 0), need(x, 1)
    axis = axis_of(attrs.get("axis", 0), data.ndim)
    index = _wrap(index, data.shape[axis])
    picked = as_bits(data).index_select(axis, index.reshape(-1))
    shape = (*data.shape[:axis], *index.shape, *data.shape[axis + 1 :])
    return from_bits(picked.reshape(shape), data.dtype)


@register("GatherElements", since=11)
def gather_elements(ctx: OpContext, x: _Inputs, attrs: _Attrs) -> torch.Tensor:
    data, index = need(x, 0), need(x, 1)
    axis = axis_of(attrs.get("axis", 0), data.ndim)
    out = torch.gather(as_bits(data), axis, _wrap(index, data.shape[axis]))
    return from_bits(out, data.dtype)


@register("GatherND", since=11)
def gather_nd(ctx: OpContext, x: _Inputs, attrs: _Attrs) -> torch.Tensor:
    data, index = need(x, 0), need(x, 1)
    b = attrs.get("batch_dims", 0)
    k = index.shape[-1]
    batch = math.prod(data.shape[:b])
    lead = data.shape[b : b + k]
    rest = data.shape[b + k :]
    # One linear index into the k indexed dimensions, per batch.
    dims = torch.tensor(lead, dtype=torch.int64, device=data.device)
    idx = _wrap(index, dims).reshape(batch, -1, k)
    strides = [math.prod(lead[i + 1 :]) for i in range(k)]
    linear = (idx * torch.tensor(strides, dtype=torch.int64, device=data.device)).sum(-1)
    flat = as_bits(data).reshape(batch, math.prod(lead), *rest)
    rows = torch.arange(batch, device=data.device).unsqueeze(1)
    out = flat[rows, linear]
    return from_bits(out.reshape(*index.shape[:-1], *rest), data.dtype)


# ---------------------------------------------------------------------------------------
# Scatter family


def _scatter_elements(
    data: torch.Tensor, index: torch.Tensor, updates: torch.Tensor, axis: int, reduction: str
) -> torch.Tensor:
    axis = axis_of(axis, data.ndim)
    index = _wrap(index, data.shape[axis])
    if reduction == "none":
        out = as_bits(data).scatter(axis, index, as_bits(updates))
        return from_bits(out, data.dtype)
    if reduction not in _REDUCE:
        raise BackendError(f"ScatterElements reduction {reduction!r} is not supported")
    return data.scatter_reduce(axis, index, updates, _REDUCE[reduction], include_self=True)


@register("Scatter", since=9, until=11)
def scatter(ctx: OpContext, x: _Inputs, attrs: _Attrs) -> torch.Tensor:
    return _scatter_elements(need(x, 0), need(x, 1), need(x, 2), attrs.get("axis", 0), "none")


@register("ScatterElements", since=11)
def scatter_elements(ctx: OpContext, x: _Inputs, attrs: _Attrs) -> torch.Tensor:
    reduction = attrs.get("reduction", "none")
    return _scatter_elements(need(x, 0), need(x, 1), need(x, 2), attrs.get("axis", 0), reduction)


@register("ScatterND", since=11)
def scatter_nd(ctx: OpContext, x: _Inputs, attrs: _Attrs) -> torch.Tensor:
    data, index, updates = need(x, 0), need(x, 1), need(x, 2)
    reduction = attrs.get("reduction", "none")
    k = index.shape[-1]
    lead, rest = data.shape[:k], data.shape[k:]
    dims = torch.tensor(lead, dtype=torch.int64, device=data.device)
    strides = [math.prod(lead[i + 1 :]) for i in range(k)]
    strides_t = torch.tensor(strides, dtype=torch.int64, device=data.device)
    linear = (_wrap(index, dims) * strides_t).sum(-1).reshape(-1)
    flat = as_bits(data).reshape(math.prod(lead), *rest).clone()
    rows = as_bits(updates).reshape(-1, *rest)
    if reduction == "none":
        flat.index_copy_(0, linear, rows)
        return from_bits(flat.reshape(data.shape), data.dtype)
    if reduction not in _REDUCE:
        raise BackendError(f"ScatterND reduction {reduction!r} is not supported")
    flat = data.reshape(math.prod(lead), *rest).clone()
    spread = linear.reshape(-1, *([1] * len(rest))).expand_as(rows)
    flat.scatter_reduce_(0, spread, updates.reshape(rows.shape), _REDUCE[reduction])
    return flat.reshape(data.shape)


# ---------------------------------------------------------------------------------------
# NonZero, TopK, ArgMax, ArgMin


@register("NonZero", since=9)
def nonzero(ctx: OpContext, x: _Inputs, attrs: _Attrs) -> torch.Tensor:
    data = need(x, 0)
    if data.ndim == 0:
        data = data.reshape(1)  # numpy treats a scalar as a 1-element vector here
    return torch.nonzero(data != 0).t().contiguous()


def _topk(
    data: torch.Tensor, k: int, axis: int, largest: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    axis = axis_of(axis, data.ndim)
    # A stable sort keeps equal values in index order, which ONNX requires of TopK.
    _, order = torch.sort(order_key(data), dim=axis, descending=largest, stable=True)
    order = order.narrow(axis, 0, k)
    values = from_bits(torch.gather(as_bits(data), axis, order), data.dtype)
    return values, order


@register("TopK", since=1, until=9)
def top_k_1(ctx: OpContext, x: _Inputs, attrs: _Attrs) -> tuple[torch.Tensor, torch.Tensor]:
    return _topk(need(x, 0), attrs["k"], attrs.get("axis", -1), True)


@register("TopK", since=10)
def top_k(ctx: OpContext, x: _Inputs, attrs: _Attrs) -> tuple[torch.Tensor, torch.Tensor]:
    k = ints(need(x, 1))[0]
    largest = bool(attrs.get("largest", 1))
    return _topk(need(x, 0), k, attrs.get("axis", -1), largest)


def _arg(data: torch.Tensor, attrs: _Attrs, largest: bool) -> torch.Tensor:
    axis = axis_of(attrs.get("axis", 0), data.ndim)
    keep = bool(attrs.get("keepdims", 1))
    last = bool(attrs.get("select_last_index", 0))
    key = order_key(data)
    if key.dtype == torch.bool:
        key = key.to(torch.uint8)
    if last:
        key = key.flip(axis)
    out = key.argmax(axis, keepdim=keep) if largest else key.argmin(axis, keepdim=keep)
    # torch returns the first extreme; from the flipped end that is ONNX's last one.
    return data.shape[axis] - 1 - out if last else out


@register("ArgMax", since=1)
def arg_max(ctx: OpContext, x: _Inputs, attrs: _Attrs) -> torch.Tensor:
    return _arg(need(x, 0), attrs, True)


@register("ArgMin", since=1)
def arg_min(ctx: OpContext, x: _Inputs, attrs: _Attrs) -> torch.Tensor:
    return _arg(need(x, 0), attrs, False)


# ---------------------------------------------------------------------------------------
# OneHot, CumSum, Trilu, Compress


@register("OneHot", since=9)
def one_hot(ctx: OpContext, x: _Inputs, attrs: _Attrs) -> torch.Tensor:
    index, depth_t, values = need(x, 0), need(x, 1), need(x, 2)
    depth = int(depth_t.reshape(-1)[0].item())
    axis = axis_of(attrs.get("axis", -1), index.ndim + 1)
    # Float indices truncate; negatives count from depth; anything else out of range is off.
    index = _wrap(index, depth)
    hot = index.unsqueeze(-1) == torch.arange(depth, device=index.device)
    flat = values.reshape(-1)
    out = torch.where(hot, flat[1], flat[0])
    return out.movedim(-1, axis)


def _cumulative(data: torch.Tensor, axis: int, attrs: _Attrs, *, product: bool) -> torch.Tensor:
    """CumSum or CumProd along ``axis``, ``exclusive`` and ``reverse`` as ONNX defines them."""
    # Two's complement sums and products wrap the same way signed or not.
    work = as_bits(data)
    if attrs.get("reverse", 0):
        work = work.flip(axis)
    scan = torch.cumprod if product else torch.cumsum
    out = scan(work, dim=axis, dtype=work.dtype)
    if attrs.get("exclusive", 0):
        n = out.shape[axis]
        first = out.narrow(axis, 0, min(n, 1))
        start = torch.ones_like(first) if product else torch.zeros_like(first)
        out = torch.cat([start, out.narrow(axis, 0, max(n - 1, 0))], dim=axis)
    if attrs.get("reverse", 0):
        out = out.flip(axis)
    return from_bits(out, data.dtype)


@register("CumSum", since=11)
def cum_sum(ctx: OpContext, x: _Inputs, attrs: _Attrs) -> torch.Tensor:
    data = need(x, 0)
    return _cumulative(data, axis_of(ints(need(x, 1))[0], data.ndim), attrs, product=False)


@register("CumProd", since=26)
def cum_prod(ctx: OpContext, x: _Inputs, attrs: _Attrs) -> torch.Tensor:
    data = need(x, 0)
    return _cumulative(data, axis_of(ints(need(x, 1))[0], data.ndim), attrs, product=True)


@register("Trilu", since=14)
def trilu(ctx: OpContext, x: _Inputs, attrs: _Attrs) -> torch.Tensor:
    data = need(x, 0)
    k_t = opt(x, 1)
    k = 0 if k_t is None else ints(k_t)[0]
    work = as_bits(data)
    out = torch.triu(work, k) if attrs.get("upper", 1) else torch.tril(work, k)
    return from_bits(out, data.dtype)


@register("Compress", since=9)
def compress(ctx: OpContext, x: _Inputs, attrs: _Attrs) -> torch.Tensor:
    data, cond = need(x, 0), need(x, 1)
    axis = attrs.get("axis")
    if axis is None:
        data, axis = data.reshape(-1), 0
    axis = axis_of(axis, data.ndim)
    # A condition shorter than the axis selects from the leading slices only.
    picks = torch.nonzero(cond.reshape(-1)).reshape(-1)
    return from_bits(as_bits(data).index_select(axis, picks), data.dtype)


# ---------------------------------------------------------------------------------------
# Unique


@register("Unique", since=11)
def unique(ctx: OpContext, x: _Inputs, attrs: _Attrs) -> list[torch.Tensor]:
    data = need(x, 0)
    axis = attrs.get("axis")
    if axis is None:
        data, dim = data.reshape(-1), 0
    else:
        dim = axis_of(axis, data.ndim)
    values, inverse, counts = torch.unique(
        data,
        sorted=True,
        return_inverse=True,
        return_counts=True,
        dim=None if axis is None else dim,
    )
    inverse = inverse.reshape(-1)
    n = data.shape[dim]
    positions = torch.arange(n, device=data.device)
    first = torch.full((values.shape[dim],), n, dtype=torch.int64, device=data.device)
    first = first.scatter_reduce(0, inverse, positions, "amin")
    if not attrs.get("sorted", 1):
        # ONNX's unsorted order is the order of first occurrence.
        order = torch.argsort(first)
        rank = torch.empty_like(order)
        rank[order] = torch.arange(order.numel(), device=data.device)
        values = values.index_select(dim, order)
        first, counts, inverse = first[order], counts[order], rank[inverse]
    return [values, first, inverse, counts]


@register("ReverseSequence", since=10)
def reverse_sequence(ctx: OpContext, x: _Inputs, attrs: _Attrs) -> torch.Tensor:
    """The first ``sequence_lens[b]`` steps of each batch entry reversed along the time axis."""
    data, lens = need(x, 0), need(x, 1).to(torch.int64)
    batch_axis, time_axis = int(attrs.get("batch_axis", 1)), int(attrs.get("time_axis", 0))
    steps = torch.arange(data.shape[time_axis], device=data.device)
    # (batch, time): where each output step reads from
    source = torch.where(steps < lens[:, None], lens[:, None] - 1 - steps, steps)
    if batch_axis > time_axis:
        source = source.transpose(0, 1)
    shape = [1] * data.dim()
    shape[batch_axis], shape[time_axis] = data.shape[batch_axis], data.shape[time_axis]
    return torch.gather(data, time_axis, source.reshape(shape).expand(data.shape))
