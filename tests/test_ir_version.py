"""IR versions: the minimum a model's opsets need, lowered copies, and ONNX Runtime's retry.

The installed onnxruntime may read the IR version onnx saves by default, so an older runtime
is simulated by refusing, with onnxruntime's own message, what a real session would accept.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import numpy.typing as npt
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from onnx_bisect.backends import create_backend
from onnx_bisect.backends.ort import OrtBackend
from onnx_bisect.backends.protocol import Tensors
from onnx_bisect.errors import BackendError
from onnx_bisect.graph.irversion import lowered, min_ir_version, runnable_ir_version

X = np.array([0.5, -1.0, 2.0], np.float32)


def exp_model(ir_version: int, opset: int = 17, domain: str = "") -> onnx.ModelProto:
    """y = Exp(x) at the given IR version and opset of ``domain`` ("" is ai.onnx)."""
    graph = helper.make_graph(
        [helper.make_node("Exp", ["x"], ["y"], name="exp")],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3])],
    )
    opsets = [helper.make_opsetid("", opset if not domain else 17)]
    if domain:
        opsets.append(helper.make_opsetid(domain, opset))
    return helper.make_model(graph, ir_version=ir_version, opset_imports=opsets)


def ort_cpu() -> OrtBackend:
    backend = create_backend("cpu")
    assert isinstance(backend, OrtBackend)
    return backend


Runner = Callable[[OrtBackend, onnx.ModelProto, Mapping[str, npt.NDArray[Any]]], Tensors]


def count_sessions(monkeypatch: pytest.MonkeyPatch, highest: int | None = None) -> list[int]:
    """The IR version of every session the adapter opens; with ``highest``, sessions above it
    are refused the way an onnxruntime that reads up to ``highest`` refuses them."""
    opened: list[int] = []
    real: Runner = OrtBackend._run_session

    def run_session(
        self: OrtBackend, model: onnx.ModelProto, feeds: Mapping[str, npt.NDArray[Any]]
    ) -> Tensors:
        opened.append(model.ir_version)
        if highest is not None and model.ir_version > highest:
            raise RuntimeError(
                "[ONNXRuntimeError] : 1 : FAIL : model.cc:256 onnxruntime::Model::Model "
                f"Unsupported model IR version: {model.ir_version}, "
                f"max supported IR version: {highest}\n"
            )
        return real(self, model, feeds)

    monkeypatch.setattr(OrtBackend, "_run_session", run_session)
    return opened


# --- the pure part --------------------------------------------------------------------------


@pytest.mark.parametrize(("opset", "needed"), [(7, 3), (13, 7), (17, 8), (21, 10), (23, 11)])
def test_min_ir_version_follows_onnx_version_table(opset: int, needed: int) -> None:
    assert min_ir_version(exp_model(14, opset)) == needed


def test_min_ir_version_ignores_runtime_domains() -> None:
    assert min_ir_version(exp_model(14, opset=1, domain="com.microsoft")) == 8


def test_min_ir_version_counts_local_functions() -> None:
    model = exp_model(14, opset=13)
    model.functions.append(
        helper.make_function("local", "f", ["a"], ["b"], [], [helper.make_opsetid("", 21)])
    )
    assert min_ir_version(model) == 10


def test_min_ir_version_is_unknown_for_an_opset_newer_than_onnx() -> None:
    assert min_ir_version(exp_model(14, opset=99)) is None
    assert min_ir_version(exp_model(14, opset=99, domain="ai.onnx.ml")) is None


def test_runnable_ir_version() -> None:
    assert runnable_ir_version(exp_model(9, opset=17), highest=10) == 9
    assert runnable_ir_version(exp_model(14, opset=17), highest=10) == 10
    assert runnable_ir_version(exp_model(14, opset=21), highest=9) is None
    assert runnable_ir_version(exp_model(14, opset=99), highest=13) is None


def test_lowered_is_a_copy() -> None:
    model = exp_model(14)
    low = lowered(model, 10)
    assert (low.ir_version, model.ir_version) == (10, 14)
    assert low.graph == model.graph


# --- onnxruntime ----------------------------------------------------------------------------


def test_a_refused_ir_version_runs_lowered_with_a_note(monkeypatch: pytest.MonkeyPatch) -> None:
    opened = count_sessions(monkeypatch)
    backend, model = ort_cpu(), exp_model(99)  # what this onnxruntime refuses for real
    out = backend.run(model, {"x": X})
    np.testing.assert_allclose(out["y"], np.exp(X), rtol=1e-6)
    highest = backend.highest_ir
    assert highest is not None and highest >= 10  # onnxruntime 1.18+ reads IR 10
    assert opened == [99, highest]
    assert model.ir_version == 99  # the caller's model is untouched
    assert backend.notes() == [
        f"cpu: onnxruntime {ort.__version__} reads IR versions up to {highest}; "
        f"ran copies of the model lowered from IR 99 to {highest}"
    ]
    # Learned: later runs are lowered without a refusal first, and noted once.
    backend.run(exp_model(99), {"x": X})
    assert opened == [99, highest, highest]
    assert len(backend.notes()) == 1


def test_an_older_runtime_runs_onnx_default_ir_lowered(monkeypatch: pytest.MonkeyPatch) -> None:
    opened = count_sessions(monkeypatch, highest=10)
    backend = ort_cpu()
    out = backend.run(exp_model(14, opset=17), {"x": X})
    np.testing.assert_allclose(out["y"], np.exp(X), rtol=1e-6)
    assert (opened, backend.highest_ir) == ([14, 10], 10)
    assert backend.notes() == [
        f"cpu: onnxruntime {ort.__version__} reads IR versions up to 10; "
        "ran copies of the model lowered from IR 14 to 10"
    ]
    # A model the runtime reads as it is runs as it is.
    backend.run(exp_model(8, opset=17), {"x": X})
    assert opened == [14, 10, 8]


def test_opsets_that_need_a_newer_ir_are_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    opened = count_sessions(monkeypatch, highest=9)
    backend = ort_cpu()
    with pytest.raises(BackendError) as info:
        backend.run(exp_model(14, opset=21), {"x": X})
    assert str(info.value) == (
        "cpu: the model has IR version 14 and its opsets need IR 10, but onnxruntime "
        f"{ort.__version__} reads IR versions up to 9; install a newer onnxruntime"
    )
    assert opened == [14]
    assert backend.notes() == []


def test_opsets_newer_than_onnx_are_not_lowered() -> None:
    backend = ort_cpu()
    with pytest.raises(BackendError) as info:
        backend.run(exp_model(99, opset=99), {"x": X})
    assert str(info.value) == (
        f"cpu: the model has IR version 99 and its opsets are newer than onnx "
        f"{onnx.__version__} knows, but onnxruntime {ort.__version__} reads IR versions up to "
        f"{backend.highest_ir}; install a newer onnxruntime"
    )


def test_other_failures_are_not_retried(monkeypatch: pytest.MonkeyPatch) -> None:
    opened = count_sessions(monkeypatch)
    model = exp_model(10)
    model.graph.node[0].op_type = "NoSuchOp"
    backend = ort_cpu()
    with pytest.raises(BackendError, match="NoSuchOp"):
        backend.run(model, {"x": X})
    assert (opened, backend.highest_ir, backend.notes()) == ([10], None, [])


@pytest.mark.parametrize("in_child", [True, None], ids=["child per run", "worker"])
def test_a_backend_in_a_child_keeps_the_childs_notes(in_child: bool | None) -> None:
    # The lowering happens in the child process; its note must still reach the report, once
    # per run for an event, and a fact once however many children said it.
    from onnx_bisect.backends.registry import create_backend

    backend = create_backend("cpu", in_child=in_child)
    for _ in range(2):
        out = backend.run(exp_model(99), {"x": X})
    np.testing.assert_allclose(out["y"], np.exp(X), rtol=1e-6)
    assert any("lowered from IR 99" in n for n in backend.notes()), backend.notes()
