"""Noise floors: how far an fp32 reference is from float64, per tensor.

``--threshold auto`` runs the float64 reference (``ref?dtype=float64``) once with every probe
marked and calls a tensor diverged when the target's error exceeds k × (fp32 reference vs
float64) + eps. An early Conv whose fp32 rounding is 1e-7 then flags a 0.2% kernel error, and a
deep tensor whose fp32 rounding has grown to 1e-4 does not flag that rounding.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import numpy as np
import numpy.typing as npt

from onnx_bisect.adapters.base import create_backend
from onnx_bisect.metrics import rel_l2
from onnx_bisect.model import LoadedModel, with_outputs
from onnx_bisect.run import RunStats, TensorStore, plan_chunks, timed_run

__all__ = ["NoiseFloor", "measure_float64"]

log = logging.getLogger(__name__)


class NoiseFloor:
    """``noise(tensor, fp32_reference_value)`` → rel_l2 against the float64 value, cached."""

    def __init__(self, float64: TensorStore) -> None:
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


def measure_float64(
    loaded: LoadedModel,
    feeds: Mapping[str, npt.NDArray[Any]],
    sizes: Mapping[str, int | None],
    budget: int,
    store: TensorStore,
    stats: RunStats,
) -> None:
    """Every probe computed in float64 by the reference evaluator, into ``store``."""
    backend = create_backend("ref?dtype=float64")
    doubled = {k: None if v is None else 2 * v for k, v in sizes.items()}
    for chunk in plan_chunks(loaded.probes, doubled, budget):
        out = timed_run(backend, with_outputs(loaded.model, chunk), feeds, "float64", stats)
        for name in chunk:
            store.put(name, out[name])
    log.info("float64 reference: %d tensors", len(loaded.probes))
