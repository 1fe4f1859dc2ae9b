"""Pure tensor metrics, a registry of them, and the divergence decision.

Every metric takes ``(ref, target)`` arrays of the same shape and returns a float. Arrays are
upcast to float64 before differencing, so fp16/bf16 targets do not lose the error they make to
the subtraction itself. Nothing here divides by a bare ``abs(ref)``: element-wise relative error
explodes on ReLU zeros, so the relative metric is a ratio of norms.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

__all__ = [
    "METRICS",
    "Metric",
    "all_metrics",
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
