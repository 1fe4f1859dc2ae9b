"""A small Llama-style decoder built with onnx.helper, its random weights in one external file.

Each layer is what the legacy torch exporter writes for a Llama block, in plain opset-18 ops:
an RMSNorm (Pow, ReduceMean, Add, Sqrt, Reciprocal, Mul, Mul by the weight), causal multi-head
attention (q/k/v projections, heads split by Reshape and Transpose, scaled scores, a causal
mask, Softmax, o_proj) with its residual Add, another RMSNorm, and the SiLU-gated MLP
(gate_proj, Sigmoid, Mul, up_proj, Mul, down_proj) with its residual Add; then a final norm
and lm_head. Node names follow the exporter's (``/model/layers.1/mlp/down_proj/MatMul``).

The weights are written with numpy straight to ``<name>.data`` (4 KiB aligned), so building
a model of hundreds of MB holds no more than one tensor at a time.

``grid=True`` draws every MatMul weight on the int4 grid (a power-of-two step times integers in
[-8, 7], each block of 32 along the reduced axis holding both -8 and 7), as a model trained
for int4 leaves them: onnxruntime's MatMulNBits quantizer (block 32, symmetric or not) then
rounds nothing, so an int4 copy differs from the float model only where a weight leaves the
grid. Without it a random model's flat logits flip their top-1 token on any rounding at all.
``outlier=LAYER`` plants one outlier input channel in that layer's ``up_proj`` (row 7 × 30)
that its post-attention norm's weight (1/30 there) cancels, as a folded norm leaves one: in
float nothing stands out, but the int4 blocks holding that row take its scale and their
other 31 rows round to 0. ``embedding_outlier=True`` makes channel 7 of every token's
embedding 30 times the others, as the massive activations of a trained LLM's residual stream:
an int4 embedding (GatherBlockQuantized, blocks of 32 along the hidden axis) rounds the other
31 channels of that block to 0 for every token.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from tests.models import make

__all__ = ["LLAMA_BYTES", "OUTLIER", "down_proj", "up_proj", "write_external_llama"]

# The default shape's weight bytes: 4 layers of 4·512² + 3·512·1536 floats, the norms,
# and an 8,192-token embedding and lm_head: 84 MiB.
LLAMA_BYTES = 4 * (4 * 512 * 512 + 3 * 512 * 1536 + 2 * 512) * 4 + (2 * 8192 * 512 + 512) * 4


# The planted outlier: input channel of up_proj, and its factor.
OUTLIER = (7, 30.0)


def down_proj(layer: int) -> str:
    return f"/model/layers.{layer}/mlp/down_proj/MatMul"


def up_proj(layer: int) -> str:
    return f"/model/layers.{layer}/mlp/up_proj/MatMul"


class _Weights:
    """Float32 tensors appended to one file as they are drawn, each 4 KiB aligned."""

    def __init__(
        self,
        f: BinaryIO,
        location: str,
        rng: np.random.Generator,
        grid: bool = False,
        scaled: Mapping[str, float] | None = None,
    ) -> None:
        self.f, self.location, self.rng, self.grid = f, location, rng, grid
        self.scaled = dict(scaled or {})
        self.tensors: list[onnx.TensorProto] = []

    def add(
        self,
        name: str,
        shape: tuple[int, ...],
        scale: float | None = None,
        rows: dict[int, float] | None = None,
        transpose: bool = False,
    ) -> str:
        """A random tensor (uniform with the variance of N(0, scale²), on the int4 grid with
        ``grid``; ones without a scale, as a freshly initialised norm weight), its ``rows``
        (index -> factor) scaled; ``transpose``: drawn as its transpose (the grid's blocks
        along the last axis, as GatherBlockQuantized quantizes an embedding), then turned."""
        drawn = shape[::-1] if transpose else shape
        value = np.ones(drawn, np.float32)
        if scale is not None:
            value = self._grid(drawn, scale) if self.grid else self._uniform(drawn, scale)
        value *= np.float32(self.scaled.get(name, 1.0))
        for row, factor in (rows or {}).items():
            value[row] *= np.float32(factor)
            if factor == 0.0 and self.grid:
                self._repin(value, row)
        value = np.ascontiguousarray(value.T) if transpose else value
        self.f.write(b"\0" * (-self.f.tell() % 4096))
        t = onnx.TensorProto(name=name, data_type=TensorProto.FLOAT, dims=list(shape))
        t.data_location = TensorProto.EXTERNAL
        for key, v in (("location", self.location), ("offset", str(self.f.tell()))):
            t.external_data.add(key=key, value=v)
        t.external_data.add(key="length", value=str(value.nbytes))
        value.tofile(self.f)
        self.tensors.append(t)
        return name

    @staticmethod
    def _repin(value: np.ndarray[Any, Any], row: int) -> None:
        """A zeroed row's block keeps a -8 and a 7 in each column (the next two rows)."""
        block = value[row - row % 32 : row - row % 32 + 32]
        step = np.abs(block).max(axis=0) / 8
        block[(row + 1) % 32] = -8 * step
        block[(row + 2) % 32] = 7 * step

    def _uniform(self, shape: tuple[int, ...], scale: float) -> np.ndarray[Any, Any]:
        limit = np.float32(scale * np.sqrt(3.0))
        return self.rng.uniform(-limit, limit, shape).astype(np.float32)

    def _grid(self, shape: tuple[int, ...], scale: float) -> np.ndarray[Any, Any]:
        """Integers in [-7, 7] (standard deviation 4.32) times the power of two nearest
        ``scale / 4.32``; in each block of 32 rows of each column one -8 and one 7 at random
        places pin the block's scale for a symmetric and an asymmetric quantizer alike."""
        rows, cols = shape
        q = self.rng.integers(-7, 8, shape)
        blocks = rows // 32
        first = self.rng.integers(0, 32, (blocks, cols))
        second = (first + 1 + self.rng.integers(0, 31, (blocks, cols))) % 32
        at = np.arange(cols)
        for b in range(blocks):
            q[32 * b + first[b], at] = -8
            q[32 * b + second[b], at] = 7
        step = 2.0 ** np.round(np.log2(scale / 4.32))
        return (q * step).astype(np.float32)


class _Builder:
    def __init__(self, weights: _Weights, hidden: int, heads: int, seq: int) -> None:
        self.w, self.hidden, self.heads, self.seq = weights, hidden, heads, seq
        self.factor = OUTLIER[1]  # the planted outlier's
        self.nodes: list[onnx.NodeProto] = []
        self.constants: list[onnx.TensorProto] = []

    def node(self, op: str, name: str, inputs: list[str], **attrs: Any) -> str:
        out = f"{name}_output_0"
        self.nodes.append(helper.make_node(op, inputs, [out], name=name, **attrs))
        return out

    def const(self, name: str, value: Any, dtype: Any = np.float32) -> str:
        self.constants.append(numpy_helper.from_array(np.asarray(value, dtype), name))
        return name

    def rms_norm(self, x: str, p: str, weight: str, outlier: bool = False) -> str:
        sq = self.node("Pow", f"{p}/Pow", [x, "two"])
        mean = self.node("ReduceMean", f"{p}/ReduceMean", [sq, "last_axis"], keepdims=1)
        eps = self.node("Add", f"{p}/Add", [mean, "eps"])
        root = self.node("Sqrt", f"{p}/Sqrt", [eps])
        inv = self.node("Reciprocal", f"{p}/Reciprocal", [root])
        normed = self.node("Mul", f"{p}/Mul", [x, inv])
        channel, factor = OUTLIER[0], self.factor
        rows = {channel: 1.0 / factor} if outlier else None
        w = self.w.add(weight, (self.hidden,), rows=rows)
        return self.node("Mul", f"{p}/Mul_1", [w, normed])

    def linear(
        self, x: str, p: str, weight: str, rows: int, cols: int, outlier: bool = False,
        rows_scaled: dict[int, float] | None = None,
    ) -> str:  # fmt: skip
        channel, factor = OUTLIER[0], self.factor
        planted = {channel: factor} if outlier else rows_scaled
        w = self.w.add(weight, (rows, cols), scale=1.0 / np.sqrt(rows), rows=planted)
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

    def mlp(
        self, x: str, p: str, w: str, intermediate: int, outlier: bool = False,
        massive: bool = False,
    ) -> str:  # fmt: skip
        h = self.hidden
        gate = self.linear(x, f"{p}/gate_proj", f"{w}.gate_proj.weight", h, intermediate)
        sig = self.node("Sigmoid", f"{p}/act_fn/Sigmoid", [gate])
        act = self.node("Mul", f"{p}/act_fn/Mul", [gate, sig])
        up = self.linear(x, f"{p}/up_proj", f"{w}.up_proj.weight", h, intermediate, outlier)
        if massive:  # down_proj's input channel 7 × 1024, a channel its weight ignores
            channel, _ = OUTLIER
            up = self.node("Mul", f"{p}/up_proj/massive", [up, self.massive(intermediate)])
        both = self.node("Mul", f"{p}/Mul", [act, up])
        dead = {OUTLIER[0]: 0.0} if massive else None
        return self.linear(both, f"{p}/down_proj", f"{w}.down_proj.weight", intermediate, h,
                           rows_scaled=dead)  # fmt: skip

    def massive(self, size: int) -> str:
        value = np.ones(size, np.float32)
        value[OUTLIER[0]] = 1024.0
        return self.const("massive_channel", value)


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
    grid: bool = False,
    outlier: int | None = None,
    embedding_outlier: bool = False,
    massive: int | None = None,
    outlier_factor: float = OUTLIER[1],
    scaled: Mapping[str, float] | None = None,
) -> None:
    """input_ids [1, seq] (int64) -> logits [1, seq, vocab]; weights in ``<path>.data``
    (``grid``, ``outlier``, ``embedding_outlier``: see module), each named in ``scaled``
    multiplied by its factor (an outlier planted)."""
    rng = np.random.default_rng(seed)
    data = path.with_name(path.name + ".data")
    with data.open("wb") as f:
        b = _Builder(_Weights(f, data.name, rng, grid, scaled), hidden, heads, seq)
        b.factor = outlier_factor
        channel, factor = OUTLIER
        planted = {channel: factor} if embedding_outlier else None
        embed = b.w.add(
            "model.embed_tokens.weight", (vocab, hidden), 1.0, rows=planted, transpose=grid
        )
        x = b.node("Gather", "/model/embed_tokens/Gather", [embed, "input_ids"])
        for i in range(layers):
            p, w = f"/model/layers.{i}", f"model.layers.{i}"
            normed = b.rms_norm(x, f"{p}/input_layernorm", f"{w}.input_layernorm.weight")
            attn = b.attention(normed, f"{p}/self_attn", f"{w}.self_attn")
            x = b.node("Add", f"{p}/Add", [x, attn])
            planted = i == outlier
            normed = b.rms_norm(
                x, f"{p}/post_attention_layernorm", f"{w}.post_norm.weight", planted
            )
            mlp = b.mlp(normed, f"{p}/mlp", f"{w}.mlp", intermediate, planted, i == massive)
            x = b.node("Add", f"{p}/Add_1", [x, mlp])
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
