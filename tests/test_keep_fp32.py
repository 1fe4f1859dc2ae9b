"""Keep in float32: when a float16 conversion overflows, the smallest node_block_list that
brings the outputs back, verified by converting again with onnxconverter-common, printed as
that call; applied exactly as printed, it holds."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import helper, numpy_helper
from typer.testing import CliRunner

from onnx_bisect.cli import bisect_app
from tests import fp16_models

pytest.importorskip("onnxconverter_common")
pytest.importorskip("torch")  # the float64 oracle gives float16's predicted error


def _run(model: onnx.ModelProto, tmp: Path) -> tuple[int, str, dict[str, object]]:
    path = tmp / "model.onnx"
    onnx.save(model, str(path))
    out = tmp / "out"
    res = CliRunner().invoke(
        bisect_app, [str(path), "-t", "cpu+fp16", "--no-repro", "--out", str(out)]
    )
    assert "Traceback" not in res.output
    report = json.loads((out / "report.json").read_text())
    return res.exit_code, " ".join(res.output.split()), report


def _rel_l2(ref: np.ndarray, got: np.ndarray) -> float:
    ref64, got64 = ref.astype(np.float64), got.astype(np.float64)
    return float(np.linalg.norm(got64 - ref64) / np.linalg.norm(ref64))


def _apply_as_printed(call: str, model: onnx.ModelProto) -> onnx.ModelProto:
    """The printed call, run as the user pastes it."""
    from onnxconverter_common import float16

    converted = eval(call, {"float16": float16, "model": model})  # noqa: S307 - the answer's own text
    assert isinstance(converted, onnx.ModelProto)
    return converted


def _ort(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return np.asarray(sess.run(None, {"x": x})[0])


@pytest.mark.slow
def test_a_matmul_overflowing_float16_is_kept_in_float32_and_the_call_holds(
    tmp_path: Path,
) -> None:
    model = fp16_models.matmul_overflow()
    code, text, report = _run(model, tmp_path)
    assert code == 1, text
    keep = report["keep_in_fp32"]
    assert isinstance(keep, dict)
    assert keep["kind"] == "node_block_list" and keep["nodes"] == ["up"]
    assert keep["verified"] is True and keep["before"] == "inf" and keep["after"] < 1e-2
    assert keep["call"] == (
        "float16.convert_float_to_float16(model, keep_io_types=True, node_block_list=['up'])"
    )
    # float16's faithful twin overflows at the same MatMul, so y has no predicted error of its
    # own; the reference run on the inputs rounded to float16 gives it one (1.8e-4), and the
    # set is held to that (the 20-units rule is for outputs that run gives nothing either).
    assert (
        "Keep in float32: node_block_list=['up']: every output within float16's predicted "
        "error, worst output rel_l2 inf -> " in text
    )
    assert "the reference run on rounded inputs moves y 1.818e-04" in text
    assert "verified by converting again with onnxconverter-common and running it on the " \
        "target (onnxruntime CPUExecutionProvider opt=all)" in text  # fmt: skip
    md = (tmp_path / "out" / "report.md").read_text()
    assert f"model = {keep['call']}" in md
    html = (tmp_path / "out" / "report.html").read_text()
    assert "<h2>Keep in float32</h2>" in html and "node_block_list=[&#x27;up&#x27;]" in html
    # Applied exactly as printed, on the float model, by the user's own converter call.
    x = np.random.default_rng(1).random(fp16_models.OVERFLOW_SHAPE).astype(np.float32)
    ref = _ort(model, x)
    assert np.isnan(_ort(_apply_as_printed("float16.convert_float_to_float16(model, "
                                           "keep_io_types=True)", model), x)).all()  # fmt: skip
    assert _rel_l2(ref, _ort(_apply_as_printed(str(keep["call"]), model), x)) < 1e-2


def test_a_model_float16_runs_fine_gets_no_set(tmp_path: Path) -> None:
    code, text, report = _run(fp16_models.matmul_overflow(scale=1.0), tmp_path)
    assert code == 0, text
    assert report["keep_in_fp32"] is None and "Keep in float32" not in text


def _three_overflows() -> onnx.ModelProto:
    """Three branches, each a MatMul that overflows float16 before its own bias Add and
    LayerNorm, summed: the same op type at fault everywhere."""
    base = fp16_models.matmul_overflow()
    nodes, inits = [], []
    for i in range(3):
        names = [t.name for t in base.graph.initializer]
        rename = {t: f"{t}{i}" for t in ("h", "hb", "n", "p", "y", *names)}
        for t in base.graph.initializer:
            w = numpy_helper.to_array(t)
            inits.append(numpy_helper.from_array(w * (1.0 + 0.01 * i), rename[t.name]))
        for n in base.graph.node:
            copy = onnx.NodeProto()
            copy.CopyFrom(n)
            copy.name = f"{n.name}{i}"
            copy.input[:] = [rename.get(t, t) for t in n.input]
            copy.output[:] = [rename.get(t, t) for t in n.output]
            nodes.append(copy)
    nodes.append(helper.make_node("Sum", ["y0", "y1", "y2"], ["y"], name="sum"))
    return helper.make_model(
        helper.make_graph(nodes, "g", list(base.graph.input), list(base.graph.output), inits),
        ir_version=base.ir_version,
        opset_imports=list(base.opset_import),
    )


@pytest.mark.slow
def test_three_overflows_keep_the_three_matmuls_where_they_start(tmp_path: Path) -> None:
    """Nine nodes are flagged (each MatMul's Inf, its Add's and its LayerNorm's NaN); the
    search starts where each fault starts and keeps the three MatMuls. The op type alone
    (op_block_list=[..., 'MatMul']) is tried and fails on ONNX Runtime: it keeps the second
    MatMuls too, and then the overflow comes back (ORT's CPU provider computes float16
    MatMul in float32 and casts, so which Casts a block list leaves decides the result),
    so the answer stays the node list."""
    model = _three_overflows()
    code, text, report = _run(model, tmp_path)
    assert code == 1, text
    keep = report["keep_in_fp32"]
    assert isinstance(keep, dict)
    assert keep["kind"] == "node_block_list" and sorted(keep["nodes"]) == ["up0", "up1", "up2"]
    assert keep["verified"] is True
    x = np.random.default_rng(1).random(fp16_models.OVERFLOW_SHAPE).astype(np.float32)
    got = _ort(_apply_as_printed(str(keep["call"]), model), x)
    assert _rel_l2(_ort(model, x), got) < 1e-2
    ops = "float16.convert_float_to_float16(model, keep_io_types=True, " \
        "op_block_list=float16.DEFAULT_OP_BLOCK_LIST + ['MatMul'])"  # fmt: skip
    assert np.isnan(_ort(_apply_as_printed(ops, model), x)).all()


@pytest.mark.slow
def test_a_constant_beyond_float16_gets_no_block_list_and_the_way_out(tmp_path: Path) -> None:
    """PP-OCRv4 det's case: a BatchNorm variance of 1e7 held in a Constant. onnxconverter-common
    casts a kept Constant's output to float16 all the same, so no block list holds: the
    answer says so, names the Constant, and says what does (folding the BatchNorm)."""
    code, text, report = _run(fp16_models.batchnorm_variance(), tmp_path)
    assert code == 1, text
    keep = report["keep_in_fp32"]
    assert isinstance(keep, dict) and keep["nodes"] == [] and keep["ops"] == []
    assert keep["note"] == (
        "bn_var holds values up to 1e+07, beyond float16's 65504, and onnxconverter-common "
        "casts a kept Constant's output to float16 all the same (and converts a kept node's "
        "initializers once it has cast its inputs): no block list keeps it; fold bn into the "
        "Conv before it first (onnxsim, or onnxoptimizer's fuse_bn_into_conv; here: "
        "+onnxsim+fp16)"
    )
    assert "Keep in float32: no set found: bn_var holds values up to 1e+07" in text


@pytest.mark.slow
def test_an_fp16_target_model_gets_the_same_answer(tmp_path: Path) -> None:
    """The user's own float16 copy as --target-model: the set is verified by converting the
    float model, as the user would convert it again."""
    from onnxconverter_common import float16

    model = fp16_models.matmul_overflow()
    onnx.save(model, str(tmp_path / "float.onnx"))
    half = float16.convert_float_to_float16(model, keep_io_types=True)
    onnx.save(half, str(tmp_path / "half.onnx"))
    res = CliRunner().invoke(
        bisect_app,
        [str(tmp_path / "float.onnx"), "-t", "cpu", "--target-model", str(tmp_path / "half.onnx"),
         "--no-repro", "--out", str(tmp_path / "out")],
    )  # fmt: skip
    assert res.exit_code == 1, res.output
    keep = json.loads((tmp_path / "out" / "report.json").read_text())["keep_in_fp32"]
    assert keep["nodes"] == ["up"] and keep["verified"] is True
