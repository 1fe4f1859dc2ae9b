"""A target that cannot run the model is a finding: bisected to the first node it cannot
handle, reported with the runtime's whole message, exit 1, and a repro bundle that shows the
same error. Real ONNX Runtime sessions behind every test backend."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import onnx
from typer.testing import CliRunner

import onnx_bisect
from onnx_bisect.backends.protocol import BackendBase, Tensors
from onnx_bisect.backends.registry import create_backend
from onnx_bisect.backends.spec import BackendSpec
from onnx_bisect.cli import bisect_app
from onnx_bisect.errors import BackendError
from onnx_bisect.graph.load import load_model
from onnx_bisect.result import CauseKind, Verdict
from tests.faulty import RefusingBackend
from tests.models import FAULTY_RUNTIME, YOLO

runner = CliRunner()


def rejecting(op: str) -> str:
    args = [sys.executable, str(FAULTY_RUNTIME), "{model}", "{inputs}", "{outputs}"]
    return "exec:" + shlex.join([*args, "--reject", op])


def first_of(op: str) -> str:
    return next(n.name for n in load_model(YOLO).nodes if n.op_type == op)


def test_an_op_the_target_lacks_is_exit_1_with_a_verified_bundle(tmp_path: Path) -> None:
    out = tmp_path / "r"
    res = runner.invoke(bisect_app, [str(YOLO), "--target", rejecting("Sigmoid"), "-o", str(out)])
    assert res.exit_code == 1, res.output
    report = json.loads((out / "report.json").read_text())
    cause = report["root_cause"]
    assert cause["kind"] == "unsupported" and cause["nodes"] == [first_of("Sigmoid")]
    assert "op Sigmoid" in cause["message"] and "is not implemented" in cause["message"]
    assert report["repro"]["kind"] == "error" and report["repro"]["reproduces"]
    # The bundle's own script shows the same error, and calls it reproduced (exit 1).
    proc = subprocess.run(
        [sys.executable, str(out / "repro" / "repro.py")], capture_output=True, text=True
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "REPRODUCED" in proc.stdout and "op Sigmoid" in proc.stdout
    assert "cannot run" in (out / "repro" / "issue.md").read_text().splitlines()[0]


def test_an_in_process_target_that_refuses_an_op_is_localized() -> None:
    result = onnx_bisect.bisect(YOLO, target=RefusingBackend("Mul"), repro=None)
    assert result.verdict == "diverged"
    cause = result.root_cause
    assert cause is not None and cause.kind is CauseKind.UNSUPPORTED
    assert cause.nodes == (first_of("Mul"),)
    assert result.first_divergence is not None
    assert result.first_divergence.verdict is Verdict.UNSUPPORTED
    assert "fails on the node alone" in cause.reason


class ContextError(BackendBase):
    """ORT CPU that fails on Mul ``node`` only when its Sigmoid input is computed in the same
    model: an error the runtime derives from the graph around the node (a fusion, a shape)."""

    def __init__(self, node: str) -> None:
        super().__init__(BackendSpec(text="context-error", name="context-error"))
        self.node = node
        self.inner = create_backend("cpu")

    def _run(self, model: onnx.ModelProto, feeds: Mapping[str, npt.NDArray[Any]]) -> Tensors:
        made = {o for n in model.graph.node for o in n.output}
        mul = next((n for n in model.graph.node if n.name == self.node), None)
        if mul is not None and all(i in made for i in mul.input):
            raise RuntimeError(f"fusion pass failed at {self.node}: bad broadcast")
        return self.inner.run(model, feeds)


def test_an_error_that_needs_the_graph_before_the_node_says_so() -> None:
    node = first_of("Mul")
    result = onnx_bisect.bisect(YOLO, target=ContextError(node))
    cause = result.root_cause
    assert cause is not None and cause.kind is CauseKind.ERROR and cause.nodes == (node,)
    assert "needs the graph before it" in cause.reason
    assert "bad broadcast" in cause.message


class LongMessage(BackendBase):
    """Fails with OpenVINO's shape of message: pages of detail, the summary at the end."""

    def __init__(self, op: str) -> None:
        super().__init__(BackendSpec(text="long", name="long"))
        self.op, self.inner = op, create_backend("cpu")

    def _run(self, model: onnx.ModelProto, feeds: Mapping[str, npt.NDArray[Any]]) -> Tensors:
        if any(n.op_type == self.op for n in model.graph.node):
            detail = "\n".join(f"-- node {i} with a message: rank is dynamic" for i in range(80))
            raise RuntimeError(f"{detail}\nSummary: Conversion is failed for: {self.op}-13")
        return self.inner.run(model, feeds)


def test_the_runtimes_whole_message_is_kept() -> None:
    result = onnx_bisect.bisect(YOLO, target=LongMessage("Concat"))
    cause = result.root_cause
    assert cause is not None and cause.kind is CauseKind.UNSUPPORTED
    assert cause.message.rstrip().endswith("Summary: Conversion is failed for: Concat-13")
    assert cause.message.count("rank is dynamic") == 80


def test_the_one_line_error_keeps_the_tail() -> None:
    target = LongMessage("Concat")
    model = load_model(YOLO).model
    try:
        target.run(model, {"images": np.zeros((1, 3, 160, 160), np.float32)})
    except BackendError as exc:
        line = str(exc)
        assert len(line) <= 420 and "\n" not in line
        assert line.endswith("Summary: Conversion is failed for: Concat-13")
    else:
        raise AssertionError("the backend did not fail")


def test_a_target_that_fails_on_anything_is_a_usage_error(tmp_path: Path) -> None:
    broken = "exec:" + shlex.join(
        [
            sys.executable,
            "-c",
            "import sys; sys.exit('no license')",
            "{model}",
            "{inputs}",
            "{outputs}",
        ]  # fmt: skip
    )
    res = runner.invoke(bisect_app, [str(YOLO), "--target", broken, "-o", str(tmp_path / "r")])
    assert res.exit_code == 2, res.output
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "no node is to blame" in lines[0]


def test_the_real_command_exits_1(tmp_path: Path) -> None:
    console_script = Path(sys.executable).parent / "bisect"
    proc = subprocess.run(
        [str(console_script), str(YOLO), "-t", rejecting("Concat"), "-q", "-o", str(tmp_path)],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr == ""


def constant_of_shape_gemm() -> onnx.ModelProto:
    """x -> Relu -> Gemm with B = W + ConstantOfShape(shape) (no ``value``: float32 zeros),
    the form on which tract gives the ConstantOfShape a float64 output and the Gemm then
    refuses it ("Impossible to unify F64 with F32")."""
    from onnx import TensorProto, helper, numpy_helper

    shape = numpy_helper.from_array(np.array([4, 3], np.int64), "shape")
    w = numpy_helper.from_array(np.arange(12, dtype=np.float32).reshape(4, 3) / 12, "W")
    nodes = [
        helper.make_node("Relu", ["x"], ["r"], name="relu"),
        helper.make_node("ConstantOfShape", ["shape"], ["zeros"], name="zeros"),
        helper.make_node("Add", ["W", "zeros"], ["w2"], name="add_w"),
        helper.make_node("Gemm", ["r", "w2"], ["y"], name="gemm"),
    ]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])], [shape, w],
    )  # fmt: skip
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


class Retyping(BackendBase):
    """ORT CPU that hands ``tensor`` on as float64 (``dtype``) or flattened (``shape``), and
    refuses any model that then reads it, as tract's Gemm does."""

    def __init__(self, tensor: str, change: str) -> None:
        super().__init__(BackendSpec(text=f"retyping({tensor})", name="retyping"))
        self.tensor, self.change = tensor, change
        self.inner = create_backend("cpu")

    def _run(self, model: onnx.ModelProto, feeds: Mapping[str, npt.NDArray[Any]]) -> Tensors:
        reader = next((n for n in model.graph.node if self.tensor in n.input), None)
        if reader is not None:
            raise BackendError(f"node {reader.name}: Impossible to unify F64 with F32")
        out = self.inner.run(model, feeds)
        if self.tensor in out:
            value = out[self.tensor]
            out[self.tensor] = value.astype(np.float64) if self.change == "dtype" else value.ravel()
        return out


def test_a_node_whose_output_type_changes_is_named_not_the_node_that_refuses_it() -> None:
    """The search accepts a prefix only when its outputs have the model's dtypes and shapes:
    a prefix that hands on the changed tensor has failed already."""
    said = {
        "dtype": "as float64 where the model says float32",
        "shape": "of shape (12) where the model says (4, 3)",
    }
    for change, words in said.items():
        result = onnx_bisect.bisect(
            constant_of_shape_gemm(), target=Retyping("zeros", change), repro=None
        )
        cause = result.root_cause
        assert cause is not None and cause.nodes == ("zeros",), (change, cause)
        assert cause.kind is CauseKind.ERROR
        assert cause.reason == (
            f"the target gives ConstantOfShape 'zeros' output 'zeros' {words}; it runs every "
            "smaller prefix of the graph, and fails on the full model where a later node is "
            "fed that tensor"
        )
        assert cause.message == "node add_w: Impossible to unify F64 with F32"


def test_tract_gives_a_constant_of_shape_float64_and_it_is_named(tmp_path: Path) -> None:
    """Real tract 0.23: ConstantOfShape without ``value`` comes out F64, and a later Gemm
    refuses it; the ConstantOfShape is named, not the Gemm."""
    import pytest

    pytest.importorskip("tract")
    result = onnx_bisect.bisect(constant_of_shape_gemm(), target="tract", repro=None)
    cause = result.root_cause
    assert cause is not None and cause.nodes == ("zeros",), cause
    assert cause.reason.startswith(
        "the target gives ConstantOfShape 'zeros' output 'zeros' as float64 where the model "
        "says float32"
    )
    assert "Impossible to unify F64 with F32" in cause.message
    assert result.first_divergence is not None
    assert result.first_divergence.verdict is Verdict.FAILED
