"""Reductions: ReduceSum, ReduceMean, ReduceMax, ReduceMin, ReduceProd, ReduceL1, ReduceL2,
ReduceLogSum, ReduceLogSumExp, ReduceSumSquare.

``axes`` moved from an attribute to an optional input (ReduceSum at 13, the others at 18),
which also brought ``noop_with_empty_axes``. Reducing over no axes is the reduction of one
element: the identity for Sum/Max/..., but ``|x|`` for L1/L2 and ``x*x`` for SumSquare (as
ONNX's reference). Reducing an empty set gives the reduction's identity (0, 1, -inf, +inf).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from onnx_bisect.backends.torch.context import OpContext
from onnx_bisect.backends.torch.ops.registry import OpFn, register

__all__: list[str] = []

# (tensor, axes (non-empty, ascending, non-negative), keepdims) -> the reduction
Reducer = Callable[[torch.Tensor, list[int], bool], torch.Tensor]

# torch's reductions lack these; int64 holds their values (uint64 wraps, as it would anyway).
_WIDEN = {torch.uint16, torch.uint32, torch.uint64}


def _floating(t: torch.Tensor) -> torch.Tensor:
    """Integers for the logarithmic and root reductions: computed in float64, cast back."""
    return t if t.dtype.is_floating_point else t.to(torch.float64)


def _sum(t: torch.Tensor, axes: list[int], keep: bool) -> torch.Tensor:
    return t.sum(dim=axes, keepdim=keep, dtype=t.dtype)


def _mean(t: torch.Tensor, axes: list[int], keep: bool) -> torch.Tensor:
    if t.dtype.is_floating_point:
        return t.mean(dim=axes, keepdim=keep)
    count = 1
    for a in axes:
        count *= t.shape[a]
    total = t.sum(dim=axes, keepdim=keep, dtype=torch.int64)
    return torch.div(total, max(count, 1), rounding_mode="trunc")


def _extreme(largest: bool) -> Reducer:
    def reduce(t: torch.Tensor, axes: list[int], keep: bool) -> torch.Tensor:
        if any(t.shape[a] == 0 for a in axes):
            # torch refuses an empty max/min; ONNX gives the identity of the reduction.
            shape = [1 if i in axes else n for i, n in enumerate(t.shape) if keep or i not in axes]
            if t.dtype == torch.bool:
                fill: float | bool = not largest
            elif t.dtype.is_floating_point:
                fill = float("-inf") if largest else float("inf")
            else:
                info = torch.iinfo(t.dtype)
                fill = info.min if largest else info.max
            return torch.full(shape, fill, dtype=t.dtype, device=t.device)
        if t.dtype == torch.bool:
            return t.any(dim=axes, keepdim=keep) if largest else t.all(dim=axes, keepdim=keep)
        return t.amax(dim=axes, keepdim=keep) if largest else t.amin(dim=axes, keepdim=keep)

    return reduce


def _prod(t: torch.Tensor, axes: list[int], keep: bool) -> torch.Tensor:
    # torch.prod takes one axis at a time; from the last, so the others keep their index.
    for a in reversed(axes):
        t = t.prod(dim=a, keepdim=keep, dtype=t.dtype)
    return t


def _l1(t: torch.Tensor, axes: list[int], keep: bool) -> torch.Tensor:
    return _sum(t.abs(), axes, keep)


def _l2(t: torch.Tensor, axes: list[int], keep: bool) -> torch.Tensor:
    w = _floating(t)
    return _sum(w * w, axes, keep).sqrt().to(t.dtype)


def _log_sum(t: torch.Tensor, axes: list[int], keep: bool) -> torch.Tensor:
    return _sum(_floating(t), axes, keep).log().to(t.dtype)


def _log_sum_exp(t: torch.Tensor, axes: list[int], keep: bool) -> torch.Tensor:
    return torch.logsumexp(_floating(t), dim=axes, keepdim=keep).to(t.dtype)


def _sum_square(t: torch.Tensor, axes: list[int], keep: bool) -> torch.Tensor:
    return _sum(t * t, axes, keep)


def _reduce(
    fn: Reducer, data: torch.Tensor, axes: list[int] | None, keep: bool, noop: bool
) -> torch.Tensor:
    dtype = data.dtype
    t = data.to(torch.int64) if dtype in _WIDEN else data
    if not axes and (noop or t.dim() == 0):
        # No axes to reduce: each element is reduced alone.
        out = fn(t.unsqueeze(0), [0], False)
    else:
        rank = t.dim()
        dims = sorted({a % rank for a in axes} if axes else range(rank))
        out = fn(t, dims, keep)
    return out.to(dtype)


def _keepdims(attrs: dict[str, Any]) -> bool:
    return bool(attrs.get("keepdims", 1))


def _with_axes_attribute(fn: Reducer) -> OpFn:
    def op(ctx: OpContext, x: list[torch.Tensor | None], attrs: dict[str, Any]) -> torch.Tensor:
        data = x[0]
        assert data is not None
        axes = attrs.get("axes")
        return _reduce(fn, data, [int(a) for a in axes] if axes else None, _keepdims(attrs), False)

    return op


def _with_axes_input(fn: Reducer) -> OpFn:
    def op(ctx: OpContext, x: list[torch.Tensor | None], attrs: dict[str, Any]) -> torch.Tensor:
        data = x[0]
        assert data is not None
        axes_t = x[1] if len(x) > 1 else None
        axes = [int(a) for a in axes_t.reshape(-1).tolist()] if axes_t is not None else None
        noop = bool(attrs.get("noop_with_empty_axes", 0))
        return _reduce(fn, data, axes, _keepdims(attrs), noop)

    return op


# op type -> (its reducer, the schema version where axes became an input)
_OPS: dict[str, tuple[Reducer, int]] = {
    "ReduceSum": (_sum, 13),
    "ReduceMean": (_mean, 18),
    "ReduceMax": (_extreme(True), 18),
    "ReduceMin": (_extreme(False), 18),
    "ReduceProd": (_prod, 18),
    "ReduceL1": (_l1, 18),
    "ReduceL2": (_l2, 18),
    "ReduceLogSum": (_log_sum, 18),
    "ReduceLogSumExp": (_log_sum_exp, 18),
    "ReduceSumSquare": (_sum_square, 18),
}

for _name, (_fn, _since) in _OPS.items():
    register(_name, since=1, until=_since - 1)(_with_axes_attribute(_fn))
    register(_name, since=_since)(_with_axes_input(_fn))
