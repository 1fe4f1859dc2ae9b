"""Pure tensor metrics, a registry of them, and the divergence decision.

Every metric takes ``(ref, target)`` arrays of the same shape and returns a float. Arrays are
upcast to float64 before differencing, so fp16/bf16 targets do not lose the error they make to
the subtraction itself. Nothing here divides by a bare ``abs(ref)``: element-wise relative error
explodes on ReLU zeros, so the relative metric is a ratio of norms.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum

import numpy as np
import numpy.typing as npt

__all__ = [
    "METRICS",
    "NOISE_EPS",
    "NOISE_K",
    "Comparison",
    "Criterion",
    "Metric",
    "Status",
    "all_metrics",
    "compare_tensors",
    "cosine",
    "max_abs",
    "mean_abs",
    "mismatch_fraction",
    "rel_l2",
    "sqnr_db",
]

Array = npt.NDArray[np.generic]
_F64 = npt.NDArray[np.float64]


def _f64(a: Array) -> _F64:
    return np.asarray(a, dtype=np.float64)


def max_abs(ref: Array, target: Array) -> float:
    if ref.size == 0:
        return 0.0
    return float(np.max(np.abs(_f64(target) - _f64(ref))))


def mean_abs(ref: Array, target: Array) -> float:
    if ref.size == 0:
        return 0.0
    return float(np.mean(np.abs(_f64(target) - _f64(ref))))


def rel_l2(ref: Array, target: Array) -> float:
    """‖t−r‖ / ‖r‖; an all-zero reference yields the absolute norm instead of a division by 0."""
    diff = float(np.linalg.norm((_f64(target) - _f64(ref)).ravel()))
    norm = float(np.linalg.norm(_f64(ref).ravel()))
    if norm == 0.0:
        return diff
    return diff / norm


def cosine(ref: Array, target: Array) -> float:
    """Cosine similarity; two all-zero tensors are identical (1.0), one all-zero one is 0.0."""
    r, t = _f64(ref).ravel(), _f64(target).ravel()
    nr, nt = float(np.linalg.norm(r)), float(np.linalg.norm(t))
    if nr == 0.0 and nt == 0.0:
        return 1.0
    if nr == 0.0 or nt == 0.0:
        return 0.0
    return float(np.dot(r, t) / (nr * nt))


def sqnr_db(ref: Array, target: Array) -> float:
    """Signal-to-quantization-noise ratio in dB; +inf when the tensors are equal."""
    noise = float(np.sum((_f64(target) - _f64(ref)) ** 2))
    signal = float(np.sum(_f64(ref) ** 2))
    if noise == 0.0:
        return math.inf
    if signal == 0.0:
        return -math.inf
    return 10.0 * math.log10(signal / noise)


def mismatch_fraction(ref: Array, target: Array, atol: float = 1e-5, rtol: float = 1e-3) -> float:
    """Fraction of elements outside ``np.isclose(target, ref, rtol, atol)``."""
    if ref.size == 0:
        return 0.0
    close = np.isclose(_f64(target), _f64(ref), rtol=rtol, atol=atol)
    return float(1.0 - np.count_nonzero(close) / close.size)


def all_metrics(ref: _F64, target: _F64, atol: float, rtol: float) -> dict[str, float]:
    """Every registry metric plus the allclose mismatch fraction, from one pass of reductions.

    Equal to calling each metric function (to rounding); the scan compares hundreds of tensors,
    and sharing the difference and the dot products makes that several times cheaper.
    """
    n = ref.size
    if n == 0:
        return {"rel_l2": 0.0, "max_abs": 0.0, "mean_abs": 0.0, "cosine": 1.0,
                "sqnr_db": math.inf, "mismatch": 0.0}  # fmt: skip
    d = target - ref
    ad = np.abs(d)
    d2, r2 = float(np.dot(d, d)), float(np.dot(ref, ref))
    t2, rt = float(np.dot(target, target)), float(np.dot(ref, target))
    rel = math.sqrt(d2) / math.sqrt(r2) if r2 > 0.0 else math.sqrt(d2)
    if r2 == 0.0 and t2 == 0.0:
        cos = 1.0
    elif r2 == 0.0 or t2 == 0.0:
        cos = 0.0
    else:
        cos = rt / (math.sqrt(r2) * math.sqrt(t2))
    if d2 == 0.0:
        sqnr = math.inf
    elif r2 == 0.0:
        sqnr = -math.inf
    else:
        sqnr = 10.0 * math.log10(r2 / d2)
    far = np.count_nonzero(ad > atol + rtol * np.abs(ref))
    return {
        "rel_l2": rel,
        "max_abs": float(ad.max()),
        "mean_abs": float(ad.mean()),
        "cosine": cos,
        "sqnr_db": sqnr,
        "mismatch": far / n,
    }


# Noise-floor thresholds: diverged when error > K × (fp32 reference vs float64) + EPS. torch's
# `same()` uses a multiplier of 2-3 for fp64-anchored checks; two fp32 runtimes that sum in
# different orders can each sit on either side of the exact value, hence 4. EPS keeps tensors
# that fp32 computes exactly (copies, integer-valued math) from flagging last-bit noise.
NOISE_K = 4.0
NOISE_EPS = 1e-5


@dataclass(frozen=True)
class Metric:
    name: str
    fn: Callable[[Array, Array], float]
    higher_is_worse: bool
    description: str


METRICS: Mapping[str, Metric] = {
    m.name: m
    for m in (
        Metric("rel_l2", rel_l2, True, "‖t−r‖₂ / ‖r‖₂"),
        Metric("max_abs", max_abs, True, "max |t−r|"),
        Metric("mean_abs", mean_abs, True, "mean |t−r|"),
        Metric("cosine", cosine, False, "cosine similarity (diverged when below threshold)"),
        Metric("sqnr_db", sqnr_db, False, "SQNR in dB (diverged when below threshold)"),
    )
}


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

    def __post_init__(self) -> None:
        if self.metric not in METRICS:
            raise ValueError(f"unknown metric {self.metric!r}; choose from {', '.join(METRICS)}")
        if self.noise is not None and (self.metric != "rel_l2" or self.allclose):
            raise ValueError("a noise-floor threshold (--threshold auto) needs --metric rel_l2")

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

    @property
    def allclose(self) -> bool:
        return self.atol is not None or self.rtol is not None

    @property
    def key(self) -> str:
        """Name of the number that decides: the metric, or the allclose mismatch fraction."""
        return "mismatch" if self.allclose else self.metric

    def describe(self) -> str:
        if self.allclose:
            return f"allclose(atol={self.atol_value:g}, rtol={self.rtol_value:g})"
        if self.auto:
            return f"{self.metric} > {self.k:g} × fp32 noise + {self.eps:g}"
        op = ">" if METRICS[self.metric].higher_is_worse else "<"
        return f"{self.metric} {op} {self.threshold:g}"

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
    reason: str = ""
    threshold: float | None = None  # what the deciding number was held against
    noise: float | None = None  # the fp32 noise floor behind an automatic threshold

    @property
    def diverged(self) -> bool:
        return self.status is not Status.OK


def _kind(a: Array) -> str:
    if np.issubdtype(a.dtype, np.floating) or a.dtype.name in ("bfloat16", "float8_e4m3fn"):
        return "float"
    if a.dtype == np.bool_:
        return "bool"
    if np.issubdtype(a.dtype, np.integer):
        return "int"
    return a.dtype.name


def compare_tensors(
    name: str, ref: Array | None, target: Array | None, crit: Criterion
) -> Comparison:
    """Compare one tensor. Non-float tensors must match exactly; NaN/Inf placement must agree."""
    if ref is None or target is None:
        missing = "target" if target is None else "reference"
        return Comparison(name, Status.MISSING, math.nan, reason=f"{missing} did not produce it")
    ref, target = np.asarray(ref), np.asarray(target)
    rd, td = str(ref.dtype), str(target.dtype)
    if ref.shape != target.shape:
        return Comparison(
            name,
            Status.SHAPE,
            math.nan,
            shape=tuple(ref.shape),
            ref_dtype=rd,
            target_dtype=td,
            reason=f"shape {tuple(target.shape)} != reference {tuple(ref.shape)}",
        )
    kr, kt = _kind(ref), _kind(target)
    if kr != kt:
        return Comparison(
            name,
            Status.DTYPE,
            math.nan,
            shape=tuple(ref.shape),
            ref_dtype=rd,
            target_dtype=td,
            reason=f"dtype {target.dtype} != reference {ref.dtype}",
        )
    limit, noise = crit.threshold_for(name, ref)
    judge = _judge_exact if kr != "float" else _judge_float
    status, metrics, nonfinite, reason = judge(ref.ravel(), target.ravel(), crit, limit)
    return Comparison(
        name,
        status,
        metrics[crit.key],
        metrics,
        shape=tuple(ref.shape),
        nonfinite_mismatch=nonfinite,
        reason=reason,
        ref_dtype=rd,
        target_dtype=td,
        threshold=None if crit.allclose else limit,
        noise=noise,
    )


_Judged = tuple[Status, dict[str, float], int, str]


def _judge_exact(ref: Array, target: Array, crit: Criterion, limit: float) -> _Judged:
    """Integers and booleans: any differing element is a divergence, whatever the metric.
    Counted on the original values: float64 cannot tell int64s above 2**53 apart."""
    metrics = all_metrics(_f64(ref), _f64(target), crit.atol_value, crit.rtol_value)
    differ = int(np.count_nonzero(ref != target))
    metrics["mismatch"] = differ / ref.size if ref.size else 0.0
    if differ:
        reason = f"{differ} of {ref.size} elements differ (exact comparison)"
        return Status.DIVERGED, metrics, 0, reason
    return Status.OK, metrics, 0, ""


def _judge_float(ref: Array, target: Array, crit: Criterion, limit: float) -> _Judged:
    r, t = _f64(ref), _f64(target)
    fin_r, fin_t = np.isfinite(r), np.isfinite(t)
    nonfinite = 0
    if not (fin_r.all() and fin_t.all()):
        # NaN and Inf must sit at the same places with the same sign; the rest compares as values.
        rn, tn = np.isnan(r), np.isnan(t)
        ri, ti = np.isinf(r), np.isinf(t)
        bad = (rn != tn) | (ri != ti) | (ri & ti & (np.sign(r) != np.sign(t)))
        nonfinite = int(np.count_nonzero(bad))
        keep = fin_r & fin_t
        r, t = r[keep], t[keep]
    metrics = all_metrics(r, t, crit.atol_value, crit.rtol_value)
    score = metrics[crit.key]
    if nonfinite:
        reason = f"{nonfinite} NaN/Inf values differ from the reference"
        return Status.NONFINITE, metrics, nonfinite, reason
    if crit.exceeds(score, limit):
        if crit.auto:
            return Status.DIVERGED, metrics, 0, f"{crit.key}={score:.3g} > threshold {limit:.3g}"
        return Status.DIVERGED, metrics, 0, f"{crit.key}={score:.3g} fails {crit.describe()}"
    return Status.OK, metrics, 0, ""
