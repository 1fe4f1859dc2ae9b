"""Strict targets: every model the tool writes is valid ONNX with typed outputs, a target that
runs the model never ends in a usage error, and runtimes' "I lack this op" messages are read as
such (issue 29, scopes 1-3).

The strict runtime (tests/strict_runtime.py) runs ``onnx.checker`` with ``full_check`` and
insists on every output's element type and shape before ONNX Runtime runs the model, as IREE's
importer and tinygrad's parser do; it exits 4 on any model it refuses, so a derived model that
is not valid turns into a refusal the assertions below see.
"""

from __future__ import annotations

import json
import re
import shlex
import sys
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from typer.testing import CliRunner

import onnx_bisect
from onnx_bisect.backends.registry import create_backend
from onnx_bisect.backends.unsupported import PHRASES, unsupported, unsupported_phrase
from onnx_bisect.cli import bisect_app
from onnx_bisect.graph.extract import (
    identity_model,
    incomplete_outputs,
    isolation_model,
    prefix_model,
    window_model,
    with_outputs,
)
from onnx_bisect.graph.load import load_model
from onnx_bisect.graph.view import TensorMeta
from tests.models import ROOT, TRANSFORMER, YOLO, YOLO_FUSED

STRICT = ROOT / "tests" / "strict_runtime.py"
MODELS = sorted((ROOT / "examples" / "models").glob("*.onnx"))
runner = CliRunner()


def strict(*args: str) -> str:
    cmd = [sys.executable, str(STRICT), "{model}", "{inputs}", "{outputs}", *args]
    return "exec:" + shlex.join(cmd)


def _fault_node(path: Path) -> str:
    """A node that computes from the input (not a constant, not a shape): where to plant."""
    loaded = load_model(path)
    ops = ("Conv", "MatMul", "Relu", "Sigmoid", "Mul", "Add")
    return next(
        n.name for n in loaded.nodes if n.op_type in ops and n.name not in loaded.constant_nodes
    )


def _refusals(result: onnx_bisect.BisectResult) -> list[str]:
    return [n for n in result.notes if "refused" in n or "invalid model" in n]


@pytest.mark.parametrize("strategy", ["scan", "bisect"])
@pytest.mark.parametrize("path", MODELS, ids=[p.stem for p in MODELS])
def test_every_strategy_runs_every_example_through_a_strict_runtime(
    path: Path, strategy: str
) -> None:
    node = _fault_node(path)
    result = onnx_bisect.bisect(path, target=strict("--fault", f"{node}=0.1"), strategy=strategy)
    assert _refusals(result) == []
    assert result.root_cause is not None and result.root_cause.nodes == (node,)
    assert result.root_cause.kind == "culprit"


@pytest.mark.slow
def test_a_pattern_window_runs_through_a_strict_runtime() -> None:
    result = onnx_bisect.bisect(YOLO_FUSED, target=strict("--pattern-fault", "/down1/Mul=0.05"))
    assert _refusals(result) == []
    assert result.root_cause is not None and result.root_cause.kind == "pattern"
    assert result.root_cause.nodes == ("/down1/conv/Conv", "/down1/Sigmoid", "/down1/Mul")


@pytest.mark.slow
def test_a_refused_op_is_unsupported_at_its_node_with_a_valid_bundle(tmp_path: Path) -> None:
    out = tmp_path / "r"
    target = strict("--reject", "Sigmoid")
    res = runner.invoke(bisect_app, [str(YOLO), "--target", target, "-o", str(out)])
    assert res.exit_code == 1, res.output
    report = json.loads((out / "report.json").read_text())
    cause = report["root_cause"]
    assert cause["kind"] == "unsupported" and cause["nodes"] == ["/stem/Sigmoid"]
    assert "op Sigmoid (node /stem/Sigmoid) is not implemented" in cause["message"]
    assert report["repro"]["reproduces"]
    onnx.checker.check_model(str(out / "repro" / "model.onnx"), full_check=True)


@pytest.mark.slow
def test_a_divergence_bundle_is_valid_and_verified_on_a_strict_runtime(tmp_path: Path) -> None:
    out = tmp_path / "r"
    target = strict("--fault", "/down1/Sigmoid=0.1")
    res = runner.invoke(bisect_app, [str(YOLO), "--target", target, "-o", str(out)])
    assert res.exit_code == 1, res.output
    report = json.loads((out / "report.json").read_text())
    assert report["root_cause"]["nodes"] == ["/down1/Sigmoid"]
    assert report["repro"]["reproduces"]
    onnx.checker.check_model(str(out / "repro" / "model.onnx"), full_check=True)


@pytest.mark.slow
def test_a_target_that_refuses_many_outputs_is_localized_by_the_cut_search() -> None:
    node = "/down1/Sigmoid"
    target = strict("--fault", f"{node}=0.1", "--max-outputs", "8")
    result = onnx_bisect.bisect(YOLO, target=target)
    assert result.verdict == "diverged"
    assert result.root_cause is not None and result.root_cause.nodes == (node,)
    assert result.root_cause.kind == "culprit"
    assert result.strategy == "scan+bisect"
    [note] = [n for n in result.notes if "refused" in n]
    assert "the scan model" in note and "too many outputs" in note and "cut search" in note


@pytest.mark.slow
def test_a_runtime_failing_from_the_first_node_on_names_the_first_node(tmp_path: Path) -> None:
    loaded = load_model(YOLO)
    first, last = loaded.nodes[0].name, loaded.nodes[-1].name
    out = tmp_path / "r"
    # Every prefix fails with exit 5 (an ordinary error); the whole model aborts (a crash).
    target = strict("--fail-on", first, "--abort-on", last)
    res = runner.invoke(bisect_app, [str(YOLO), "--target", target, "-o", str(out)])
    assert res.exit_code == 1, res.output
    report = json.loads((out / "report.json").read_text())
    cause = report["root_cause"]
    assert cause["nodes"] == [first] and cause["kind"] == "error"
    assert "exited with code 5" in cause["message"]
    assert "runs every smaller prefix" not in cause["reason"]
    assert "first node of the graph" in cause["reason"]
    # The full model's own failure (the abort) is in the report beside the prefix's error.
    assert "signal 6" in cause["model_message"]
    said = (out / "report.md").read_text().split("On the full model it said:")[1]
    assert "signal 6" in said.split("```")[1]


def test_a_runtime_that_fails_on_anything_shows_the_identity_probes_own_error() -> None:
    # Its words differ by model (the model's size): the probe's own words are shown too.
    code = "import os, sys; sys.exit(f'no license for {os.path.getsize(sys.argv[1])} bytes')"
    broken = "exec:" + shlex.join([sys.executable, "-c", code, "{model}", "{inputs}", "{outputs}"])
    res = runner.invoke(bisect_app, [str(YOLO), "--target", broken])
    assert res.exit_code == 2, res.output
    [line] = res.stderr.strip().splitlines()
    assert "no node is to blame: " in line and "no license for" in line.split("to blame: ")[1]
    said = re.findall(r"no license for \d+ bytes", line)
    assert len(said) == 2 and said[0] != said[1], line


def test_a_runtime_that_says_the_same_on_anything_is_quoted_once() -> None:
    # The same words on both models (only the temporary path differs): printed once.
    code = "import sys; sys.exit('no license for ' + sys.argv[1])"
    broken = "exec:" + shlex.join([sys.executable, "-c", code, "{model}", "{inputs}", "{outputs}"])
    res = runner.invoke(bisect_app, [str(YOLO), "--target", broken])
    assert res.exit_code == 2, res.output
    [line] = res.stderr.strip().splitlines()
    assert line.count("no license for /") == 1, line
    assert line.endswith("(it also fails on a one-node Identity model, so no node is to blame)"), (
        line
    )


# Derived models, checked directly: valid under the full checker, every output typed.


def _reference(path: Path) -> tuple[Any, dict[str, Any], dict[str, TensorMeta]]:
    loaded = load_model(path)
    rng = np.random.default_rng(0)
    feeds = {}
    for i in loaded.model.graph.input:
        if i.name in loaded.initializers:
            continue
        shape = [d.dim_value or 1 for d in i.type.tensor_type.shape.dim]
        feeds[i.name] = rng.standard_normal(shape).astype(np.float32)
    cpu = create_backend("cpu")
    values = cpu.run(with_outputs(loaded.model, list(loaded.probes)), feeds)
    metas = {k: TensorMeta(np.dtype(v.dtype), tuple(v.shape)) for k, v in values.items()}
    return loaded, values, metas


def _valid(model: onnx.ModelProto) -> None:
    onnx.checker.check_model(model, full_check=True)
    assert incomplete_outputs(model) == []


@pytest.mark.parametrize("path", [YOLO, TRANSFORMER], ids=["yolo_like", "transformer"])
def test_every_cut_model_is_valid(path: Path) -> None:
    loaded, _, metas = _reference(path)
    _valid(with_outputs(loaded.model, list(loaded.probes), metas))
    _valid(identity_model(loaded, loaded.inputs[0]))
    nodes = [n for n in loaded.nodes if n.name not in loaded.constant_nodes]
    _valid(isolation_model(loaded, nodes[:20], metas)[0])
    _valid(window_model(loaded, nodes[3:9], metas)[0])
    for position in (1, len(loaded.nodes) // 2, len(loaded.nodes) - 1):
        _valid(prefix_model(loaded, position, metas))


def test_outputs_shape_inference_cannot_type_are_typed_from_the_reference() -> None:
    # Reshape to a shape of a length computed from the data: inference knows the dtype only.
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 6])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 6])  # the user declares it
    nodes = [
        helper.make_node("Relu", ["x"], ["r"], name="relu"),
        helper.make_node("ReduceMax", ["r"], ["m"], name="max", keepdims=0),
        helper.make_node("Cast", ["m"], ["mi"], name="cast", to=TensorProto.INT64),
        helper.make_node("Reshape", ["mi", "one"], ["k"], name="k"),
        helper.make_node("Slice", ["dims", "zero", "k"], ["shape"], name="shape"),
        helper.make_node("Abs", ["x"], ["a"], name="abs"),
        helper.make_node("Reshape", ["a", "shape"], ["yr"], name="reshape"),
        helper.make_node("Neg", ["yr"], ["y"], name="neg"),
    ]
    inits = [
        numpy_helper.from_array(np.array([1], np.int64), "one"),
        numpy_helper.from_array(np.array([0], np.int64), "zero"),
        numpy_helper.from_array(np.array([2, 6, 1], np.int64), "dims"),
    ]
    graph = helper.make_graph(nodes, "g", [x], [y], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 10
    loaded = load_model(model)
    untyped = with_outputs(loaded.model, list(loaded.probes))
    assert "yr" in incomplete_outputs(untyped)
    feeds = {"x": np.full((2, 6), 2.5, np.float32)}
    values = create_backend("cpu").run(untyped, feeds)
    metas = {k: TensorMeta(np.dtype(v.dtype), tuple(v.shape)) for k, v in values.items()}
    typed = with_outputs(loaded.model, list(loaded.probes), metas)
    _valid(typed)
    [y_out] = [o for o in typed.graph.output if o.name == "yr"]
    assert [d.dim_value for d in y_out.type.tensor_type.shape.dim] == [2, 6]
    _valid(prefix_model(loaded, len(loaded.nodes), metas))
    # Through the strict runtime the scan and the prefix search both run.
    result = onnx_bisect.bisect(model, target=strict("--fault", "abs=0.1"), inputs=feeds)
    assert _refusals(result) == []
    assert result.root_cause is not None and result.root_cause.nodes == ("abs",)


# Failure kinds: one table, read with each runtime's real words.

REAL_UNSUPPORTED = {
    # iree-compile 3.13 on BatchNormalization at opset 13
    "iree": "bn13.mlir:8:10: error: failed to legalize operation 'torch.operator' that was "
    'explicitly marked illegal: %9 = "torch.operator"(%arg0, %1, %3, %5, %7) <{name = '
    '"onnx.BatchNormalization"}> : (!torch.vtensor<[1,3,4,4],f32>, ...)',
    # apache-tvm 0.27, relax ONNX frontend on an LSTM
    "tvm": "tvm.error.OpNotImplemented: The following operators are not supported for "
    "frontend ONNX: LSTM",
    "tvm-message-only": "The following operators are not supported for frontend ONNX: LSTM",
    # tinygrad's OnnxRunner._select_op
    "tinygrad": "NotImplementedError: op='LSTM' is not supported",
    "tinygrad-version": "NotImplementedError: op='Pad' is not supported for domain "
    "Domain.ONNX and version 11",
    # OpenVINO 2026.4 on an op of a custom domain
    "openvino": "Exception from src/inference/src/cpp/core.cpp:132:\nCheck 'false' failed at "
    "src/frontends/common_translators/src/unconverted_ops_report.cpp:151:\nFrontEnd API failed "
    "with OpConversionFailure:\nModel wasn't fully converted.\nSummary:\n-- No conversion rule "
    "found for operations: com.acme.Frobnicate",
    "openvino-conversion": "Summary: Conversion is failed for: Concat-13",
    "onnxruntime": "[ONNXRuntimeError] : 9 : NOT_IMPLEMENTED : Could not find an implementation "
    "for Det(22) node with name 'det'",
    "tract": 'Translating node #3 "det" Det ToTypedTranslator\n\nCaused by:\n    '
    "Unimplemented(Det)",
}

REAL_FAILURES = {
    "iree-demote": "INVALID_ARGUMENT; buffer view byte length 1024 exceeds backing buffer "
    "byte length 512",
    "iree-pad": "error: 'linalg.generic' op inferred input/output operand #0 has shape's "
    "dimension #0 to be greater than or equal to 64, but found 63",
    "tvm-reshape": "Reshape requires the input new shape to be Shape",
    "onnxruntime": "[ONNXRuntimeError] : 2 : INVALID_ARGUMENT : Got invalid dimensions for "
    "input: x for the following indices index: 1 Got: 4 Expected: 3",
}


@pytest.mark.parametrize("runtime", list(REAL_UNSUPPORTED))
def test_each_runtimes_missing_op_message_is_unsupported(runtime: str) -> None:
    assert unsupported(REAL_UNSUPPORTED[runtime])


@pytest.mark.parametrize("runtime", list(REAL_FAILURES))
def test_a_runtime_failure_is_not_unsupported(runtime: str) -> None:
    assert not unsupported(REAL_FAILURES[runtime])


def test_every_phrase_of_the_table_is_used_and_lower_case() -> None:
    texts = [*REAL_UNSUPPORTED.values()]
    assert all(p.text == p.text.lower() for p in PHRASES)
    matched = {unsupported_phrase(t) for t in texts}
    assert {"failed to legalize operation", "are not supported", "is not supported"} <= {
        p.text for p in matched if p is not None
    }


# A quantized (QDQ) second model: tensors the reference never computed cannot feed a window.


def test_a_qdq_target_model_is_diagnosed_without_a_key_error(tmp_path: Path) -> None:
    quantization = pytest.importorskip("onnxruntime.quantization")
    rng = np.random.default_rng(0)
    x = helper.make_tensor_value_info("images", TensorProto.FLOAT, [1, 3, 16, 16])
    y = helper.make_tensor_value_info("out", TensorProto.FLOAT, [1, 4, 16, 16])
    w = rng.standard_normal((8, 3, 3, 3)).astype(np.float32)
    w2 = rng.standard_normal((4, 8, 3, 3)).astype(np.float32)
    conv = "/model.0/conv/Conv_output_0"
    nodes = [
        helper.make_node("Conv", ["images", "w"], [conv], name="/model.0/conv/Conv", pads=[1] * 4),
        helper.make_node("Sigmoid", [conv], ["s"], name="/model.0/act/Sigmoid"),
        helper.make_node("Mul", [conv, "s"], ["m"], name="/model.0/act/Mul"),
        helper.make_node("Conv", ["m", "w2"], ["out"], name="/model.1/conv/Conv", pads=[1] * 4),
    ]
    inits = [numpy_helper.from_array(w, "w"), numpy_helper.from_array(w2, "w2")]
    graph = helper.make_graph(nodes, "g", [x], [y], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    f32, qdq = tmp_path / "f32.onnx", tmp_path / "qdq.onnx"
    onnx.save(model, f32)

    class Calibration(quantization.CalibrationDataReader):  # type: ignore[misc]
        def __init__(self) -> None:
            shape = (1, 3, 16, 16)
            self.data = iter([{"images": rng.standard_normal(shape).astype(np.float32)}] * 4)

        def get_next(self) -> dict[str, Any] | None:
            return next(self.data, None)

    quantization.quantize_static(
        str(f32), str(qdq), Calibration(), quant_format=quantization.QuantFormat.QDQ,
        activation_type=quantization.QuantType.QUInt8, weight_type=quantization.QuantType.QInt8,
    )  # fmt: skip
    assert f"{conv}_QuantizeLinear_Output" in {
        t for n in onnx.load(qdq).graph.node for t in n.output
    }
    res = runner.invoke(
        bisect_app,
        [str(f32), "--target", "cpu", "--target-model", str(qdq), "-o", str(tmp_path / "r")],
    )
    assert res.exit_code == 1, res.output
    report = json.loads((tmp_path / "r" / "report.json").read_text())
    assert report["first_divergence"] is not None
