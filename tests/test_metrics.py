"""Metrics on hand-computed arrays, and the divergence decision of ``compare_tensors``."""

from __future__ import annotations

import math

import numpy as np
import pytest

from onnx_bisect.compare.criterion import Comparison, Criterion, Status
from onnx_bisect.compare.metrics import (
    METRICS,
    cosine,
    max_abs,
    mean_abs,
    mismatch_fraction,
    rel_l2,
    sqnr_db,
)
from onnx_bisect.compare.noise import NoiseFloor
from onnx_bisect.compare.tensors import _reference_off, compare_tensors

F32 = np.float32
REF = np.array([3.0, 0.0, -4.0, 0.0], F32)  # ‖REF‖ = 5
TGT = np.array([3.0, 1.0, -4.0, -2.0], F32)  # diff = [0, 1, 0, -2], ‖diff‖ = √5


# --- the metrics themselves ------------------------------------------------------------------


def test_max_and_mean_abs() -> None:
    assert max_abs(REF, TGT) == 2.0
    assert mean_abs(REF, TGT) == 0.75


def test_rel_l2_is_ratio_of_norms() -> None:
    assert rel_l2(REF, TGT) == pytest.approx(math.sqrt(5) / 5, rel=1e-15)
    assert rel_l2(REF, REF) == 0.0


def test_rel_l2_all_zero_reference_is_the_absolute_norm() -> None:
    zeros = np.zeros(4, F32)
    with np.errstate(all="raise"):  # any 0/0 or x/0 would raise here
        value = rel_l2(zeros, np.array([3.0, 4.0, 0.0, 0.0], F32))
        assert rel_l2(zeros, zeros) == 0.0
    assert value == 5.0
    assert math.isfinite(value)


def test_cosine() -> None:
    assert cosine(REF, REF) == pytest.approx(1.0)
    assert cosine(REF, -REF) == pytest.approx(-1.0)
    # [1, 0]·[1, 1] / (1 · √2)
    assert cosine(np.array([1.0, 0.0]), np.array([1.0, 1.0])) == pytest.approx(1 / math.sqrt(2))


def test_cosine_zero_tensors() -> None:
    zeros = np.zeros(3, F32)
    with np.errstate(all="raise"):
        assert cosine(zeros, zeros) == 1.0
        assert cosine(zeros, np.ones(3, F32)) == 0.0
        assert cosine(np.ones(3, F32), zeros) == 0.0


def test_sqnr_db() -> None:
    # signal 25, noise 5 -> 10·log10(5)
    assert sqnr_db(REF, TGT) == pytest.approx(10 * math.log10(5), rel=1e-12)
    assert sqnr_db(np.array([1.0, 0.0]), np.array([1.0, 0.1])) == pytest.approx(20.0)
    assert sqnr_db(REF, REF.copy()) == math.inf
    assert sqnr_db(np.zeros(2), np.ones(2)) == -math.inf


def test_mismatch_fraction() -> None:
    ref = np.array([1.0, 2.0, 3.0, 4.0])
    tgt = np.array([1.0, 2.05, 3.0, 4.5])
    assert mismatch_fraction(ref, tgt, atol=0.1, rtol=0.0) == 0.25
    assert mismatch_fraction(ref, tgt, atol=0.0, rtol=0.2) == 0.0
    assert mismatch_fraction(ref, tgt, atol=0.01, rtol=0.0) == 0.5


def test_empty_tensors_give_zero_error() -> None:
    empty = np.zeros((0, 3), F32)
    assert max_abs(empty, empty) == 0.0
    assert mean_abs(empty, empty) == 0.0
    assert rel_l2(empty, empty) == 0.0
    assert mismatch_fraction(empty, empty) == 0.0
    assert compare_tensors("e", empty, empty, Criterion()).status is Status.OK


def test_registry() -> None:
    assert list(METRICS) == ["rel_l2", "max_abs", "mean_abs", "cosine", "sqnr_db"]
    assert [m.higher_is_worse for m in METRICS.values()] == [True, True, True, False, False]
    assert METRICS["rel_l2"].fn is rel_l2


# --- upcasting ------------------------------------------------------------------------------


def test_float16_difference_is_not_lost_to_fp16_overflow() -> None:
    # 60000 - (-60000) overflows fp16 (max 65504); an fp16 subtraction would return inf.
    ref = np.array([-60000.0], np.float16)
    tgt = np.array([60000.0], np.float16)
    with np.errstate(over="ignore"):
        assert np.isinf(tgt - ref).all()
    assert max_abs(ref, tgt) == 120000.0
    assert mean_abs(ref, tgt) == 120000.0
    assert rel_l2(ref, tgt) == 2.0


def test_uint8_difference_does_not_wrap() -> None:
    ref = np.array([10], np.uint8)
    tgt = np.array([5], np.uint8)
    assert max_abs(ref, tgt) == 5.0  # not 251


def test_fp16_target_against_fp32_reference() -> None:
    # 2049 is not representable in fp16 and rounds to 2048 (ties to even).
    ref = np.array([1.0, 2049.0], F32)
    tgt = ref.astype(np.float16)
    assert tgt.tolist() == [1.0, 2048.0]
    c = compare_tensors("t", ref, tgt, Criterion())
    expected = 1.0 / math.sqrt(1.0 + 2049.0**2)
    assert c.metrics["rel_l2"] == pytest.approx(expected, rel=1e-12)
    assert c.metrics["max_abs"] == 1.0
    assert (c.ref_dtype, c.target_dtype) == ("float32", "float16")
    assert c.status is Status.OK  # 4.9e-4 < 1e-3


def test_relu_zeros_do_not_explode_the_relative_error() -> None:
    rng = np.random.default_rng(0)
    ref = np.maximum(rng.standard_normal(10_000), 0).astype(F32)
    assert np.count_nonzero(ref == 0) > 4000
    noise = np.where(np.arange(ref.size) % 2 == 0, 1e-6, -1e-6).astype(F32)
    tgt = ref + noise
    value = rel_l2(ref, tgt)
    assert 0 < value < 1e-5
    c = compare_tensors("relu", ref, tgt, Criterion())
    assert c.status is Status.OK
    assert c.score == value
    # What an element-wise |t - r| / |r| would have reported on the same data:
    with np.errstate(divide="ignore"):
        elementwise = np.abs(tgt.astype(np.float64) - ref) / np.abs(ref.astype(np.float64))
    assert np.isinf(elementwise).any()


# --- compare_tensors ------------------------------------------------------------------------


def test_compare_identical_floats_ok() -> None:
    c = compare_tensors("t", REF, REF.copy(), Criterion())
    assert c == Comparison(
        "t",
        Status.OK,
        0.0,
        c.metrics,
        ref_dtype="float32",
        target_dtype="float32",
        shape=(4,),
        threshold=1e-3,
    )
    assert c.metrics["rel_l2"] == 0.0
    assert c.metrics["sqnr_db"] == math.inf
    assert c.metrics["mismatch"] == 0.0
    assert not c.diverged


def test_compare_diverged_float_reason() -> None:
    c = compare_tensors("t", REF, TGT, Criterion())
    assert c.status is Status.DIVERGED
    assert c.diverged
    assert c.score == pytest.approx(math.sqrt(5) / 5)
    assert c.reason == "rel_l2=0.447 > threshold 0.001"


def test_compare_scalar() -> None:
    c = compare_tensors("s", np.float32(2.0), np.float32(2.0), Criterion())
    assert c.status is Status.OK
    assert c.shape == ()


def test_nan_at_the_same_place_is_ok_and_excluded_from_metrics() -> None:
    ref = np.array([1.0, np.nan, 2.0, np.inf], F32)
    tgt = np.array([1.0005, np.nan, 2.0, np.inf], F32)
    c = compare_tensors("t", ref, tgt, Criterion(metric="max_abs", threshold=1e-3))
    assert c.status is Status.OK
    assert c.nonfinite_mismatch == 0
    assert c.score == pytest.approx(0.0005, rel=1e-3)
    assert math.isfinite(c.metrics["rel_l2"])


def test_nan_mismatch_is_nonfinite() -> None:
    ref = np.array([1.0, 2.0, 3.0], F32)
    tgt = np.array([1.0, np.nan, 3.0], F32)
    c = compare_tensors("t", ref, tgt, Criterion())
    assert c.status is Status.NONFINITE
    assert c.diverged
    assert c.nonfinite_mismatch == 1
    assert c.reason == "1 NaN/Inf value differs from the reference"
    assert c.metrics["rel_l2"] == 0.0  # the finite elements agree


def test_nan_in_reference_only_is_nonfinite() -> None:
    c = compare_tensors("t", np.array([np.nan, 1.0], F32), np.array([0.0, 1.0], F32), Criterion())
    assert c.status is Status.NONFINITE
    assert c.nonfinite_mismatch == 1


def test_inf_sign_mismatch_is_nonfinite() -> None:
    ref = np.array([np.inf, -np.inf, 1.0], F32)
    tgt = np.array([-np.inf, -np.inf, 1.0], F32)
    c = compare_tensors("t", ref, tgt, Criterion())
    assert c.status is Status.NONFINITE
    assert c.nonfinite_mismatch == 1
    same = compare_tensors("t", ref, ref.copy(), Criterion())
    assert same.status is Status.OK


def test_inf_vs_nan_is_nonfinite() -> None:
    c = compare_tensors("t", np.array([np.inf], F32), np.array([np.nan], F32), Criterion())
    assert c.status is Status.NONFINITE
    assert c.nonfinite_mismatch == 1


def test_integer_tensors_compare_exactly() -> None:
    ref = np.arange(1000, 2000, dtype=np.int64)
    tgt = ref.copy()
    tgt[500] += 1
    # As floats, rel_l2 would call this equal (≈ 2e-5 < 1e-3); integers must match exactly,
    # and every metric is the share of differing elements (int64 sentinels as floats are 9e18).
    c = compare_tensors("idx", ref, tgt, Criterion())
    assert c.metrics["rel_l2"] == c.metrics["max_abs"] == 0.001
    assert c.status is Status.DIVERGED
    assert c.reason == "1 of 1000 elements differ (exact comparison)"
    assert c.metrics["mismatch"] == 0.001
    ok = compare_tensors("idx", ref, ref.copy(), Criterion())
    assert ok.status is Status.OK
    assert ok.reason == ""


def test_bool_tensors_compare_exactly() -> None:
    ref = np.array([True, False, True])
    c = compare_tensors("m", ref, np.array([True, True, True]), Criterion())
    assert c.status is Status.DIVERGED
    assert c.reason == "1 of 3 elements differ (exact comparison)"
    assert compare_tensors("m", ref, ref.copy(), Criterion()).status is Status.OK


def test_int32_vs_int64_is_not_a_dtype_mismatch() -> None:
    c = compare_tensors("i", np.array([1, 2], np.int64), np.array([1, 2], np.int32), Criterion())
    assert c.status is Status.OK
    assert (c.ref_dtype, c.target_dtype) == ("int64", "int32")


def test_shape_mismatch() -> None:
    c = compare_tensors("t", np.zeros((3, 2), F32), np.zeros((2, 3), F32), Criterion())
    assert c.status is Status.SHAPE
    assert c.diverged
    assert c.reason == "shape (2, 3) != reference (3, 2)"
    assert c.shape == (3, 2)
    assert math.isnan(c.score)


def test_int_vs_float_is_dtype_mismatch() -> None:
    c = compare_tensors("t", np.zeros(3, F32), np.zeros(3, np.int64), Criterion())
    assert c.status is Status.DTYPE
    assert c.reason == "dtype int64 != reference float32"
    c = compare_tensors("t", np.zeros(3, np.bool_), np.zeros(3, np.int64), Criterion())
    assert c.status is Status.DTYPE
    assert c.reason == "dtype int64 != reference bool"


def test_missing() -> None:
    c = compare_tensors("t", REF, None, Criterion())
    assert c.status is Status.MISSING
    assert c.reason == "target did not produce it"
    assert c.diverged
    c = compare_tensors("t", None, REF, Criterion())
    assert c.status is Status.MISSING
    assert c.reason == "reference did not produce it"


# --- Criterion ------------------------------------------------------------------------------


def test_criterion_rejects_unknown_metric() -> None:
    with pytest.raises(ValueError) as err:
        Criterion(metric="l1")
    assert str(err.value) == (
        "unknown metric 'l1'; choose from rel_l2, max_abs, mean_abs, cosine, sqnr_db"
    )


def test_criterion_cosine_lower_is_worse() -> None:
    crit = Criterion(metric="cosine", threshold=0.99)
    assert crit.describe() == "cosine < 0.99"
    ref = np.array([1.0, 0.0], F32)
    bad = compare_tensors("t", ref, np.array([1.0, 1.0], F32), crit)
    assert bad.score == pytest.approx(1 / math.sqrt(2))
    assert bad.status is Status.DIVERGED
    assert bad.reason == "cosine=0.707 < threshold 0.99"
    good = compare_tensors("t", ref, np.array([1.0, 0.01], F32), crit)
    assert good.score > 0.99
    assert good.status is Status.OK
    # Worse comparisons sort first: lower cosine means larger badness.
    assert crit.badness(bad) > crit.badness(good)


def test_criterion_sqnr_lower_is_worse() -> None:
    crit = Criterion(metric="sqnr_db", threshold=30.0)
    ref = np.array([1.0, 0.0], F32)
    noisy = compare_tensors("t", ref, np.array([1.0, 0.1], F32), crit)  # 20 dB
    assert noisy.score == pytest.approx(20.0, rel=1e-6)
    assert noisy.status is Status.DIVERGED
    clean = compare_tensors("t", ref, np.array([1.0, 0.01], F32), crit)  # 40 dB
    assert clean.score == pytest.approx(40.0, rel=1e-5)
    assert clean.status is Status.OK
    exact = compare_tensors("t", ref, ref.copy(), crit)
    assert exact.score == math.inf
    assert exact.status is Status.OK


def test_criterion_allclose_uses_mismatch_fraction() -> None:
    crit = Criterion(atol=0.1, rtol=0.0)
    assert crit.allclose
    assert crit.key == "mismatch"
    assert crit.describe() == "allclose(atol=0.1, rtol=0)"
    ref = np.array([1.0, 2.0, 3.0, 4.0], F32)
    c = compare_tensors("t", ref, np.array([1.0, 2.0, 3.05, 4.5], F32), crit)
    assert c.status is Status.DIVERGED
    assert c.score == 0.25
    assert c.reason == "1 of 4 values outside allclose(atol=0.1, rtol=0)"
    ok = compare_tensors("t", ref, np.array([1.05, 2.0, 3.05, 4.09], F32), crit)
    assert ok.status is Status.OK
    assert ok.score == 0.0


def test_criterion_allclose_rtol_only_defaults_atol() -> None:
    crit = Criterion(rtol=0.01)
    assert crit.allclose
    assert (crit.atol_value, crit.rtol_value) == (1e-5, 0.01)
    ref = np.array([100.0, 200.0], F32)
    assert compare_tensors("t", ref, np.array([100.5, 200.0], F32), crit).status is Status.OK
    assert compare_tensors("t", ref, np.array([102.0, 200.0], F32), crit).score == 0.5


def test_criterion_defaults() -> None:
    crit = Criterion()
    assert not crit.allclose
    assert crit.key == "rel_l2"
    assert crit.describe() == "rel_l2 > 0.001"
    assert crit.exceeds(0.0011)
    assert not crit.exceeds(0.001)
    assert crit.exceeds(math.nan)


def test_badness_puts_structural_mismatches_first() -> None:
    crit = Criterion()
    shape = compare_tensors("t", np.zeros(2, F32), np.zeros(3, F32), crit)
    diverged = compare_tensors("t", REF, TGT, crit)
    assert crit.badness(shape) == math.inf
    assert crit.badness(diverged) == pytest.approx(math.sqrt(5) / 5)


@pytest.mark.parametrize("zero_ref", [False, True])
def test_all_metrics_equals_the_pure_functions(zero_ref: bool) -> None:
    from onnx_bisect.compare.metrics import METRICS, all_metrics

    rng = np.random.default_rng(3)
    ref = np.zeros(500) if zero_ref else rng.standard_normal(500)
    tgt = ref + 1e-3 * rng.standard_normal(500)
    fused = all_metrics(ref, tgt, atol=1e-5, rtol=1e-3)
    for name, metric in METRICS.items():
        assert fused[name] == pytest.approx(metric.fn(ref, tgt), rel=1e-9, abs=1e-12), name
    assert fused["mismatch"] == pytest.approx(mismatch_fraction(ref, tgt, 1e-5, 1e-3))


def test_large_int64_differences_are_not_lost_to_float64() -> None:
    ref = np.array([2**60, 5], dtype=np.int64)
    tgt = np.array([2**60 + 1, 5], dtype=np.int64)
    c = compare_tensors("i", ref, tgt, Criterion())
    assert c.status is Status.DIVERGED and c.metrics["mismatch"] == 0.5


def test_block_by_block_comparison_equals_the_whole_tensor() -> None:
    """Tensors over several comparison blocks (a float64 copy of each block only): metrics,
    NaN placement and the absolute floor are those of the whole tensor."""
    from onnx_bisect.compare.metrics import COMPARE_BLOCK, all_metrics

    rng = np.random.default_rng(5)
    n = 2 * COMPARE_BLOCK + 17
    ref = rng.standard_normal(n).astype(F32)
    tgt = (ref + 1e-3 * rng.standard_normal(n)).astype(F32)
    tgt[-3] = ref[-3] + 7.0  # the worst element sits in the last, partial block
    r64, t64 = ref.astype(np.float64), tgt.astype(np.float64)
    whole = {
        "rel_l2": np.linalg.norm(t64 - r64) / np.linalg.norm(r64),
        "max_abs": 7.0,
        "mean_abs": np.mean(np.abs(t64 - r64)),
        "mismatch": np.mean(~np.isclose(t64, r64, rtol=1e-3, atol=1e-5)),
    }
    blocked = all_metrics(ref, tgt, atol=1e-5, rtol=1e-3)
    for name, value in whole.items():
        assert blocked[name] == pytest.approx(value, rel=1e-9), name
    # NaNs at the same places in two blocks are excluded; one placed differently counts once.
    ref[[5, COMPARE_BLOCK + 5]] = np.nan
    tgt[[5, COMPARE_BLOCK + 5]] = np.nan
    c = compare_tensors("t", ref, tgt, Criterion())
    assert c.status is Status.DIVERGED and c.metrics["max_abs"] == pytest.approx(7.0, rel=1e-6)
    tgt[2 * COMPARE_BLOCK + 1] = np.nan
    assert compare_tensors("t", ref, tgt, Criterion()).nonfinite_mismatch == 1


@pytest.mark.parametrize("ref_error", [0.0, 1e-7, 1e-4, 1e-2])
@pytest.mark.parametrize("target_error", [0.0, 1e-7, 1e-2])
def test_reference_off_shortcut_agrees_with_the_full_check(
    ref_error: float, target_error: float
) -> None:
    """``compare_tensors`` skips the three-way check when the reference's noise floor is
    within the bound; the verdict must be the one the full check gives."""
    rng = np.random.default_rng(7)
    exact = rng.standard_normal(4096)
    ref = (exact * (1 + ref_error * rng.standard_normal(4096))).astype(np.float32)
    target = (exact * (1 + target_error * rng.standard_normal(4096))).astype(np.float32)
    floors = NoiseFloor({"t": exact}, {"t": 1e-7})
    crit = Criterion(noise=floors, truth=floors.truth)
    full = _reference_off("t", ref, target, crit, None)
    assert compare_tensors("t", ref, target, crit).reference_off == bool(full)
    assert bool(full) == (ref_error >= 1e-4 and target_error < 1e-4)


# --- comparisons that scale (issue 28) -------------------------------------------------------


def test_dot_is_exact_enough_over_a_block() -> None:
    """einsum's sums of products over a full block agree with math.fsum to float64 rounding."""
    from onnx_bisect.compare.metrics import COMPARE_BLOCK, dot

    rng = np.random.default_rng(11)
    a, b = rng.standard_normal(COMPARE_BLOCK), rng.standard_normal(COMPARE_BLOCK)
    assert dot(a, b) == pytest.approx(math.fsum(a * b), rel=1e-11, abs=1e-9)
    assert dot(a, a) == pytest.approx(math.fsum(a * a), rel=1e-13)


def test_comparisons_call_no_blas(monkeypatch: pytest.MonkeyPatch) -> None:
    """np.dot of a long float64 vector runs on BLAS threads, which fought the runtimes for the
    cores (15-55 ms a tensor on a busy machine): comparing and measuring fp32 noise must not
    call it, whatever the tensor's size."""
    from onnx_bisect.compare.metrics import COMPARE_BLOCK
    from onnx_bisect.compare.noise import fp32_noise

    def no_blas(*args: object, **kwargs: object) -> None:
        raise AssertionError("np.dot called in a comparison")

    rng = np.random.default_rng(2)
    ref = rng.standard_normal(COMPARE_BLOCK + 5).astype(F32)
    tgt = (ref * 1.01).astype(F32)
    exact = ref.astype(np.float64) * (1 + 1e-7)
    monkeypatch.setattr(np, "dot", no_blas)
    monkeypatch.setattr(np, "vdot", no_blas)
    crit = Criterion(truth=NoiseFloor({"t": exact}, {"t": 1e-2}).truth)
    c = compare_tensors("t", ref, tgt, crit)
    assert c.status is Status.DIVERGED and c.metrics["rel_l2"] == pytest.approx(0.01, rel=1e-4)
    assert _reference_off("t", ref, tgt, crit, None) == ""  # the three-way sums, too
    assert rel_l2(ref, tgt) == pytest.approx(0.01, rel=1e-4)
    assert cosine(ref, tgt) == pytest.approx(1.0)
    assert fp32_noise(exact, ref) == pytest.approx(1e-7, rel=1e-2)


def test_fp32_noise_leaves_out_values_not_finite_in_both() -> None:
    from onnx_bisect.compare.noise import fp32_noise

    exact = np.array([1.0, 2.0, np.inf, 4.0, np.nan])
    value = np.array([1.0, 2.5, np.inf, 4.0, 3.0], F32)
    assert fp32_noise(exact, value) == pytest.approx(0.5 / math.sqrt(21))
    assert fp32_noise(exact, value[:4]) is None
