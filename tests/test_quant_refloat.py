"""Keep-in-float for QOperator and dynamic models (issue 27): their integer kernels put back
in float (``graph/refloat.py``), the search run through the CLI, and its answer checked by
quantizing the float model again with onnxruntime's ``nodes_to_exclude``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import numpy_helper
from typer.testing import CliRunner

from onnx_bisect.cli import bisect_app
from onnx_bisect.graph.refloat import integer_kernels, restore_float
from tests import quant_models as qm
from tests.models import make

pytest.importorskip("onnxruntime.quantization")


def _bisect(src: Path, dst: Path, out: Path, *extra: str) -> tuple[int, dict[str, Any], str]:
    result = CliRunner().invoke(
        bisect_app,
        [str(src), "--target-model", str(dst), "--target", "cpu", "--out", str(out),
         "--format", "json", *extra],
    )  # fmt: skip
    assert result.exception is None or isinstance(result.exception, SystemExit), result.output
    return result.exit_code, json.loads((out / "report.json").read_text()), result.output


def _run(model: onnx.ModelProto | str, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    data = model if isinstance(model, str) else model.SerializeToString()
    session = ort.InferenceSession(data, providers=["CPUExecutionProvider"])
    return list(session.run(None, feeds))


def _sensitive_block() -> onnx.ModelProto:
    """The attention block with one outlier in the output projection's weights: per-tensor
    int8 rounds every other weight of ``o_proj`` to a few steps."""
    model = qm.block()
    for t in model.graph.initializer:
        if t.name == "Wo":
            w = numpy_helper.to_array(t) * 10
            w[0, 0] = 1000.0
            t.CopyFrom(numpy_helper.from_array(w.astype(np.float32), "Wo"))
    return model


def _pools() -> onnx.ModelProto:
    """Conv with a bias -> LeakyRelu -> AveragePool -> GlobalAveragePool: onnxruntime's
    QOperator form has QLinearLeakyRelu and QLinearAveragePool (com.microsoft)."""
    rng = np.random.default_rng(0)
    w = numpy_helper.from_array((rng.standard_normal((8, 3, 3, 3)) / 5).astype(np.float32), "W")
    b = numpy_helper.from_array(rng.standard_normal(8).astype(np.float32), "B")
    h = onnx.helper
    nodes = [
        h.make_node("Conv", ["x", "W", "B"], ["c"], name="conv", pads=[1, 1, 1, 1]),
        h.make_node("LeakyRelu", ["c"], ["l"], name="leaky", alpha=0.1),
        h.make_node("AveragePool", ["l"], ["p"], name="pool", kernel_shape=[2, 2], strides=[2, 2]),
        h.make_node("GlobalAveragePool", ["p"], ["y"], name="gap"),
    ]
    return make(
        nodes,
        [h.make_tensor_value_info("x", onnx.TensorProto.FLOAT, list(qm.DETECTOR_SHAPE))],
        [h.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1, 8, 1, 1])],
        [w, b],
    )


@pytest.mark.parametrize(
    ("build", "form"),
    [(qm.detector, "qoperator"), (qm.block, "qoperator"), (qm.block, "dynamic"),
     (qm.detector, "dynamic"), (_pools, "qoperator")],
    ids=["detector-qop", "block-qop", "block-dynamic", "detector-dynamic", "pools-qop"],
)  # fmt: skip
def test_every_integer_kernel_back_in_float_is_the_float_model(
    build: Any, form: str, tmp_path: Path
) -> None:
    """Each kernel alone in float gives a model onnx's full check passes and onnxruntime
    runs; all of them in float compute what the float model does (to float rounding where
    no integer tensor is left between them)."""
    src, dst = qm.quantized(build(), tmp_path, form)
    ref, target = onnx.load(src), onnx.load(dst)
    found = integer_kernels(target, ref)
    assert not found.skipped
    assert set(found.kernels) <= {n.name for n in ref.graph.node}
    first = ref.graph.input[0]
    shape = [d.dim_value for d in first.type.tensor_type.shape.dim]
    feeds = {first.name: np.random.default_rng(1).random(shape).astype(np.float32)}
    expected = _run(ref, feeds)
    for name, kernel in found.kernels.items():
        one = restore_float(target, {kernel: name}, ref)
        onnx.checker.check_model(one, full_check=True)
        assert kernel not in {n.name for n in one.graph.node}
        _run(one, feeds)
    every = restore_float(target, {k: n for n, k in found.kernels.items()}, ref)
    onnx.checker.check_model(every, full_check=True)
    got = _run(every, feeds)
    quantized = _run(str(dst), feeds)
    for e, g, q in zip(expected, got, quantized, strict=True):
        assert np.linalg.norm(g - e) < 0.5 * np.linalg.norm(q - e)
    if build in (qm.detector, _pools):  # no integer tensor left between the kernels
        np.testing.assert_allclose(got[0], expected[0], rtol=1e-4, atol=1e-4)


def test_a_qoperator_concat_of_a_unit_and_a_wide_branch_is_kept_in_float(
    tmp_path: Path,
) -> None:
    src, dst = qm.quantized(qm.detector(), tmp_path, "qoperator")
    code, report, output = _bisect(src, dst, tmp_path / "out")
    assert code == 1
    keep = report["quantization"]["keep_in_float"]
    assert keep["nodes"] == ["head_concat"]  # the float model's name, not head_concat_quant
    assert keep["verified"] and keep["after"] <= 0.2 * keep["before"]
    patched = tmp_path / "out" / "repro" / "keep_in_float.onnx"
    onnx.checker.check_model(onnx.load(patched), full_check=True)
    assert report["quantization"]["sensitivity"][0]["node"] == "head_concat"
    assert report["root_cause"]["nodes"] == ["head_concat"]
    assert "nodes_to_exclude=['head_concat']" in output
    # onnxruntime's own quantizer, told to leave that node out, does at least as well.
    again = tmp_path / "again"
    again.mkdir()
    _, redone = qm.quantized(qm.detector(), again, "qoperator", nodes_to_exclude=keep["nodes"])
    _, report2, _ = _bisect(src, redone, tmp_path / "out2")
    assert report2["quantization"]["keep_in_float"]["before"] <= keep["after"] * 1.05


def test_a_dynamic_blocks_sensitive_matmul_is_named_by_its_float_name(tmp_path: Path) -> None:
    src, dst = qm.quantized(_sensitive_block(), tmp_path, "dynamic")
    goal = ("--quant-goal", "0.03")
    code, report, output = _bisect(src, dst, tmp_path / "out", *goal)
    assert code == 1
    keep = report["quantization"]["keep_in_float"]
    assert keep["nodes"] == ["o_proj"] and keep["verified"]
    assert keep["after"] <= 0.03 < keep["before"]
    assert report["quantization"]["sensitivity"][0]["node"] == "o_proj"
    assert "nodes_to_exclude=['o_proj']" in output
    # A dynamic model needs no calibration: onnxruntime's quantize_dynamic verifies the set.
    assert keep["verified_by"] == "requantized"
    assert keep["requantized"]["after"] == pytest.approx(keep["after"], rel=1e-4)
    assert keep["call"] == (
        "quantize_dynamic(model_input, model_output, nodes_to_exclude=['o_proj'], "
        "weight_type=QuantType.QInt8, per_channel=False, reduce_range=False)"
    )
    again = tmp_path / "again"
    again.mkdir()
    _, redone = qm.quantized(_sensitive_block(), again, "dynamic", nodes_to_exclude=["o_proj"])
    code2, report2, _ = _bisect(src, redone, tmp_path / "out2", *goal)
    assert report2["quantization"]["keep_in_float"]["before"] <= keep["after"] * 1.05


def test_a_dynamic_gemm_is_named_as_quantize_dynamic_excludes_it(tmp_path: Path) -> None:
    """quantize_dynamic splits a Gemm into ``<Gemm>_MatMul`` and ``<Gemm>_Add`` and matches
    nodes_to_exclude against those: the kernel is named ``fc_MatMul``, and that name given
    back to it leaves the MatMul in float."""
    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.standard_normal((16, 8)).astype(np.float32), "W")
    b = numpy_helper.from_array(rng.standard_normal(8).astype(np.float32), "b")
    node = onnx.helper.make_node("Gemm", ["x", "W", "b"], ["y"], name="fc")
    model = make(
        [node],
        [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [4, 16])],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [4, 8])],
        [w, b],
    )
    src, dst = qm.quantized(model, tmp_path, "dynamic")
    found = integer_kernels(onnx.load(dst), onnx.load(src))
    assert list(found.kernels) == ["fc_MatMul"]
    patched = restore_float(onnx.load(dst), {found.kernels["fc_MatMul"]: "fc_MatMul"}, model)
    onnx.checker.check_model(patched, full_check=True)
    feeds = {"x": rng.random((4, 16)).astype(np.float32)}
    np.testing.assert_allclose(_run(patched, feeds)[0], _run(model, feeds)[0], rtol=1e-5)
    again = tmp_path / "again"
    again.mkdir()
    _, redone = qm.quantized(model, again, "dynamic", nodes_to_exclude=["fc_MatMul"])
    assert "MatMulInteger" not in {n.op_type for n in onnx.load(redone).graph.node}


def test_an_integer_kernel_without_a_float_form_is_skipped_and_said() -> None:
    h = onnx.helper
    where = h.make_node(
        "QLinearWhere", ["c", "a", "s", "z", "b", "s", "z", "s", "z"], ["y"], name="w_quant",
        domain="com.microsoft",
    )  # fmt: skip
    found = integer_kernels(h.make_model(h.make_graph([where], "g", [], [])), qm.block())
    assert found.kernels == {}
    assert found.skipped == {"w_quant": "QLinearWhere has no float form here"}


def test_restoring_many_dynamic_kernels_costs_about_one_copy_of_the_weights(
    tmp_path: Path,
) -> None:
    """Every kernel of a 48-MatMul dynamic model put back in float: the float model's output,
    in about the time of copying its weights once (a copy of the whole graph per kernel made
    each trial of the search on a 100 MB transformer cost seconds)."""
    import time

    from onnxruntime.quantization import QuantType, quantize_dynamic

    rng = np.random.default_rng(0)
    h, x, n, d = onnx.helper, "x", 48, 512
    nodes, inits = [], []
    for i in range(n):
        w = (rng.standard_normal((d, d)) / np.sqrt(d)).astype(np.float32)
        inits.append(numpy_helper.from_array(w, f"w{i}"))
        nodes += [
            h.make_node("MatMul", [x, f"w{i}"], [f"h{i}"], name=f"mm{i}"),
            h.make_node("Relu", [f"h{i}"], [f"r{i}"], name=f"relu{i}"),
        ]
        x = f"r{i}"
    io = [h.make_tensor_value_info(t, onnx.TensorProto.FLOAT, [4, d]) for t in ("x", x)]
    graph = h.make_graph(nodes, "mlp", io[:1], io[1:], inits)
    float_model = h.make_model(graph, opset_imports=[h.make_opsetid("", 17)])
    onnx.save(float_model, tmp_path / "f.onnx")
    quantize_dynamic(tmp_path / "f.onnx", tmp_path / "q.onnx", weight_type=QuantType.QInt8)
    target = onnx.load(tmp_path / "q.onnx")
    kernels = {k: name for name, k in integer_kernels(target, float_model).kernels.items()}
    assert len(kernels) == n

    def fastest(work: Any) -> float:
        times = []
        for _ in range(3):
            start = time.perf_counter()
            work()
            times.append(time.perf_counter() - start)
        return min(times)

    copy = fastest(lambda: onnx.ModelProto().CopyFrom(float_model))
    restored = restore_float(target, kernels, float_model)
    took = fastest(lambda: restore_float(target, kernels, float_model))
    feeds = {"x": rng.standard_normal((4, d)).astype(np.float32)}
    np.testing.assert_allclose(_run(restored, feeds)[0], _run(float_model, feeds)[0], rtol=1e-5)
    # Measured 8x here; a graph copied per kernel was about 90x.
    assert took < 30 * copy, (took, copy)


def test_ops_run_on_the_integers_are_named_as_the_float_model_names_them(
    tmp_path: Path,
) -> None:
    """A QOperator model's Split runs on uint8 as ``split_quant``, with no float form to put
    back: verdicts and root causes still name it ``split``, the float node nodes_to_exclude
    takes, as they name the integer kernels."""
    from onnx_bisect.engine.quant.conclude import _float_nodes
    from onnx_bisect.graph.load import load_model

    h, rng = onnx.helper, np.random.default_rng(0)
    w1 = numpy_helper.from_array((rng.standard_normal((8, 3, 3, 3)) / 5).astype(np.float32), "W1")
    w2 = numpy_helper.from_array((rng.standard_normal((4, 4, 1, 1)) / 2).astype(np.float32), "W2")
    nodes = [
        h.make_node("Conv", ["x", "W1"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
        h.make_node("Split", ["c1"], ["a", "b"], name="split", axis=1, num_outputs=2),
        h.make_node("Conv", ["a", "W2"], ["c2"], name="conv2"),
        h.make_node("Add", ["c2", "b"], ["y"], name="add"),
    ]
    x = h.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, 3, 16, 16])
    y = h.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1, 4, 16, 16])
    src, dst = qm.quantized(make(nodes, [x], [y], [w1, w2]), tmp_path, "qoperator")
    target, ref = load_model(str(dst)), load_model(str(src))
    assert "split_quant" in {n.name for n in target.nodes}  # onnxruntime's QOperator form
    named = _float_nodes(target, ref)
    assert named["split_quant"] == "split"
    float_nodes = {n.name for n in ref.nodes}
    assert set(named.values()) <= float_nodes
