"""Elementwise operators: arithmetic, comparison, logic, bitwise, variadic reductions
(Max, Min, Sum, Mean), Where, Clip and the unary math functions.

torch has almost no kernels for uint16/uint32/uint64, so those are computed in int64 and cast
back. That is exact for modular arithmetic (+, -, *, Pow, shifts left, bitwise ops: the low bits
agree) and, through an order-preserving map, for comparisons and Max/Min/Clip; Div and Mod on
uint64 values of 2**63 and above have no exact int64 form and raise instead.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import reduce
from typing import Any

import torch

from onnx_bisect.backends.torch.context import OpContext
from onnx_bisect.backends.torch.ops.registry import register
from onnx_bisect.errors import BackendError

__all__: list[str] = []

Inputs = list[torch.Tensor | None]
Binary = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
Unary = Callable[[torch.Tensor], torch.Tensor]

_WIDE_UNSIGNED = (torch.uint16, torch.uint32, torch.uint64)
_INT64_MIN = -(2**63)


def _given(x: Inputs) -> list[torch.Tensor]:
    """The inputs that are present, for ops whose inputs are all required."""
    out = [t for t in x if t is not None]
    if len(out) != len(x):
        raise BackendError("a required input is missing (an empty input name)")
    return out


def _widen(t: torch.Tensor) -> torch.Tensor:
    """uint16/32/64 as int64 (uint64 reinterpreted: modular arithmetic stays exact)."""
    return t.to(torch.int64) if t.dtype in _WIDE_UNSIGNED else t


def _to_order(t: torch.Tensor) -> torch.Tensor:
    """An int64 (or native) tensor that orders like ``t``: uint64 gets its top bit flipped,
    which maps unsigned order onto signed order."""
    if t.dtype == torch.uint64:
        return t.to(torch.int64) ^ _INT64_MIN
    return _widen(t)


def _from_order(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if dtype == torch.uint64:
        return (t ^ _INT64_MIN).to(dtype)
    return t.to(dtype)


def _no_high_uint64(*ts: torch.Tensor, op: str) -> None:
    for t in ts:
        if t.dtype == torch.uint64 and bool((t.to(torch.int64) < 0).any()):
            raise BackendError(
                f"{op} of uint64 values of 2**63 or more is not supported by the torch backend "
                "(torch has no uint64 division)"
            )


def _modular(fn: Binary) -> Binary:
    """``fn`` on uint16/32/64 through int64, cast back (exact where only low bits matter)."""

    def call(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        if a.dtype not in _WIDE_UNSIGNED:
            return fn(a, b)
        return fn(_widen(a), _widen(b)).to(a.dtype)

    return call


def _ordered(fn: Binary, *, same_type: bool = True) -> Binary:
    """``fn`` that depends on order (comparisons, max, min) on the order-preserving map."""

    def call(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        if a.dtype not in _WIDE_UNSIGNED:
            return fn(a, b)
        out = fn(_to_order(a), _to_order(b))
        return _from_order(out, a.dtype) if same_type else out

    return call


def _legacy_align(a: torch.Tensor, b: torch.Tensor, attrs: dict[str, Any]) -> torch.Tensor:
    """Opset < 7 broadcasting: with ``broadcast=1``, B's dims line up with A's from ``axis``
    (default: A's trailing dims)."""
    if not attrs.get("broadcast", 0) or "axis" not in attrs or b.dim() == 0:
        return b
    axis = int(attrs["axis"]) % max(a.dim(), 1)
    return b.reshape(tuple(b.shape) + (1,) * (a.dim() - axis - b.dim()))


def _register_binary(name: str, fn: Binary, *, since: int = 7, legacy: bool = True) -> None:
    def modern(ctx: OpContext, x: Inputs, attrs: dict[str, Any]) -> torch.Tensor:
        a, b = _given(x)
        return fn(a, b)

    def old(ctx: OpContext, x: Inputs, attrs: dict[str, Any]) -> torch.Tensor:
        a, b = _given(x)
        return fn(a, _legacy_align(a, b, attrs))

    register(name, since=since)(modern)
    if legacy:
        register(name, since=1, until=since - 1)(old)


def _div(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    if a.dtype.is_floating_point:
        return a / b
    _no_high_uint64(a, b, op="Div")
    # C semantics: integer division truncates toward zero (torch's // floors).
    return torch.div(_widen(a), _widen(b), rounding_mode="trunc").to(a.dtype)


def _pow(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    # The result has the base's type, whatever the exponent's.
    if a.dtype.is_floating_point:
        out = torch.pow(a, b).to(a.dtype)
        # torch's pow by a tensor is off by an ulp even for x**2 (its vector pow is not
        # correctly rounded); ORT multiplies for exponents 2 and 3, and so do we.
        out = torch.where(b == 3, a * a * a, out)
        return torch.where(b == 2, a * a, out)
    if not b.dtype.is_floating_point:
        return torch.pow(_widen(a), _widen(b)).to(a.dtype)
    # An integer base with a floating exponent: C's pow in double, truncated (as ORT does).
    return torch.pow(a.to(torch.float64), b.to(torch.float64)).to(a.dtype)


for _name, _fn in {
    "Add": _modular(torch.add),
    "Sub": _modular(torch.sub),
    "Mul": _modular(torch.mul),
    "Div": _div,
    "Pow": _pow,
    "And": torch.logical_and,
    "Or": torch.logical_or,
    "Xor": torch.logical_xor,
    "Equal": _ordered(torch.eq, same_type=False),
    "Greater": _ordered(torch.gt, same_type=False),
    "Less": _ordered(torch.lt, same_type=False),
}.items():
    _register_binary(_name, _fn)

for _name, _fn in {
    "GreaterOrEqual": _ordered(torch.ge, same_type=False),
    "LessOrEqual": _ordered(torch.le, same_type=False),
}.items():
    _register_binary(_name, _fn, since=12, legacy=False)

for _name, _fn in {
    "BitwiseAnd": _modular(torch.bitwise_and),
    "BitwiseOr": _modular(torch.bitwise_or),
    "BitwiseXor": _modular(torch.bitwise_xor),
}.items():
    _register_binary(_name, _fn, since=18, legacy=False)


@register("Mod", since=10)
def mod(ctx: OpContext, x: Inputs, attrs: dict[str, Any]) -> torch.Tensor:
    a, b = _given(x)
    _no_high_uint64(a, b, op="Mod")
    wa, wb = _widen(a), _widen(b)
    if attrs.get("fmod", 0):
        return torch.fmod(wa, wb).to(a.dtype)  # C fmod: the sign of the dividend
    out = torch.remainder(wa, wb)  # the sign of the divisor
    if out.dtype.is_floating_point:
        # A zero result takes the divisor's sign (Mod-28 spells this out; fmod gives x's).
        out = torch.where(out == 0, torch.copysign(out, wb), out)
    return out.to(a.dtype)


@register("BitShift", since=11)
def bit_shift(ctx: OpContext, x: Inputs, attrs: dict[str, Any]) -> torch.Tensor:
    a, s = _given(x)
    direction = attrs.get("direction", "")
    if direction not in ("LEFT", "RIGHT"):
        raise BackendError(f"BitShift direction {direction!r} is not supported; use LEFT or RIGHT")
    wa, ws = _widen(a), _widen(s)
    # torch already gives ONNX's results for shift amounts < 0 or >= the width (0, or -1 for a
    # negative signed right shift); narrow unsigned types shift as int64, zeros coming in.
    if direction == "LEFT":
        return torch.bitwise_left_shift(wa, ws).to(a.dtype)
    if a.dtype != torch.uint64:
        return torch.bitwise_right_shift(wa, ws).to(a.dtype)
    # A logical shift of uint64 as int64: shift once and clear the copied sign bit first.
    once = torch.bitwise_right_shift(wa, 1) & (2**63 - 1)
    rest = torch.bitwise_right_shift(once, (ws - 1).clamp(min=0))
    return torch.where(ws == 0, wa, rest).to(a.dtype)


def _variadic(fn: Binary) -> Callable[[OpContext, Inputs, dict[str, Any]], torch.Tensor]:
    def call(ctx: OpContext, x: Inputs, attrs: dict[str, Any]) -> torch.Tensor:
        ts = _given(x)
        if not ts:
            raise BackendError("a variadic operator needs at least one input")
        return reduce(fn, ts[1:], ts[0])

    return call


register("Max", since=1)(_variadic(_ordered(torch.maximum)))
register("Min", since=1)(_variadic(_ordered(torch.minimum)))
register("Sum", since=1)(_variadic(_modular(torch.add)))


@register("Mean", since=1)
def mean(ctx: OpContext, x: Inputs, attrs: dict[str, Any]) -> torch.Tensor:
    total = _variadic(torch.add)(ctx, x, attrs)
    return total / len(x)


@register("Where", since=9)
def where(ctx: OpContext, x: Inputs, attrs: dict[str, Any]) -> torch.Tensor:
    cond, a, b = _given(x)
    return torch.where(cond.to(torch.bool), _widen(a), _widen(b)).to(a.dtype)


def _clip(x: torch.Tensor, lo: Any, hi: Any) -> torch.Tensor:
    if lo is None and hi is None:
        return x
    if x.dtype in _WIDE_UNSIGNED:
        lo = None if lo is None else _to_order(lo)
        hi = None if hi is None else _to_order(hi)
        return _from_order(torch.clamp(_to_order(x), lo, hi), x.dtype)
    return torch.clamp(x, lo, hi)


@register("Clip", since=1, until=10)
def clip_attrs(ctx: OpContext, x: Inputs, attrs: dict[str, Any]) -> torch.Tensor:
    (t,) = _given(x)
    return _clip(t, attrs.get("min"), attrs.get("max"))


@register("Clip", since=11)
def clip(ctx: OpContext, x: Inputs, attrs: dict[str, Any]) -> torch.Tensor:
    t, lo, hi = (x + [None, None])[:3]
    assert t is not None
    return _clip(t, _scalar(lo), _scalar(hi))


def _scalar(b: torch.Tensor | None) -> torch.Tensor | None:
    # min and max are scalars; exporters often write shape [1], which must not grow a 0-d x.
    return b.reshape(()) if b is not None and b.numel() == 1 else b


# Unary operators.


_UNSIGNED = (torch.uint8, *_WIDE_UNSIGNED)


def _abs(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype in _UNSIGNED else torch.abs(t)


def _sign(t: torch.Tensor) -> torch.Tensor:
    return (t != 0).to(t.dtype) if t.dtype in _UNSIGNED else torch.sign(t)


def _bitwise_not(t: torch.Tensor) -> torch.Tensor:
    return torch.bitwise_not(_widen(t)).to(t.dtype)


def _sqrt(t: torch.Tensor) -> torch.Tensor:
    # torch's CPU sqrt is not correctly rounded (1 ulp off on ~15% of float32 values; ORT
    # and numpy are exact). A float64 sqrt rounded to float32 is exact.
    if t.dtype == torch.float32 and t.device.type == "cpu":
        return torch.sqrt(t.to(torch.float64)).to(torch.float32)
    return torch.sqrt(t)


def _det(t: torch.Tensor) -> torch.Tensor:
    # torch's LU has no half kernels: float32 then round back.
    wide = t.dtype in (torch.float16, torch.bfloat16)
    out: torch.Tensor = torch.linalg.det(t.float() if wide else t)  # the stubs return Any
    return out.to(t.dtype)


_UNARY: dict[str, tuple[int, Unary]] = {
    "Abs": (1, _abs),
    "Neg": (1, torch.neg),
    "Exp": (1, torch.exp),
    "Log": (1, torch.log),
    "Sqrt": (1, _sqrt),
    "Reciprocal": (1, torch.reciprocal),
    "Floor": (1, torch.floor),
    "Ceil": (1, torch.ceil),
    "Round": (11, torch.round),  # half to even, as ONNX asks
    "Sign": (9, _sign),
    "Not": (1, torch.logical_not),
    "BitwiseNot": (18, _bitwise_not),
    "Sin": (7, torch.sin),
    "Cos": (7, torch.cos),
    "Tan": (7, torch.tan),
    "Asin": (7, torch.asin),
    "Acos": (7, torch.acos),
    "Atan": (7, torch.atan),
    "Sinh": (9, torch.sinh),
    "Cosh": (9, torch.cosh),
    "Asinh": (9, torch.asinh),
    "Acosh": (9, torch.acosh),
    "Atanh": (9, torch.atanh),
    "Erf": (9, torch.erf),
    "IsNaN": (9, torch.isnan),
    "Det": (11, _det),
}


def _register_unary(name: str, since: int, fn: Unary) -> None:
    def call(ctx: OpContext, x: Inputs, attrs: dict[str, Any]) -> torch.Tensor:
        (t,) = _given(x)
        return fn(t)

    register(name, since=since)(call)


for _name, (_since, _ufn) in _UNARY.items():
    _register_unary(_name, _since, _ufn)


@register("IsInf", since=10)
def is_inf(ctx: OpContext, x: Inputs, attrs: dict[str, Any]) -> torch.Tensor:
    (t,) = _given(x)
    pos, neg = attrs.get("detect_positive", 1), attrs.get("detect_negative", 1)
    if pos and neg:
        return torch.isinf(t)
    if pos or neg:
        return t == (math.inf if pos else -math.inf)
    return torch.zeros_like(t, dtype=torch.bool)
