"""``compare_tensors``: one reference tensor against one target tensor under a ``Criterion``.

NaN/Inf placement is compared separately (a mismatch always diverges), integer and bool
tensors exactly, floats through every metric in one pass.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from onnx_bisect.compare.criterion import Comparison, Criterion, Status
from onnx_bisect.compare.metrics import METRICS, MetricSums, blocks, dot, norm_ratio
from onnx_bisect.compare.precision import held_in_range, range_problem, sampling_floor
from onnx_bisect.compare.quant import QParams, dequantize
from onnx_bisect.text import plural

__all__ = ["REFERENCE_ABS_FLOOR", "compare_tensors"]

# Below this max_abs × max(1, peak |float64|), a reference that is off is not called off.
REFERENCE_ABS_FLOOR = 1e-6

Array = npt.NDArray[np.generic]


def _kind(a: Array) -> str:
    return _dtype_kind(a.dtype)


# Cached per dtype: a scan compares every tensor, and these cost more than the metrics of a
# small one (str(dtype) alone is ~15 us).
@functools.cache
def _dtype_kind(dtype: np.dtype[Any]) -> str:
    if np.issubdtype(dtype, np.floating) or dtype.name in ("bfloat16", "float8_e4m3fn"):
        return "float"
    if dtype == np.bool_:
        return "bool"
    if np.issubdtype(dtype, np.integer):
        return "int"
    return dtype.name


@functools.cache
def _dtype_text(dtype: np.dtype[Any]) -> str:
    return str(dtype)


def compare_tensors(
    name: str, ref: Array | None, target: Array | None, crit: Criterion
) -> Comparison:
    """Compare one tensor. Non-float tensors must match exactly; NaN/Inf placement must agree."""
    if ref is None or target is None:
        missing = "target" if target is None else "reference"
        return Comparison(name, Status.MISSING, math.nan, reason=f"{missing} did not produce it")
    ref, target = np.asarray(ref), np.asarray(target)
    rd, td = _dtype_text(ref.dtype), _dtype_text(target.dtype)
    shape = tuple(ref.shape)

    def mismatch(status: Status, reason: str) -> Comparison:
        return Comparison(
            name, status, math.nan, shape=shape, ref_dtype=rd, target_dtype=td, reason=reason
        )

    if ref.shape != target.shape:
        return mismatch(Status.SHAPE, f"shape {tuple(target.shape)} != reference {shape}")
    if _kind(ref) != _kind(target):
        return mismatch(Status.DTYPE, f"dtype {target.dtype} != reference {ref.dtype}")
    bound = crit.quant_bounds.get(name) if crit.quant_bounds else None
    if bound is not None:
        flipped = _within_flips(name, ref, target, bound, crit)
        if flipped is not None:
            return flipped
    limit, noise = crit.threshold_for(name, ref)
    lowered = _Lowered()
    grid = crit.quantized.get(name) if crit.quantized else None
    if grid is not None and _kind(ref) == "float" and _on_grid(ref, target, grid, crit):
        judged = _judge_float(ref.ravel(), target.ravel(), crit, math.inf)
        status, metrics, misplaced, _, _ = judged
        reason = f"dequantized, within {plural(crit.quant_steps, 'quantization step')}"
        lowered, off = _Lowered(None, True), ""
    elif _kind(ref) == "float":
        judged = _judge_float(ref.ravel(), target.ravel(), crit, limit)
        if crit.floors is not None and judged[0] is not Status.OK:
            held = held_in_range(ref, target, crit.floors.precision)
            if held is not target:  # values beyond the precision's range, held at its edge
                target = held
                judged = _judge_float(ref.ravel(), target.ravel(), crit, limit)
        status, metrics, misplaced, reason, finite = judged
        if crit.floors is not None:
            status, reason, lowered = _precision(name, ref, target, crit, judged)
        off = ""
        if crit.truth is not None:
            # With every value finite, the reference's rel_l2 against float64 is its noise
            # floor, just measured: at or under the bound, it is not off (half the scan's
            # comparison time at auto, on YOLOv8n, went to the full check).
            # The floor is the reference's own distance from float64, except where it is the
            # oracle twin's (``NoiseFloor.twin_only``): then that distance is measured here.
            twin = name in getattr(crit.noise, "twin_only", ())
            off = _reference_off(name, ref, target, crit, noise if finite and not twin else None)
        if off:
            status, reason = Status.DIVERGED, off
    else:
        p = crit.quantized.get(name) if crit.quantized else None
        stepped = _judge_steps(ref, target, p, crit.quant_steps) if p is not None else None
        if stepped is not None:
            status, metrics, reason, lowered = stepped
        else:
            status, metrics, _, reason = _judge_exact(ref.ravel(), target.ravel())
        misplaced, off = _Misplaced(), ""
    return Comparison(
        name,
        status,
        metrics[crit.key],
        metrics,
        shape=tuple(ref.shape),
        nonfinite_mismatch=misplaced.count,
        nonfinite=misplaced.label,
        target_nan=misplaced.target_nan,
        target_inf=misplaced.target_inf,
        reason=reason,
        ref_dtype=rd,
        target_dtype=td,
        threshold=None if crit.allclose else lowered.limit or limit,
        noise=noise,
        reference_off=bool(off),
        precision_floor=lowered.floor,
        within_precision=lowered.within,
        range_problem=lowered.problem,
        insignificant=reason if status is Status.OK and reason else "",
    )


@dataclass(frozen=True)
class _Lowered:
    floor: float | None = None
    within: bool = False
    problem: str = ""
    # The bound the error was held against where the precision's floor judged it (k × floor
    # + eps): the threshold to show beside a ``precision`` verdict, not fp32 noise's.
    limit: float | None = None


def _precision(
    name: str,
    ref: Array,
    target: Array,
    crit: Criterion,
    judged: tuple[Status, dict[str, float], _Misplaced, str, bool],
) -> tuple[Status, str, _Lowered]:
    """A lower-precision target's judgement: values the precision cannot hold (a range
    problem) diverge whatever the error; an error within k × the precision floor + eps is
    what the precision predicts."""
    status, metrics, _, reason, _ = judged
    assert crit.floors is not None
    problem = range_problem(ref, target, crit.floors.precision)
    bound = crit.precision_limit(name)
    if status is Status.DIVERGED and bound is not None and metrics["rel_l2"] > bound[0]:
        # Past the twin's floor: a tensor of few values gets the floor its sampling allows
        # (computed only here, where it can change the verdict: it costs a pass).
        few = sampling_floor(ref, crit.floors.precision)
        if few > bound[1]:
            bound = crit.precision_bound(few)
    floor = bound[1] if bound else None
    if problem:
        status = Status.NONFINITE if status is Status.NONFINITE else Status.DIVERGED
        return status, problem, _Lowered(floor, False, problem)
    if status is Status.DIVERGED and bound is not None and metrics["rel_l2"] <= bound[0]:
        return Status.OK, "", _Lowered(floor, True, limit=bound[0])
    judged_by_floor = bound[0] if status is Status.DIVERGED and bound is not None else None
    if judged_by_floor is not None and floor is not None:
        # The words name the bound that judged it, as the threshold field does (the fp32
        # noise's 1e-05 was said beside a threshold of 1.15e-03: zoo G3).
        reason = (
            f"rel_l2={metrics['rel_l2']:.3g} > threshold {judged_by_floor:.3g} "
            f"({crit.k:g} × the {crit.floors.precision.value} floor {floor:.3g} + {crit.eps:g})"
        )
    return status, reason, _Lowered(floor, limit=judged_by_floor)


_Judged = tuple[Status, dict[str, float], int, str]


def _judge_exact(ref: Array, target: Array) -> _Judged:
    """Integers and booleans: any differing element is a divergence, whatever the metric.
    Counted on the original values, and every metric is the share of differing elements: as
    floats, int64 sentinels (INT64_MIN/MAX) give errors of 9e18 that mean nothing."""
    differ = int(np.count_nonzero(ref != target))
    share = differ / ref.size if ref.size else 0.0
    metrics = {"rel_l2": share, "max_abs": share, "mean_abs": share, "mismatch": share,
               "cosine": 1.0 - share, "sqnr_db": math.inf if not differ else 0.0}  # fmt: skip
    if differ:
        reason = f"{differ} of {ref.size} elements differ (exact comparison)"
        return Status.DIVERGED, metrics, 0, reason
    return Status.OK, metrics, 0, ""


# A row counts as moved by a flip where some element moved by more than this share of the
# bound (fp32 rounding is ~1e-6 of it), and at most this share of the rows may have moved.
FLIP_SHARE, FLIPPED_ROWS = 1e-3, 0.25


def _within_flips(
    name: str, ref: Array, target: Array, bound: Array, crit: Criterion
) -> Comparison | None:
    """``target`` differs from ``ref`` somewhere, nowhere by more than what its integer
    inputs one step apart make (``bound``: per last-axis column, or per channel shaped to
    broadcast, (M, 1, 1) for a convolution's output): within the int8 precision. None where it
    is not so (judged as any tensor then)."""
    r, t = np.asarray(ref, np.float64), np.asarray(target, np.float64)
    d = np.abs(t - r)
    if not d.size or not np.all(np.isfinite(d)) or not _broadcasts(bound, d):
        return None
    share = d / np.maximum(bound, 1e-30)
    worst = float(np.max(share))
    if not 0.0 < worst <= crit.quant_steps:
        return None
    # A flipped input element moves one row (all axes but the bound's, a column or a
    # channel) of the result; a kernel that is off moves every row, by less than the
    # worst-case bound when it is a few percent: past a quarter of the rows, the difference
    # is not a few flips.
    if bound.ndim > 1 and share.ndim >= bound.ndim:
        share = np.moveaxis(share, share.ndim - bound.ndim, -1)
    rows = share.reshape(-1, share.shape[-1]) if share.ndim else share.reshape(1, 1)
    if float(np.mean(np.any(rows > FLIP_SHARE, axis=1))) > FLIPPED_ROWS:
        return None
    diff = (t - r).ravel()
    err, norm = float(np.linalg.norm(diff)), float(np.linalg.norm(r))
    rel = err / norm if norm else math.inf
    cos = float(np.dot(r.ravel(), t.ravel())) / (norm * float(np.linalg.norm(t)) or 1.0)
    metrics = {"rel_l2": rel, "max_abs": float(np.max(d)), "mean_abs": float(np.mean(d)),
               "mismatch": float(np.count_nonzero(diff)) / diff.size, "cosine": cos,
               "sqnr_db": 20 * math.log10(norm / err) if err and norm else math.inf}  # fmt: skip
    reason = (
        f"within what its integer inputs one quantization step apart make "
        f"({worst:.2g} of that bound)"
    )
    return Comparison(
        name, Status.OK, metrics[crit.key], metrics, shape=tuple(r.shape), reason=reason,
        ref_dtype=_dtype_text(ref.dtype), target_dtype=_dtype_text(target.dtype),
        within_precision=True,
    )  # fmt: skip


def _broadcasts(bound: Array, d: Array) -> bool:
    """Whether ``bound`` applies to a difference of ``d``'s shape: one value, a column per
    last-axis element, or a channel axis shaped to broadcast, (M, 1, ..., 1)."""
    if bound.size == 1:
        return True
    if bound.ndim == 1:
        return d.ndim >= 1 and d.shape[-1] == bound.size
    if bound.ndim > d.ndim:
        return False
    channel = d.shape[d.ndim - bound.ndim]
    return tuple(bound.shape) == (channel,) + (1,) * (bound.ndim - 1)


def _on_grid(ref: Array, target: Array, p: QParams, crit: Criterion) -> bool:
    """A dequantized tensor that differs somewhere, by at most ``crit.quant_steps`` steps of
    its scale everywhere (and nowhere NaN): integer kernels rounding apart."""
    d = np.abs(np.asarray(target, np.float64) - np.asarray(ref, np.float64))
    step = float(np.min(p.scale))
    if not d.size or not np.all(np.isfinite(d)) or step <= 0:
        return False
    worst = float(np.max(d))
    return 0.0 < worst <= (crit.quant_steps + 0.01) * step


def _judge_steps(
    ref: Array, target: Array, p: QParams, slack: int
) -> tuple[Status, dict[str, float], str, _Lowered] | None:
    """A quantized tensor of one model on two backends, in real units: ``slack`` steps apart
    at most (one per integer kernel that rounded it) is integer kernels rounding differently
    (within precision); more is a divergence. None when its parameters do not fit."""
    steps = int(np.max(np.abs(ref.astype(np.int64) - target.astype(np.int64)), initial=0))
    try:
        r, t = dequantize(ref, p), dequantize(target, p)
    except ValueError:
        return None
    d = (t - r).ravel()
    differ = int(np.count_nonzero(d))
    norm = float(np.linalg.norm(r))
    err = float(np.linalg.norm(d))
    rel = err / norm if norm > 0 else (0.0 if err == 0 else math.inf)
    cos = float(np.dot(r.ravel(), t.ravel())) / (norm * float(np.linalg.norm(t)) or 1.0)
    metrics = {"rel_l2": rel, "max_abs": float(np.max(np.abs(d), initial=0.0)),
               "mean_abs": float(np.mean(np.abs(d))) if d.size else 0.0,
               "mismatch": differ / d.size if d.size else 0.0, "cosine": cos,
               "sqnr_db": 20 * math.log10(norm / err) if err and norm else math.inf}  # fmt: skip
    if not differ:
        return Status.OK, metrics, "", _Lowered()
    what = f"{differ} of {d.size} elements differ by up to {plural(steps, 'quantization step')}"
    if steps <= slack:
        return Status.OK, metrics, f"{what}: integer kernels rounding apart", _Lowered(None, True)
    return Status.DIVERGED, metrics, what, _Lowered()


class _Misplaced:
    """NaN and Inf at different places in the two tensors, counted block by block."""

    def __init__(self) -> None:
        self.count = self.target_nan = self.target_inf = 0
        self.nan = False  # a NaN among them: the error is NaN there, not inf

    def split(self, r: npt.NDArray[np.float64], t: npt.NDArray[np.float64]) -> npt.NDArray[Any]:
        """Counts the misplaced values of a block; the mask of the values finite in both."""
        fin_r, fin_t = np.isfinite(r), np.isfinite(t)
        rn, tn = np.isnan(r), np.isnan(t)
        ri, ti = np.isinf(r), np.isinf(t)
        # NaN and Inf must sit at the same places with the same sign; the rest compares as
        # values.
        bad = (rn != tn) | (ri != ti) | (ri & ti & (np.sign(r) != np.sign(t)))
        self.count += int(np.count_nonzero(bad))
        self.nan = self.nan or bool(np.any(bad & (rn | tn)))
        self.target_nan += int(np.count_nonzero(tn & fin_r))
        self.target_inf += int(np.count_nonzero(ti & fin_r))
        keep: npt.NDArray[Any] = fin_r & fin_t
        return keep

    @property
    def label(self) -> str:
        return "" if not self.count else "NaN" if self.nan else "inf"


def _judge_float(
    ref: Array, target: Array, crit: Criterion, limit: float
) -> tuple[Status, dict[str, float], _Misplaced, str, bool]:
    """The judgement, and whether every value of both was finite."""
    sums = MetricSums(crit.atol_value, crit.rtol_value)
    misplaced = _Misplaced()
    for r, t in blocks(ref, target):
        if not (np.isfinite(r).all() and np.isfinite(t).all()):
            keep = misplaced.split(r, t)
            r, t = r[keep], t[keep]
        sums.add(r, t)
    metrics = sums.metrics()
    if misplaced.count:
        # Misplaced values are values outside any tolerance.
        metrics["mismatch"] = (sums.far + misplaced.count) / (sums.n + misplaced.count)
        differ = "differs" if misplaced.count == 1 else "differ"
        reason = f"{plural(misplaced.count, 'NaN/Inf value')} {differ} from the reference"
        return Status.NONFINITE, metrics, misplaced, reason, False
    score = metrics[crit.key]
    finite = sums.n == ref.size
    if crit.exceeds(score, limit) and not _below_abs_floor(sums, crit):
        exceeded = _exceeded(crit, score, limit, sums)
        if crit.significance and sums.max_ad <= crit.significance * sums.ref_peak:
            # Said (the reason of an OK comparison), not counted: see ``insignificant``.
            why = (
                f"{exceeded}, but max_abs={sums.max_ad:.3g} is at most "
                f"{crit.significance:g} × its peak |value| {sums.ref_peak:.3g}"
            )
            return Status.OK, metrics, misplaced, why, finite
        return Status.DIVERGED, metrics, misplaced, exceeded, finite
    return Status.OK, metrics, misplaced, "", finite


def _exceeded(crit: Criterion, score: float, limit: float, sums: MetricSums) -> str:
    """Why a tensor diverges, as the comparison that holds: ``rel_l2=0.01 > threshold 0.001``
    (``fails rel_l2 > 0.001`` read as the opposite of what it meant)."""
    if crit.allclose:
        return f"{sums.far} of {sums.n} values outside {crit.describe()}"
    op = ">" if METRICS[crit.metric].higher_is_worse else "<"
    reason = f"{crit.key}={score:.3g} {op} threshold {limit:.3g}"
    if crit.abs_floor:
        reason += f" and max_abs={sums.max_ad:.3g} > {_floor(crit.abs_floor, sums.ref_peak):.3g}"
    return reason


def _below_abs_floor(sums: MetricSums, crit: Criterion) -> bool:
    if not crit.abs_floor or not sums.n:
        return False
    return sums.max_ad <= _floor(crit.abs_floor, sums.ref_peak)


def _floor(per_unit: float, peak: float) -> float:
    """An absolute floor of ``per_unit`` × max(1, peak |values|): a few fp32 ulps of the
    tensor's scale, however small its values are."""
    return per_unit * max(1.0, peak)


def _reference_off(
    name: str, ref: Array, target: Array, crit: Criterion, ref_noise: float | None
) -> str:
    """Why the reference, not the target, is off at ``name`` ("" if it is not): the target is
    within fp32 noise of float64 and the reference is not. The noise is the oracle's own fp32
    run's, so a wrong reference cannot excuse itself by inflating its noise floor.
    ``ref_noise``: the reference's rel_l2 against float64 over the same elements, if known."""
    assert crit.truth is not None
    known = crit.truth(name)
    if known is None:
        return ""
    exact, oracle_noise = known
    bound = crit.k * oracle_noise + crit.eps
    if exact.shape != ref.shape or (ref_noise is not None and ref_noise <= bound):
        return ""
    # Sums of squares over the elements finite in all three, block by block.
    ee = rr = er = et = rt = 0.0
    peak = worst = 0.0
    for e, r, t in blocks(exact, ref, target):
        keep = np.isfinite(e) & np.isfinite(r) & np.isfinite(t)
        e, r, t = e[keep], r[keep], t[keep]
        if not e.size:
            continue
        ee, rr = ee + dot(e, e), rr + dot(r, r)
        er, et, rt = er + _sq(r - e), et + _sq(t - e), rt + _sq(t - r)
        peak = max(peak, float(np.max(np.abs(e))))
        worst = max(worst, float(np.max(np.abs(e - r))))
    ref_err, tgt_err = norm_ratio(er, ee), norm_ratio(et, ee)
    # As for the fixed threshold's floor: an error of a few ulps of max(1, peak) is no error,
    # however large relative to values driven to ~1e-5 (fp32 sigmoid tails differ by 1e-3).
    significant = worst > _floor(REFERENCE_ABS_FLOOR, peak)
    if significant and ref_err > bound and tgt_err <= bound and norm_ratio(rt, rr) > bound:
        return (
            f"the reference is off: rel_l2 against float64 is {ref_err:.3g} for the reference "
            f"and {tgt_err:.3g} for the target (fp32 noise bound {bound:.3g})"
        )
    return ""


def _sq(d: Array) -> float:
    return dot(d, d)
