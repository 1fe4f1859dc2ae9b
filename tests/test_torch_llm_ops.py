"""The torch backend's current-ONNX operators against ONNX Runtime: Attention (GQA, KV cache,
causal, masks), RMSNormalization, RotaryEmbedding, quantization of every type, NMS, GridSample
and DFT, each built with onnx.helper; and a Llama-style block exported by torch.onnx at opset
18 (decomposed) and 23 (Attention and RMSNormalization nodes).

``torch:cpu`` runs as written; ``torch:cpu?dtype=float64`` is the float64 oracle, whose floating
outputs must be float64. ONNX's own node tests for these operators run in
tests/test_torch_ops.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnx_bisect.backends.spec import parse_spec

torch = pytest.importorskip("torch")
ort = pytest.importorskip("onnxruntime")

from onnx_bisect.backends.torch.backend import TorchBackend  # noqa: E402

F = TensorProto.FLOAT
SPECS = ["torch:cpu", "torch:cpu?dtype=float64"]


def _model(nodes: list[onnx.NodeProto], inputs: list[Any], outputs: list[Any],
           opset: int, inits: list[onnx.TensorProto] | None = None) -> onnx.ModelProto:  # fmt: skip
    graph = helper.make_graph(nodes, "g", inputs, outputs, initializer=inits or [])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 10
    return model


def _onnxruntime(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return list(sess.run(None, feeds))


def _agree(model: onnx.ModelProto, feeds: dict[str, np.ndarray], rtol: float = 1e-5) -> None:
    """Each torch spec's outputs match ONNX Runtime's; the oracle's floats are float64."""
    expected = _onnxruntime(model, feeds)
    names = [o.name for o in model.graph.output]
    for spec in SPECS:
        got = TorchBackend(parse_spec(spec)).run(model, feeds)
        for name, want in zip(names, expected, strict=True):
            if "float64" in spec and want.dtype == np.float32:
                assert got[name].dtype == np.float64, f"{spec} {name} is {got[name].dtype}"
            np.testing.assert_allclose(
                got[name].astype(np.float64), want.astype(np.float64), rtol=rtol, atol=1e-6,
                err_msg=f"{spec} {name}",
            )  # fmt: skip


def _attention_case(kind: str) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    rng = np.random.default_rng(0)
    b, q_len, past, hq, hkv, d = 2, 5, 3, 8, 2, 4
    attrs: dict[str, Any] = {"q_num_heads": hq, "kv_num_heads": hkv, "is_causal": 1}
    feeds = {
        "Q": rng.standard_normal((b, q_len, hq * d)).astype(np.float32),
        "K": rng.standard_normal((b, q_len, hkv * d)).astype(np.float32),
        "V": rng.standard_normal((b, q_len, hkv * d)).astype(np.float32),
    }
    names = ["Q", "K", "V"]
    if kind == "gqa_kv_cache_causal_3d":
        names += ["", "past_key", "past_value"]
        feeds["past_key"] = rng.standard_normal((b, hkv, past, d)).astype(np.float32)
        feeds["past_value"] = rng.standard_normal((b, hkv, past, d)).astype(np.float32)
    elif kind == "bool_mask_scaled_3d":
        attrs.update(is_causal=0, scale=0.3)
        names.append("mask")
        feeds["mask"] = rng.random((q_len, q_len)) > 0.3
    elif kind == "softcap_3d":
        attrs.update(softcap=2.0)
    inputs = [
        helper.make_tensor_value_info(n, TensorProto.BOOL if n == "mask" else F, None)
        for n in names if n
    ]  # fmt: skip
    outputs = ["Y", "present_key", "present_value"] if "past_key" in feeds else ["Y"]
    node = helper.make_node("Attention", names, outputs, **attrs)
    infos = [helper.make_tensor_value_info(o, F, None) for o in outputs]
    return _model([node], inputs, infos, 23), feeds


@pytest.mark.parametrize("kind", ["gqa_kv_cache_causal_3d", "bool_mask_scaled_3d", "softcap_3d"])
def test_attention_matches_onnxruntime(kind: str) -> None:
    model, feeds = _attention_case(kind)
    _agree(model, feeds)


def test_rms_normalization_and_rotary_embedding_match_onnxruntime() -> None:
    rng = np.random.default_rng(1)
    b, s, h, d = 2, 6, 4, 8
    inputs = [
        helper.make_tensor_value_info("x", F, [b, s, h * d]),
        helper.make_tensor_value_info("pos", TensorProto.INT64, [b, s]),
    ]
    freqs = np.outer(np.arange(16), 1 / 10000 ** (np.arange(0, d, 2) / d))
    inits = [
        numpy_helper.from_array(rng.random(h * d).astype(np.float32), "w"),
        numpy_helper.from_array(np.cos(freqs).astype(np.float32), "cos"),
        numpy_helper.from_array(np.sin(freqs).astype(np.float32), "sin"),
    ]
    nodes = [
        helper.make_node("RMSNormalization", ["x", "w"], ["n"], epsilon=1e-6),
        helper.make_node("RotaryEmbedding", ["n", "cos", "sin", "pos"], ["y"], num_heads=h),
    ]
    model = _model(nodes, inputs, [helper.make_tensor_value_info("y", F, None)], 23, inits)
    feeds = {
        "x": rng.standard_normal((b, s, h * d)).astype(np.float32),
        "pos": np.stack([np.arange(s), np.arange(3, 3 + s)]).astype(np.int64),
    }
    _agree(model, feeds)


@pytest.mark.parametrize(
    "elem_type",
    [TensorProto.INT4, TensorProto.UINT4, TensorProto.INT8, TensorProto.UINT16,
     TensorProto.INT16, TensorProto.FLOAT8E4M3FN, TensorProto.FLOAT8E5M2],
)  # fmt: skip
def test_quantize_dequantize_matches_onnxruntime(elem_type: int) -> None:
    """x -> QuantizeLinear (per channel) -> DequantizeLinear -> * 3: the round trip's grid is
    the type's, in both modes (the oracle computes the float side in float64)."""
    floating = elem_type in (TensorProto.FLOAT8E4M3FN, TensorProto.FLOAT8E5M2)
    zero = np.zeros(3) if floating else np.array([1, 0, 2])
    inits = [
        numpy_helper.from_array(np.array([0.05, 0.1, 0.3], np.float32), "scale"),
        helper.make_tensor("zero", elem_type, [3], zero.tolist()),
        numpy_helper.from_array(np.array(3.0, np.float32), "three"),
    ]
    nodes = [
        helper.make_node("QuantizeLinear", ["x", "scale", "zero"], ["q"], axis=1),
        helper.make_node("DequantizeLinear", ["q", "scale", "zero"], ["dq"], axis=1),
        helper.make_node("Mul", ["dq", "three"], ["y"]),
    ]
    inputs = [helper.make_tensor_value_info("x", F, [4, 3, 5])]
    model = _model(nodes, inputs, [helper.make_tensor_value_info("y", F, None)], 21, inits)
    x = np.random.default_rng(2).standard_normal((4, 3, 5)).astype(np.float32) * 2
    _agree(model, {"x": x})


def test_nms_grid_sample_and_dft_match_onnxruntime() -> None:
    rng = np.random.default_rng(3)
    corners = rng.random((1, 12, 2)) * 40
    boxes = np.concatenate([corners, corners + rng.random((1, 12, 2)) * 20 + 1], axis=-1)
    inits = [
        numpy_helper.from_array(np.array([4], np.int64), "keep"),
        numpy_helper.from_array(np.array([0.3], np.float32), "iou"),
        numpy_helper.from_array(np.array([0.2], np.float32), "score"),
    ]
    nodes = [
        helper.make_node("NonMaxSuppression", ["boxes", "scores", "keep", "iou", "score"], ["sel"]),
        helper.make_node("GridSample", ["img", "grid"], ["sampled"], mode="linear"),
        helper.make_node("DFT", ["signal"], ["spectrum"], onesided=1),
    ]
    inputs = [
        helper.make_tensor_value_info("boxes", F, [1, 12, 4]),
        helper.make_tensor_value_info("scores", F, [1, 2, 12]),
        helper.make_tensor_value_info("img", F, [1, 2, 6, 7]),
        helper.make_tensor_value_info("grid", F, [1, 4, 5, 2]),
        helper.make_tensor_value_info("signal", F, [2, 16, 1]),
    ]
    typed = [("sel", TensorProto.INT64), ("sampled", F), ("spectrum", F)]
    outputs = [helper.make_tensor_value_info(n, t, None) for n, t in typed]
    model = _model(nodes, inputs, outputs, 22, inits)
    feeds = {
        "boxes": boxes.astype(np.float32),
        "scores": rng.random((1, 2, 12)).astype(np.float32),
        "img": rng.standard_normal((1, 2, 6, 7)).astype(np.float32),
        "grid": (rng.random((1, 4, 5, 2)) * 2.4 - 1.2).astype(np.float32),
        "signal": rng.standard_normal((2, 16, 1)).astype(np.float32),
    }
    _agree(model, feeds, rtol=1e-4)


class _LlamaBlock(torch.nn.Module):  # type: ignore[misc]
    """RMSNorm, grouped-query causal attention with rotary positions, a SwiGLU MLP."""

    def __init__(self, hidden: int = 32, heads: int = 4, kv_heads: int = 2) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.size = heads, kv_heads, hidden // heads
        self.norm = torch.nn.RMSNorm(hidden, eps=1e-6)
        self.q = torch.nn.Linear(hidden, hidden, bias=False)
        self.kv = torch.nn.Linear(hidden, 2 * kv_heads * self.size, bias=False)
        self.o = torch.nn.Linear(hidden, hidden, bias=False)
        self.gate = torch.nn.Linear(hidden, 2 * hidden, bias=False)
        self.down = torch.nn.Linear(hidden, hidden, bias=False)

    def _rotate(self, t: Any, pos: Any) -> Any:
        half = self.size // 2
        freq = pos[:, None] / 10000 ** (torch.arange(half) / half)
        cos, sin = freq.cos(), freq.sin()
        a, b = t[..., :half], t[..., half:]
        return torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1)

    def forward(self, x: Any) -> Any:
        b, s, _ = x.shape
        h = self.norm(x)
        pos = torch.arange(s, dtype=torch.float32)
        q = self._rotate(self.q(h).view(b, s, self.heads, self.size).transpose(1, 2), pos)
        k, v = self.kv(h).view(b, s, 2, self.kv_heads, self.size).permute(2, 0, 3, 1, 4)
        k = self._rotate(k, pos)
        att = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=True, enable_gqa=True
        )
        x = x + self.o(att.transpose(1, 2).reshape(b, s, -1))
        gate, up = self.gate(self.norm(x)).chunk(2, dim=-1)
        return x + self.down(torch.nn.functional.silu(gate) * up)


@pytest.mark.slow
@pytest.mark.parametrize("opset", [18, 23])
def test_exported_llama_block_runs(opset: int, tmp_path: Path) -> None:
    """torch.onnx's export of a GQA Llama block: decomposed at opset 18, Attention and
    RMSNormalization nodes at 23; both run on the torch backend like on ONNX Runtime."""
    pytest.importorskip("onnxscript")
    torch.manual_seed(0)
    block = _LlamaBlock().eval()
    x = torch.randn(2, 7, 32)
    path = tmp_path / "block.onnx"
    torch.onnx.export(block, (x,), str(path), opset_version=opset, dynamo=True,
                      input_names=["x"], output_names=["y"])  # fmt: skip
    model = onnx.load(str(path))
    ops = {n.op_type for n in model.graph.node}
    if opset >= 23:
        assert {"Attention", "RMSNormalization"} <= ops, sorted(ops)
    _agree(model, {"x": x.numpy()}, rtol=1e-4)


def test_planted_fault_in_an_attention_block_is_named_on_the_torch_backend(
    tmp_path: Path,
) -> None:
    """RMSNormalization -> q/k/v projections -> GQA causal Attention-23 -> output projection:
    a 1% fault in the Attention node of ``torch:cpu`` is found against ONNX Runtime, with the
    torch float64 oracle setting the threshold (it used to fall back: no Attention)."""
    import onnx_bisect
    from tests.faulty import FaultyBackend

    rng = np.random.default_rng(4)
    hidden, kv = 32, 8  # 8 query heads, 2 KV heads of size 4

    def weight(name: str, cols: int) -> onnx.TensorProto:
        return numpy_helper.from_array(
            (rng.standard_normal((hidden, cols)) / 6).astype(np.float32), name
        )

    inits = [weight("wq", hidden), weight("wk", kv), weight("wv", kv), weight("wo", hidden)]
    inits.append(numpy_helper.from_array(np.ones(hidden, np.float32), "g"))
    nodes = [
        helper.make_node("RMSNormalization", ["x", "g"], ["n"], name="norm"),
        helper.make_node("MatMul", ["n", "wq"], ["q"], name="q_proj"),
        helper.make_node("MatMul", ["n", "wk"], ["k"], name="k_proj"),
        helper.make_node("MatMul", ["n", "wv"], ["v"], name="v_proj"),
        helper.make_node(
            "Attention",
            ["q", "k", "v"],
            ["a"],
            name="attn",
            is_causal=1,
            q_num_heads=8,
            kv_num_heads=2,
        ),  # fmt: skip
        helper.make_node("MatMul", ["a", "wo"], ["y"], name="o_proj"),
    ]
    inputs = [helper.make_tensor_value_info("x", F, [1, 16, hidden])]
    outputs = [helper.make_tensor_value_info("y", F, [1, 16, hidden])]
    path = tmp_path / "attention_block.onnx"
    onnx.save(_model(nodes, inputs, outputs, 23, inits), str(path))
    target = FaultyBackend("attn", 0.01, base="torch:cpu")
    result = onnx_bisect.bisect(path, ref="cpu", target=target, threshold="auto")
    assert result.verdict == "diverged"
    assert result.root_cause is not None and result.root_cause.nodes == ("attn",)
    assert any("float64 values from torch" in n for n in result.notes), result.notes


@pytest.mark.parametrize("elem_type", [TensorProto.FLOAT8E4M3FN, TensorProto.FLOAT8E5M2])
def test_a_cast_through_float8_rounds_in_the_oracle_too(elem_type: int) -> None:
    """float8 is quantized data, not a compute precision: the float64 oracle keeps the
    rounding (and saturation), as ONNX Runtime and onnx.reference do."""
    nodes = [
        helper.make_node("Cast", ["x"], ["q"], to=elem_type),
        helper.make_node("Cast", ["q"], ["y"], to=F),
    ]
    inputs = [helper.make_tensor_value_info("x", F, [64])]
    model = _model(nodes, inputs, [helper.make_tensor_value_info("y", F, [64])], 21)
    x = (np.random.default_rng(5).standard_normal(64) * 300).astype(np.float32)
    _agree(model, {"x": x}, rtol=0)
