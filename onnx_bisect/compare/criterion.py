"""What "diverged" means: the ``Criterion`` and the ``Comparison`` it yields for one tensor."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from enum import StrEnum

import numpy as np
import numpy.typing as npt

from onnx_bisect.compare.metrics import METRICS
from onnx_bisect.compare.precision import PrecisionFloors
from onnx_bisect.compare.quant import QParams
from onnx_bisect.text import fmt

__all__ = ["FLOOR_CAP", "Comparison", "Criterion", "NOISE_EPS", "NOISE_K", "Status"]

Array = npt.NDArray[np.generic]


# Noise-floor thresholds: diverged when error > K × (fp32 reference vs float64) + EPS. torch's
# `same()` uses a multiplier of 2-3 for fp64-anchored checks; two fp32 runtimes that sum in
# different orders can each sit on either side of the exact value, hence 4. EPS keeps tensors
# that fp32 computes exactly (copies, integer-valued math) from flagging last-bit noise.
NOISE_K = 4.0


NOISE_EPS = 1e-5


# The largest precision floor (rel_l2) a tensor is judged against: with k = 4 an error up to
# half the tensor's norm is still rounding, beyond it the tensor is lost, whatever the twin
# measured. A floor of 1 or more (a faithful twin whose probabilities came out all different)
# would pass any value at all.
FLOOR_CAP = 0.125


@dataclass(frozen=True)
class Criterion:
    """What "diverged" means: one metric against a threshold, or allclose(atol, rtol), or
    (``noise`` set) rel_l2 against ``k`` times the tensor's own fp32 noise floor plus ``eps``.

    ``noise(tensor, reference_value)`` returns how far the fp32 reference itself is from a
    float64 computation of that tensor (rel_l2), or None where it is not known.
    """

    metric: str = "rel_l2"
    threshold: float = 1e-3
    atol: float | None = None
    rtol: float | None = None
    noise: Callable[[str, Array], float | None] | None = field(default=None, compare=False)
    k: float = NOISE_K
    eps: float = NOISE_EPS
    # ``truth(tensor)``: the float64 value and the fp32 noise of the oracle's own fp32 run, or
    # None; decides which side is off when the reference itself is wrong.
    truth: Callable[[str], tuple[Array, float] | None] | None = field(default=None, compare=False)
    # Without float64 values: below this max_abs × max(1, peak |reference|), no divergence
    # (outputs driven to ~1e-5 by random inputs otherwise flag last-ulp noise as rel error).
    abs_floor: float = 0.0
    # A lower-precision target: each tensor's precision floor (``isolating``: the isolated
    # one, for nodes fed the reference's values); rel_l2 within k × floor + eps is what the
    # precision predicts, not a divergence.
    floors: PrecisionFloors | None = field(default=None, compare=False)
    isolating: bool = False
    # --threshold auto: an error whose max_abs is at most this × the tensor's own peak
    # |reference| is not significant (a sigmoid tail off by 4e-7 on a probability map).
    significance: float = 0.0
    # One quantized model on two backends: each integer tensor's scale and zero point. Such
    # a tensor compares in real units, and a difference of one step (two int8 kernels
    # rounding a tie apart) is within precision, not a divergence.
    quantized: Mapping[str, QParams] | None = field(default=None, compare=False)
    # How many steps apart such a tensor may be: one per integer kernel that rounded it (a
    # window of nodes run together rounds once in each).
    quant_steps: int = 1
    # One quantized model on two backends: per accumulator of an integer kernel (and its float
    # result), the largest difference per last-axis column that its integer inputs one step
    # apart can make. Held only where the inputs may differ (not ``for_isolation``).
    quant_bounds: Mapping[str, Array] | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if self.metric not in METRICS:
            raise ValueError(f"unknown metric {self.metric!r}; choose from {', '.join(METRICS)}")
        if self.noise is not None and (self.metric != "rel_l2" or self.allclose):
            raise ValueError("a noise-floor threshold (threshold='auto') needs metric rel_l2")

    def renamed(self, pairs: Mapping[str, str]) -> Criterion:
        """The criterion for another model's tensors: ``pairs`` maps each to the reference
        tensor holding its value; the noise and float64 truth of any other name are unknown
        (a same-named reference tensor may mean something else)."""
        noise, truth = self.noise, self.truth
        if noise is None:
            return self

        def renamed_noise(tensor: str, ref: Array) -> float | None:
            return noise(pairs[tensor], ref) if tensor in pairs else None

        def renamed_truth(tensor: str) -> tuple[Array, float] | None:
            return truth(pairs[tensor]) if truth is not None and tensor in pairs else None

        floors = self.floors.renamed(pairs) if self.floors is not None else None
        return replace(self, noise=renamed_noise, truth=renamed_truth, floors=floors)

    @property
    def auto(self) -> bool:
        return self.noise is not None

    def threshold_for(self, tensor: str, ref: Array) -> tuple[float, float | None]:
        """The threshold that applies to ``tensor``, and the noise floor it came from."""
        if self.noise is None:
            return self.threshold, None
        floor = self.noise(tensor, ref)
        if floor is None:
            return self.threshold, None
        return self.k * floor + self.eps, floor

    def precision_limit(self, tensor: str) -> tuple[float, float] | None:
        """The bound a lower precision's floor gives ``tensor`` (k × floor + eps), and the
        floor; None without one."""
        if self.floors is None:
            return None
        floor = self.floors.floor(tensor, isolating=self.isolating)
        return None if floor is None else self.precision_bound(floor)

    def precision_bound(self, floor: float) -> tuple[float, float]:
        """k × floor + eps and the floor, the floor capped at ``FLOOR_CAP``: a precision that
        predicts an error of the tensor's own size predicts nothing a wrong value would not
        pass (an fp16 floor of 1.03 on a probability vector allowed 4.1)."""
        floor = min(floor, FLOOR_CAP)
        return self.k * floor + self.eps, floor

    def for_isolation(self) -> Criterion:
        """The criterion for nodes fed the reference's values: isolated precision floors, and
        no bounds for flipped integer inputs (a kernel fed the reference's own integers)."""
        if self.floors is None and not self.quant_bounds:
            return self
        return replace(self, isolating=self.floors is not None, quant_bounds=None)

    @property
    def allclose(self) -> bool:
        return self.atol is not None or self.rtol is not None

    @property
    def key(self) -> str:
        """Name of the number that decides: the metric, or the allclose mismatch fraction."""
        return "mismatch" if self.allclose else self.metric

    def describe(self) -> str:
        """When a tensor diverges: ``rel_l2 > 0.001``."""
        if self.allclose:
            return f"allclose(atol={self.atol_value:g}, rtol={self.rtol_value:g})"
        op = ">" if METRICS[self.metric].higher_is_worse else "<"
        floor = f" and max_abs > {self.abs_floor:g} × max(1, |reference|)" if self.abs_floor else ""
        return f"{self.metric} {op} {self._limit()}{floor}"

    def agreement(self, measured: Comparison | None = None, *, largest: bool = False) -> str:
        """When a tensor agrees, the negation of ``describe()``: ``rel_l2 ≤ 0.001``. Said of
        outputs that pass, ``describe()`` read as if they had crossed the threshold. With
        ``measured`` (the worst output), its error beside the bound it was held against:
        ``rel_l2 4.1e-07 ≤ 4 × fp32 noise + 1e-05 = 2.3e-05``."""
        if self.allclose:
            return self.describe()
        op = "≤" if METRICS[self.metric].higher_is_worse else "≥"
        floor = f" or max_abs ≤ {self.abs_floor:g} × max(1, |reference|)" if self.abs_floor else ""
        if measured is None or self.key not in measured.metrics:
            return f"{self.metric} {op} {self._limit()}{floor}"
        value = f"{'largest ' if largest else ''}{self.metric} {measured.shown(self.key)}"
        bound = measured.threshold
        held = f" = {fmt(bound)}" if self.auto and bound is not None else ""
        return f"{value} {op} {self._limit()}{held}{floor}"

    def _limit(self) -> str:
        return f"{self.k:g} × fp32 noise + {self.eps:g}" if self.auto else f"{self.threshold:g}"

    @property
    def atol_value(self) -> float:
        return 1e-5 if self.atol is None else self.atol

    @property
    def rtol_value(self) -> float:
        return 1e-3 if self.rtol is None else self.rtol

    def badness(self, c: Comparison) -> float:
        """Orders comparisons worst-first: structural mismatches, then by the deciding number."""
        if c.status not in (Status.OK, Status.DIVERGED):
            return math.inf
        if math.isnan(c.score):
            return math.inf
        if self.allclose or METRICS[self.metric].higher_is_worse:
            return c.score
        return -c.score

    def exceeds(self, value: float, threshold: float | None = None) -> bool:
        limit = self.threshold if threshold is None else threshold
        if math.isnan(value):
            return True
        if self.allclose:
            return value > 0.0
        if METRICS[self.metric].higher_is_worse:
            return value > limit
        return value < limit


class Status(StrEnum):
    OK = "ok"
    DIVERGED = "diverged"
    NONFINITE = "nonfinite-mismatch"
    SHAPE = "shape-mismatch"
    DTYPE = "dtype-mismatch"
    MISSING = "missing"


@dataclass(frozen=True)
class Comparison:
    """The comparison of one tensor between reference and target."""

    tensor: str
    status: Status
    score: float
    metrics: Mapping[str, float] = field(default_factory=dict)
    ref_dtype: str = ""
    target_dtype: str = ""
    shape: tuple[int, ...] = ()
    nonfinite_mismatch: int = 0
    # Where NaN/Inf sit in different places, the metrics cover the elements finite in both
    # (an all-NaN tensor's would all be 0, which reads as bit-identical). ``nonfinite``: the
    # error once those elements count, "NaN" or "inf" ("" with none); ``target_nan`` and
    # ``target_inf``: the target's NaN and Inf values where the reference's are finite.
    nonfinite: str = ""
    target_nan: int = 0
    target_inf: int = 0
    reason: str = ""
    threshold: float | None = None  # what the deciding number was held against
    noise: float | None = None  # the fp32 noise floor behind an automatic threshold
    # A lower-precision target: the error its precision predicts here, and whether the error
    # is beyond fp32 noise but within k × that floor + eps (``within_precision``).
    precision_floor: float | None = None
    within_precision: bool = False
    # What the values show that the precision cannot explain (flush to 0, ±Inf, NaN, pinned
    # at the largest value), "" for nothing.
    range_problem: str = ""
    # Beyond the threshold but with max_abs at most ``Criterion.significance`` × the peak
    # |reference|: said in a note, not counted.
    insignificant: str = ""
    reference_off: bool = False  # the target agrees with float64 and the reference does not

    @property
    def diverged(self) -> bool:
        return self.status is not Status.OK

    @property
    def state(self) -> str:
        """The status for people: ``within precision`` where a lower precision's floor, not
        fp32 noise, is what the error is within."""
        return "within precision" if self.within_precision else self.status.value

    def shown(self, metric: str) -> str:
        """``metric`` for people: NaN or inf where NaN/Inf sit in different places, however
        small the error of the finite elements; "—" where it was not computed."""
        if self.nonfinite and metric in _WITH_INF:
            return "NaN" if self.nonfinite == "NaN" else _WITH_INF[metric]
        return fmt(self.metrics.get(metric))


# Each metric with an infinite error (a NaN error makes every one NaN); the allclose mismatch
# fraction counts the misplaced values, so it stays a number.
_WITH_INF = {"rel_l2": "inf", "max_abs": "inf", "mean_abs": "inf", "cosine": "NaN",
             "sqnr_db": "-inf"}  # fmt: skip
