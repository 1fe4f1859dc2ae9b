"""Shape and layout operators: Reshape, Flatten, Transpose, Squeeze/Unsqueeze, Concat, Split,
Slice, Expand, Tile, Pad, Shape, Size, DepthToSpace, SpaceToDepth.

Most of them only move data, so they work on every dtype torch can hold; shape arguments
that ONNX passes as tensors are read into Python (they decide output shapes, which torch
needs on the host anyway). The helpers at the top are shared with indexing.py and
generate.py.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from onnx_bisect.backends.torch.context import OpContext
from onnx_bisect.backends.torch.ops.registry import register
from onnx_bisect.errors import BackendError

__all__: list[str] = []

_Inputs = list[torch.Tensor | None]
_Attrs = dict[str, Any]

# torch has few kernels for uint16/32/64; a same-width signed view moves the same bits.
_SIGNED = {torch.uint16: torch.int16, torch.uint32: torch.int32, torch.uint64: torch.int64}


def need(x: _Inputs, i: int) -> torch.Tensor:
    """Input ``i``, which the operator requires."""
    t = x[i] if i < len(x) else None
    if t is None:
        raise BackendError(f"required input {i} is missing")
    return t


def opt(x: _Inputs, i: int) -> torch.Tensor | None:
    """Optional input ``i`` (absent or omitted: None)."""
    return x[i] if i < len(x) else None


def ints(t: torch.Tensor) -> list[int]:
    """A shape/index tensor as Python ints (any rank, flattened)."""
    return [int(v) for v in t.reshape(-1).tolist()]


def axis_of(axis: int, rank: int) -> int:
    """A possibly negative axis as a positive one."""
    if not -rank <= axis < max(rank, 1):
        raise BackendError(f"axis {axis} is out of range for rank {rank}")
    return axis + rank if axis < 0 else axis


def as_bits(t: torch.Tensor) -> torch.Tensor:
    """Unsigned wide ints as signed ones of the same width (for data movement only)."""
    signed = _SIGNED.get(t.dtype)
    return t if signed is None else t.view(signed)


def from_bits(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Undoes ``as_bits``."""
    return t.view(dtype) if dtype in _SIGNED else t


def order_key(t: torch.Tensor) -> torch.Tensor:
    """A tensor that compares like ``t`` on which torch has comparison kernels."""
    if t.dtype in (torch.uint16, torch.uint32):
        return t.to(torch.int64)
    if t.dtype == torch.uint64:
        # Flipping the sign bit maps unsigned order onto signed order.
        return t.view(torch.int64) ^ torch.iinfo(torch.int64).min
    return t


def _index(axis: int, index: Any) -> tuple[Any, ...]:
    return (slice(None),) * axis + (index,)


# ---------------------------------------------------------------------------------------
# Reshape, Flatten, Transpose, Squeeze, Unsqueeze


def _reshape(data: torch.Tensor, shape: Sequence[int], allowzero: bool) -> torch.Tensor:
    # 0 copies the input's dimension at the same position unless allowzero says it is 0.
    dims = [d if d != 0 or allowzero else data.shape[i] for i, d in enumerate(shape)]
    return data.reshape(dims)


@register("Reshape", since=1, until=4)
def reshape_1(ctx: OpContext, x: _Inputs, attrs: _Attrs) -> torch.Tensor:
    return _reshape(need(x, 0), attrs["shape"], False)


@register("Reshape", since=5)
def reshape(ctx: OpContext, x: _Inputs, attrs: _Attrs) -> torch.Tensor:
    return _reshape(need(x, 0), ints(need(x, 1)), bool(attrs.get("allowzero", 0)))


@register("Flatten", since=1)
def flatten(ctx: OpContext, x: _Inputs, attrs: _Attrs) -> torch.Tensor:
    data = need(x, 0)
    axis = attrs.get("axis", 1)
    axis = axis + data.ndim if axis < 0 else axis
    return data.reshape(math.prod(data.shape[:axis]), math.prod(data.shape[axis:]))


@register("Transpose", since=1)
def transpose(ctx: OpContext, x: _Inputs, attrs: _Attrs) -> torch.Tensor:
    data = need(x, 0)
    perm = attrs.get("perm") or list(reversed(range(data.ndim)))
    return data.permute(*perm)


def _squeeze(data: torch.Tensor, axes: list[int] | None) -> torch.Tensor:
    if axes is None:
        return data.squeeze()
    dims = tuple(axis_of(a, data.ndim) for a in axes)
    if any(data.shape[d] != 1 for d in dims):
        raise BackendError(f"Squeeze: axes {axes} of shape {tuple(data.shape)} are not all 1")
    return data.squeeze(dims)


def _unsqueeze(data: torch.Tensor, axes: list[int]) -> torch.Tensor:
    # Axes index the output, so they are normalised against the output rank.
    rank = data.ndim + len(axes)
    out = data
    for a in sorted(axis_of(a, rank) for a in axes):
        out = out.unsqueeze(a)
    return out


@register("Squeeze", since=1, until=12)
def squeeze_1(ctx: OpContext, x: _Inputs, attrs: _Attrs) -> torch.Tensor:
    return _squeeze(need(x, 0), attrs.get("axes"))


@register("Squeeze", since=13)
def squeeze(ctx: OpContext, x: _Inputs, attrs: _Attrs) -> torch.Tensor:
    axes = opt(x, 1)
    return _squeeze(need(x, 0), None if axes is None else ints(axes))


@register("Unsqueeze", since=1, until=12)
def unsqueeze_1(ctx: OpContext, x: _Inputs, attrs: _Attrs) -> torch.Tensor:
    return _unsqueeze(need(x, 0), list(attrs["axes"]))


@register("Unsqueeze", since=13)
def unsqueeze(ctx: OpContext, x: _Inputs, attrs: _Attrs) -> torch.Tensor:
    return _unsqueeze(need(x, 0), ints(need(x, 1)))


# ---------------------------------------------------------------------------------------
# Concat, Split


@register("Concat", since=1)
def concat(ctx: OpContext, x: _Inputs, attrs: _Attrs) -> torch.Tensor:
    parts = [t for t in x if t is not None]
    axis = axis_of(attrs.get("axis", 1), parts[0].ndim)
    return torch.cat(parts, dim=axis)


def _split(
    data: torch.Tensor, axis: int, sizes: list[int] | None, count: int | None
) -> list[torch.Tensor]:
    axis = axis_of(axis, data.ndim)
    n = data.shape[axis]
    if sizes is None:
        assert count is not None
        # ONNX: equal chunks of ceil(n / count), the last one smaller.
        chunk = -(-n // count)
        sizes = [max(min(chunk, n - i * chunk), 0) for i in range(count)]
    if sum(sizes) != n:
        raise BackendError(f"Split: sizes {sizes} do not add up to dimension {n}")
    return list(torch.split(data, sizes, dim=axis))


@register("Split", since=1, until=12)
def split_1(ctx: OpContext, x: _Inputs, attrs: _Attrs) -> list[torch.Tensor]:
    # Split-1 could also take the sizes as a second input.
    sizes = attrs.get("split")
    second = opt(x, 1)
    if sizes is None and second is not None:
        sizes = ints(second)
    return _split(need(x, 0), attrs.get("axis", 0), sizes and list(sizes), ctx.num_outputs)


@register("Split", since=13)
def split(ctx: OpContext, x: _Inputs, attrs: _Attrs) -> list[torch.Tensor]:
    second = opt(x, 1)
    sizes = None if second is None else ints(second)
    # Without sizes or num_outputs, the node's own output count splits it evenly.
    count = attrs.get("num_outputs", ctx.num_outputs)
    return _split(need(x, 0), attrs.get("axis", 0), sizes, count)


# ---------------------------------------------------------------------------------------
# Slice


def _slice(
    ctx: OpContext,
    data: torch.Tensor,
    starts: list[int],
    ends: list[int],
    axes: list[int] | None,
    steps: list[int] | None,
) -> torch.Tensor:
    axes = axes if axes is not None else list(range(len(starts)))
    steps = steps if steps is not None else [1] * len(starts)
    out = data
    for start, end, axis, step in zip(starts, ends, axes, steps, strict=True):
        axis = axis_of(axis, data.ndim)
        n = out.shape[axis]
        start += n if start < 0 else 0
        end += n if end < 0 else 0
        if step > 0:
            start, end = min(max(start, 0), n), min(max(end, 0), n)
            out = out[_index(axis, slice(start, end, step))]
        elif step < 0:
            # torch has no negative-step slicing: select the indices ONNX walks.
            start, end = min(max(start, 0), n - 1), min(max(end, -1), n - 1)
            end = min(end, start)  # empty, which arange only accepts in step order
            picks = torch.arange(start, end, step, device=out.device)
            out = out.index_select(axis, picks)
        else:
            raise BackendError("Slice: a step of 0 is invalid")
    return out


@register("Slice", since=1, until=9)
def slice_1(ctx: OpContext, x: _Inputs, attrs: _Attrs) -> torch.Tensor:
    axes = attrs.get("axes")
    return _slice(ctx, need(x, 0), attrs["starts"], attrs["ends"], axes and list(axes), None)


@register("Slice", since=10)
def slice_(ctx: OpContext, x: _Inputs, attrs: _Attrs) -> torch.Tensor:
    axes, steps = opt(x, 3), opt(x, 4)
    return _slice(
        ctx,
        need(x, 0),
        ints(need(x, 1)),
        ints(need(x, 2)),
        None if axes is None else ints(axes),
        None if steps is None else ints(steps),
    )


# ---------------------------------------------------------------------------------------
# Expand, Tile


@register("Expand", since=8)
def expand(ctx: OpContext, x: _Inputs, attrs: _Attrs) -> torch.Tensor:
    data = need(x, 0)
    # Bidirectional: a 1 in `shape` keeps the input's dimension.
    want = ints(need(x, 1))
    have = list(data.shape)
    rank = max(len(want), len(have))
    want, have = [1] * (rank - len(want)) + want, [1] * (rank - len(have)) + have
    shape = [h if w == 1 else w for h, w in zip(have, want, strict=True)]
    if any(h not in (1, s) for h, s in zip(have, shape, strict=True)):
        raise BackendError(f"Expand: shape {want} does not broadcast with {tuple(data.shape)}")
    return data.expand(shape)


@register("Tile", since=6)
def tile(ctx: OpContext, x: _Inputs, attrs: _Attrs) -> torch.Tensor:
    data = need(x, 0)
    return from_bits(as_bits(data).repeat(ints(need(x, 1))), data.dtype)


# ---------------------------------------------------------------------------------------
# Pad


def _pad_index(j: torch.Tensor, n: int, mode: str) -> torch.Tensor:
    if mode == "edge":
        return j.clamp(0, n - 1)
    if mode == "wrap":
        return j.remainder(n)
    if mode == "reflect":
        if n == 1:
            return torch.zeros_like(j)
        period = 2 * (n - 1)
        m = j.remainder(period)
        return torch.where(m < n, m, period - m)
    raise BackendError(f"Pad mode {mode!r} is not supported by the torch backend")


def _pad(
    data: torch.Tensor,
    pads: list[int],
    mode: str,
    value: torch.Tensor | None,
    axes: list[int] | None = None,
) -> torch.Tensor:
    dims = [axis_of(a, data.ndim) for a in axes] if axes is not None else list(range(data.ndim))
    k = len(dims)
    if len(pads) != 2 * k:
        raise BackendError(f"Pad: {len(pads)} pads for {k} axes")
    out = data
    # Negative pads crop.
    for i, d in enumerate(dims):
        lo, hi = max(-pads[i], 0), max(-pads[k + i], 0)
        if lo or hi:
            out = out.narrow(d, lo, out.shape[d] - lo - hi)
    grow = {d: (max(pads[i], 0), max(pads[k + i], 0)) for i, d in enumerate(dims)}
    grow = {d: p for d, p in grow.items() if p != (0, 0)}
    if not grow:
        return out
    if mode == "constant":
        shape = [n + sum(grow.get(d, (0, 0))) for d, n in enumerate(out.shape)]
        fill = torch.zeros((), dtype=out.dtype, device=out.device)
        if value is not None and value.numel():
            fill = value.reshape(-1)[0].to(out.dtype)
        result = fill.expand(shape).contiguous()
        where = tuple(
            slice(grow.get(d, (0, 0))[0], grow.get(d, (0, 0))[0] + n)
            for d, n in enumerate(out.shape)
        )
        result[where] = out
        return result
    for d, (lo, hi) in grow.items():
        n = out.shape[d]
        j = torch.arange(-lo, n + hi, device=out.device)
        out = out.index_select(d, _pad_index(j, n, mode))
    return out


@register("Pad", since=1, until=10)
def pad_1(ctx: OpContext, x: _Inputs, attrs: _Attrs) -> torch.Tensor:
    data = need(x, 0)
    pads = list(attrs["pads"] if "pads" in attrs else attrs["paddings"])
    value = torch.tensor(attrs.get("value", 0.0), device=data.device)
    return _pad(data, pads, attrs.get("mode", "constant"), value)


@register("Pad", since=11)
def pad(ctx: OpContext, x: _Inputs, attrs: _Attrs) -> torch.Tensor:
    axes = opt(x, 3)
    return _pad(
        need(x, 0),
        ints(need(x, 1)),
        attrs.get("mode", "constant"),
        opt(x, 2),
        None if axes is None else ints(axes),
    )


# ---------------------------------------------------------------------------------------
# Shape, Size


@register("Shape", since=1)
def shape(ctx: OpContext, x: _Inputs, attrs: _Attrs) -> torch.Tensor:
    dims = list(need(x, 0).shape)
    rank = len(dims)
    # start/end (Shape-15) are clamped to [0, rank] after adding rank to negatives.
    start, end = attrs.get("start", 0), attrs.get("end", rank)
    start = min(max(start + rank if start < 0 else start, 0), rank)
    end = min(max(end + rank if end < 0 else end, 0), rank)
    return torch.tensor(dims[start:end], dtype=torch.int64, device=ctx.device)


@register("Size", since=1)
def size(ctx: OpContext, x: _Inputs, attrs: _Attrs) -> torch.Tensor:
    return torch.tensor(need(x, 0).numel(), dtype=torch.int64, device=ctx.device)


# ---------------------------------------------------------------------------------------
# DepthToSpace, SpaceToDepth


@register("DepthToSpace", since=1)
def depth_to_space(ctx: OpContext, x: _Inputs, attrs: _Attrs) -> torch.Tensor:
    data = need(x, 0)
    b, c, h, w = data.shape
    bs, mode = attrs["blocksize"], attrs.get("mode", "DCR")
    if mode == "DCR":
        tmp = data.reshape(b, bs, bs, c // (bs * bs), h, w).permute(0, 3, 4, 1, 5, 2)
    elif mode == "CRD":
        tmp = data.reshape(b, c // (bs * bs), bs, bs, h, w).permute(0, 1, 4, 2, 5, 3)
    else:
        raise BackendError(f"DepthToSpace mode {mode!r} is not supported")
    return tmp.reshape(b, c // (bs * bs), h * bs, w * bs)


@register("SpaceToDepth", since=1)
def space_to_depth(ctx: OpContext, x: _Inputs, attrs: _Attrs) -> torch.Tensor:
    data = need(x, 0)
    b, c, h, w = data.shape
    bs, mode = attrs["blocksize"], attrs.get("mode", "DCR")
    tmp = data.reshape(b, c, h // bs, bs, w // bs, bs)
    if mode == "DCR":
        tmp = tmp.permute(0, 3, 5, 1, 2, 4)
    elif mode == "CRD":
        tmp = tmp.permute(0, 1, 3, 5, 2, 4)
    else:
        raise BackendError(f"SpaceToDepth mode {mode!r} is not supported")
    return tmp.reshape(b, c * bs * bs, h // bs, w // bs)
