"""A failing runtime leaves stderr to our one-line error; numpy's warnings become notes.

``capfd`` reads file descriptor 2, so native writes (onnxruntime's logger) count too.
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import numpy.typing as npt
import onnx
import pytest
from onnx import TensorProto, helper

from onnx_bisect.backends import create_backend
from onnx_bisect.backends.reference import ReferenceBackend
from onnx_bisect.errors import BackendError


def _model(nodes: list[onnx.NodeProto], inputs: list[onnx.ValueInfoProto]) -> onnx.ModelProto:
    graph = helper.make_graph(
        nodes, "g", inputs, [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)]
    )
    return helper.make_model(graph, ir_version=10, opset_imports=[helper.make_opsetid("", 17)])


def reshape_model() -> onnx.ModelProto:
    """Reshape to a runtime ``shape``: loads, and fails while running on a wrong one."""
    return _model(
        [helper.make_node("Reshape", ["x", "shape"], ["y"], name="reshape")],
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, [6]),
            helper.make_tensor_value_info("shape", TensorProto.INT64, [1]),
        ],
    )


def reference(spec: str) -> ReferenceBackend:
    backend = create_backend(spec)
    assert isinstance(backend, ReferenceBackend)
    return backend


def exp_model() -> onnx.ModelProto:
    return _model(
        [helper.make_node("Exp", ["x"], ["y"], name="exp")],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
    )


def test_ort_failing_while_running_writes_nothing_to_stderr(
    capfd: pytest.CaptureFixture[str],
) -> None:
    feeds: dict[str, npt.NDArray[Any]] = {
        "x": np.ones(6, np.float32),
        "shape": np.array([4], np.int64),
    }
    with pytest.raises(BackendError) as info:
        create_backend("cpu").run(reshape_model(), feeds)
    assert "cannot be reshaped" in str(info.value) and "\n" not in str(info.value)
    assert capfd.readouterr().err == ""


def test_ort_failing_to_load_writes_nothing_to_stderr(capfd: pytest.CaptureFixture[str]) -> None:
    model = exp_model()
    model.graph.node[0].op_type = "NoSuchOp"
    with pytest.raises(BackendError, match="NoSuchOp"):
        create_backend("cpu").run(model, {"x": np.ones(2, np.float32)})
    assert capfd.readouterr().err == ""


def test_openvino_failing_writes_nothing_to_stderr(capfd: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("openvino")
    model = exp_model()
    model.graph.node[0].op_type = "NoSuchOp"
    with pytest.raises(BackendError, match="NoSuchOp"):
        create_backend("openvino").run(model, {"x": np.ones(2, np.float32)})
    assert capfd.readouterr().err == ""


def test_reference_overflow_is_a_note_not_a_warning(capfd: pytest.CaptureFixture[str]) -> None:
    backend = reference("ref")
    before = np.geterr()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = backend.run(exp_model(), {"x": np.array([1000.0, 0.0], np.float32)})
    assert out["y"].tolist() == [np.inf, 1.0]
    assert caught == []
    assert capfd.readouterr().err == ""
    assert np.geterr() == before  # the errstate ends with the run
    assert backend.notes() == ["ref: overflow encountered in exp"]
    backend.run(exp_model(), {"x": np.array([1000.0, 0.0], np.float32)})
    assert backend.notes() == ["ref: overflow encountered in exp (2 times)"]


def test_reference_underflow_is_not_noted() -> None:
    backend = reference("ref")
    out = backend.run(exp_model(), {"x": np.array([-1000.0, 0.0], np.float32)})
    assert out["y"].tolist() == [0.0, 1.0]
    assert backend.notes() == []


def test_reference_invalid_values_are_noted_per_operation() -> None:
    model = _model(
        [
            helper.make_node("Exp", ["x"], ["e"], name="exp"),
            helper.make_node("Sub", ["e", "e"], ["y"], name="inf_minus_inf"),
        ],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
    )
    backend = reference("ref?dtype=float64")
    out = backend.run(model, {"x": np.array([1000.0, 0.0], np.float32)})
    assert np.isnan(out["y"][0]) and out["y"][1] == 0.0
    assert backend.notes() == [
        "ref?dtype=float64: overflow encountered in exp",
        "ref?dtype=float64: invalid value encountered in subtract",
    ]
