"""An fp16 squeeze-excite block on a runtime that sums a GlobalAveragePool in float16 and fuses
the Conv after it with its Relu (issue 33 items 6 and 11: tract on the fp16 PP-OCRv4 det).

The pool's sum overflows to Inf; the 1x1 Conv after it makes NaN of the Infs; fused with the
Relu (``fmax``) the NaN becomes 0 and the output is finite but wrong, while marking the Conv's
output undoes the fusion and the output turns NaN: the observer effect. The scan found the pool
(isolated alone, its sum overflows), but the observer effect handed the diagnosis to the cut
search, which never marks the fused tensor and named a pattern window around it instead
(the real run: a 6-node window Conv -> GlobalAveragePool -> Conv -> Relu -> Mul -> Add, 43
target runs, 102 s). A repair of the scan's cause on the unmarked model settles it.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnx_bisect
from onnx_bisect import Verdict
from onnx_bisect.result import CauseKind, Outcome
from tests.models import make

LOWP = Path(__file__).resolve().parent / "lowp_runtime.py"


def _init(name: str, value: object) -> onnx.TensorProto:
    return numpy_helper.from_array(np.asarray(value, np.float32), name)


def squeeze_excite_overflow(seed: int = 0) -> onnx.ModelProto:
    """x -> Conv ``conv`` (+1 bias) -> Relu -> Mul 600 -> GlobalAveragePool ``pool`` -> Conv
    ``se_conv`` (1x1, weights of both signs) -> Relu ``se_relu`` -> Conv ``se_up`` ->
    HardSigmoid -> Mul with the pool's input ``excite`` -> Mul 1/600 -> y. The pool's means are
    about 800, its sums over 256 values beyond float16's 65504."""
    rng = np.random.default_rng(seed)
    squeeze = rng.standard_normal((6, 8, 1, 1)) / 600
    squeeze[:, :4], squeeze[:, 4:] = np.abs(squeeze[:, :4]), -np.abs(squeeze[:, 4:])
    inits = [
        _init("w", rng.standard_normal((8, 4, 3, 3)) / 3),
        _init("b", np.ones(8)),
        _init("k", 600.0),
        _init("w1", squeeze),
        _init("w2", rng.standard_normal((8, 6, 1, 1))),
        _init("inv", 1 / 600.0),
    ]
    nodes = [
        helper.make_node("Conv", ["x", "w", "b"], ["c"], name="conv", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c"], ["r"], name="relu"),
        helper.make_node("Mul", ["r", "k"], ["big"], name="scale"),
        helper.make_node("GlobalAveragePool", ["big"], ["p"], name="pool"),
        helper.make_node("Conv", ["p", "w1"], ["s"], name="se_conv"),
        helper.make_node("Relu", ["s"], ["sr"], name="se_relu"),
        helper.make_node("Conv", ["sr", "w2"], ["g"], name="se_up"),
        helper.make_node("HardSigmoid", ["g"], ["gate"], name="se_gate"),
        helper.make_node("Mul", ["big", "gate"], ["m"], name="excite"),
        helper.make_node("Mul", ["m", "inv"], ["y"], name="unscale"),
    ]
    return make(
        nodes,
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 16, 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8, 16, 16])],
        inits,
    )


def _target(*flags: str) -> str:
    return f"exec:{sys.executable} {LOWP} {{model}} {{inputs}} {{outputs}} {' '.join(flags)}"


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("overflow_fusion") / "se.onnx"
    onnx.save(squeeze_excite_overflow(), path)
    return path


def test_an_overflow_behind_a_fusion_is_the_root_cause_not_a_window(model: Path) -> None:
    """The pool whose float16 sum overflows is the root cause (``range``, Inf), verified by
    repair on the unmarked model; the Conv a few float16 steps off (an fp16 accumulation) is
    ``precision``; no cut search, no window."""
    target = _target("--accumulate pool --fuse-relu se_conv --nudge conv=8")
    result = onnx_bisect.bisect(model, ref="cpu", target=target, target_precision="float16")
    assert result.verdict is Outcome.DIVERGED
    cause = result.root_cause
    assert cause is not None
    assert (cause.kind, cause.nodes) == (CauseKind.RANGE, ("pool",))
    assert cause.reason.startswith(
        "GlobalAveragePool 'pool', fed the reference's inputs: 75.0% of the elements are ±Inf "
        "where the reference's are finite; fed the reference's values there, the target's "
        "outputs agree (y rel_l2 "
    ), cause.reason
    assert cause.reason.endswith("; verified on the unmarked model)"), cause.reason
    assert result.first_divergence is not None and result.first_divergence.name == "pool"
    verdicts = {n.name: n.verdict for n in result.nodes}
    assert verdicts["conv"] is Verdict.PRECISION
    assert verdicts["pool"] is Verdict.RANGE
    assert [verdicts[n] for n in ("se_conv", "se_relu", "excite")] == [Verdict.PROPAGATED] * 3
    assert result.strategy == "scan"
    assert any(n.startswith("instrumentation changes the target's result") for n in result.notes)
    assert (
        "the scan's root cause holds on the unmarked model (fed the reference's values at pool, "
        "the target's outputs agree: y rel_l2 "
    ) in "\n".join(result.notes)
    # One run for the repair; none for the marking search, the cut search or the windows.
    assert result.stage_runs["rank"] == 1
    assert not {"marking", "bisect", "pattern"} & set(result.stage_runs)


def test_a_marking_that_turns_the_output_nan_says_nan_not_zero() -> None:
    """The marking note said "y moves rel_l2 0 from the plain run" where marking the fused
    Conv's output turned y NaN (an all-NaN comparison's finite metrics are 0)."""
    from onnx_bisect.compare.criterion import Comparison, Status
    from onnx_bisect.engine.search.marking import Marking

    nan = Comparison("y", Status.NONFINITE, 0.0, {"rel_l2": 0.0}, nonfinite="NaN", target_nan=8)
    note = Marking("s", "se_conv", "Conv", ("se_relu",), nan, 5).note()
    assert note.startswith(
        "marking 's' alone changes the target's result (y moves rel_l2 NaN from the plain run; "
        "found in 5 target runs): a fusion from Conv 'se_conv' to its readers (se_relu)"
    ), note
