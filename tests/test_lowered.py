"""Precision-aware verdicts: a float16, bfloat16 or TF32 target is judged against the error its
precision predicts (measured by the float64 oracle's faithful twin), and what is worse than
that is named: a flushed Sigmoid, a MatMul that accumulates in float16, a runtime that lowered
the precision unasked.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnx_bisect
from onnx_bisect import Verdict
from onnx_bisect.compare.precision import DATA_MOVEMENT, Precision, range_problem, round_to
from onnx_bisect.result import CauseKind, Outcome

pytest.importorskip("torch")  # the faithful twin that measures precision floors

LOWP = Path(__file__).resolve().parent / "lowp_runtime.py"
OPSET, IR = 18, 10


def _init(name: str, value: np.ndarray) -> onnx.TensorProto:
    return numpy_helper.from_array(value.astype(np.float32), name)


def conv_net(seed: int = 0) -> onnx.ModelProto:
    """Conv -> Sigmoid -> Mul (SiLU) -> Conv -> Add (residual) -> Reshape -> Transpose ->
    MatMul, the Sigmoid also an output (a detector's class scores). The first Conv's outputs
    reach -20: a Sigmoid below -11.1 gives values float16 holds only as subnormals, which a
    flushing runtime returns as 0."""
    rng = np.random.default_rng(seed)
    inits = [
        _init("w1", rng.standard_normal((8, 4, 3, 3)) * 2.4),
        _init("w2", rng.standard_normal((8, 8, 1, 1)) / np.sqrt(8)),
        _init("shape", np.zeros(0)),  # replaced below: int64
        _init("w3", rng.standard_normal((8, 4)) / np.sqrt(8)),
    ]
    inits[2] = numpy_helper.from_array(np.array([1, 8, 256], np.int64), "shape")
    nodes = [
        helper.make_node("Conv", ["x", "w1"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
        helper.make_node("Sigmoid", ["c1"], ["s1"], name="sigmoid1"),
        helper.make_node("Mul", ["c1", "s1"], ["m1"], name="silu1"),
        # An output of its own: onnxconverter-common mistypes a graph output read inside.
        helper.make_node("Identity", ["s1"], ["scores"], name="scores"),
        helper.make_node("Conv", ["m1", "w2"], ["c2"], name="conv2"),
        helper.make_node("Add", ["c2", "m1"], ["r1"], name="residual"),
        helper.make_node("Reshape", ["r1", "shape"], ["flat"], name="reshape"),
        helper.make_node("Transpose", ["flat"], ["rows"], name="transpose", perm=[0, 2, 1]),
        helper.make_node("MatMul", ["rows", "w3"], ["y"], name="head"),
    ]
    graph = helper.make_graph(
        nodes,
        "conv_net",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 16, 16])],
        [
            helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 256, 4]),
            helper.make_tensor_value_info("scores", TensorProto.FLOAT, [1, 8, 16, 16]),
        ],
        initializer=inits,
    )
    return helper.make_model(graph, ir_version=IR, opset_imports=[helper.make_opsetid("", OPSET)])


def long_matmul(k: int = 4096, seed: int = 0) -> onnx.ModelProto:
    """x [4, K] -> MatMul W [K, 16] -> Tanh -> MatMul V [16, 8]: one K=4096 reduction."""
    rng = np.random.default_rng(seed)
    inits = [
        _init("w", rng.standard_normal((k, 16)) / np.sqrt(k) * 4),
        _init("v", rng.standard_normal((16, 8)) / 4),
    ]
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["h"], name="long_mm"),
        helper.make_node("Tanh", ["h"], ["a"], name="act"),
        helper.make_node("MatMul", ["a", "v"], ["y"], name="out_mm"),
    ]
    graph = helper.make_graph(
        nodes,
        "long_matmul",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 8])],
        initializer=inits,
    )
    return helper.make_model(graph, ir_version=IR, opset_imports=[helper.make_opsetid("", OPSET)])


@pytest.fixture(scope="module")
def net(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("lowered") / "conv_net.onnx"
    onnx.save(conv_net(), path)
    return path


def _lowp(*flags: str) -> str:
    return f"exec:{sys.executable} {LOWP} {{model}} {{inputs}} {{outputs}} {' '.join(flags)}"


def _no_data_movement_culprit(result: onnx_bisect.BisectResult) -> None:
    blamed = [
        n.name
        for n in result.nodes
        if n.op_type in DATA_MOVEMENT and n.verdict in (Verdict.CULPRIT, Verdict.RANGE)
    ]
    assert not blamed


def _agrees_within(result: onnx_bisect.BisectResult, precision: str) -> None:
    assert result.verdict is Outcome.MATCH, result.summary()
    assert not result.culprits()
    assert not [n for n in result.nodes if n.verdict in (Verdict.CULPRIT, Verdict.RANGE)]
    assert f"agrees within {precision} precision: " in result.summary()
    _no_data_movement_culprit(result)


@pytest.mark.parametrize(
    ("target", "precision"),
    [
        ("cpu+fp16", "float16"),
        ("torch:cpu?dtype=float16", "float16"),
        ("torch:cpu?dtype=bfloat16", "bfloat16"),
        ("torch:cpu?round=tf32", "tf32"),
    ],
)
def test_a_declared_lower_precision_agrees_within_its_floors(
    net: Path, target: str, precision: str
) -> None:
    result = onnx_bisect.bisect(net, ref="cpu", target=target, always_scan=True)
    _agrees_within(result, precision)
    assert result.target_precision.precision.value == precision
    assert result.target_precision.source == "declared"
    # Without floors the same run had many culprits: the floors are what explain them.
    assert any(n.verdict is Verdict.PRECISION for n in result.nodes)
    # The first Conv, fed by the graph input (through a converter's Cast), is isolated too.
    first = next(n for n in result.nodes if n.name == "conv1")
    assert first.isolated is not None


def test_a_faithful_exec_runtime_declared_with_target_precision_agrees(net: Path) -> None:
    result = onnx_bisect.bisect(
        net, ref="cpu", target=_lowp(), target_precision="float16", always_scan=True
    )
    _agrees_within(result, "float16")
    assert result.target_precision.how == "--target-precision"


def test_a_flushing_sigmoid_is_the_root_cause_and_its_zeros_are_named(net: Path) -> None:
    result = onnx_bisect.bisect(
        net, ref="cpu", target=_lowp("--flush Sigmoid=1.6e-5"), target_precision="float16"
    )
    assert result.verdict is Outcome.DIVERGED
    assert result.root_cause is not None
    assert result.root_cause.nodes == ("sigmoid1",)
    assert result.root_cause.kind is CauseKind.RANGE
    assert "are 0 where float16 holds values up to" in result.root_cause.reason
    verdicts = {n.name: n.verdict for n in result.nodes}
    assert verdicts["sigmoid1"] is Verdict.RANGE
    assert verdicts["conv1"] in (Verdict.OK, Verdict.PRECISION)
    _no_data_movement_culprit(result)


def test_a_matmul_that_accumulates_in_float16_is_the_culprit(tmp_path: Path) -> None:
    path = tmp_path / "long.onnx"
    onnx.save(long_matmul(), path)
    result = onnx_bisect.bisect(
        path, ref="cpu", target=_lowp("--accumulate long_mm"), target_precision="float16"
    )
    assert result.root_cause is not None, result.summary()
    assert result.root_cause.nodes == ("long_mm",)
    assert result.root_cause.kind is CauseKind.CULPRIT
    others = {n.name: n.verdict for n in result.nodes if n.name != "long_mm"}
    assert set(others.values()) <= {Verdict.OK, Verdict.PRECISION, Verdict.PROPAGATED}


def test_the_same_matmul_accumulating_in_float32_agrees(tmp_path: Path) -> None:
    path = tmp_path / "long.onnx"
    onnx.save(long_matmul(), path)
    result = onnx_bisect.bisect(path, ref="cpu", target=_lowp(), target_precision="float16")
    assert result.verdict is Outcome.MATCH, result.summary()


def _openvino_lowers() -> str | None:
    if importlib.util.find_spec("openvino") is None:
        return "openvino is not installed"
    from onnx_bisect.backends.openvino import default_precision

    return None if default_precision() != "f32" else "OpenVINO runs f32 on this CPU"


def test_openvino_lowering_unasked_is_the_root_cause_with_a_verified_workaround(
    net: Path,
) -> None:
    why = _openvino_lowers()
    if why is not None:
        pytest.skip(why)
    result = onnx_bisect.bisect(net, ref="cpu", target="openvino")
    assert result.verdict is Outcome.DIVERGED
    assert result.root_cause is not None
    assert result.root_cause.kind is CauseKind.PRECISION
    reason = result.root_cause.reason
    assert "without being asked (OpenVINO's CPU default INFERENCE_PRECISION_HINT=" in reason
    assert "Workaround: --target 'openvino?precision=f32' (verified:" in reason
    first_lines = result.summary().splitlines()[:4]
    assert any(line.startswith("Root cause (precision): the target") for line in first_lines)
    _no_data_movement_culprit(result)


def test_openvino_at_f32_agrees(net: Path) -> None:
    if importlib.util.find_spec("openvino") is None:
        pytest.skip("openvino is not installed")
    result = onnx_bisect.bisect(net, ref="cpu", target="openvino?precision=f32")
    assert result.verdict is Outcome.MATCH


def test_round_to_matches_the_formats() -> None:
    x = np.array([1.0, 1 + 2**-11, 1 + 2**-9, 3.0e-6, 70000.0, np.inf], np.float32)
    with np.errstate(over="ignore"):  # 70000 overflows float16, as it should
        expected = x.astype(np.float16).astype(np.float32)
    assert np.array_equal(round_to(x, Precision.FLOAT16), expected)
    bf = round_to(np.array([1 + 2**-8, 1 + 3 * 2**-8], np.float32), Precision.BFLOAT16)
    assert bf.tolist() == [1.0, 1 + 2**-6]  # ties to even
    tf = round_to(np.array([1 + 2**-12], np.float32), Precision.TF32)
    assert tf.tolist() == [1.0]


def test_range_problems_are_told_from_rounding() -> None:
    ref = np.linspace(-1, 1, 1000).astype(np.float32) * 1e-4
    assert range_problem(ref, round_to(ref, Precision.FLOAT16), Precision.FLOAT16) == ""
    flushed = np.where(np.abs(ref) < 5e-5, 0, ref)
    assert "are 0 where float16 holds" in range_problem(ref, flushed, Precision.FLOAT16)
    # 3.5e4 fits float16; an overflowing kernel returned Inf for it.
    overflowed = np.full(100, np.inf, np.float32)
    assert "are ±Inf" in range_problem(np.full(100, 3.5e4), overflowed, Precision.FLOAT16)
