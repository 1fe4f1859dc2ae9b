"""The torch backend's com.microsoft weight-only kernels (MatMulNBits, GatherBlockQuantized)
against ONNX Runtime's own: models quantized by onnxruntime's MatMulNBitsQuantizer (4 and 8
bits, symmetric or not, K not a multiple of the block) and nodes built with onnx.helper for
what the quantizer does not write (float zero points, g_idx, a bias, uint8 packed data).
``torch:cpu`` computes in float32, the float64 oracle (``dtype=float64``) in float64."""

from __future__ import annotations

import copy
import logging
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnx_bisect.backends.spec import parse_spec
from tests.llama_model import write_external_llama

torch = pytest.importorskip("torch")
ort = pytest.importorskip("onnxruntime")
pytest.importorskip("onnxruntime.quantization.matmul_nbits_quantizer")

from onnx_bisect.backends.torch.backend import TorchBackend  # noqa: E402

F = TensorProto.FLOAT
SPECS = ["torch:cpu", "torch:cpu?dtype=float64"]
MS = "com.microsoft"


def _onnxruntime(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    so = ort.SessionOptions()
    so.log_severity_level = 3
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    return list(sess.run(None, feeds))


def _agree(model: onnx.ModelProto, feeds: dict[str, np.ndarray], rtol: float = 1e-5) -> None:
    expected = _onnxruntime(model, feeds)
    names = [o.name for o in model.graph.output]
    for spec in SPECS:
        got = TorchBackend(parse_spec(spec)).run(model, feeds)
        for name, want in zip(names, expected, strict=True):
            if "float64" in spec:
                assert got[name].dtype == np.float64, f"{spec} {name} is {got[name].dtype}"
            np.testing.assert_allclose(
                got[name].astype(np.float64), want.astype(np.float64), rtol=rtol, atol=1e-5,
                err_msg=f"{spec} {name}",
            )  # fmt: skip


def _model(nodes: list[onnx.NodeProto], inputs: list[Any], outputs: list[Any],
           inits: list[onnx.TensorProto]) -> onnx.ModelProto:  # fmt: skip
    graph = helper.make_graph(nodes, "g", inputs, outputs, initializer=inits)
    opsets = [helper.make_opsetid("", 21), helper.make_opsetid(MS, 1)]
    model = helper.make_model(graph, opset_imports=opsets)
    model.ir_version = 10
    return model


def _quantized(model: onnx.ModelProto, **kw: Any) -> onnx.ModelProto:
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    logging.getLogger("onnxruntime.quantization.matmul_nbits_quantizer").setLevel(logging.WARNING)
    q = MatMulNBitsQuantizer(copy.deepcopy(model), **kw)
    q.process()
    out: onnx.ModelProto = q.model.model
    return out


def _matmul(k: int, n: int) -> onnx.ModelProto:
    w = np.random.default_rng(k).standard_normal((k, n)).astype(np.float32)
    node = helper.make_node("MatMul", ["x", "W"], ["y"], name="mm")
    return _model(
        [node],
        [helper.make_tensor_value_info("x", F, [2, 3, k])],
        [helper.make_tensor_value_info("y", F, [2, 3, n])],
        [numpy_helper.from_array(w, "W")],
    )


@pytest.mark.parametrize(
    ("bits", "block", "symmetric", "k"),
    [(4, 32, True, 64), (4, 32, False, 64), (4, 16, False, 80), (8, 32, True, 96),
     (8, 32, False, 72), (4, 128, False, 40)],
)  # fmt: skip
def test_matmulnbits_as_the_quantizer_writes_it_agrees_with_onnxruntime(
    bits: int, block: int, symmetric: bool, k: int
) -> None:
    model = _quantized(_matmul(k, 24), bits=bits, block_size=block, is_symmetric=symmetric)
    assert [n.op_type for n in model.graph.node] == ["MatMulNBits"]
    x = np.random.default_rng(1).standard_normal((2, 3, k)).astype(np.float32)
    _agree(model, {"x": x})


def _nbits_node(k: int, n: int, block: int, inputs: list[str]) -> onnx.NodeProto:
    return helper.make_node("MatMulNBits", inputs, ["y"], domain=MS, name="nbits",
                            K=k, N=n, bits=4, block_size=block)  # fmt: skip


def test_matmulnbits_with_float_zero_points_g_idx_and_a_bias_agrees_with_onnxruntime() -> None:
    k, n, block = 64, 8, 16
    blocks = k // block
    rng = np.random.default_rng(2)
    b = rng.integers(0, 256, (n, blocks, block // 2)).astype(np.uint8)
    scales = rng.uniform(0.01, 0.1, n * blocks).astype(np.float32)
    zeros = rng.uniform(6.0, 9.0, n * blocks).astype(np.float32)
    bias = rng.standard_normal(n).astype(np.float32)
    g_idx = (np.arange(k) // block).astype(np.int32)
    inits = [numpy_helper.from_array(v, name) for v, name in
             ((b, "B"), (scales, "S"), (zeros, "Z"), (g_idx, "G"), (bias, "bias"))]  # fmt: skip
    x = rng.standard_normal((3, k)).astype(np.float32)
    for inputs in (["x", "B", "S", "Z"], ["x", "B", "S", "", "", "bias"]):
        model = _model(
            [_nbits_node(k, n, block, inputs)],
            [helper.make_tensor_value_info("x", F, [3, k])],
            [helper.make_tensor_value_info("y", F, [3, n])],
            inits,
        )
        _agree(model, {"x": x})


def _embedding(vocab: int = 64, d: int = 48) -> onnx.ModelProto:
    e = np.random.default_rng(3).standard_normal((vocab, d)).astype(np.float32)
    node = helper.make_node("Gather", ["E", "ids"], ["y"], name="embed")
    return _model(
        [node],
        [helper.make_tensor_value_info("ids", TensorProto.INT64, [2, 5])],
        [helper.make_tensor_value_info("y", F, [2, 5, d])],
        [numpy_helper.from_array(e, "E")],
    )


@pytest.mark.parametrize("symmetric", [True, False])
def test_gather_block_quantized_as_the_quantizer_writes_it_agrees_with_onnxruntime(
    symmetric: bool,
) -> None:
    model = _quantized(_embedding(), block_size=16, is_symmetric=symmetric,
                       op_types_to_quantize=("Gather",))  # fmt: skip
    node = model.graph.node[0]
    assert node.op_type == "GatherBlockQuantized"
    kind = {t.name: t.data_type for t in model.graph.initializer}[node.input[0]]
    assert kind == (TensorProto.INT4 if symmetric else TensorProto.UINT4)
    ids = np.array([[0, 5, 63, 7, 7], [1, 2, 3, 62, 0]], np.int64)
    _agree(model, {"ids": ids})


def test_gather_block_quantized_of_packed_uint8_agrees_with_onnxruntime() -> None:
    vocab, d, block = 10, 32, 16
    rng = np.random.default_rng(4)
    data = rng.integers(0, 256, (vocab, d // 2)).astype(np.uint8)
    scales = rng.uniform(0.01, 0.1, (vocab, d // block)).astype(np.float32)
    zeros = rng.integers(0, 256, (vocab, d // block // 2)).astype(np.uint8)
    ids = np.array([[9, 0, 3]], np.int64)
    for inputs in (["D", "ids", "S"], ["D", "ids", "S", "Z"]):
        attrs = {"bits": 4, "block_size": block, "gather_axis": 0, "quantize_axis": 1}
        node = helper.make_node("GatherBlockQuantized", inputs, ["y"], domain=MS, **attrs)
        model = _model(
            [node],
            [helper.make_tensor_value_info("ids", TensorProto.INT64, [1, 3])],
            [helper.make_tensor_value_info("y", F, [1, 3, d])],
            [numpy_helper.from_array(data, "D"), numpy_helper.from_array(scales, "S"),
             numpy_helper.from_array(zeros, "Z")],
        )  # fmt: skip
        _agree(model, {"ids": ids})


def test_an_int4_llama_runs_on_torch_as_on_onnxruntime(tmp_path: Path) -> None:
    path = tmp_path / "llama.onnx"
    write_external_llama(path, layers=1, hidden=64, intermediate=128, vocab=256, heads=4, seq=8)
    model = _quantized(onnx.load(str(path)), block_size=32, is_symmetric=False,
                       op_types_to_quantize=("MatMul", "Gather"))  # fmt: skip
    ops = {n.op_type for n in model.graph.node}
    assert {"MatMulNBits", "GatherBlockQuantized"} <= ops and "MatMul" in ops
    ids = np.random.default_rng(5).integers(0, 256, (1, 8))
    _agree(model, {"input_ids": ids}, rtol=1e-4)
