"""Resize and its deprecated alias Upsample.

Separable: for each resized axis a small table, built on the CPU, gives the source index of
every output index (nearest) or its neighbours and weights (linear, cubic, antialiased
kernels); the data itself is only gathered and blended on its device. Source coordinates
are computed in float32 as onnxruntime does (ONNX's reference uses float64; the two differ
on nearest ties such as 4.5 against 4.5000002), weights in float64 as the reference does.
Nearest resizes by a whole factor whose table is a plain repetition (YOLO's 2x upsampling)
take an exact expand instead of a gather.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from onnx_bisect.backends.torch.context import OpContext, untraced
from onnx_bisect.backends.torch.ops.registry import register
from onnx_bisect.backends.torch.ops.shape import need
from onnx_bisect.errors import BackendError

__all__: list[str] = []

_COORDS = {
    "half_pixel",
    "half_pixel_symmetric",
    "pytorch_half_pixel",
    "align_corners",
    "asymmetric",
    "tf_crop_and_resize",
    "tf_half_pixel_for_nn",
}
_NEAREST = {"round_prefer_floor", "round_prefer_ceil", "floor", "ceil", "simple"}
_F64 = torch.float64


@dataclass(frozen=True)
class _Options:
    mode: str = "nearest"
    coord: str = "half_pixel"
    nearest: str = "round_prefer_floor"  # "simple": Resize-10/Upsample (floor up, ceil down)
    cubic_a: float = -0.75
    exclude_outside: bool = False
    extrapolation: float = 0.0
    antialias: bool = False
    policy: str = "stretch"


@dataclass(frozen=True)
class _Axis:
    axis: int
    size: int  # input length
    out: int
    scale: float
    roi: tuple[float, float]


def _options(attrs: dict[str, Any], *, legacy: bool) -> _Options:
    mode = str(attrs.get("mode", "nearest"))
    if mode == "bilinear":
        mode = "linear"
    if legacy:
        # ONNX leaves Resize-10/Upsample's mapping unsaid; onnxruntime's is asymmetric and
        # floors when enlarging, ceils when shrinking.
        opts = _Options(mode=mode, coord="asymmetric", nearest="simple")
    else:
        opts = _Options(
            mode=mode,
            coord=str(attrs.get("coordinate_transformation_mode", "half_pixel")),
            nearest=str(attrs.get("nearest_mode", "round_prefer_floor")),
            cubic_a=float(attrs.get("cubic_coeff_a", -0.75)),
            exclude_outside=bool(attrs.get("exclude_outside", 0)),
            extrapolation=float(attrs.get("extrapolation_value", 0.0)),
            antialias=bool(attrs.get("antialias", 0)),
            policy=str(attrs.get("keep_aspect_ratio_policy", "stretch")),
        )
    if opts.mode not in ("nearest", "linear", "cubic"):
        raise BackendError(f"Resize mode {opts.mode!r} is not supported")
    if opts.coord not in _COORDS:
        raise BackendError(f"Resize coordinate_transformation_mode {opts.coord!r} is not supported")
    if opts.nearest not in _NEAREST:
        raise BackendError(f"Resize nearest_mode {opts.nearest!r} is not supported")
    if opts.policy not in ("stretch", "not_larger", "not_smaller"):
        raise BackendError(f"Resize keep_aspect_ratio_policy {opts.policy!r} is not supported")
    if opts.antialias and opts.mode == "nearest":
        raise BackendError("Resize antialias with mode 'nearest' is not supported")
    return opts


def _values(t: torch.Tensor | None) -> list[float] | None:
    """A 1-D input as Python numbers; an empty tensor counts as omitted (Resize-11)."""
    if t is None or t.numel() == 0:
        return None
    return [float(v) for v in t.reshape(-1).tolist()]


def _plan(
    shape: tuple[int, ...],
    axes: list[int],
    scales: list[float] | None,
    sizes: list[float] | None,
    roi: list[float] | None,
    opts: _Options,
) -> list[_Axis]:
    """Per resized axis: input length, output length, scale and region of interest."""
    n = len(axes)
    given = sizes if sizes is not None else scales
    if given is None:
        raise BackendError("Resize needs either scales or sizes")
    if len(given) != n or (roi is not None and len(roi) != 2 * n):
        raise BackendError(f"Resize: scales/sizes/roi do not match the {n} resized axes")
    ins = [shape[a] for a in axes]
    # Scales and output lengths in float32 arithmetic, as onnxruntime computes them: a
    # product like 0.7 * 10 is 7 there (6 in float64), and shapes must agree.
    if sizes is not None:
        outs = [int(s) for s in sizes]
        factors = [
            float(np.float32(o) / np.float32(i)) if i else 1.0
            for o, i in zip(outs, ins, strict=True)
        ]
        if opts.policy != "stretch":
            pick = min if opts.policy == "not_larger" else max
            s = pick(factors)
            factors = [s] * n
            outs = [math.floor(float(np.float32(s) * np.float32(i)) + 0.5) for i in ins]
    else:
        assert scales is not None
        factors = [float(np.float32(s)) for s in scales]
        outs = [int(np.float32(s) * np.float32(i)) for s, i in zip(factors, ins, strict=True)]
    if any(s <= 0 for s in factors):
        raise BackendError("Resize scales must be positive")
    spans = [(0.0, 1.0)] * n if roi is None else [(roi[k], roi[n + k]) for k in range(n)]
    return [
        _Axis(a, i, o, s, r)
        for a, i, o, s, r in zip(axes, ins, outs, factors, spans, strict=True)
        # ONNX skips an axis left as it is (the kernels would not change it anyway).
        if not (math.isclose(s, 1.0) and o == i and _whole(r))
    ]


def _whole(roi: tuple[float, float]) -> bool:
    return math.isclose(roi[0], 0.0, abs_tol=1e-9) and math.isclose(roi[1], 1.0)


def _source(ax: _Axis, coord: str) -> torch.Tensor:
    """The source coordinate of every output index (float32 arithmetic, returned as float64).

    align_corners and tf_crop_and_resize divide by the unrounded output length
    ``scale * size`` as ONNX's reference and node tests do (onnxruntime uses the rounded one,
    and fails those tests)."""
    return _source32(ax, coord).to(_F64)


def _source32(ax: _Axis, coord: str) -> torch.Tensor:
    y = torch.arange(ax.out, dtype=torch.float32)
    width, s, n = ax.scale * ax.size, ax.scale, ax.size
    if coord == "asymmetric":
        return y / s
    if coord == "half_pixel":
        return (y + 0.5) / s - 0.5
    if coord == "tf_half_pixel_for_nn":
        return (y + 0.5) / s
    if coord == "pytorch_half_pixel":
        return torch.full_like(y, -0.5) if width == 1 else (y + 0.5) / s - 0.5
    if coord == "align_corners":
        return torch.zeros_like(y) if width == 1 else y * (n - 1) / (width - 1)
    if coord == "half_pixel_symmetric":
        n32 = np.float32(n)
        offset = n32 / np.float32(2) * (np.float32(1) - np.float32(ax.out) / (np.float32(s) * n32))
        return (float(offset) + (y.double() + 0.5) / s - 0.5).float()  # onnxruntime: in double
    start, end = ax.roi  # tf_crop_and_resize
    if width == 1:
        x = torch.full_like(y, (end - start) * (n - 1) / 2)
    else:
        x = y * (end - start) * (n - 1) / (width - 1)
    return x + start * (n - 1)


def _nearest_index(x: torch.Tensor, ax: _Axis, mode: str) -> torch.Tensor:
    low = torch.floor(x)
    frac = x - low
    if mode == "simple":
        up = torch.ceil(x) if ax.scale < 1 else low
    elif mode == "floor":
        up = low
    elif mode == "ceil":
        up = torch.ceil(x)
    elif mode == "round_prefer_floor":
        up = torch.where(frac <= 0.5, low, low + 1)
    else:
        up = torch.where(frac < 0.5, low, low + 1)
    return up.to(torch.int64).clamp(0, ax.size - 1)


def _kernel(d: torch.Tensor, opts: _Options) -> torch.Tensor:
    d = d.abs()
    if opts.mode == "linear":
        return (1 - d).clamp(min=0)
    a = opts.cubic_a
    near = ((a + 2) * d - (a + 3)) * d * d + 1
    far = ((a * d - 5 * a) * d + 8 * a) * d - 4 * a
    return torch.where(d <= 1, near, torch.where(d < 2, far, torch.zeros_like(d)))


def _weights(x: torch.Tensor, ax: _Axis, opts: _Options) -> tuple[torch.Tensor, torch.Tensor]:
    """Neighbour indices and weights [out, taps] for linear/cubic (antialiased) kernels."""
    low = torch.floor(x)
    exact = x == low
    # ONNX's reference prefers the left neighbour window at an exact source pixel (ratio 1).
    ratio = torch.where(exact, torch.ones_like(x), x - low)
    base = torch.where(exact, low - 1, low)
    s = min(ax.scale, 1.0) if opts.antialias else 1.0
    radius = 1 if opts.mode == "linear" else 2
    first = math.floor(-radius / s) + 1
    taps = torch.arange(first, 2 - first, dtype=_F64)
    w = _kernel(s * (taps[None, :] - ratio[:, None]), opts)
    if opts.antialias:
        w = w / w.sum(-1, keepdim=True)
    index = (base[:, None] + taps[None, :]).to(torch.int64)
    if opts.exclude_outside:
        w = torch.where((index < 0) | (index >= ax.size), torch.zeros_like(w), w)
        total = w.sum(-1, keepdim=True)
        w = w / torch.where(total == 0, torch.ones_like(total), total)
    return index.clamp(0, ax.size - 1), w


def _repeat_factor(index: torch.Tensor, ax: _Axis) -> int | None:
    """k when ``index`` is arange(size) with every entry repeated k times."""
    if ax.size == 0 or ax.out % ax.size:
        return None
    k = ax.out // ax.size
    with untraced():
        expected = torch.arange(ax.out, dtype=torch.int64) // k
        return k if torch.equal(index, expected) else None


def _twice(data: torch.Tensor, repeats: dict[int, int]) -> bool:
    """Whether torch's own nearest kernel is exact: it maps ``o`` to ``o >> 1`` when an
    axis doubles (and is much faster than a gather); it only resizes axes after N, C."""
    return (
        bool(repeats)
        and 3 <= data.ndim <= 5
        and data.dtype.is_floating_point
        and min(repeats) >= 2
        and set(repeats.values()) == {2}
    )


def _gather_nearest(data: torch.Tensor, plans: list[tuple[_Axis, torch.Tensor]]) -> torch.Tensor:
    repeats: dict[int, int] = {}
    for ax, index in plans:
        k = _repeat_factor(index, ax)
        if k is not None:
            repeats[ax.axis] = k
        else:
            data = data.index_select(ax.axis, index.to(data.device))
    if _twice(data, repeats):
        size = [n * repeats.get(a, 1) for a, n in enumerate(data.shape)][2:]
        return torch.nn.functional.interpolate(data, size=size, mode="nearest")
    if repeats:
        # One exact copy for every whole-factor axis: view a unit axis after each, expand.
        view, expand, final = [], [], []
        for axis, n in enumerate(data.shape):
            k = repeats.get(axis)
            view += [n] if k is None else [n, 1]
            expand += [n] if k is None else [n, k]
            final.append(n if k is None else n * k)
        data = data.reshape(view).expand(expand).reshape(final)
    return data


def _blend(data: torch.Tensor, axis: int, index: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Sum over taps of neighbour times weight, one gather per tap (taps are few)."""
    shape = [1] * data.ndim
    shape[axis] = -1
    index, w = index.to(data.device), w.to(data.dtype).to(data.device)  # mps has no float64
    out = data.index_select(axis, index[:, 0]) * w[:, 0].reshape(shape)
    for k in range(1, index.shape[1]):
        out += data.index_select(axis, index[:, k]) * w[:, k].reshape(shape)
    return out


def _compute_dtype(dtype: torch.dtype, device: torch.device) -> torch.dtype:
    if dtype in (torch.float32, torch.float64):
        return dtype
    if dtype.is_floating_point or device.type == "mps":  # mps has no float64
        return torch.float32
    return _F64


def _resize(
    data: torch.Tensor,
    axes: list[int],
    scales: list[float] | None,
    sizes: list[float] | None,
    roi: list[float] | None,
    opts: _Options,
) -> torch.Tensor:
    if opts.coord != "tf_crop_and_resize":
        roi = None
    plan = _plan(tuple(data.shape), axes, scales, sizes, roi, opts)
    outside: list[tuple[int, torch.Tensor]] = []
    sources = []
    with untraced():  # shape-only tables: constants of a compiled graph
        for ax in plan:
            x = _source(ax, opts.coord)
            if opts.coord == "tf_crop_and_resize":
                outside.append((ax.axis, (x < 0) | (x > ax.size - 1)))
            sources.append(x)
    if opts.mode == "nearest":
        with untraced():
            pairs = [
                (ax, _nearest_index(x, ax, opts.nearest))
                for ax, x in zip(plan, sources, strict=True)
            ]
        out = _gather_nearest(data, pairs)
    else:
        dtype = _compute_dtype(data.dtype, data.device)
        out = data.to(dtype)
        # Innermost axis first, while the data is smallest: its gathers are the slow ones.
        for ax, x in sorted(zip(plan, sources, strict=True), key=lambda p: -p[0].axis):
            with untraced():
                index, w = _weights(x, ax, opts)
            out = _blend(out, ax.axis, index, w)
        if not data.dtype.is_floating_point:
            info = torch.iinfo(data.dtype)
            out = out.round().clamp(info.min, info.max)
        out = out.to(data.dtype)
    return _extrapolate(out, outside, opts.extrapolation)


def _extrapolate(
    out: torch.Tensor, outside: list[tuple[int, torch.Tensor]], value: float
) -> torch.Tensor:
    """tf_crop_and_resize: an output whose source lies outside the input on any axis."""
    mask: torch.Tensor | None = None
    for axis, m in outside:
        if not bool(m.any()):
            continue
        shaped = m.to(out.device).reshape(-1, *[1] * (out.ndim - axis - 1))
        mask = shaped if mask is None else mask | shaped
    if mask is None:
        return out
    fill = torch.tensor(value, device=out.device).to(out.dtype)
    return torch.where(mask, fill, out)


def _axes(attrs: dict[str, Any], rank: int) -> list[int]:
    axes = [int(a) + rank if int(a) < 0 else int(a) for a in attrs.get("axes", range(rank))]
    if sorted(set(axes)) != sorted(axes) or any(not 0 <= a < rank for a in axes):
        raise BackendError(f"Resize axes {axes} are invalid for rank {rank}")
    return axes


@register("Resize", since=11, until=19)
def resize(ctx: OpContext, x: list[torch.Tensor | None], attrs: dict[str, Any]) -> torch.Tensor:
    data = need(x, 0)
    roi, scales, sizes = (_values(x[i]) if len(x) > i else None for i in (1, 2, 3))
    opts = _options(attrs, legacy=False)
    return _resize(data, _axes(attrs, data.ndim), scales, sizes, roi, opts)


def _legacy(
    x: torch.Tensor | None, scales: list[float] | None, attrs: dict[str, Any]
) -> torch.Tensor:
    assert x is not None
    return _resize(x, list(range(x.ndim)), scales, None, None, _options(attrs, legacy=True))


@register("Resize", since=10, until=10)
def resize10(ctx: OpContext, x: list[torch.Tensor | None], attrs: dict[str, Any]) -> torch.Tensor:
    return _legacy(x[0], _values(x[1]), attrs)


@register("Upsample", since=7, until=7)
def upsample7(ctx: OpContext, x: list[torch.Tensor | None], attrs: dict[str, Any]) -> torch.Tensor:
    return _legacy(x[0], [float(s) for s in attrs["scales"]], attrs)


@register("Upsample", since=9, until=9)
def upsample9(ctx: OpContext, x: list[torch.Tensor | None], attrs: dict[str, Any]) -> torch.Tensor:
    return _legacy(x[0], _values(x[1]), attrs)
