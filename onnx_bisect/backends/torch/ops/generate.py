"""Operators that make tensors: Constant, ConstantOfShape, Range, EyeLike and the random
generators RandomNormal, RandomUniform and RandomNormalLike.

Every floating tensor made here goes through the backend's policy (``ctx.tensor``,
``ctx.dtype``, ``ctx.floating``): a float64 oracle must not read float32 constants.
Bernoulli and RandomUniformLike are left out: ONNX's node tests (Bernoulli's expansion
uses RandomUniformLike) compare random draws with numpy's, which torch cannot reproduce.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import onnx
import torch

from onnx_bisect.backends.torch.context import OpContext
from onnx_bisect.backends.torch.ops.registry import register
from onnx_bisect.backends.torch.ops.shape import ints, need
from onnx_bisect.errors import BackendError

__all__: list[str] = []

_Inputs = list[torch.Tensor | None]
_Attrs = dict[str, Any]


@register("Constant", since=1)
def constant(ctx: OpContext, x: _Inputs, attrs: _Attrs) -> torch.Tensor:
    if "value" in attrs:
        value = attrs["value"]
        # Reshaped: a 0-d array must stay a scalar whatever the conversion does.
        return ctx.tensor(value).reshape(value.shape)
    if "value_float" in attrs:
        return ctx.tensor(np.array(attrs["value_float"], dtype=np.float32)).reshape(())
    if "value_floats" in attrs:
        return ctx.tensor(np.array(attrs["value_floats"], dtype=np.float32).reshape(-1))
    if "value_int" in attrs:
        return ctx.tensor(np.array(attrs["value_int"], dtype=np.int64)).reshape(())
    if "value_ints" in attrs:
        return ctx.tensor(np.array(attrs["value_ints"], dtype=np.int64).reshape(-1))
    kind = next(iter(attrs), "no value")
    raise BackendError(f"Constant with {kind} is not supported by the torch backend")


@register("ConstantOfShape", since=9)
def constant_of_shape(ctx: OpContext, x: _Inputs, attrs: _Attrs) -> torch.Tensor:
    shape = ints(need(x, 0))
    value = attrs.get("value")
    if value is None:
        value = np.zeros(1, dtype=np.float32)  # ONNX's default: a float32 zero
    fill = ctx.tensor(np.asarray(value).reshape(-1)[:1]).reshape(())
    return fill.expand(shape).contiguous()


def _range(ctx: OpContext, x: _Inputs) -> torch.Tensor:
    start, limit, delta = need(x, 0), need(x, 1), need(x, 2)
    dtype = ctx.floating(start.dtype)
    if not dtype.is_floating_point:
        lo, hi, step = (int(t.reshape(-1)[0].item()) for t in (start, limit, delta))
        count = max(-((lo - hi) // step), 0)  # exact ceil((hi - lo) / step)
        return torch.arange(lo, lo + count * step, step, dtype=dtype, device=ctx.device)
    lo_f, hi_f, step_f = (float(t.reshape(-1)[0].item()) for t in (start, limit, delta))
    count = max(math.ceil((hi_f - lo_f) / step_f), 0)
    # Computed in float64 and rounded once, as ONNX's reference does (and what
    # Range-27's stash_type asks for low-precision types).
    steps = torch.arange(count, dtype=torch.float64, device=ctx.device)
    return (steps * step_f + lo_f).to(dtype)


@register("Range", since=11)
def range_(ctx: OpContext, x: _Inputs, attrs: _Attrs) -> torch.Tensor:
    return _range(ctx, x)


@register("EyeLike", since=9)
def eye_like(ctx: OpContext, x: _Inputs, attrs: _Attrs) -> torch.Tensor:
    data = need(x, 0)
    if data.ndim != 2:
        raise BackendError(f"EyeLike needs a 2-D input, got rank {data.ndim}")
    dtype = ctx.dtype(attrs["dtype"]) if "dtype" in attrs else ctx.floating(data.dtype)
    rows = torch.arange(data.shape[0], device=ctx.device).unsqueeze(1)
    cols = torch.arange(data.shape[1], device=ctx.device).unsqueeze(0)
    k = int(attrs.get("k", 0))
    return (cols - rows == k).to(dtype)


# ---------------------------------------------------------------------------------------
# Random generators: shape and dtype follow ONNX; the draws are torch's, not numpy's.


def _generator(ctx: OpContext, attrs: _Attrs) -> torch.Generator | None:
    if "seed" not in attrs:
        return None
    gen = torch.Generator(device=ctx.device)
    gen.manual_seed(int(attrs["seed"]))
    return gen


def _random_dtype(ctx: OpContext, attrs: _Attrs, like: torch.Tensor | None) -> torch.dtype:
    if "dtype" in attrs:
        dtype = ctx.dtype(attrs["dtype"])
    elif like is not None:
        dtype = ctx.floating(like.dtype)
    else:
        dtype = ctx.dtype(onnx.TensorProto.FLOAT)
    if not dtype.is_floating_point:
        raise BackendError(f"random values of type {dtype} are not supported")
    return dtype


def _normal(
    ctx: OpContext, attrs: _Attrs, shape: list[int], like: torch.Tensor | None
) -> torch.Tensor:
    dtype = _random_dtype(ctx, attrs, like)
    draw = torch.randn(shape, generator=_generator(ctx, attrs), dtype=dtype, device=ctx.device)
    return draw * float(attrs.get("scale", 1.0)) + float(attrs.get("mean", 0.0))


def _uniform(
    ctx: OpContext, attrs: _Attrs, shape: list[int], like: torch.Tensor | None
) -> torch.Tensor:
    dtype = _random_dtype(ctx, attrs, like)
    draw = torch.rand(shape, generator=_generator(ctx, attrs), dtype=dtype, device=ctx.device)
    low, high = float(attrs.get("low", 0.0)), float(attrs.get("high", 1.0))
    return draw * (high - low) + low


@register("RandomNormal", since=1)
def random_normal(ctx: OpContext, x: _Inputs, attrs: _Attrs) -> torch.Tensor:
    return _normal(ctx, attrs, list(attrs["shape"]), None)


@register("RandomUniform", since=1)
def random_uniform(ctx: OpContext, x: _Inputs, attrs: _Attrs) -> torch.Tensor:
    return _uniform(ctx, attrs, list(attrs["shape"]), None)


@register("RandomNormalLike", since=1)
def random_normal_like(ctx: OpContext, x: _Inputs, attrs: _Attrs) -> torch.Tensor:
    like = need(x, 0)
    return _normal(ctx, attrs, list(like.shape), like)
