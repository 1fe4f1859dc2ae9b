"""``openvino?precision=f32`` computes in float32: no dynamic quantization of the activations
of a MatMul whose weights are int8, which OpenVINO's CPU plugin does even under an f32 hint."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

import onnx_bisect
from tests.models import IR, OPSET


def _weight_only_int8(path: Path) -> None:
    """y = x @ (float(Wq) * 0.01): the weights stored as int8, as weight-only exports do."""
    rng = np.random.default_rng(0)
    wq = numpy_helper.from_array(rng.integers(-127, 127, (384, 384)).astype(np.int8), "Wq")
    scale = numpy_helper.from_array(np.array(0.01, np.float32), "scale")
    nodes = [
        helper.make_node("Cast", ["Wq"], ["Wf"], to=onnx.TensorProto.FLOAT, name="dequant/Cast"),
        helper.make_node("Mul", ["Wf", "scale"], ["W"], name="dequant/Mul"),
        helper.make_node("MatMul", ["x", "W"], ["y"], name="proj/MatMul"),
    ]
    io = [helper.make_tensor_value_info(n, onnx.TensorProto.FLOAT, [1, 32, 384]) for n in "xy"]
    graph = helper.make_graph(nodes, "wo_int8", io[:1], io[1:], [wq, scale])
    model = helper.make_model(graph, ir_version=IR, opset_imports=[helper.make_opsetid("", OPSET)])
    onnx.save(model, path)


def test_f32_does_not_quantize_activations_of_int8_weights(tmp_path: Path) -> None:
    pytest.importorskip("openvino")
    path = tmp_path / "wo.onnx"
    _weight_only_int8(path)
    r = onnx_bisect.bisect(path, ref="cpu", target="openvino?precision=f32", seed=1)
    assert not r.diverged, r.summary()
    (out,) = r.outputs
    assert out.metrics["rel_l2"] < 1e-5  # 5e-3 with OpenVINO's dynamic quantization
