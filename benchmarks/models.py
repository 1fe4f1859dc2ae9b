"""MLP-like block models of a chosen node count, for the scaling benchmark and its tests.

    python benchmarks/models.py NODES OUT.onnx

Each block is a residual MLP step followed by a LayerNorm written out in primitive ops, so the
graph is long (thousands of nodes) while every tensor stays small (a few kB): the cost of a
diagnosis is then dominated by what scales with the node count, not by arithmetic.

    mm = MatMul(x, W)  bias = Add(mm, b)  act = Relu(bias)  res = Add(x, act)
    mean = ReduceMean(res)  centred = Sub(res, mean)  sq = Mul(centred, centred)
    var = ReduceMean(sq)  var_eps = Add(var, eps)  std = Sqrt(var_eps)  y = Div(centred, std)

Node ``block{i}/mm`` is block ``i``'s MatMul; ``middle_matmul`` names the one a benchmark
plants its fault on. Only onnx and numpy are needed, so tests can build these offline.
"""

from __future__ import annotations

import sys

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

__all__ = ["NODES_PER_BLOCK", "middle_matmul", "mlp_blocks"]

NODES_PER_BLOCK = 11
# The MatMul's share of each residual step. At 1.0 the chain is chaotic: by 450 blocks fp32
# rounding alone moves the output by rel_l2 ~1, so no threshold tells a fault from noise. At
# 0.2 (numpy, 1,818 blocks) fp32 noise at the output is 7e-6 and a 5% fault in the middle
# block's MatMul still moves it by 0.018.
_GAIN = 0.2
OPSET = 18
IR = 10  # what onnxruntime 1.18+ loads


def mlp_blocks(nodes: int, width: int = 16, batch: int = 64, seed: int = 0) -> onnx.ModelProto:
    """A chain of ``nodes // NODES_PER_BLOCK`` blocks (at least one) on input ``x`` of shape
    ``[batch, width]``, output ``y``."""
    blocks = max(1, nodes // NODES_PER_BLOCK)
    rng = np.random.default_rng(seed)
    inits = [
        numpy_helper.from_array(np.array([-1], np.int64), "axes"),
        numpy_helper.from_array(np.array(1e-5, np.float32), "eps"),
    ]
    graph_nodes: list[onnx.NodeProto] = []
    prev = "x"
    for i in range(blocks):
        w = (_GAIN * rng.standard_normal((width, width)) / np.sqrt(width)).astype(np.float32)
        b = (0.1 * rng.standard_normal(width)).astype(np.float32)
        inits += [numpy_helper.from_array(w, f"W{i}"), numpy_helper.from_array(b, f"b{i}")]
        out = "y" if i == blocks - 1 else f"block{i}/y"
        graph_nodes += _block(f"block{i}", prev, f"W{i}", f"b{i}", out)
        prev = out
    graph = helper.make_graph(
        graph_nodes,
        "mlp_blocks",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, width])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [batch, width])],
        initializer=inits,
    )
    return helper.make_model(graph, ir_version=IR, opset_imports=[helper.make_opsetid("", OPSET)])


def _block(p: str, x: str, w: str, b: str, out: str) -> list[onnx.NodeProto]:
    def node(op: str, inputs: list[str], name: str, output: str | None = None) -> onnx.NodeProto:
        return helper.make_node(op, inputs, [output or f"{p}/{name}"], name=f"{p}/{name}")

    def t(name: str) -> str:
        return f"{p}/{name}"

    return [
        node("MatMul", [x, w], "mm"),
        node("Add", [t("mm"), b], "bias"),
        node("Relu", [t("bias")], "act"),
        node("Add", [x, t("act")], "res"),
        node("ReduceMean", [t("res"), "axes"], "mean"),
        node("Sub", [t("res"), t("mean")], "centred"),
        node("Mul", [t("centred"), t("centred")], "sq"),
        node("ReduceMean", [t("sq"), "axes"], "var"),
        node("Add", [t("var"), "eps"], "var_eps"),
        node("Sqrt", [t("var_eps")], "std"),
        node("Div", [t("centred"), t("std")], "norm", output=out),
    ]


def middle_matmul(model: onnx.ModelProto) -> str:
    """The MatMul of the middle block: a fault there has half the graph after it."""
    mms = [n.name for n in model.graph.node if n.op_type == "MatMul"]
    return mms[len(mms) // 2]


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(f"usage: {sys.argv[0]} NODES OUT.onnx")
    onnx.save(mlp_blocks(int(sys.argv[1])), sys.argv[2])
