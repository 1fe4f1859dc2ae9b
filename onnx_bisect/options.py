"""Options of a diagnosis: one definition of every option and its default, for the API and the
CLI (whose defaults are read from ``BisectOptions()``)."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy.typing as npt
import onnx

from onnx_bisect.compare.criterion import NOISE_EPS, NOISE_K, Criterion
from onnx_bisect.compare.topk import TopKSpec, parse_topk
from onnx_bisect.errors import InputError
from onnx_bisect.inputs.values import check_fills

__all__ = ["DEFAULT_MAX_MEMORY", "STRATEGIES", "BisectOptions", "ModelLike"]

DEFAULT_MAX_MEMORY = 4 << 30
STRATEGIES = ("auto", "scan", "bisect")
ModelLike = str | os.PathLike[str] | onnx.ModelProto


@dataclass(frozen=True)
class BisectOptions:
    """How to diagnose; see ``onnx_bisect.bisect`` for what each option does."""

    inputs: Path | Mapping[str, npt.NDArray[Any]] | None = None
    shapes: Mapping[str, Sequence[int]] | None = None
    # Generated inputs only: input name -> every element this constant (ints kept exact) ...
    values: Mapping[str, float] | None = None
    # ... or -> (low, high): floats uniform in [low, high), integers in [low, high] inclusive.
    ranges: Mapping[str, tuple[float, float]] | None = None
    seed: int = 0
    metric: str = "rel_l2"
    threshold: float | str = "auto"
    noise_k: float = NOISE_K
    noise_eps: float = NOISE_EPS
    atol: float | None = None
    rtol: float | None = None
    max_memory: int = DEFAULT_MAX_MEMORY
    parallel: bool = True
    always_scan: bool = False
    strategy: str = "auto"
    isolate_crashes: bool | None = None
    timeout: float | None = None
    repro: str | os.PathLike[str] | None = None
    target_model: ModelLike | None = None
    topk: Sequence[str | TopKSpec] = ()
    unroll_max: int = 64
    # After a divergence: which optimizer passes of the target cause it (auto: divergences
    # only; on: failures too; off: never), and the pass names of an exec: runtime.
    bisect_passes: str = "auto"
    passes: Sequence[str] = ()
    command: str = ""

    def __post_init__(self) -> None:
        # What needs no model fails here, before anything loads; the rest in make_feeds.
        check_fills(self.values, self.ranges)
        if self.bisect_passes not in ("auto", "on", "off"):
            raise InputError(
                f"bisect_passes must be one of auto, on, off, got {self.bisect_passes!r}"
            )
        if not isinstance(self.unroll_max, int) or self.unroll_max < 0:
            raise InputError(f"unroll_max must be an integer >= 0, got {self.unroll_max!r}")

    @property
    def auto_threshold(self) -> bool:
        """``threshold="auto"`` (the default): per-tensor noise floors measured against
        float64. They exist for rel_l2 only, so another metric or --atol/--rtol keeps the
        fixed 1e-3 that "auto" stands for there."""
        return (
            self._auto_requested
            and self.metric == "rel_l2"
            and self.atol is None
            and self.rtol is None
        )

    @property
    def _auto_requested(self) -> bool:
        return isinstance(self.threshold, str) and self.threshold.strip().lower() == "auto"

    def criterion(self) -> Criterion:
        """The fixed part of the criterion (a noise floor is added once it is measured);
        raises InputError for values that make no criterion."""
        if self.strategy not in STRATEGIES:
            raise InputError(
                f"unknown strategy {self.strategy!r}; choose from {', '.join(STRATEGIES)}"
            )
        try:
            fixed = 1e-3 if self._auto_requested else float(self.threshold)
            crit = Criterion(metric=self.metric, threshold=fixed, atol=self.atol, rtol=self.rtol)
        except ValueError as exc:
            raise InputError(str(exc)) from None
        return crit

    def topk_specs(self) -> tuple[TopKSpec, ...]:
        return tuple(parse_topk(t) if isinstance(t, str) else t for t in self.topk)
