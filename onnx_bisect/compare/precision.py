"""Lower precisions, pure: what a float16, bfloat16 or TF32 computation can hold, its rounding,
and the range problems seen in its values (overflow, flush to zero, NaN, saturation).

A target computing in a lower precision than the reference is expected to differ by its
rounding; these functions say what that rounding is and what is worse than rounding: a value
the precision can hold that came back as 0, Inf or NaN.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import numpy as np
import numpy.typing as npt

from onnx_bisect.compare.metrics import blocks, dot

__all__ = [
    "DATA_MOVEMENT",
    "FLOAT32_DEFAULT",
    "Format",
    "Precision",
    "PrecisionFloors",
    "PrecisionInfo",
    "format_of",
    "held_in_range",
    "parse_precision",
    "range_problem",
    "round_to",
    "sampling_floor",
]


class Precision(StrEnum):
    FLOAT32 = "float32"
    TF32 = "tf32"
    BFLOAT16 = "bfloat16"
    FLOAT16 = "float16"


@dataclass(frozen=True)
class PrecisionInfo:
    """What one side computes float32 work in, and where that is known from.

    ``source``: ``declared`` (the spec, a transform, ``--target-precision``, a model file of
    float16 tensors), ``observed`` (the runtime says what it picked) or ``default`` (nothing
    says otherwise: the model's own types). ``asked``: the user chose it; a runtime that lowers
    precision on its own is a finding, one the user asked for is not."""

    precision: Precision
    source: str
    how: str
    asked: bool

    @property
    def lowered(self) -> bool:
        return self.precision is not Precision.FLOAT32

    def describe(self) -> str:
        return f"{self.precision.value} ({self.source}: {self.how})"


FLOAT32_DEFAULT = PrecisionInfo(Precision.FLOAT32, "default", "the model's own types", False)


@dataclass(frozen=True)
class PrecisionFloors:
    """The error a lower precision predicts per tensor, measured by the float64 oracle's
    faithful twin (``torch:cpu?round=``): ``accumulated`` over the whole run, ``isolated`` for
    the node fed exact operands. Keyed by the reference model's tensor names."""

    precision: Precision
    accumulated: Mapping[str, float] = field(default_factory=dict)
    isolated: Mapping[str, float] = field(default_factory=dict)

    def floor(self, tensor: str, *, isolating: bool) -> float | None:
        """A node fed exact operands is held to its isolated floor; where the twin could not
        run it alone (an If, a Loop: a subgraph), to the floor of the whole run up to it,
        never to fp32 noise (zoo G2: a model that is one If, judged at 2e-5)."""
        if isolating and tensor in self.isolated:
            return self.isolated[tensor]
        return self.accumulated.get(tensor)

    def renamed(self, pairs: Mapping[str, str]) -> PrecisionFloors:
        """For another model's tensors: ``pairs`` maps each to the reference tensor holding
        its value; other names have no floor."""

        def mapped(floors: Mapping[str, float]) -> dict[str, float]:
            return {t: floors[r] for t, r in pairs.items() if r in floors}

        return PrecisionFloors(self.precision, mapped(self.accumulated), mapped(self.isolated))


@dataclass(frozen=True)
class Format:
    """A floating-point format: mantissa bits (without the implicit one), the largest finite
    value and the smallest positive (subnormal where the format has them) value."""

    mantissa: int
    max: float
    tiny: float

    @property
    def unit(self) -> float:
        """Unit roundoff: the largest relative error of rounding one value to nearest."""
        return float(2.0 ** -(self.mantissa + 1))


_FORMATS = {
    Precision.FLOAT32: Format(23, float(np.finfo(np.float32).max), 1.4e-45),
    # TF32 keeps float32's range; only MatMul/Conv/Gemm operands lose mantissa bits.
    Precision.TF32: Format(10, float(np.finfo(np.float32).max), 1.4e-45),
    Precision.BFLOAT16: Format(7, 3.3895313892515355e38, 9.2e-41),
    Precision.FLOAT16: Format(10, 65504.0, 5.960464477539063e-08),
}

_ALIASES = {
    "float32": Precision.FLOAT32, "fp32": Precision.FLOAT32, "f32": Precision.FLOAT32,
    "tf32": Precision.TF32,
    "bfloat16": Precision.BFLOAT16, "bf16": Precision.BFLOAT16,
    "float16": Precision.FLOAT16, "fp16": Precision.FLOAT16, "f16": Precision.FLOAT16,
    "half": Precision.FLOAT16,
}  # fmt: skip

# Ops that move values without computing new ones: on any precision their output holds their
# inputs' values exactly (rounded once to the precision), so they are never where error starts.
DATA_MOVEMENT = frozenset(
    {
        "Reshape", "Transpose", "Slice", "Gather", "GatherElements", "GatherND", "Concat",
        "Split", "Squeeze", "Unsqueeze", "Identity", "Flatten", "Expand", "Tile", "Pad",
        "DepthToSpace", "SpaceToDepth", "ScatterND", "ScatterElements",
    }
)  # fmt: skip


# A flush zeroes at least this share of the values up to its zeros' size.
FLUSH_BAND = 0.9

# A sentinel (a reference value this many times beyond a format's largest) held this many
# binades below that largest (float16: 8188) or closer is clipped, not wrong:
# onnxconverter-common clips float16 constants to ±1e4.
SENTINEL = 1e4
CLIPPED_BINADES = 3

# A tensor whose rel_l2 rests on a few values may hold one of them this many units of roundoff
# (two units in the last place) further from float64 than the faithful twin's own draw did.
FEW_VALUES_UNITS = 4.0

# A zero counts as flushed where the reference is at least this many of the format's smallest
# steps from 0.
FLUSH_ULPS = 16


def parse_precision(text: str) -> Precision:
    """``float16``, ``fp16``, ``f16``, ``half``, ``bf16``, ``tf32``, ``float32``…"""
    try:
        return _ALIASES[text.strip().lower()]
    except KeyError:
        names = ", ".join(p.value for p in Precision)
        raise ValueError(f"unknown precision {text!r}; choose from {names}") from None


def format_of(precision: Precision) -> Format:
    return _FORMATS[precision]


def round_to(values: npt.NDArray[Any], precision: Precision) -> npt.NDArray[np.float32]:
    """``values`` rounded to nearest in ``precision``, returned as float32 (TF32 rounds the
    mantissa to 10 bits, as a TF32 MatMul does to its operands)."""
    array = np.asarray(values, dtype=np.float32)
    if precision is Precision.FLOAT16:
        with np.errstate(over="ignore"):
            return array.astype(np.float16).astype(np.float32)
    if precision is Precision.FLOAT32:
        return array.copy()
    dropped = 23 - _FORMATS[precision].mantissa  # 16 for bfloat16, 13 for TF32
    bits = np.ascontiguousarray(array).view(np.uint32)
    finite = np.isfinite(array)
    # Round half to even on the dropped bits; non-finite values pass unchanged.
    bias = np.uint32((1 << (dropped - 1)) - 1) + ((bits >> np.uint32(dropped)) & np.uint32(1))
    rounded = ((bits + bias) >> np.uint32(dropped)) << np.uint32(dropped)
    return np.where(finite, rounded.view(np.float32), array)


def sampling_floor(ref: npt.NDArray[Any], precision: Precision) -> float:
    """The least error ``precision`` predicts for a tensor of few values, whatever the twin's
    draw: ``FEW_VALUES_UNITS`` × the unit roundoff of the format it stores values in, over
    √n_eff, n_eff = (Σr²)² / Σr⁴ being how many values its rel_l2 rests on.

    The twin's floor is one sample of the rounding. Over thousands of values its rel_l2 is
    what the precision predicts; over a few it is whether those few happened to round near
    their float64 value, which another faithful computation need not repeat: PP-OCRv4 det's
    squeeze-excite Relu holds one nonzero value, 69.4, which the twin got within 0.06 of a
    float16 step (floor 5.8e-5) and ONNX Runtime's float16 two steps off (rel_l2 1.8e-3): no
    error started there. One value that far off moves rel_l2 by 4 units / √n_eff, nothing
    over many values. TF32 stores float32 values: its floor is float32's."""
    stored = Precision.FLOAT32 if precision is Precision.TF32 else precision
    r2 = r4 = 0.0
    for (r,) in blocks(ref):
        square = np.square(r[np.isfinite(r)], dtype=np.float64)
        r2, r4 = r2 + float(np.sum(square)), r4 + float(dot(square, square))
    if r4 <= 0.0 or not math.isfinite(r4):
        return 0.0
    effective = r2 * r2 / r4
    return FEW_VALUES_UNITS * _FORMATS[stored].unit / math.sqrt(effective)


def held_in_range(
    ref: npt.NDArray[Any], target: npt.NDArray[Any], precision: Precision
) -> npt.NDArray[Any]:
    """``target`` where ``ref`` holds a sentinel (a value ``SENTINEL`` times beyond
    ``precision``'s largest magnitude: an attention mask's -1e9 or float32's lowest) that the
    target holds within ``CLIPPED_BINADES`` of that largest or at ±Inf, with the same sign,
    taken as the reference's: the format cannot hold it, and a large value of the same sign is
    what a conversion does with it. onnxconverter-common clips a GPT-2 export's -3.4e38 causal
    mask to -1e4 (its ``max_finite_val``): the 4 mask Adds were culprits at rel_l2 1, though the
    Softmax after them gives the same 0s. Values just beyond the range are real values lost,
    not sentinels: PP-OCRv4 det's BatchNormalization variances of 1e7, clipped to 1e4, move
    its output by rel_l2 32. ``target`` itself where there are none."""
    largest = _FORMATS[precision].max
    r, t = np.asarray(ref), np.asarray(target)
    if largest * SENTINEL >= float(np.finfo(r.dtype if r.dtype.kind == "f" else np.float64).max):
        return target  # no value of ref's type is a sentinel (bfloat16, TF32 from float32)
    if r.shape != t.shape:
        return target
    with np.errstate(invalid="ignore"):
        beyond = np.isfinite(r) & (np.abs(r) > largest * SENTINEL)
        if not beyond.any():
            return target
        beyond &= (np.sign(t) == np.sign(r)) & (np.abs(t) >= largest / 2**CLIPPED_BINADES)
    return np.where(beyond, r, t) if beyond.any() else target


def range_problem(
    ref: npt.NDArray[Any],
    target: npt.NDArray[Any],
    precision: Precision,
    significance: float = 1e-6,
) -> str:
    """What the target's values show that ``precision`` cannot explain, or "": values the
    format holds that came back 0 (flushed), finite values that became ±Inf (overflow) or NaN,
    or values pinned at the format's largest magnitude (saturation). Counted over the elements
    where the reference is finite; zeros or pinned values under 1% of them (or under 8), or
    Inf/NaN under 1% and under 16 elements, are not a finding.

    A zero counts where the reference is at least ``FLUSH_ULPS`` of the format's smallest step
    (a zero there is that many units in the last place off, which no faithful rounding gives:
    ONNX Runtime's float16 Sigmoid returns 0 near 1e-7, two steps of float16) and above
    ``significance`` × the tensor's median nonzero magnitude (OpenVINO's bf16 flushes PP-OCRv4
    rec's float32 denormal weights, and Conv outputs of 1e-37 next to values of 0.1). The
    median, not the peak: YOLOv8n's output concatenates boxes up to 320 with class scores, and
    a Sigmoid that flushes every score below 1.5e-5 (tinygrad's float16) zeroes 55% of that
    tensor, at 5e-8 of its peak."""
    fmt_ = _FORMATS[precision]
    flushed = overflow = nan = saturated = finite = 0
    example = 0.0
    zeroed: list[npt.NDArray[np.float32]] = []
    smallest = max(FLUSH_ULPS * fmt_.tiny, significance * _typical(ref))
    for r, t in blocks(ref, target):
        ok = np.isfinite(r)
        finite += int(np.count_nonzero(ok))
        held = ok & (np.abs(r) >= smallest) & (np.abs(r) <= fmt_.max)
        zero = held & (t == 0)
        flushed += int(np.count_nonzero(zero))
        if zero.any():
            zeroed.append(np.abs(r[zero]).astype(np.float32))
            example = max(example, float(np.max(zeroed[-1])))
        overflow += int(np.count_nonzero(ok & np.isinf(t)))
        nan += int(np.count_nonzero(ok & np.isnan(t)))
        big = np.abs(r) > fmt_.max * 1.01
        saturated += int(np.count_nonzero(held & ~big & (np.abs(t) >= fmt_.max) & np.isfinite(t)))
    if not finite:
        return ""

    def share(count: int) -> str:
        return f"{100 * count / finite:.1f}% of the elements"

    def counts(count: int) -> bool:
        return count >= 16 or count >= 0.01 * finite

    def many(count: int) -> bool:
        # A faithful sum of two rounded operands can cancel to an exact 0 (0.1% of a
        # PP-OCRv4 residual Add's elements in float16): zeros count from 1% of the tensor,
        # and from 8 of them (one of PP-OCRv4 det's 48 squeeze-excite Relu values crossed 0
        # on OpenVINO's bf16: 2.1%).
        return count >= max(8, 0.01 * finite)

    if many(flushed) and _small_values(ref, np.concatenate(zeroed), smallest):
        return f"{share(flushed)} are 0 where {precision.value} holds values up to {example:.2g}"
    if counts(overflow):
        return f"{share(overflow)} are ±Inf where the reference's are finite"
    if counts(nan):
        return f"{share(nan)} are NaN where the reference's are finite"
    if many(saturated):
        return f"{share(saturated)} are pinned at ±{fmt_.max:g}, {precision.value}'s largest"
    return ""


def _small_values(ref: npt.NDArray[Any], zeroed: npt.NDArray[np.float32], smallest: float) -> bool:
    """Whether the zeros are the tensor's small values, nearly all of them up to a size (a
    flush: tinygrad's float16 Sigmoid zeroes every value under 1.5e-5, FTZ every subnormal),
    not scattered among values of their size (two rounded operands of a faithful difference
    that cancel, a clamp whose input's rounding crossed its edge: some of the values up to
    their size, fewer the larger). Up to the zeros' 90th percentile, so that a stray zero
    does not decide."""
    edge = float(np.quantile(zeroed, 0.9))
    up_to = 0
    for (r,) in blocks(ref):
        size = np.abs(r)
        up_to += int(np.count_nonzero(np.isfinite(r) & (size >= smallest) & (size <= edge)))
    return int(np.count_nonzero(zeroed <= edge)) >= FLUSH_BAND * up_to


def _typical(ref: npt.NDArray[Any]) -> float:
    """The median magnitude of the finite nonzero values (a strided sample of at most 2**16:
    a rough figure for a threshold, not worth sorting a large tensor)."""
    flat = np.asarray(ref).reshape(-1)
    sample = np.abs(flat[:: max(1, flat.size // (1 << 16))].astype(np.float64))
    sample = sample[np.isfinite(sample) & (sample > 0)]
    return float(np.median(sample)) if sample.size else 0.0
