"""A small Llama-style decoder built with onnx.helper, its random weights in one external file.

Each layer is what the legacy torch exporter writes for a Llama block, in plain opset-18 ops:
an RMSNorm (Pow, ReduceMean, Add, Sqrt, Reciprocal, Mul, Mul by the weight), causal multi-head
attention (q/k/v projections, heads split by Reshape and Transpose, scaled scores, a causal
mask, Softmax, o_proj) with its residual Add, another RMSNorm, and the SiLU-gated MLP
(gate_proj, Sigmoid, Mul, up_proj, Mul, down_proj) with its residual Add; then a final norm
and lm_head. Node names follow the exporter's (``/model/layers.1/mlp/down_proj/MatMul``).

The weights are written with numpy straight to ``<name>.data`` (4 KiB aligned), so building
a model of hundreds of MB holds no more than one tensor at a time.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from tests.models import make

__all__ = ["LLAMA_BYTES", "down_proj", "write_external_llama"]

# The default shape's weight bytes: 4 layers of 4·512² + 3·512·1536 floats, the norms,
# and an 8,192-token embedding and lm_head: 84 MiB.
LLAMA_BYTES = 4 * (4 * 512 * 512 + 3 * 512 * 1536 + 2 * 512) * 4 + (2 * 8192 * 512 + 512) * 4


def down_proj(layer: int) -> str:
    return f"/model/layers.{layer}/mlp/down_proj/MatMul"


class _Weights:
    """Float32 tensors appended to one file as they are drawn, each 4 KiB aligned."""

    def __init__(
        self,
        f: BinaryIO,
        location: str,
        rng: np.random.Generator,
        scaled: Mapping[str, float] | None = None,
    ) -> None:
        self.f, self.location, self.rng = f, location, rng
        self.scaled = dict(scaled or {})
        self.tensors: list[onnx.TensorProto] = []

    def add(self, name: str, shape: tuple[int, ...], scale: float | None = None) -> str:
        """A random tensor (uniform with the variance of N(0, scale²); ones without a scale,
        as a freshly initialised norm weight)."""
        value = np.ones(shape, np.float32)
        if scale is not None:
            limit = np.float32(scale * np.sqrt(3.0))
            value = self.rng.uniform(-limit, limit, shape).astype(np.float32)
        value *= np.float32(self.scaled.get(name, 1.0))
        self.f.write(b"\0" * (-self.f.tell() % 4096))
        t = onnx.TensorProto(name=name, data_type=TensorProto.FLOAT, dims=list(shape))
        t.data_location = TensorProto.EXTERNAL
        for key, v in (("location", self.location), ("offset", str(self.f.tell()))):
            t.external_data.add(key=key, value=v)
        t.external_data.add(key="length", value=str(value.nbytes))
        value.tofile(self.f)
        self.tensors.append(t)
        return name


class _Builder:
    def __init__(self, weights: _Weights, hidden: int, heads: int, seq: int) -> None:
        self.w, self.hidden, self.heads, self.seq = weights, hidden, heads, seq
        self.nodes: list[onnx.NodeProto] = []
        self.constants: list[onnx.TensorProto] = []

    def node(self, op: str, name: str, inputs: list[str], **attrs: Any) -> str:
        out = f"{name}_output_0"
        self.nodes.append(helper.make_node(op, inputs, [out], name=name, **attrs))
        return out

    def const(self, name: str, value: Any, dtype: Any = np.float32) -> str:
        self.constants.append(numpy_helper.from_array(np.asarray(value, dtype), name))
        return name

    def rms_norm(self, x: str, p: str, weight: str) -> str:
        sq = self.node("Pow", f"{p}/Pow", [x, "two"])
        mean = self.node("ReduceMean", f"{p}/ReduceMean", [sq, "last_axis"], keepdims=1)
        eps = self.node("Add", f"{p}/Add", [mean, "eps"])
        root = self.node("Sqrt", f"{p}/Sqrt", [eps])
        inv = self.node("Reciprocal", f"{p}/Reciprocal", [root])
        normed = self.node("Mul", f"{p}/Mul", [x, inv])
        return self.node("Mul", f"{p}/Mul_1", [self.w.add(weight, (self.hidden,)), normed])

    def linear(self, x: str, p: str, weight: str, rows: int, cols: int) -> str:
        w = self.w.add(weight, (rows, cols), scale=1.0 / np.sqrt(rows))
        return self.node("MatMul", f"{p}/MatMul", [x, w])

    def attention(self, x: str, p: str, w: str) -> str:
        h = self.hidden
        split = []
        for proj in ("q", "k", "v"):
            y = self.linear(x, f"{p}/{proj}_proj", f"{w}.{proj}_proj.weight", h, h)
            y = self.node("Reshape", f"{p}/Reshape_{proj}", [y, "heads_shape"])
            split.append(self.node("Transpose", f"{p}/Transpose_{proj}", [y], perm=[0, 2, 1, 3]))
        q, k, v = split
        kt = self.node("Transpose", f"{p}/Transpose_kt", [k], perm=[0, 1, 3, 2])
        scores = self.node("MatMul", f"{p}/MatMul", [q, kt])
        scaled = self.node("Mul", f"{p}/Mul", [scores, "head_scale"])
        masked = self.node("Add", f"{p}/Add", [scaled, "causal_mask"])
        probs = self.node("Softmax", f"{p}/Softmax", [masked], axis=-1)
        mixed = self.node("MatMul", f"{p}/MatMul_1", [probs, v])
        merged = self.node("Transpose", f"{p}/Transpose", [mixed], perm=[0, 2, 1, 3])
        flat = self.node("Reshape", f"{p}/Reshape", [merged, "hidden_shape"])
        return self.linear(flat, f"{p}/o_proj", f"{w}.o_proj.weight", h, h)

    def mlp(self, x: str, p: str, w: str, intermediate: int) -> str:
        h = self.hidden
        gate = self.linear(x, f"{p}/gate_proj", f"{w}.gate_proj.weight", h, intermediate)
        sig = self.node("Sigmoid", f"{p}/act_fn/Sigmoid", [gate])
        act = self.node("Mul", f"{p}/act_fn/Mul", [gate, sig])
        up = self.linear(x, f"{p}/up_proj", f"{w}.up_proj.weight", h, intermediate)
        both = self.node("Mul", f"{p}/Mul", [act, up])
        return self.linear(both, f"{p}/down_proj", f"{w}.down_proj.weight", intermediate, h)


def write_external_llama(
    path: Path,
    *,
    layers: int = 4,
    hidden: int = 512,
    intermediate: int = 1536,
    vocab: int = 8192,
    heads: int = 8,
    seq: int = 16,
    seed: int = 0,
    scaled: Mapping[str, float] | None = None,
) -> None:
    """input_ids [1, seq] (int64) -> logits [1, seq, vocab]; weights in ``<path>.data``, each
    named in ``scaled`` multiplied by its factor (an outlier planted)."""
    rng = np.random.default_rng(seed)
    data = path.with_name(path.name + ".data")
    with data.open("wb") as f:
        b = _Builder(_Weights(f, data.name, rng, scaled), hidden, heads, seq)
        embed = b.w.add("model.embed_tokens.weight", (vocab, hidden), scale=1.0)
        x = b.node("Gather", "/model/embed_tokens/Gather", [embed, "input_ids"])
        for i in range(layers):
            p, w = f"/model/layers.{i}", f"model.layers.{i}"
            normed = b.rms_norm(x, f"{p}/input_layernorm", f"{w}.input_layernorm.weight")
            attn = b.attention(normed, f"{p}/self_attn", f"{w}.self_attn")
            x = b.node("Add", f"{p}/Add", [x, attn])
            normed = b.rms_norm(x, f"{p}/post_attention_layernorm", f"{w}.post_norm.weight")
            x = b.node(
                "Add", f"{p}/Add_1", [x, b.mlp(normed, f"{p}/mlp", f"{w}.mlp", intermediate)]
            )
        normed = b.rms_norm(x, "/model/norm", "model.norm.weight")
        head = b.w.add("lm_head.weight", (hidden, vocab), scale=1.0 / np.sqrt(hidden))
        b.nodes.append(
            helper.make_node("MatMul", [normed, head], ["logits"], name="/lm_head/MatMul")
        )
    head_dim = hidden // heads
    mask = np.triu(np.full((seq, seq), -1e4, np.float32), k=1)
    b.const("two", 2.0)
    b.const("eps", 1e-6)
    b.const("last_axis", [-1], np.int64)
    b.const("head_scale", 1.0 / np.sqrt(head_dim))
    b.const("causal_mask", mask)
    b.const("heads_shape", [1, seq, heads, head_dim], np.int64)
    b.const("hidden_shape", [1, seq, hidden], np.int64)
    model = make(
        b.nodes,
        [helper.make_tensor_value_info("input_ids", TensorProto.INT64, [1, seq])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, seq, vocab])],
        b.constants + b.w.tensors,
    )
    onnx.save_model(model, str(path))
