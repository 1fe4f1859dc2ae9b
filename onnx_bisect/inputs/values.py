"""What a generated input holds: a default range per dtype, or the user's constant or range,
checked against the input's dtype before anything is drawn."""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from onnx_bisect.errors import InputError
from onnx_bisect.inputs.signature import InputSpec

__all__ = ["Fill", "check_fills", "default_fill", "draw", "fills_for"]

Values = Mapping[str, float]
Ranges = Mapping[str, tuple[float, float]]

_INT64_MAX = int(np.iinfo(np.int64).max)


@dataclass(frozen=True)
class Fill:
    """One input's values: floats uniform in [low, high); integers and booleans (0/1) in
    [low, high], both ends included; every element ``low`` when ``low == high``. Integer
    bounds stay Python ints, so an int64 bound near 2**63 is exact."""

    low: float
    high: float
    constant: bool = False  # from a constant value, not a range (for the messages)

    @property
    def what(self) -> str:
        if self.constant:
            return f"constant value {self.low}"
        return f"range {self.low},{self.high}"


def default_fill(dtype: np.dtype[np.generic]) -> Fill | None:
    """Floats in [0, 1): image-like and safe for log and sqrt. Integers in [0, 9]: valid
    indices and token ids for most models. 8-bit integers use their full range, since they
    are pixels or quantized values. Booleans are True or False at even odds. None for a
    dtype that cannot be generated (strings, bfloat16, complex)."""
    if dtype == np.bool_:
        return Fill(0, 1)
    if np.issubdtype(dtype, np.integer):
        if dtype.itemsize == 1:
            info = np.iinfo(dtype.type)  # type: ignore[type-var]
            return Fill(int(info.min), int(info.max))
        return Fill(0, 9)
    if np.issubdtype(dtype, np.floating):
        return Fill(0.0, 1.0)
    return None


def check_fills(values: Values | None, ranges: Ranges | None) -> None:
    """What can be checked without the model: numbers, finite ordered bounds, and no input
    given both a constant and a range."""
    for what, given in (("constant values", values), ("ranges", ranges)):
        if given is not None and not isinstance(given, Mapping):
            raise InputError(f"{what} must map input names to numbers, not {given!r}")
    values, ranges = values or {}, ranges or {}
    for name, value in values.items():
        if not _is_number(value):
            raise InputError(f"constant value for input {name!r} must be a number, not {value!r}")
    for name, bounds in ranges.items():
        if (
            not isinstance(bounds, Sequence)
            or len(bounds) != 2
            or not all(_is_number(b) for b in bounds)
        ):
            raise InputError(
                f"range for input {name!r} must be two numbers (low, high), not {bounds!r}"
            )
        low, high = bounds
        if not (math.isfinite(low) and math.isfinite(high)):
            raise InputError(f"range for input {name!r} must be finite, not {low},{high}")
        if low > high:
            raise InputError(f"range for input {name!r}: low {low} is above high {high}")
    both = sorted(set(values) & set(ranges))
    if both:
        raise InputError(
            f"input(s) {', '.join(both)} given both a constant value and a range; give one"
        )


def fills_for(
    specs: Sequence[InputSpec], values: Values | None, ranges: Ranges | None
) -> dict[str, Fill | None]:
    """Every input's fill: the user's, checked against the input's dtype, else the default
    (None where the dtype cannot be generated)."""
    check_fills(values, ranges)
    given = {n: Fill(v, v, constant=True) for n, v in (values or {}).items()}
    given |= {n: Fill(lo, hi) for n, (lo, hi) in (ranges or {}).items()}
    unknown = sorted(set(given) - {s.name for s in specs})
    if unknown:
        raise InputError(
            f"constant value or range for unknown input(s) {', '.join(unknown)}; model inputs "
            f"are {', '.join(s.name for s in specs)}"
        )
    fills: dict[str, Fill | None] = {}
    for spec in specs:
        fill = given.get(spec.name)
        fills[spec.name] = default_fill(spec.dtype) if fill is None else _fitted(spec, fill)
    return fills


def _fitted(spec: InputSpec, fill: Fill) -> Fill:
    """``fill`` with integer bounds as ints, or an InputError saying why it does not fit."""
    dt, where = spec.dtype, f"input {spec.name!r} is {spec.dtype}"
    if default_fill(dt) is None:
        raise InputError(f"{where}, which cannot be generated; give its values as inputs")
    if dt == np.bool_ or np.issubdtype(dt, np.integer):
        if not all(float(b).is_integer() for b in (fill.low, fill.high)):
            flaw = "is not" if fill.constant else "has a bound that is not"
            raise InputError(f"{where}; the {fill.what} {flaw} an integer")
        low, high = int(fill.low), int(fill.high)
        lo, hi = (0, 1) if dt == np.bool_ else _int_limits(dt)
        if low < lo or high > hi:
            raise InputError(f"{where}; the {fill.what} is outside [{lo}, {hi}]")
        return Fill(low, high, fill.constant)
    peak = float(np.finfo(dt.type).max)  # type: ignore[type-var]
    if fill.constant:
        # NaN and infinities are values a float input can hold (check_fills keeps them out
        # of ranges).
        if math.isfinite(fill.low) and abs(fill.low) > peak:
            raise InputError(f"{where}; the {fill.what} is beyond ±{peak:g}")
        return fill
    if max(abs(fill.low), abs(fill.high)) > peak or not math.isfinite(fill.high - fill.low):
        raise InputError(f"{where}; the {fill.what} is beyond ±{peak:g}")
    if fill.low < fill.high:
        first, last = _inside(dt, fill.low, fill.high)
        if first > last:
            raise InputError(f"{where}; the {fill.what} holds no {dt} value")
    return fill


def _int_limits(dt: np.dtype[np.generic]) -> tuple[int, int]:
    info = np.iinfo(dt.type)  # type: ignore[type-var]
    return int(info.min), int(info.max)


def _is_number(x: object) -> bool:
    return isinstance(x, numbers.Real)


def _inside(dt: np.dtype[np.generic], low: float, high: float) -> tuple[float, float]:
    """The smallest and largest values of ``dt`` in [low, high): rounding to a narrow float
    can land on ``high`` or just below ``low``, and the promise is [low, high)."""
    first, last = dt.type(low), dt.type(high)
    if float(first) < low:
        first = np.nextafter(first, dt.type(np.inf))
    if float(last) >= high:
        last = np.nextafter(last, dt.type(-np.inf))
    return float(first), float(last)


def draw(
    rng: np.random.Generator, dtype: np.dtype[np.generic], shape: tuple[int, ...], fill: Fill
) -> npt.NDArray[np.generic]:
    """One tensor of ``fill``'s values. The defaults draw exactly what earlier versions drew
    (``rng.random``, ``rng.integers(lo, hi + 1)``), so a seed still gives the same inputs.

    Drawn in blocks into the result: a whole-tensor draw held float64 or int64 values and
    their temporaries, six times a float32 input's bytes at its peak. The generator's stream
    is the same whether drawn at once or block by block, and so are the values."""
    if fill.constant or fill.low == fill.high:
        return np.full(shape, fill.low, dtype=dtype)
    out = np.empty(shape, dtype=dtype)
    flat = out.reshape(-1)
    for start in range(0, flat.size, _DRAW_BLOCK):
        flat[start : start + _DRAW_BLOCK] = _block(
            rng, dtype, min(_DRAW_BLOCK, flat.size - start), fill
        )
    return out


# Elements drawn at a time (8 MiB of float64).
_DRAW_BLOCK = 1 << 20


def _block(
    rng: np.random.Generator, dtype: np.dtype[np.generic], n: int, fill: Fill
) -> npt.NDArray[np.generic]:
    if dtype == np.bool_:
        return rng.random(n) < 0.5  # the only range left is [0, 1]
    if np.issubdtype(dtype, np.integer):
        wide = np.uint64 if int(fill.high) > _INT64_MAX else np.int64
        values = rng.integers(int(fill.low), int(fill.high), n, dtype=wide, endpoint=True)
        return values.astype(dtype)
    low, high = float(fill.low), float(fill.high)
    drawn = (low + (high - low) * rng.random(n, dtype=np.float64)).astype(dtype)
    first, last = _inside(dtype, low, high)
    return np.clip(drawn, first, last)
