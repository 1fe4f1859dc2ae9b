"""The float64 oracle covers every node: a node torch cannot compute is computed alone another
way (``backends/torch/stand_in.py``), the rest of the graph stays on torch, and what judges a
tensor without a float64 value is said, never a silent fixed threshold."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator
from typer.testing import CliRunner

import onnx_bisect
from onnx_bisect.cli import bisect_app
from onnx_bisect.errors import BackendError

torch = pytest.importorskip("torch")

from onnx_bisect.backends.registry import create_backend  # noqa: E402
from onnx_bisect.backends.torch import interpreter  # noqa: E402
from onnx_bisect.backends.torch.ops.registry import UnsupportedOperator  # noqa: E402

runner = CliRunner()


def _model(nodes: list[onnx.NodeProto], inits: list[onnx.TensorProto], **opsets: int) -> Any:
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4096])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4096])],
        inits,
    )
    imports = [helper.make_opsetid("", 17)]
    imports += [helper.make_opsetid(d.replace("_", "."), v) for d, v in opsets.items()]
    return helper.make_model(graph, opset_imports=imports)


def gelu_log(fp16: bool) -> onnx.ModelProto:
    """com.microsoft.Gelu (which neither torch nor onnx.reference computes) → Mul → Add → Log
    of values near 1.1, where float16's rounding of the Log's input is a 4e-3 error of its
    output; ``fp16``: the same model with everything after the Gelu in float16."""
    dtype = np.float16 if fp16 else np.float32
    nodes = [helper.make_node("Gelu", ["x"], ["g"], domain="com.microsoft", name="gelu")]
    src = "g"
    if fp16:
        nodes.append(helper.make_node("Cast", ["g"], ["g16"], to=TensorProto.FLOAT16, name="in"))
        src = "g16"
    nodes += [
        helper.make_node("Mul", [src, "k"], ["m"], name="mul"),
        helper.make_node("Add", ["m", "c"], ["a"], name="add"),
        helper.make_node("Log", ["a"], ["l" if fp16 else "y"], name="log"),
    ]
    if fp16:
        nodes.append(helper.make_node("Cast", ["l"], ["y"], to=TensorProto.FLOAT, name="out"))
    inits = [
        numpy_helper.from_array(np.array([0.02], dtype), "k"),
        numpy_helper.from_array(np.array([1.1], dtype), "c"),
    ]
    return _model(nodes, inits, com_microsoft=1)


def scaler_log() -> onnx.ModelProto:
    """ai.onnx.ml.Scaler, which torch lacks and onnx.reference computes, then Log."""
    nodes = [
        helper.make_node(
            "Scaler", ["x"], ["s"], domain="ai.onnx.ml", offset=[-6.0], scale=[0.25], name="scaler"
        ),
        helper.make_node("Log", ["s"], ["y"], name="log"),
    ]
    return _model(nodes, [], ai_onnx_ml=3)


def _x() -> np.ndarray:
    return np.random.default_rng(0).standard_normal((1, 4096)).astype(np.float32)


def test_a_node_torch_lacks_is_computed_by_onnx_reference_alone_in_float64() -> None:
    model = scaler_log()
    with pytest.raises(UnsupportedOperator, match="does not support ai.onnx.ml.Scaler"):
        create_backend("torch:cpu?dtype=float64").run(model, {"x": _x()})
    oracle = create_backend("torch:cpu?dtype=float64&fallback=1")
    got = oracle.run(model, {"x": _x()})["y"]
    exact = np.log((_x().astype(np.float64) + 6.0) * 0.25)
    assert got.dtype == np.float64
    assert np.max(np.abs(got - exact)) < 1e-12  # float64 throughout, not a float32 value
    assert oracle.notes() == [  # type: ignore[attr-defined]
        "Scaler 'scaler' computed alone by onnx.reference (the torch backend does not support "
        "ai.onnx.ml.Scaler version 1 (model opset 3))"
    ]


def test_a_failed_translation_is_said_to_be_ours_and_is_stood_in_for(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    real = interpreter.lookup

    def broken(op_type: str, opset: int, domain: str = "") -> Any:
        if op_type != "Log":
            return real(op_type, opset, domain)

        def fails(ctx: Any, x: Any, attrs: Any) -> Any:
            raise RuntimeError("frames do not fit")

        return fails

    monkeypatch.setattr(interpreter, "lookup", broken)
    model = _model([helper.make_node("Log", ["x"], ["y"], name="log")], [])
    x = np.abs(_x()) + 0.5
    with pytest.raises(BackendError) as raised:
        create_backend("torch:cpu").run(model, {"x": x})
    assert str(raised.value) == (
        "node 'log' (Log): the torch backend's translation of Log failed: frames do not fit"
    )
    oracle = create_backend("torch:cpu?dtype=float64&fallback=1")
    got = oracle.run(model, {"x": x})["y"]
    assert np.max(np.abs(got - np.log(x.astype(np.float64)))) < 1e-12
    assert oracle.notes() == [  # type: ignore[attr-defined]
        "Log 'log' computed alone by onnx.reference (the torch backend's translation of Log "
        "failed: frames do not fit)"
    ]


def test_an_op_only_onnx_runtime_has_leaves_one_tensor_without_a_float64_value() -> None:
    from onnx_bisect.engine.oracle.job import inexact

    oracle = create_backend("torch:cpu?dtype=float64&fallback=1")
    out = oracle.run(gelu_log(False), {"x": _x()})["y"]
    session = ort.InferenceSession(gelu_log(False).SerializeToString())
    assert np.max(np.abs(out - session.run(None, {"x": _x()})[0])) < 1e-6
    assert inexact(oracle) == ["g"]  # the Gelu's output; the Log's is float64 again


def test_fp16_past_an_op_no_oracle_has_is_judged_by_its_precision_not_a_fixed_threshold(
    tmp_path: Path,
) -> None:
    """The measured false alarm: the oracle could not run one op, the tool fell back to a
    fixed 1e-3 for the whole model and flagged a Log whose float16 error (4e-3 here) is what
    float16 predicts."""
    onnx.save(gelu_log(False), tmp_path / "m.onnx")
    onnx.save(gelu_log(True), tmp_path / "m16.onnx")
    result = onnx_bisect.bisect(
        tmp_path / "m.onnx",
        ref="cpu",
        target="torch:cpu?fallback=1",
        target_model=tmp_path / "m16.onnx",
        target_precision="float16",
    )
    assert result.verdict == "match"
    (output,) = result.outputs
    assert output.metrics["rel_l2"] > 2e-3  # a fixed 1e-3 would have called it diverged
    assert output.within_precision
    assert not any(n.startswith("--threshold auto: no float64 values") for n in result.notes)
    assert (
        "float64 oracle: Gelu 'gelu' computed alone by ONNX Runtime in float32 (the torch "
        "backend does not support com.microsoft.Gelu version 1 (model opset 1))"
    ) in result.notes
    assert (
        "--threshold auto: no float64 value of 1 tensor ('g'): only ONNX Runtime computed their "
        "nodes, in float32; they are judged by float16 precision floors, measured from their "
        "own operands"
    ) in result.notes
    cli = runner.invoke(
        bisect_app,
        [str(tmp_path / "m.onnx"), "--ref", "cpu", "--target", "torch:cpu?fallback=1",
         "--target-model", str(tmp_path / "m16.onnx"), "--target-precision", "float16"],
    )  # fmt: skip
    assert cli.exit_code == 0, cli.output
    assert "note: float64 oracle: Gelu 'gelu' computed alone by ONNX Runtime" in cli.output
    assert "warning: --threshold auto: no float64 value of 1 tensor ('g')" in cli.output


# --- STFT as exporters write it ---------------------------------------------------------------


def _stft(signal: list[int], window: int | None, frame: int | None) -> onnx.ModelProto:
    inputs = ["x", "step", "win" if window else "", "frame" if frame else ""]
    inits = [numpy_helper.from_array(np.array(8, np.int64), "step")]
    if window:
        hann = np.hanning(window + 1)[:-1].astype(np.float32)
        inits.append(numpy_helper.from_array(hann, "win"))
    if frame:
        inits.append(numpy_helper.from_array(np.array(frame, np.int64), "frame"))
    graph = helper.make_graph(
        [helper.make_node("STFT", [n for n in inputs], ["y"], name="stft")],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, signal)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        inits,
    )
    while graph.node[0].input and not graph.node[0].input[-1]:
        del graph.node[0].input[-1]
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize(
    ("signal", "window", "frame", "judge"),
    [
        ([2, 64, 1], 16, None, "ort"),
        ([2, 64, 1], None, 16, "ort"),
        ([2, 64, 2], 16, 16, "ort"),
        ([2, 64], 16, None, "ort"),  # no trailing axis: ONNX Runtime accepts it
        ([2, 64, 1], 12, 16, "reference"),  # a frame zero-padded to frame_length (the spec's)
    ],
)
def test_stft_matches_the_spec_in_the_forms_models_use(
    signal: list[int], window: int | None, frame: int | None, judge: str
) -> None:
    model = _stft(signal, window, frame)
    x = np.random.default_rng(1).standard_normal(signal).astype(np.float32)
    if judge == "ort":
        want = ort.InferenceSession(model.SerializeToString()).run(None, {"x": x})[0]
    else:
        want = ReferenceEvaluator(model).run(None, {"x": x})[0]
    for spec in ("torch:cpu", "torch:cpu?dtype=float64"):
        got = create_backend(spec).run(model, {"x": x})["y"]
        assert got.shape == want.shape
        assert np.max(np.abs(got - want)) < 1e-5 * max(1.0, float(np.max(np.abs(want))))
