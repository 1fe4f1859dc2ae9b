"""``--threshold auto`` with a PyTorch side: each mapped tensor's fp32 noise floor from the
module's precision twin (``capture.precision_twin``), as the float64 oracle gives it for two
backends: rel_l2 of the float32 run against the float64 run, per module output and per model
output. A float64 module's own run is the float64 one, its float32 twin the other."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from onnx_bisect.compare.criterion import Criterion
from onnx_bisect.compare.metrics import rel_l2
from onnx_bisect.engine.torchref.capture import Captured
from onnx_bisect.engine.torchref.mapping import Mapped
from onnx_bisect.options import BisectOptions

__all__ = ["noise_criterion", "noise_floors", "precision_note"]

Array = npt.NDArray[Any]


def noise_floors(
    got: Captured, twin: Captured, mapped: Sequence[Mapped], outputs: Sequence[str]
) -> dict[str, float]:
    """Per ONNX tensor (a mapped module's, a model output), the fp32 noise of its value."""
    floors: dict[str, float] = {}
    pairs = [(m.tensor, got.outputs.get(m.module), twin.outputs.get(m.module)) for m in mapped]
    pairs += list(zip(outputs, got.final, twin.final, strict=False))
    for tensor, mine, other in pairs:
        if mine is None or other is None or mine.shape != other.shape:
            continue
        if mine.dtype.kind != "f" or other.dtype.kind != "f":
            continue
        exact, fp32 = (mine, other) if mine.dtype == np.float64 else (other, mine)
        floors[tensor] = rel_l2(exact.astype(np.float64), fp32.astype(np.float64))
    return floors


def noise_criterion(opts: BisectOptions, floors: Mapping[str, float]) -> Criterion:
    """``--threshold auto``'s criterion on those floors (a tensor without one: 1e-3)."""

    def noise(tensor: str, _ref: Array) -> float | None:
        return floors.get(tensor)

    return opts.noise_criterion(noise)


def precision_note(auto: bool, module64: bool, floors: Mapping[str, float]) -> list[str]:
    """What the run says of the precisions: where the floors came from, and a float64
    module against a float32 ONNX model."""
    notes = []
    if auto:
        twin = "float32" if module64 else "float64"
        notes.append(
            f"--threshold auto: each tensor's fp32 noise from the module run in {twin} "
            f"({len(floors)} tensors; 1e-3 where none)"
        )
    if module64:
        notes.append(
            "the module computes in float64, the ONNX model in float32: differences up to "
            "float32's noise are expected (--threshold auto measures it per tensor); export "
            "after model.float() to compare like with like"
        )
    return notes
