"""Keeping nodes in float means what onnxruntime's quantizer does with them excluded: the
patched QDQ model the keep-in-float search runs is the one ``quantize_static(...,
nodes_to_exclude=[...])`` writes, and the answer holds when the user re-quantizes with it."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from typer.testing import CliRunner

from onnx_bisect.cli import bisect_app
from onnx_bisect.graph.load import load_model
from onnx_bisect.graph.unquantize import Unquantizer
from tests import quant_models as qm

pytest.importorskip("onnxruntime.quantization")


def _run(model: onnx.ModelProto | Path, x: np.ndarray) -> np.ndarray:
    so = ort.SessionOptions()
    so.log_severity_level = 3
    blob = model.SerializeToString() if isinstance(model, onnx.ModelProto) else str(model)
    s = ort.InferenceSession(blob, so, providers=["CPUExecutionProvider"])
    out: np.ndarray = s.run(None, {s.get_inputs()[0].name: x})[0]
    return out


def _requantized(src: Path, tmp: Path, exclude: list[str], form: str = "qdq") -> Path:
    """``src`` quantized again (as ``qm.quantized`` did it) with ``exclude`` left out."""
    folder = tmp / f"re{len(list(tmp.glob('re*')))}"
    folder.mkdir()
    _, dst = qm.quantized(onnx.load(str(src)), folder, form, nodes_to_exclude=exclude)
    return dst


@pytest.mark.parametrize(
    ("build", "apart"),
    [(qm.detector, ()), (qm.yolo_head, ()), (qm.block, ("softmax",))],
    ids=["detector", "yolo_head", "block"],
)
def test_each_node_kept_in_float_is_the_model_the_quantizer_writes(
    tmp_path: Path, build: object, apart: tuple[str, ...]
) -> None:
    """Every node alone, and every node at once: the patched model computes exactly what
    the re-quantized one does. ``apart``: a Softmax excluded loses the [0, 1] range the
    quantizer gives its output, which its reader's pair then takes from calibration (the
    patched model keeps the target's scale there): equal up to calibration."""
    src, dst = qm.quantized(build(), tmp_path, "qdq")  # type: ignore[operator]
    rules = Unquantizer(load_model(str(dst)), load_model(str(src)))
    assert rules.unmatched() == ()
    x = np.random.default_rng(7).random(qm.DETECTOR_SHAPE if build is not qm.block
                                        else qm.BLOCK_SHAPE).astype(np.float32)  # fmt: skip
    for keep in [*([c] for c in rules.candidates), list(rules.candidates)]:
        requantized = _run(_requantized(src, tmp_path, keep), x)
        patched = _run(rules.model(keep), x)
        if set(keep) & set(apart) and len(keep) == 1:
            assert np.abs(patched - requantized).max() < 0.05, keep
        else:
            np.testing.assert_allclose(patched, requantized, rtol=0, atol=1e-5, err_msg=str(keep))
    # Every node in float is the float model.
    np.testing.assert_allclose(
        _run(rules.model(rules.candidates), x), _run(src, x), rtol=0, atol=1e-4
    )


def test_a_dropped_relu_is_put_back_when_its_conv_is_kept_in_float(tmp_path: Path) -> None:
    """The quantizer drops a Relu after a quantized Conv (its output pair's range clamps);
    excluding the Conv keeps the Relu, in float, before the pair its reader asks for."""
    src, dst = qm.quantized(qm.detector(), tmp_path, "qdq")
    rules = Unquantizer(load_model(str(dst)), load_model(str(src)))
    assert rules.base.removed == {"relu1": "c1", "relu2": "c2"}
    patched = rules.model(["conv1"])
    ops = {n.name: n.op_type for n in patched.graph.node}
    assert ops["relu1"] == "Relu" and "conv1" in ops
    relu = next(n for n in patched.graph.node if n.name == "relu1")
    assert list(relu.input) == ["c1"] and list(relu.output) == ["r1"]
    assert "x_QuantizeLinear" not in ops  # nobody quantizes the input any more
    assert "r1_QuantizeLinear" in ops  # conv2 still does


def _agreement(model: onnx.ModelProto | Path, src: Path) -> float:
    """Top-1 class agreement with the float model over 8 fresh inputs (the score channels
    of ``y``, per position)."""
    rows = []
    for i in range(8):
        x = np.random.default_rng(900 + i).random(qm.HEAD_SHAPE).astype(np.float32)
        ref, got = _run(src, x)[:, 4:], _run(model, x)[:, 4:]
        rows.append(ref.argmax(1) == got.argmax(1))
    return float(np.mean(rows))


@pytest.mark.slow
@pytest.mark.parametrize(("form", "quant_format"), [("qdq", "QDQ"), ("qoperator", "QOperator")])
def test_the_yolo_head_answer_holds_when_the_user_requantizes_with_it(
    tmp_path: Path, form: str, quant_format: str
) -> None:
    """A Sigmoid's scores and 0-320 boxes joined by one Concat: excluding the Concat alone
    leaves the Sigmoid's own pair, which rounds most scores to 0, so the answer must name
    both. Re-quantized with the printed list and the same calibration, top-1 class agreement
    is restored, and the tool's own (patched-model) verification agrees with it. QOperator's
    QLinearSigmoid writes integers at its own scale: the same answer."""
    src, dst = qm.quantized(qm.yolo_head(), tmp_path, form)
    calibration = tmp_path / "calibration.npz"  # the inputs qm.quantized calibrated on
    np.savez(calibration, x=np.concatenate([c["x"] for c in qm.calibration("x", qm.HEAD_SHAPE)]))
    out = tmp_path / "out"
    result = CliRunner().invoke(
        bisect_app,
        [str(src), "--target-model", str(dst), "--target", "cpu", "--topk", "1:y@1[4:]",
         "--calibration", str(calibration), "--out", str(out), "--format", "json"],
    )  # fmt: skip
    assert result.exit_code == 1, result.output
    keep = json.loads((out / "report.json").read_text())["quantization"]["keep_in_float"]
    assert sorted(keep["nodes"]) == ["cls_sigmoid", "head_concat"] and keep["verified"]
    # Verified by onnxruntime's quantizer on the same calibration: it computes what the
    # patched model did, the target's loss without the set and its recovery with it.
    assert keep["verified_by"] == "requantized"
    assert keep["requantized"] == {"before": keep["before"], "after": keep["after"]}
    assert keep["kind"] == "nodes_to_exclude"
    assert keep["call"] == (
        "quantize_static(model_input, model_output, calibration_data_reader, "
        f"nodes_to_exclude={keep['nodes']!r}, quant_format=QuantFormat.{quant_format}, "
        "activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8, per_channel=False, "
        "reduce_range=False)"
    )
    assert f"paste: {keep['call']}" in result.output
    printed = re.search(r"nodes_to_exclude=(\[[^\]]*\])", result.output)
    assert printed is not None
    exclude = json.loads(printed.group(1).replace("'", '"'))
    assert _agreement(dst, src) < 0.2  # the quantized model as it is
    # The Concat alone, as the tool answered before it followed the quantizer's rules.
    assert _agreement(_requantized(src, tmp_path, ["head_concat"], form), src) < 0.3
    requantized = _agreement(_requantized(src, tmp_path, exclude, form), src)
    surgical = _agreement(out / "repro" / "keep_in_float.onnx", src)
    assert requantized >= 0.7
    assert abs(surgical - requantized) <= 0.05


@pytest.mark.parametrize(
    ("form", "activation", "weight", "call"),
    [
        ("qdq", "QUInt8", "QInt8", "quant_format=QuantFormat.QDQ, activation_type="
         "QuantType.QUInt8, weight_type=QuantType.QInt8, per_channel=False, reduce_range=False"),
        ("qdq-per-channel", "QInt16", "QInt8", "quant_format=QuantFormat.QDQ, activation_type="
         "QuantType.QInt16, weight_type=QuantType.QInt8, per_channel=True, reduce_range=False"),
        ("qoperator", "QUInt8", "QUInt8", "quant_format=QuantFormat.QOperator, activation_type="
         "QuantType.QUInt8, weight_type=QuantType.QUInt8, per_channel=False, "
         "reduce_range=False"),
        ("dynamic", "QUInt8", "QInt8", "weight_type=QuantType.QInt8, per_channel=False, "
         "reduce_range=False"),
    ],
)  # fmt: skip
def test_the_quantizer_settings_are_read_from_the_int8_model(
    tmp_path: Path, form: str, activation: str, weight: str, call: str
) -> None:
    from onnx_bisect.graph.quant_settings import read_settings

    _, dst = qm.quantized(qm.detector(), tmp_path, form, activation, weight)
    settings = read_settings(onnx.load(str(dst)))
    head = (
        "quantize_dynamic(model_input, model_output"
        if form == "dynamic"
        else ("quantize_static(model_input, model_output, calibration_data_reader")
    )
    assert settings.call(["n1"]) == f"{head}, nodes_to_exclude=['n1'], {call})"


def test_symmetric_activations_and_reduced_range_are_read_too(tmp_path: Path) -> None:
    from onnx_bisect.graph.quant_settings import read_settings

    _, dst = qm.quantized(qm.detector(), tmp_path, "qdq", "QInt8", "QInt8", reduce_range=True,
                          extra_options={"ActivationSymmetric": True})  # fmt: skip
    s = read_settings(onnx.load(str(dst)))
    assert (s.activation_type, s.activation_symmetric, s.reduce_range) == ("QInt8", True, True)
    assert "extra_options={'ActivationSymmetric': True}" in s.call([])


def test_calibration_is_for_a_quantized_target_model(tmp_path: Path) -> None:
    src, _ = qm.quantized(qm.detector(), tmp_path, "dynamic")
    result = CliRunner().invoke(
        bisect_app, [str(src), "--target", "cpu", "--calibration", str(tmp_path)]
    )
    assert result.exit_code == 2
    assert (
        "--calibration applies only to a quantized --target-model (its float model is "
        "quantized again on these inputs)" in result.output
    )


def test_a_constant_quantized_as_an_activation_is_no_weight(tmp_path: Path) -> None:
    """A Mul's constant gets the activation type (uint8) from the quantizer, and its
    DequantizeLinear comes first (its name sorts first, as YOLOv8n's folded constants do):
    the weight type is still the Conv weight's (int8)."""
    from onnx import TensorProto, helper, numpy_helper

    from onnx_bisect.graph.quant_settings import read_settings
    from tests.models import make

    w = np.random.default_rng(0).standard_normal((4, 3, 3, 3)).astype(np.float32)
    model = make(
        [helper.make_node("Mul", ["x", "K"], ["m"], name="scale"),
         helper.make_node("Conv", ["m", "W"], ["y"], name="conv", pads=[1, 1, 1, 1])],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(qm.DETECTOR_SHAPE))],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 16, 16])],
        [numpy_helper.from_array(np.array(2.0, np.float32), "K"),
         numpy_helper.from_array(w, "W")],
    )  # fmt: skip
    _, dst = qm.quantized(model, tmp_path, "qdq")
    settings = read_settings(onnx.load(str(dst)))
    assert (settings.activation_type, settings.weight_type) == ("QUInt8", "QInt8")
