"""Pooling: MaxPool, AveragePool, LpPool and their global forms.

ONNX windows differ from torch's at the edges: pads may be asymmetric, padded cells never
count for MaxPool (nor for AveragePool unless ``count_include_pad``), and with ``ceil_mode``
the last window may overhang the padded input (its missing cells count for nothing), unless
it would start in the end padding. So every pool here pads the input itself, to exactly the
span the ONNX output needs, and runs torch's pool without padding; averages divide by a
count pooled from a mask of the cells that count.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from onnx_bisect.backends.torch.context import OpContext
from onnx_bisect.backends.torch.ops.linear import explicit_pads, ints, torch_pad
from onnx_bisect.backends.torch.ops.registry import register
from onnx_bisect.backends.torch.ops.shape import need
from onnx_bisect.errors import BackendError

__all__: list[str] = []

_MAX: dict[int, Callable[..., Any]] = {1: F.max_pool1d, 2: F.max_pool2d, 3: F.max_pool3d}
_AVG: dict[int, Callable[..., torch.Tensor]] = {1: F.avg_pool1d, 2: F.avg_pool2d, 3: F.avg_pool3d}
_CONV: dict[int, Callable[..., torch.Tensor]] = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}


@dataclass(frozen=True)
class _Window:
    kernel: list[int]
    strides: list[int]
    dilations: list[int]
    begin: list[int]  # pads before each axis
    end: list[int]  # explicit pads after each axis
    extra: list[int]  # beyond `end` to reach the last window's end (negative: crop)


def _window(x: torch.Tensor, attrs: dict[str, Any], op: str) -> _Window:
    n = x.dim() - 2
    if n not in _MAX:
        raise BackendError(f"{op} over {n} spatial dimensions is not supported")
    kernel = [int(k) for k in attrs["kernel_shape"]]
    strides = ints(attrs, "strides", 1, n)
    dilations = ints(attrs, "dilations", 1, n)
    sizes = list(x.shape[2:])
    begin, end = explicit_pads(attrs, sizes, kernel, strides, dilations)
    ceil_mode = bool(attrs.get("ceil_mode", 0))
    extra = []
    for size, k, s, d, b, e in zip(sizes, kernel, strides, dilations, begin, end, strict=True):
        span = (k - 1) * d + 1
        out = (size + b + e - span) // s + 1
        if ceil_mode and (size + b + e - span) % s:
            out += 1
            # A window that would start in the end padding is dropped (ONNX and torch agree).
            if (out - 1) * s >= size + b:
                out -= 1
        extra.append((out - 1) * s + span - (size + b + e))
    return _Window(kernel, strides, dilations, begin, end, extra)


def _pad(x: torch.Tensor, w: _Window, value: float, extra_value: float = 0.0) -> torch.Tensor:
    x = F.pad(x, torch_pad(w.begin, w.end), value=value)
    return F.pad(x, torch_pad([0] * len(w.extra), w.extra), value=extra_value)


def _window_mean(x: torch.Tensor, w: _Window) -> torch.Tensor:
    """The mean over each full window of an already padded input."""
    n = len(w.kernel)
    if all(d == 1 for d in w.dilations):
        return _AVG[n](x, w.kernel, w.strides)
    # torch's avg_pool has no dilations: a depthwise convolution with a constant kernel.
    c = x.shape[1]
    fill = 1.0 / math.prod(w.kernel)
    weight = torch.full((c, 1, *w.kernel), fill, dtype=x.dtype, device=x.device)
    return _CONV[n](x, weight, None, w.strides, 0, w.dilations, c)


def _counted(x: torch.Tensor, w: _Window, include_pad: bool) -> torch.Tensor:
    """How many cells of each window count for an average."""
    ones = torch.ones((1, 1, *x.shape[2:]), dtype=x.dtype, device=x.device)
    mask = _pad(ones, w, 1.0 if include_pad else 0.0, 0.0)
    return (_window_mean(mask, w) * math.prod(w.kernel)).round()


def _flat_indices(
    idx: torch.Tensor, x: torch.Tensor, padded: Sequence[int], w: _Window, column_major: bool
) -> torch.Tensor:
    """torch's indices (into each padded plane) as ONNX's, into the whole flattened input."""
    coords = []
    rest = idx
    for size in reversed(padded):
        coords.append(rest % size)
        rest = rest // size
    coords.reverse()
    sizes = list(x.shape[2:])
    shifted = [c - b for c, b in zip(coords, w.begin, strict=True)]
    pairs = list(zip(shifted, sizes, strict=True))
    flat = torch.zeros_like(idx)
    for coord, size in reversed(pairs) if column_major else pairs:
        flat = flat * size + coord
    planes = torch.arange(x.shape[0] * x.shape[1], device=x.device, dtype=idx.dtype)
    plane = planes.reshape(x.shape[0], x.shape[1], *[1] * len(sizes)) * math.prod(sizes)
    return flat + plane


@register("MaxPool", since=1)
def max_pool(
    ctx: OpContext, x: list[torch.Tensor | None], attrs: dict[str, Any]
) -> tuple[torch.Tensor, torch.Tensor | None]:
    data = need(x, 0)
    w = _window(data, attrs, "MaxPool")
    dtype = data.dtype
    if not dtype.is_floating_point and data.device.type != "cpu":
        # Accelerators lack integer max-pool kernels; 8-bit values are exact in any float.
        data = data.to(torch.float32 if data.device.type == "mps" else torch.float64)
    low = float("-inf") if data.dtype.is_floating_point else torch.iinfo(data.dtype).min
    padded = _pad(data, w, low, low)
    n = len(w.kernel)
    y, idx = _MAX[n](padded, w.kernel, w.strides, 0, w.dilations, return_indices=True)
    column_major = bool(attrs.get("storage_order", 0))
    indices = _flat_indices(idx, data, padded.shape[2:], w, column_major)
    return y.to(dtype), indices


@register("AveragePool", since=1)
def average_pool(
    ctx: OpContext, x: list[torch.Tensor | None], attrs: dict[str, Any]
) -> torch.Tensor:
    data = need(x, 0)
    w = _window(data, attrs, "AveragePool")
    mean = _window_mean(_pad(data, w, 0.0), w)
    include_pad = bool(attrs.get("count_include_pad", 0))
    padded = any(w.begin) or any(w.end)
    if not any(e > 0 for e in w.extra) and (include_pad or not padded):
        return mean  # every window is full: no cell to leave out of the count
    full = math.prod(w.kernel)
    return mean * (full / _counted(data, w, include_pad))


def _lp_p(attrs: dict[str, Any]) -> float:
    # LpPool-1 and GlobalLpPool-1 took p as a float; later versions as an int. Both default 2.
    return float(attrs.get("p", 2))


@register("LpPool", since=1)
def lp_pool(ctx: OpContext, x: list[torch.Tensor | None], attrs: dict[str, Any]) -> torch.Tensor:
    data = need(x, 0)
    p = _lp_p(attrs)
    w = _window(data, attrs, "LpPool")
    powered = _pad(data.abs().pow(p), w, 0.0)
    return (_window_mean(powered, w) * math.prod(w.kernel)).pow(1.0 / p)


def _spatial(x: torch.Tensor) -> list[int]:
    return list(range(2, x.dim()))


@register("GlobalAveragePool", since=1)
def global_average_pool(
    ctx: OpContext, x: list[torch.Tensor | None], attrs: dict[str, Any]
) -> torch.Tensor:
    data = need(x, 0)
    return data.mean(dim=_spatial(data), keepdim=True)


@register("GlobalMaxPool", since=1)
def global_max_pool(
    ctx: OpContext, x: list[torch.Tensor | None], attrs: dict[str, Any]
) -> torch.Tensor:
    data = need(x, 0)
    return data.amax(dim=_spatial(data), keepdim=True)


@register("GlobalLpPool", since=1)
def global_lp_pool(
    ctx: OpContext, x: list[torch.Tensor | None], attrs: dict[str, Any]
) -> torch.Tensor:
    data = need(x, 0)
    p = _lp_p(attrs)
    return data.abs().pow(p).sum(dim=_spatial(data), keepdim=True).pow(1.0 / p)


@register("MaxUnpool", since=9)
def max_unpool(ctx: OpContext, x: list[torch.Tensor | None], attrs: dict[str, Any]) -> torch.Tensor:
    """Each value written back at its MaxPool index (flat over the whole unpooled tensor),
    zeros elsewhere; an ``output_shape`` larger than the inferred one pads at the end."""
    data, indices = need(x, 0), need(x, 1)
    n = data.dim() - 2
    kernel = [int(k) for k in attrs["kernel_shape"]]
    strides = ints(attrs, "strides", 1, n)
    pads = ints(attrs, "pads", 0, 2 * n)
    inferred = [
        (data.shape[i + 2] - 1) * strides[i] - pads[i] - pads[i + n] + kernel[i] for i in range(n)
    ]
    full = [data.shape[0], data.shape[1], *inferred]
    flat = torch.zeros(math.prod(full), dtype=data.dtype, device=data.device)
    flat[indices.reshape(-1).to(torch.int64)] = data.reshape(-1)
    out = flat.reshape(full)
    shape_t = x[2] if len(x) > 2 else None
    if shape_t is None:
        return out
    shape = [int(v) for v in shape_t.reshape(-1).tolist()]
    padded = torch.zeros(shape, dtype=data.dtype, device=data.device)
    padded[tuple(slice(0, s) for s in full)] = out
    return padded
