"""``compare_tensors``: one reference tensor against one target tensor under a ``Criterion``.

NaN/Inf placement is compared separately (a mismatch always diverges), integer and bool
tensors exactly, floats through every metric in one pass.
"""

from __future__ import annotations

import math

import numpy as np
import numpy.typing as npt

from onnx_bisect.compare.criterion import Comparison, Criterion, Status
from onnx_bisect.compare.metrics import _f64, all_metrics

__all__ = ["compare_tensors"]

Array = npt.NDArray[np.generic]


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
    shape = tuple(ref.shape)

    def mismatch(status: Status, reason: str) -> Comparison:
        return Comparison(
            name, status, math.nan, shape=shape, ref_dtype=rd, target_dtype=td, reason=reason
        )

    if ref.shape != target.shape:
        return mismatch(Status.SHAPE, f"shape {tuple(target.shape)} != reference {shape}")
    if _kind(ref) != _kind(target):
        return mismatch(Status.DTYPE, f"dtype {target.dtype} != reference {ref.dtype}")
    limit, noise = crit.threshold_for(name, ref)
    judge = _judge_exact if _kind(ref) != "float" else _judge_float
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
