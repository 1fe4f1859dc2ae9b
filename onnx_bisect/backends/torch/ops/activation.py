"""Activation functions and Softmax, LogSoftmax, Hardmax.

Each follows ONNX's formula with ONNX's defaults, not torch's: torch's hardsigmoid has
alpha=1/6 where ONNX has 0.2, and its softplus switches to x above 20, which an oracle in
float64 would notice. Python-float attributes keep full precision under a float64 policy.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from onnx_bisect.backends.torch.context import OpContext
from onnx_bisect.backends.torch.ops.registry import register
from onnx_bisect.errors import BackendError

__all__: list[str] = []

Inputs = list[torch.Tensor | None]
Activation = Callable[[torch.Tensor, dict[str, Any]], torch.Tensor]


def _one(x: Inputs) -> torch.Tensor:
    t = x[0]
    if t is None:
        raise BackendError("the input tensor is missing (an empty input name)")
    return t


def _hard_sigmoid(t: torch.Tensor, alpha: float, beta: float) -> torch.Tensor:
    return (t * alpha + beta).clamp(0, 1)


def _softplus(t: torch.Tensor) -> torch.Tensor:
    # log(1 + exp(x)) without overflow, and without torch's switch to x above 20.
    return t.clamp(min=0) + torch.log1p(torch.exp(-t.abs()))


def _elu(t: torch.Tensor, alpha: float) -> torch.Tensor:
    return torch.where(t > 0, t, alpha * torch.expm1(t))


def _gelu(t: torch.Tensor, attrs: dict[str, Any]) -> torch.Tensor:
    approximate = attrs.get("approximate", "none")
    if approximate not in ("none", "tanh"):
        raise BackendError(f"Gelu approximate={approximate!r} is not supported; use none or tanh")
    out: torch.Tensor = F.gelu(t, approximate=approximate)  # the stubs return Any
    return out


def _relu(t: torch.Tensor, attrs: dict[str, Any]) -> torch.Tensor:
    out: torch.Tensor = torch.relu(t)  # the stubs return Any
    return out


def _leaky_relu(t: torch.Tensor, attrs: dict[str, Any]) -> torch.Tensor:
    return torch.where(t >= 0, t, t * attrs.get("alpha", 0.01))


def _selu(t: torch.Tensor, attrs: dict[str, Any]) -> torch.Tensor:
    alpha = float(attrs.get("alpha", 1.67326319217681884765625))
    gamma = float(attrs.get("gamma", 1.05070102214813232421875))
    return gamma * _elu(t, alpha)


def _celu(t: torch.Tensor, attrs: dict[str, Any]) -> torch.Tensor:
    alpha = float(attrs.get("alpha", 1.0))
    return t.clamp(min=0) + (alpha * torch.expm1(t / alpha)).clamp(max=0)


def _thresholded_relu(t: torch.Tensor, attrs: dict[str, Any]) -> torch.Tensor:
    return torch.where(t > attrs.get("alpha", 1.0), t, torch.zeros_like(t))


def _shrink(t: torch.Tensor, attrs: dict[str, Any]) -> torch.Tensor:
    lambd, bias = float(attrs.get("lambd", 0.5)), float(attrs.get("bias", 0.0))
    out = torch.where(t < -lambd, t + bias, torch.where(t > lambd, t - bias, 0))
    return out.to(t.dtype)


_ACTIVATIONS: dict[str, tuple[int, Activation]] = {
    "Relu": (1, _relu),
    "LeakyRelu": (1, _leaky_relu),
    "Sigmoid": (1, lambda t, a: torch.sigmoid(t)),
    "HardSigmoid": (
        1,
        lambda t, a: _hard_sigmoid(t, a.get("alpha", 0.2), a.get("beta", 0.5)),
    ),
    # ONNX defines HardSwish as x * HardSigmoid(x; alpha=1/6, beta=0.5), not torch's (x+3)/6.
    "HardSwish": (14, lambda t, a: t * _hard_sigmoid(t, 1 / 6, 0.5)),
    "Tanh": (1, lambda t, a: torch.tanh(t)),
    "Softplus": (1, lambda t, a: _softplus(t)),
    "Softsign": (1, lambda t, a: t / (1 + t.abs())),
    "Elu": (1, lambda t, a: _elu(t, a.get("alpha", 1.0))),
    "Selu": (1, _selu),
    "Celu": (12, _celu),
    "Gelu": (20, _gelu),
    "Mish": (18, lambda t, a: t * torch.tanh(_softplus(t))),
    "ThresholdedRelu": (10, _thresholded_relu),
    "Swish": (24, lambda t, a: t * torch.sigmoid(t * a.get("alpha", 1.0))),
    "Shrink": (9, _shrink),
}


def _register_activation(name: str, since: int, fn: Activation) -> None:
    def call(ctx: OpContext, x: Inputs, attrs: dict[str, Any]) -> torch.Tensor:
        return fn(_one(x), attrs)

    register(name, since=since)(call)


for _name, (_since, _fn) in _ACTIVATIONS.items():
    _register_activation(_name, _since, _fn)


@register("PRelu", since=7)
def prelu(ctx: OpContext, x: Inputs, attrs: dict[str, Any]) -> torch.Tensor:
    t, slope = x[0], x[1]
    if t is None or slope is None:
        raise BackendError("PRelu needs X and slope")
    # slope broadcasts to X (unidirectionally), e.g. [C, 1, 1] against [N, C, H, W].
    return torch.where(t < 0, t * slope, t).expand(t.shape)


@register("SwiGLU", since=28)
def swiglu(ctx: OpContext, x: Inputs, attrs: dict[str, Any]) -> torch.Tensor:
    """Swish(A; alpha) * B, the gated feed-forward of Llama-style MLPs."""
    a, b = x[0], x[1]
    if a is None or b is None:
        raise BackendError("SwiGLU needs A and B")
    return a * torch.sigmoid(a * float(attrs.get("alpha", 1.0))) * b


# Softmax, LogSoftmax and Hardmax.

Along = Callable[[torch.Tensor, int], torch.Tensor]


def _hardmax(t: torch.Tensor, dim: int) -> torch.Tensor:
    if t.numel() == 0:
        return torch.zeros_like(t)
    # argmax picks the first of equal maxima, as ONNX asks.
    index = t.argmax(dim=dim, keepdim=True)
    return torch.zeros_like(t).scatter(dim, index, 1)


def _coerced(fn: Along) -> Callable[[OpContext, Inputs, dict[str, Any]], torch.Tensor]:
    """Versions before 13: the input is flattened to 2-D at ``axis`` (default 1) and the
    function runs over the whole second dimension."""

    def call(ctx: OpContext, x: Inputs, attrs: dict[str, Any]) -> torch.Tensor:
        t = _one(x)
        if t.dim() == 0:
            return fn(t.reshape(1, 1), 1).reshape(())
        axis = attrs.get("axis", 1)
        axis = axis + t.dim() if axis < 0 else axis
        rows = math.prod(t.shape[:axis])
        flat = t.reshape(rows, math.prod(t.shape[axis:]))
        return fn(flat, 1).reshape(t.shape)

    return call


def _along(fn: Along) -> Callable[[OpContext, Inputs, dict[str, Any]], torch.Tensor]:
    def call(ctx: OpContext, x: Inputs, attrs: dict[str, Any]) -> torch.Tensor:
        t = _one(x)
        if t.dim() == 0:
            return fn(t.reshape(1), 0).reshape(())
        return fn(t, attrs.get("axis", -1))

    return call


for _name, _alongfn in {
    "Softmax": lambda t, d: torch.softmax(t, d),
    "LogSoftmax": lambda t, d: torch.log_softmax(t, d),
    "Hardmax": _hardmax,
}.items():
    register(_name, since=1, until=12)(_coerced(_alongfn))
    register(_name, since=13)(_along(_alongfn))
