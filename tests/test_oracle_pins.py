"""The float64 oracle takes a float -> integer node's values from its fp32 twin: a step
function on the other side of a step in float64 would make the fp32 noise floor vacuous."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnx_bisect
from onnx_bisect.engine.oracle.pins import pinned_values
from tests.faulty import FaultyBackend
from tests.models import IR, OPSET


def _stepped() -> onnx.ModelProto:
    """y = 10 · (x·3 − 0.3 < 0) + Relu(x @ W). For x = 0.1 (float32), x·3 rounds to the
    float32 0.3 exactly, so float32 says False; float64 keeps 0.3000000045 < 0.3000000119 and
    says True: the output differs by 10 where float32 runtimes agree to the last bit."""
    w = np.random.default_rng(0).normal(0, 1, (64, 64)).astype(np.float32)
    inits = [
        numpy_helper.from_array(w, "W"),
        numpy_helper.from_array(np.array(3.0, np.float32), "three"),
        numpy_helper.from_array(np.array(0.3, np.float32), "c"),
        numpy_helper.from_array(np.array(0.0, np.float32), "zero"),
        numpy_helper.from_array(np.array(10.0, np.float32), "ten"),
    ]
    n = helper.make_node
    nodes = [
        n("Mul", ["x", "three"], ["a"], name="step/Mul"),
        n("Sub", ["a", "c"], ["d"], name="step/Sub"),
        n("Less", ["d", "zero"], ["m"], name="step/Less"),
        n("Cast", ["m"], ["mf"], to=TensorProto.FLOAT, name="step/Cast"),
        n("Mul", ["mf", "ten"], ["big"], name="step/Scale"),
        n("MatMul", ["x", "W"], ["h"], name="mm/MatMul"),
        n("Relu", ["h"], ["r"], name="mm/Relu"),
        n("Add", ["big", "r"], ["y"], name="out/Add"),
    ]
    io = [helper.make_tensor_value_info(t, TensorProto.FLOAT, [1, 64]) for t in "xy"]
    graph = helper.make_graph(nodes, "stepped", io[:1], io[1:], inits)
    return helper.make_model(graph, ir_version=IR, opset_imports=[helper.make_opsetid("", OPSET)])


def test_pinned_values_are_the_float_to_integer_steps() -> None:
    model = onnx.shape_inference.infer_shapes(_stepped())
    assert pinned_values(model) == ["m"]


def test_a_fault_behind_a_step_function_is_not_hidden_by_float64(tmp_path: object) -> None:
    pytest.importorskip("torch")
    feeds = {"x": np.full((1, 64), 0.1, np.float32)}
    r = onnx_bisect.bisect(_stepped(), ref="cpu", target=FaultyBackend("mm/MatMul"), inputs=feeds)
    # Without the pin float64's True made the output's fp32 noise ~1: the 5% fault passed.
    assert r.diverged, r.summary()
    assert r.root_cause is not None and r.root_cause.nodes == ("mm/MatMul",)


def test_agreeing_float32_runtimes_stay_quiet_behind_a_step_function() -> None:
    pytest.importorskip("torch")
    feeds = {"x": np.full((1, 64), 0.1, np.float32)}
    r = onnx_bisect.bisect(_stepped(), ref="cpu", target="cpu?opt=disable", inputs=feeds)
    assert not r.diverged, r.summary()
