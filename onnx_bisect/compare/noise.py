"""Noise floors: how far an fp32 reference is from float64, per tensor.

``--threshold auto`` runs the float64 reference (``ref?dtype=float64``) once with every probe
marked and calls a tensor diverged when the target's error exceeds k × (fp32 reference vs
float64) + eps. An early Conv whose fp32 rounding is 1e-7 then flags a 0.2% kernel error, and a
deep tensor whose fp32 rounding has grown to 1e-4 does not flag that rounding.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from onnx_bisect.compare.metrics import blocks, dot, norm_ratio

__all__ = ["Float64Values", "NoiseFloor", "fp32_noise"]


class Float64Values(Protocol):
    """Where the float64 values are (a ``TensorStore``): looked up by tensor name."""

    def __contains__(self, name: object) -> bool: ...

    def get(self, name: str) -> npt.NDArray[Any]: ...


class NoiseFloor:
    """``noise(tensor, fp32_reference_value)`` → rel_l2 against the float64 value, cached.

    ``oracle_noise``: per tensor, how far the oracle's own fp32 run is from its float64 run.
    With it, ``truth(tensor)`` gives the float64 value and that noise, to tell which side is
    off when the reference itself is wrong (its own floor would excuse its error)."""

    def __init__(
        self,
        float64: Float64Values,
        oracle_noise: Mapping[str, float] | None = None,
        inexact: Collection[str] = (),
        twin_only: Collection[str] = (),
    ) -> None:
        self.float64 = float64
        self.oracle_noise = dict(oracle_noise or {})
        # Tensors whose floor is the oracle's own fp32 twin's noise, not the reference's
        # distance from float64: downstream of a node whose reference kernel computes other
        # than the op means (ONNX Runtime's DynamicQuantizeLSTM quantizes its activations,
        # 0.257 from float64 on voicefilter-embedder), which would otherwise set a threshold
        # no planted 5% fault can pass (zoo G15).
        self.twin_only = frozenset(twin_only)
        # Values the oracle holds that are not float64 ones (a node computed in float32 by
        # a stand-in): no floor and no truth from them.
        self.inexact = frozenset(inexact)
        self._cache: dict[str, float | None] = {}

    def truth(self, tensor: str) -> tuple[npt.NDArray[Any], float] | None:
        if tensor not in self.oracle_noise or tensor not in self.float64:
            return None
        if tensor in self.inexact:
            return None
        return self.float64.get(tensor), self.oracle_noise[tensor]

    def __call__(self, tensor: str, ref: npt.NDArray[Any]) -> float | None:
        if tensor not in self._cache:
            self._cache[tensor] = self._measure(tensor, ref)
        return self._cache[tensor]

    def _measure(self, tensor: str, ref: npt.NDArray[Any]) -> float | None:
        if tensor not in self.float64 or tensor in self.inexact:
            return None
        if tensor in self.twin_only and tensor in self.oracle_noise:
            return self.oracle_noise[tensor]
        return fp32_noise(self.float64.get(tensor), ref)


def fp32_noise(exact: npt.NDArray[Any], value: npt.NDArray[Any]) -> float | None:
    """rel_l2 of ``value`` against its float64 computation ``exact`` over the elements finite
    in both; None where the two are not the same float tensor."""
    if exact.shape != value.shape or not np.issubdtype(exact.dtype, np.floating):
        return None
    d2 = r2 = 0.0
    flat, at = np.ravel(value), 0
    for (e,) in blocks(exact):
        # ``value`` (float32) is widened inside the subtraction, not copied to float64 first.
        v, at = flat[at : at + e.size], at + e.size
        with np.errstate(invalid="ignore", over="ignore"):  # inf - inf: left out below
            d = np.subtract(v, e, dtype=np.float64)
        dd, ee = dot(d, d), dot(e, e)
        if not (math.isfinite(dd) and math.isfinite(ee)):
            # Rare: only then pay for the mask and the copies it makes.
            finite = np.isfinite(e) & np.isfinite(v)
            e, d = e[finite], d[finite]
            dd, ee = dot(d, d), dot(e, e)
        d2, r2 = d2 + dd, r2 + ee
    return norm_ratio(d2, r2)
