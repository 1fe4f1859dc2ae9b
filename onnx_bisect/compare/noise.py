"""Noise floors: how far an fp32 reference is from float64, per tensor.

``--threshold auto`` runs the float64 reference (``ref?dtype=float64``) once with every probe
marked and calls a tensor diverged when the target's error exceeds k × (fp32 reference vs
float64) + eps. An early Conv whose fp32 rounding is 1e-7 then flags a 0.2% kernel error, and a
deep tensor whose fp32 rounding has grown to 1e-4 does not flag that rounding.
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from onnx_bisect.compare.metrics import rel_l2

__all__ = ["Float64Values", "NoiseFloor"]


class Float64Values(Protocol):
    """Where the float64 values are (a ``TensorStore``): looked up by tensor name."""

    def __contains__(self, name: object) -> bool: ...

    def get(self, name: str) -> npt.NDArray[Any]: ...


class NoiseFloor:
    """``noise(tensor, fp32_reference_value)`` → rel_l2 against the float64 value, cached."""

    def __init__(self, float64: Float64Values) -> None:
        self.float64 = float64
        self._cache: dict[str, float | None] = {}

    def __call__(self, tensor: str, ref: npt.NDArray[Any]) -> float | None:
        if tensor not in self._cache:
            self._cache[tensor] = self._measure(tensor, ref)
        return self._cache[tensor]

    def _measure(self, tensor: str, ref: npt.NDArray[Any]) -> float | None:
        if tensor not in self.float64:
            return None
        exact = self.float64.get(tensor)
        if exact.shape != ref.shape or not np.issubdtype(exact.dtype, np.floating):
            return None
        finite = np.isfinite(exact) & np.isfinite(np.asarray(ref, dtype=np.float64))
        return rel_l2(exact[finite], np.asarray(ref)[finite])
