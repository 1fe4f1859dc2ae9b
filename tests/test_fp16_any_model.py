"""``+fp16`` answers on every valid model: a model already in float16 is judged as it is; the
nodes onnxconverter-common's float16 copy breaks are kept in float32, named with why; a
quantized model has only its float parts converted. Each run exits 0 or 1, never 2."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from typer.testing import CliRunner

from onnx_bisect.cli import bisect_app
from onnx_bisect.transforms.apply import apply_transforms
from onnx_bisect.transforms.fp16 import blocks_of
from tests import fp16_models, quant_models

pytest.importorskip("onnxconverter_common")

_BROKE = "(the converter's float16 model fails onnx type inference at {node}: {why})"
_INFERRED = "[TypeInferenceError] Inferred elem type differs from existing elem type: (1) vs (10)"


def _run(path: Path, tmp: Path) -> tuple[int, str]:
    res = CliRunner().invoke(
        bisect_app, [str(path), "-t", "cpu+fp16", "--no-repro", "--out", str(tmp / "out")]
    )
    assert "Traceback" not in res.output
    return res.exit_code, " ".join(res.output.split())


def _ort(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return [np.asarray(o) for o in sess.run(None, feeds)]


@pytest.mark.parametrize(
    ("build", "node", "why"),
    [
        (fp16_models.shared_initializer, "add", "B has inconsistent type tensor(float)"),
        (fp16_models.constant_of_shape, "zeros", _INFERRED),
        (fp16_models.output_read_inside, "mul", _INFERRED),
    ],
)
def test_a_node_the_converter_breaks_is_kept_in_float32(
    build: Callable[[], onnx.ModelProto], node: str, why: str, tmp_path: Path
) -> None:
    from onnxconverter_common import float16

    from onnx_bisect.transforms.validity import broken_by

    model = build()
    # The breakage itself: the converter's own model fails onnx's strict inference at node.
    inferred = onnx.shape_inference.infer_shapes(model)
    raw = float16.convert_float_to_float16(inferred, keep_io_types=True)
    assert f"node name: {node})" in broken_by(model, raw)
    path = tmp_path / "m.onnx"
    onnx.save(model, str(path))
    code, text = _run(path, tmp_path)
    assert code == 0, text
    assert f"kept in float32: {node} {_BROKE.format(node=node, why=why)}" in text
    assert (
        f"converted as float16.convert_float_to_float16(model, keep_io_types=True, "
        f"node_block_list=['{node}'])" in text
    )


def test_a_cast_inside_a_loop_body_is_kept_in_float32(tmp_path: Path) -> None:
    path = tmp_path / "loop.onnx"
    onnx.save(fp16_models.cast_in_loop(), str(path))
    code, text = _run(path, tmp_path)
    assert code == 0, text
    assert (
        "kept in float32: 1 Cast(to=FLOAT) node(s) of the model's own (the converter keeps "
        "their float32 output but labels it float16)" in text
    )
    assert "node_block_list=['body_cast']" in text


def test_the_printed_call_writes_the_model_judged() -> None:
    """The call in the notes, run as printed, gives the transform's model: what the user
    pastes is what was judged."""
    from onnxconverter_common import float16

    model = fp16_models.shared_initializer()
    converted, (record,) = apply_transforms(model, ["fp16"], "target")
    blocks = blocks_of(converted)
    assert blocks is not None and blocks.nodes == ("add",) and blocks.ops == ()
    pasted = float16.convert_float_to_float16(
        onnx.shape_inference.infer_shapes(model), keep_io_types=True, node_block_list=["add"]
    )
    x = {"x": np.random.default_rng(0).standard_normal((2, 3)).astype(np.float32)}
    np.testing.assert_array_equal(_ort(pasted, x)[0], _ort(converted, x)[0])
    assert [n.op_type for n in pasted.graph.node] == [n.op_type for n in converted.graph.node]


def test_a_model_already_in_float16_is_judged_as_it_is(tmp_path: Path) -> None:
    from onnxconverter_common import float16

    half = float16.convert_float_to_float16(quant_models.detector(), keep_io_types=True)
    path = tmp_path / "half.onnx"
    onnx.save(half, str(path))
    code, text = _run(path, tmp_path)
    assert code == 0, text
    assert (
        "the model is already float16 (94% of its float tensors): not converted, judged at "
        "its own float16 precision" in text
    )
    assert "the target computes in float16 (declared: the +fp16 transform)" in text


def test_a_qdq_model_keeps_its_quantization_in_float32(tmp_path: Path) -> None:
    _, path = quant_models.quantized(quant_models.detector(), tmp_path, "qdq")
    code, text = _run(path, tmp_path)
    assert code == 0, text
    assert "kept in float32: the quantization ops (DequantizeLinear, QuantizeLinear)" in text
    assert (
        "op_block_list=float16.DEFAULT_OP_BLOCK_LIST + ['DequantizeLinear', 'QuantizeLinear']"
        in text
    )


def test_a_dynamic_int8_model_keeps_its_integer_arithmetic_in_float32(tmp_path: Path) -> None:
    """DynamicQuantizeLinear and MatMulInteger stay as they are, and so do the Cast and Muls
    that scale the int32 accumulator (127 x 127 x K overflows float16)."""
    _, path = quant_models.quantized(quant_models.block(), tmp_path, "dynamic")
    code, text = _run(path, tmp_path)
    assert code == 0, text
    assert "kept in float32: the quantization ops (DynamicQuantizeLinear, MatMulInteger)" in text
    assert (
        "kept in float32: q_proj_quant_scales_mul, k_proj_quant_scales_mul, "
        "v_proj_quant_scales_mul, q_output_quantized_cast, k_output_quantized_cast, "
        "v_output_quantized_cast ... (the Cast and Mul that scale an integer accumulator to "
        "float)" in text
    )
    converted, _ = apply_transforms(onnx.load(str(path)), ["fp16"], "target")
    types = {v.name: v.type.tensor_type.elem_type for v in converted.graph.value_info}
    nodes = {n.name: n for n in converted.graph.node}
    for name in ("q_output_quantized_cast", "q_proj_quant_output_scale_mul"):
        assert types[nodes[name].output[0]] == onnx.TensorProto.FLOAT, name
