"""Pure tensor metrics, a registry of them, and the divergence decision.

Every metric takes ``(ref, target)`` arrays of the same shape and returns a float. Arrays are
upcast to float64 before differencing, so fp16/bf16 targets do not lose the error they make to
the subtraction itself. Nothing here divides by a bare ``abs(ref)``: element-wise relative error
explodes on ReLU zeros, so the relative metric is a ratio of norms.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

__all__ = [
    "COMPARE_BLOCK",
    "METRICS",
    "Metric",
    "MetricSums",
    "all_metrics",
    "blocks",
    "cosine",
    "dot",
    "max_abs",
    "mean_abs",
    "mismatch_fraction",
    "norm_ratio",
    "rel_l2",
    "sqnr_db",
]

Array = npt.NDArray[np.generic]


_F64 = npt.NDArray[np.float64]


def _f64(a: Array) -> _F64:
    return np.asarray(a, dtype=np.float64)


def dot(a: npt.NDArray[Any], b: npt.NDArray[Any]) -> float:
    """Σ a·b of two flat float64 arrays, on this thread. ``np.dot`` hands a vector this long to
    BLAS, whose threads fight the runtimes' for the cores: on a busy 2-core machine each call
    of 25k values took 15-55 ms instead of 4 µs (issue 28). einsum's own loop has no threads
    and, unlike ``(a * b).sum()``, no temporary array."""
    return float(np.einsum("i,i->", a, b))


# Elements per block when comparing: the float64 copies and differences of a block take a few
# tens of MiB however large the tensor (whole, a 64 MiB float32 tensor took ~700 MB of them).
COMPARE_BLOCK = 1 << 20


def blocks(*arrays: Array) -> Iterator[tuple[_F64, ...]]:
    """The arrays (same size), flattened, in float64 pieces of ``COMPARE_BLOCK`` elements."""
    flat = [np.ravel(a) for a in arrays]  # a view of a contiguous or memory-mapped array
    for start in range(0, flat[0].size, COMPARE_BLOCK):
        yield tuple(_f64(f[start : start + COMPARE_BLOCK]) for f in flat)


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
    d2 = r2 = 0.0
    for r, t in blocks(ref, target):
        d = t - r
        d2 += dot(d, d)
        r2 += dot(r, r)
    return norm_ratio(d2, r2)


def norm_ratio(d2: float, r2: float) -> float:
    """rel_l2 from its sums of squares (the absolute norm where the reference is all zero)."""
    return math.sqrt(d2) / math.sqrt(r2) if r2 > 0.0 else math.sqrt(d2)


def cosine(ref: Array, target: Array) -> float:
    """Cosine similarity; two all-zero tensors are identical (1.0), one all-zero one is 0.0."""
    r, t = _f64(ref).ravel(), _f64(target).ravel()
    nr, nt = math.sqrt(dot(r, r)), math.sqrt(dot(t, t))
    if nr == 0.0 and nt == 0.0:
        return 1.0
    if nr == 0.0 or nt == 0.0:
        return 0.0
    return dot(r, t) / (nr * nt)


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


class MetricSums:
    """Every registry metric plus the allclose mismatch fraction, accumulated block by block
    (``add``) from one pass of reductions; ``metrics()`` gives them. Equal to calling each
    metric function (to rounding); the scan compares hundreds of tensors, and sharing the
    difference and the dot products makes that several times cheaper. ``ref_peak`` is the
    largest |reference| seen, for absolute floors."""

    def __init__(self, atol: float, rtol: float) -> None:
        self.atol, self.rtol = atol, rtol
        self.n = self.far = 0
        self.d2 = self.r2 = self.t2 = self.rt = self.sum_ad = self.max_ad = self.ref_peak = 0.0

    def add(self, ref: _F64, target: _F64) -> None:
        if not ref.size:
            return
        # Two block-sized temporaries, reused in place: the scan compares thousands of tensors.
        d = target - ref
        self.n += ref.size
        self.d2 += dot(d, d)
        self.r2 += dot(ref, ref)
        self.t2 += dot(target, target)
        self.rt += dot(ref, target)
        ad = np.abs(d, out=d)
        self.sum_ad += float(ad.sum())
        self.max_ad = max(self.max_ad, float(ad.max()))
        bound = np.abs(ref)
        self.ref_peak = max(self.ref_peak, float(bound.max()))
        bound *= self.rtol
        bound += self.atol
        self.far += int(np.count_nonzero(ad > bound))

    def metrics(self) -> dict[str, float]:
        if not self.n:
            return {"rel_l2": 0.0, "max_abs": 0.0, "mean_abs": 0.0, "cosine": 1.0,
                    "sqnr_db": math.inf, "mismatch": 0.0}  # fmt: skip
        d2, r2, t2 = self.d2, self.r2, self.t2
        if r2 == 0.0 and t2 == 0.0:
            cos = 1.0
        elif r2 == 0.0 or t2 == 0.0:
            cos = 0.0
        else:
            cos = self.rt / (math.sqrt(r2) * math.sqrt(t2))
        if d2 == 0.0:
            sqnr = math.inf
        elif r2 == 0.0:
            sqnr = -math.inf
        else:
            sqnr = 10.0 * math.log10(r2 / d2)
        return {
            "rel_l2": norm_ratio(d2, r2),
            "max_abs": self.max_ad,
            "mean_abs": self.sum_ad / self.n,
            "cosine": cos,
            "sqnr_db": sqnr,
            "mismatch": self.far / self.n,
        }


def all_metrics(ref: Array, target: Array, atol: float, rtol: float) -> dict[str, float]:
    """Every registry metric plus the allclose mismatch fraction (``MetricSums``), computed
    in blocks of ``COMPARE_BLOCK`` elements."""
    sums = MetricSums(atol, rtol)
    for r, t in blocks(ref, target):
        sums.add(r, t)
    return sums.metrics()


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
