"""Element types narrower than torch's arithmetic types: float8 (four kinds and E8M0), float4
E2M1, and the 4- and 2-bit integers.

Each travels in a *carrier*: float8 in torch's own float8 dtypes, float4 in
``float8_e4m3fn`` (which holds every float4 value exactly), int4/int2 in int8 and
uint4/uint2 in uint8. Values are always on the narrow type's grid; ``to_narrow`` is the one
place that rounds onto it, as ONNX's Cast and QuantizeLinear define (round to nearest even,
``saturate`` for float8, E8M0's ``round_mode``, wrap-around for the small integers).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt
import onnx
import torch

__all__ = ["CARRIERS", "INT_RANGES", "carrier_from_numpy", "numpy_from_carrier", "to_narrow"]

_T = onnx.TensorProto
CARRIERS: dict[int, torch.dtype] = {
    _T.FLOAT8E4M3FN: torch.float8_e4m3fn,
    _T.FLOAT8E4M3FNUZ: torch.float8_e4m3fnuz,
    _T.FLOAT8E5M2: torch.float8_e5m2,
    _T.FLOAT8E5M2FNUZ: torch.float8_e5m2fnuz,
    _T.FLOAT8E8M0: torch.float8_e8m0fnu,
    _T.FLOAT4E2M1: torch.float8_e4m3fn,
    _T.INT4: torch.int8,
    _T.UINT4: torch.uint8,
    _T.INT2: torch.int8,
    _T.UINT2: torch.uint8,
}
INT_RANGES: dict[int, tuple[int, int]] = {
    _T.UINT8: (0, 255), _T.INT8: (-128, 127), _T.UINT16: (0, 65535), _T.INT16: (-32768, 32767),
    _T.UINT4: (0, 15), _T.INT4: (-8, 7), _T.UINT2: (0, 3), _T.INT2: (-2, 1),
}  # fmt: skip
_FLOAT8 = (_T.FLOAT8E4M3FN, _T.FLOAT8E4M3FNUZ, _T.FLOAT8E5M2, _T.FLOAT8E5M2FNUZ)
_SMALL_INTS = {"int4": np.int8, "int2": np.int8, "uint4": np.uint8, "uint2": np.uint8}


def carrier_from_numpy(array: npt.NDArray[Any]) -> torch.Tensor | None:
    """An ml_dtypes array of a narrow type as its carrier (None for other arrays)."""
    name = array.dtype.name
    if name.startswith("float8_"):
        bits = torch.from_numpy(np.ascontiguousarray(array).view(np.uint8).copy())
        return bits.reshape(array.shape).view(getattr(torch, name))
    if name in _SMALL_INTS:
        return torch.from_numpy(array.astype(_SMALL_INTS[name]).reshape(array.shape))
    if name == "float4_e2m1fn":
        return torch.from_numpy(array.astype(np.float32)).to(torch.float8_e4m3fn)
    return None


def numpy_from_carrier(t: torch.Tensor) -> npt.NDArray[Any] | None:
    """A float8 tensor as an ml_dtypes array (None for other dtypes)."""
    name = str(t.dtype).removeprefix("torch.")
    if not name.startswith("float8_"):
        return None
    import ml_dtypes  # onnx's own dependency, which reads these types too

    bits = t.view(torch.uint8).cpu().numpy()
    out: npt.NDArray[Any] = bits.view(getattr(ml_dtypes, name)).reshape(tuple(t.shape))
    return out


def _float8(t: torch.Tensor, elem_type: int, saturate: bool) -> torch.Tensor:
    dtype = CARRIERS[elem_type]
    w = t if t.dtype.is_floating_point else t.to(torch.float32)
    if saturate:
        top = torch.finfo(dtype).max
        return w.clamp(-top, top).to(dtype)
    if elem_type == _T.FLOAT8E4M3FN:
        # torch saturates E4M3FN; without saturate ONNX overflows it to NaN (it has no inf).
        over = w.abs() > 464  # halfway between the largest value, 448, and the next, 480
        return torch.where(over, torch.nan, w).to(dtype)
    return w.to(dtype)


def _e8m0(t: torch.Tensor, saturate: bool, round_mode: str) -> torch.Tensor:
    """A power of two from float32's exponent bits (the sign is dropped, as the spec's
    reference does); NaN and inf become the NaN code."""
    bits = t.to(torch.float32).view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    exponent = (bits >> 23) & 0xFF
    mantissa = bits & 0x7FFFFF
    special = exponent == 0xFF
    if round_mode == "nearest":
        guard, rest = (mantissa & 0x400000) > 0, (mantissa & 0x3FFFFF) > 0
        up = guard & (rest | (exponent > 0))
    elif round_mode == "up":
        up = mantissa > 0
    else:
        up = torch.zeros_like(special)
    if saturate:
        up = up & (exponent != 0xFE)
    code = torch.where(special, 0xFF, exponent + up.to(torch.int64)).clamp(max=0xFF)
    return code.to(torch.uint8).view(torch.float8_e8m0fnu)


def _float4(t: torch.Tensor) -> torch.Tensor:
    """E2M1 (0, 0.5, 1, 1.5, 2, 3, 4, 6), round to nearest even, saturating at 6. It has no
    NaN: ONNX's reference (ml_dtypes) gives -0 for one, and so does this."""
    w = t if t.dtype == torch.float64 else t.to(torch.float32)  # exact for this grid
    a = w.abs()
    step = torch.where(a < 2, 0.5, torch.where(a < 4, 1.0, 2.0))
    q = (torch.round(a / step) * step).clamp(max=6.0)  # torch.round: half to even
    q = torch.where(torch.isnan(w), -0.0, torch.copysign(q, w))
    return q.to(torch.float8_e4m3fn)


def _small_int(t: torch.Tensor, elem_type: int) -> torch.Tensor:
    """Truncated toward zero, then wrapped into range (what a two's complement narrowing
    does, and ml_dtypes' conversion)."""
    lo, hi = INT_RANGES[elem_type]
    v = torch.trunc(t).to(torch.int64) if t.dtype.is_floating_point else t
    v = (v.to(torch.int64) - lo) % (hi - lo + 1) + lo
    return v.to(CARRIERS[elem_type])


def to_narrow(
    t: torch.Tensor, elem_type: int, *, saturate: bool = True, round_mode: str = "up"
) -> torch.Tensor:
    """``t`` rounded onto ``elem_type``'s grid, in its carrier."""
    if t.dtype.is_floating_point and t.dtype.itemsize == 1:
        t = t.to(torch.float32)  # float8 has no arithmetic: widen before rounding again
    if elem_type in _FLOAT8:
        return _float8(t, elem_type, saturate)
    if elem_type == _T.FLOAT8E8M0:
        return _e8m0(t, saturate, round_mode)
    if elem_type == _T.FLOAT4E2M1:
        return _float4(t)
    return _small_int(t, elem_type)
