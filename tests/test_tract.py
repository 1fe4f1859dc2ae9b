"""The tract adapter on the real tract bindings: values by name, no false alarms, the CLI."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper
from typer.testing import CliRunner

import onnx_bisect
from onnx_bisect import Verdict
from onnx_bisect.backends import Backend, create_backend
from onnx_bisect.backends.tract import TractBackend, input_fact
from onnx_bisect.cli import bisect_app
from onnx_bisect.errors import BackendError, SpecError
from onnx_bisect.graph.extract import with_outputs
from tests.models import TRANSFORMER, YOLO, YOLO_FUSED, chain, make, two_inputs

pytest.importorskip("tract")

X = np.linspace(-1, 1, 16, dtype=np.float32).reshape(2, 8)
runner = CliRunner()


def _chain_with_value_info() -> onnx.ModelProto:
    """chain(3) with a symbolic ``batch`` input and value_info to match, as exporters write it.

    tract given the concrete input fact 2x8 fails on this file as written ("Impossible to unify
    Sym(batch) with Val(2)"), which is why the adapter clears value_info.
    """
    model = chain(3)
    model.graph.value_info.extend(
        helper.make_tensor_value_info(n, TensorProto.FLOAT, ["batch", 8]) for n in ("h0", "a0")
    )
    return model


def test_runs_and_returns_every_output_by_name() -> None:
    tract = create_backend("tract")
    assert isinstance(tract, Backend) and isinstance(tract, TractBackend)
    assert tract.describe().startswith("tract ") and set(tract.versions()) == {"tract"}
    # Intermediates marked as outputs, out of graph order, and the graph input itself.
    names = ["a0", "h2", "y", "h1", "x"]
    model = with_outputs(_chain_with_value_info(), names)
    before = model.SerializeToString()
    got = tract.run(model, {"x": X, "unused": np.zeros(3)})
    want = create_backend("cpu").run(model, {"x": X})
    assert list(got) == names
    for name in names:
        assert got[name].shape == (2, 8) and got[name].dtype == np.float32, name
        np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-6, err_msg=name)
    # tract names its outputs after nodes and returns them by position: nothing is shuffled.
    assert not np.allclose(got["a0"], got["h1"])
    assert model.SerializeToString() == before  # the caller's model is left alone


def test_integer_bool_scalar_and_shape_outputs() -> None:
    tract, cpu = create_backend("tract"), create_backend("cpu")
    # Shape arithmetic is typed TDim inside tract; it must come back as ONNX's int64.
    nodes = [
        helper.make_node("Neg", ["s"], ["neg"], name="neg"),
        helper.make_node("Shape", ["a"], ["shape"], name="shape"),
        helper.make_node("Not", ["mask"], ["inv"], name="not"),
        helper.make_node("ArgMax", ["a"], ["idx"], name="argmax", axis=1, keepdims=0),
    ]
    model = make(
        nodes,
        [
            helper.make_tensor_value_info("s", TensorProto.FLOAT, []),
            helper.make_tensor_value_info("a", TensorProto.FLOAT, ["seq", 4]),
            helper.make_tensor_value_info("mask", TensorProto.BOOL, ["seq", 4]),
        ],
        [
            helper.make_tensor_value_info("neg", TensorProto.FLOAT, []),
            helper.make_tensor_value_info("shape", TensorProto.INT64, [2]),
            helper.make_tensor_value_info("inv", TensorProto.BOOL, ["seq", 4]),
            helper.make_tensor_value_info("idx", TensorProto.INT64, ["seq"]),
        ],
    )
    rng = np.random.default_rng(0)
    feeds = {
        "mask": rng.random((3, 4)) > 0.5,
        "a": rng.standard_normal((3, 4)).astype(np.float32),
        "s": np.array(2.5, np.float32),
    }
    got, want = tract.run(model, feeds), cpu.run(model, feeds)
    for name, value in want.items():
        assert got[name].dtype == value.dtype and got[name].shape == value.shape, name
        np.testing.assert_array_equal(got[name], value, err_msg=name)
    # Inputs are fed by name whatever order the feeds come in.
    feeds = {"mask": feeds["mask"], "a": feeds["a"]}
    np.testing.assert_array_equal(
        tract.run(two_inputs(), feeds)["y"], cpu.run(two_inputs(), feeds)["y"]
    )


def test_input_fact_strings() -> None:
    assert input_fact(np.zeros((1, 3, 8, 8), np.float32)) == "1,3,8,8,f32"
    assert input_fact(np.zeros((2,), np.bool_)) == "2,bool"
    assert input_fact(np.zeros((), np.int64)) == "i64"
    assert input_fact(np.zeros((4, 1), np.float16)) == "4,1,f16"
    with pytest.raises(RuntimeError, match="complex64"):
        input_fact(np.zeros(2, np.complex64))


@pytest.mark.parametrize("model", [YOLO, YOLO_FUSED, TRANSFORMER], ids=lambda p: p.stem)
def test_no_false_alarm(model: Path) -> None:
    result = onnx_bisect.bisect(model, ref="cpu", target="tract")
    assert result.verdict == "match", [c.reason for c in result.outputs]
    assert result.first_divergence is None and result.root_cause is None
    assert {k: v for k, v in result.runs.items() if k != "float64"} == {"ref": 1, "target": 1}
    assert all(c.score < 1e-5 for c in result.outputs)  # measured: about 2e-7


@pytest.mark.parametrize("model", [YOLO, YOLO_FUSED, TRANSFORMER], ids=lambda p: p.stem)
def test_every_intermediate_agrees(model: Path) -> None:
    # always_scan marks every tensor as an output: tract must return them all, and all agree.
    result = onnx_bisect.bisect(model, ref="cpu", target="tract", always_scan=True)
    assert result.verdict == "match"
    assert result.nodes, "the scan compared no node"
    assert all(n.accumulated is not None for n in result.nodes)
    assert not [n.name for n in result.nodes if n.diverged]
    assert {n.verdict for n in result.nodes} == {Verdict.OK}
    assert result.target.description.startswith("tract ")
    assert set(result.target.versions) == {"tract"}


def test_cli_target_tract_exits_zero(tmp_path: Path) -> None:
    out = tmp_path / "report"
    res = runner.invoke(
        bisect_app, [str(YOLO), "--ref", "cpu", "--target", "tract", "-o", str(out)]
    )
    assert res.exit_code == 0, res.output
    assert res.stdout.strip().startswith("No divergence: tract vs cpu")
    assert (out / "report.json").is_file()


def _unsupported(tmp_path: Path) -> Path:
    """ONNX Runtime runs Det; tract 0.23 has no Det kernel."""
    nodes = [
        helper.make_node("Relu", ["x"], ["r"], name="relu"),
        helper.make_node("Det", ["r"], ["y"], name="det"),
    ]
    model = make(
        nodes,
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [])],
    )
    path = tmp_path / "det.onnx"
    onnx.save(model, str(path))
    return path


def test_model_tract_cannot_run_is_a_finding_at_the_node(tmp_path: Path) -> None:
    path = _unsupported(tmp_path)
    with pytest.raises(BackendError) as err:
        create_backend("tract").run(onnx.load(str(path)), {"x": np.eye(3, dtype=np.float32)})
    message = str(err.value)
    assert message.startswith("tract: ") and "Det" in message
    assert "\n" not in message and "Stack backtrace" not in message
    # A target that cannot run the model is a finding localized to the node, not a usage error.
    res = runner.invoke(bisect_app, [str(path), "--target", "tract"])
    assert res.exit_code == 1, res.output
    assert "Root cause (unsupported): det" in res.stdout, res.stdout
    assert "Unimplemented(Det)" in res.stdout and "Traceback" not in res.output


def test_missing_input_is_named() -> None:
    with pytest.raises(BackendError, match=r"^tract: no value for input\(s\) x$"):
        create_backend("tract").run(chain(), {"other": X})


def test_spec_errors() -> None:
    with pytest.raises(SpecError, match=r"unknown option\(s\) threads; valid: none"):
        create_backend("tract?threads=2")
    with pytest.raises(SpecError, match="tract takes no device"):
        create_backend("tract:cpu")
    assert TractBackend.unavailable_reason() is None


def test_tract_missing_kernel_message_reads_as_unsupported() -> None:
    """tract says ``Unimplemented(Det)``: an isolated node failing so is `unsupported`."""
    from onnx_bisect.engine.measure.isolate import IsolationFailure

    message = 'tract: Translating node #2 "det" Unimplemented(Det) ToTypedTranslator'
    assert IsolationFailure(message).unsupported
    assert not IsolationFailure("tract: shape mismatch in node #3").unsupported


def _resize_from_cast_constants() -> onnx.ModelProto:
    """x -> Relu -> Resize(roi, scales) -> y, its roi and scales Casts of float16 initializers
    to float32 (as onnxconverter-common leaves a Resize in a float16 PP-OCRv4 det)."""
    from onnx import numpy_helper

    inits = [
        numpy_helper.from_array(np.zeros(0, np.float16), "roi16"),
        numpy_helper.from_array(np.array([1, 1, 2, 2], np.float16), "scales16"),
    ]
    nodes = [
        helper.make_node("Cast", ["roi16"], ["roi"], name="roi_cast", to=TensorProto.FLOAT),
        helper.make_node(
            "Cast", ["scales16"], ["scales"], name="scales_cast", to=TensorProto.FLOAT
        ),
        helper.make_node("Relu", ["x"], ["r"], name="relu"),
        helper.make_node("Resize", ["r", "roi", "scales"], ["y"], name="resize", mode="nearest"),
    ]
    return make(
        nodes,
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2, 4, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 2, 8, 8])],
        inits,
    )


def test_a_resize_whose_scales_are_computed_from_constants_is_isolated() -> None:
    """Isolation fed a Resize's scales (a Cast of an initializer) as an input; tract cannot size
    the Resize from an input ("Neither sizes nor scales makes sense") and every isolation of the
    six Resizes of the float16 PP-OCRv4 det failed, each costing a target run of its own. A
    small tensor computed from initializers alone is embedded, as a Constant's is."""
    result = onnx_bisect.bisect(_resize_from_cast_constants(), target="tract", always_scan=True)
    verdicts = {n.name: n.verdict for n in result.nodes}
    assert verdicts["resize"] is Verdict.OK, next(
        n.note for n in result.nodes if n.name == "resize"
    )
    assert result.stage_runs["isolate"] == 1
