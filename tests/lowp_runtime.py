#!/usr/bin/env python3
"""A SIMULATED lower-precision runtime for the exec: protocol (tests only).

    python tests/lowp_runtime.py MODEL INPUTS OUTPUTS [--precision float16|bfloat16]
        [--flush OP|NODE=T] [--accumulate NODE] [--nudge NODE=STEPS] [--fuse-relu NODE]

Each node runs alone in ONNX Runtime in float32 on operands rounded to the precision, and its
float outputs are rounded to it: what a correct fp16/bf16 kernel that accumulates in float32
computes. Independent of onnx-bisect's own faithful twin (torch), so a test that it agrees is
not circular. Faults a real lower-precision runtime has:

- ``--flush OP=T``: outputs of every OP node below T in magnitude become exactly 0 (tinygrad
  0.14's half-precision Sigmoid returns 0 below about -11.1, where exp2 overflows float16).
  OP may also be one node's name, to plant the fault in that node alone.
- ``--accumulate NODE``: MatMul NODE accumulates its products in the precision itself, not in
  float32, one product at a time (a kernel without a float32 accumulator); a
  GlobalAveragePool NODE sums in float16, so that a sum beyond 65504 is Inf (tract's).
- ``--nudge NODE=STEPS``: NODE's largest value moves STEPS units in the last place of the
  precision, as a kernel whose rounding landed elsewhere (two steps: ONNX Runtime's float16
  on PP-OCRv4 det's squeeze-excite Relu) or a wrong one (many steps) returns.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
from onnx import helper, numpy_helper

_LOW = {"float16": np.float16}


def rounded(value: np.ndarray[Any, Any], precision: str) -> np.ndarray[Any, Any]:
    if value.dtype != np.float32:
        return value
    if precision == "float16":
        with np.errstate(over="ignore"):
            return value.astype(np.float16).astype(np.float32)
    bits = np.ascontiguousarray(value).view(np.uint32)  # bfloat16: round half to even
    bias = np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))
    out = (((bits + bias) >> np.uint32(16)) << np.uint32(16)).view(np.float32)
    return np.where(np.isfinite(value), out, value)


def run_node(node: onnx.NodeProto, env: dict[str, Any], opsets: list[Any]) -> list[Any]:
    names = [n for n in node.input if n]
    inputs = [
        helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(env[n].dtype), None)
        for n in names
    ]
    outputs = [helper.make_empty_tensor_value_info(n) for n in node.output if n]
    graph = helper.make_graph([node], "node", inputs, outputs)
    model = helper.make_model(graph, opset_imports=opsets, ir_version=10)
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(model.SerializeToString(), options, ["CPUExecutionProvider"])
    return list(session.run(None, {n: env[n] for n in names}))


def accumulate_low(a: np.ndarray[Any, Any], b: np.ndarray[Any, Any], precision: str) -> Any:
    """a @ b with every partial sum rounded to the precision, one product at a time."""
    low = a.astype(np.float16) if precision == "float16" else a
    acc = np.zeros((*a.shape[:-1], b.shape[-1]), np.float16)
    for k in range(a.shape[-1]):
        product = low[..., k : k + 1].astype(np.float32) * b[k : k + 1, :].astype(np.float32)
        acc = (acc.astype(np.float32) + product).astype(np.float16)
    return acc.astype(np.float32)


def pool_low(x: np.ndarray[Any, Any]) -> Any:
    """GlobalAveragePool whose sum is a float16 running sum (tract's float16 pool): beyond
    65504 it is Inf, whatever the mean."""
    flat = x.reshape(*x.shape[:2], -1)
    acc = np.zeros(x.shape[:2], np.float16)
    with np.errstate(over="ignore"):
        for k in range(flat.shape[-1]):
            acc = (acc.astype(np.float32) + flat[..., k]).astype(np.float16)
    mean = acc.astype(np.float32) / np.float32(flat.shape[-1])
    return mean.reshape(*x.shape[:2], *([1] * (x.ndim - 2)))


def nudged(value: np.ndarray[Any, Any], steps: float, precision: str) -> np.ndarray[Any, Any]:
    """``value`` with its largest magnitude moved ``steps`` units in the last place."""
    out = value.copy().reshape(-1)
    at = int(np.argmax(np.abs(out)))
    step = 2.0 ** (np.floor(np.log2(abs(float(out[at])))) - (10 if precision == "float16" else 7))
    out[at] += np.float32(steps * step)
    return rounded(out.reshape(value.shape), precision)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("inputs")
    parser.add_argument("outputs")
    parser.add_argument("--precision", default="float16", choices=["float16", "bfloat16"])
    parser.add_argument("--flush", default="")
    parser.add_argument("--accumulate", default="")
    parser.add_argument("--nudge", default="")
    parser.add_argument("--fuse-relu", default="")
    args = parser.parse_args(argv)
    model = onnx.load(args.model)
    p = args.precision
    env: dict[str, Any] = {
        t.name: rounded(numpy_helper.to_array(t), p) for t in model.graph.initializer
    }
    with np.load(args.inputs) as data:
        env.update({k: rounded(data[k], p) for k in data.files})
    flush_op, _, flush_below = args.flush.partition("=")
    nudge_node, _, steps = args.nudge.partition("=")
    marked = {o.name for o in model.graph.output}
    fusing = {o for n in model.graph.node if n.name == args.fuse_relu for o in n.output}
    for node in model.graph.node:
        if node.op_type == "Relu" and node.input[0] in fusing:
            # Fused: fmax drops a NaN; unfused (its input marked): maximum passes it on.
            relu = np.maximum if node.input[0] in marked else np.fmax
            results = [relu(env[node.input[0]], np.float32(0))]
        elif node.name == args.accumulate and node.op_type == "MatMul":
            results = [accumulate_low(env[node.input[0]], env[node.input[1]], p)]
        elif node.name == args.accumulate and node.op_type == "GlobalAveragePool":
            results = [pool_low(env[node.input[0]])]
        else:
            results = run_node(node, env, list(model.opset_import))
        for name, value in zip(node.output, results, strict=False):
            value = rounded(np.asarray(value), p)
            if flush_op and flush_op in (node.op_type, node.name):
                value = np.where(np.abs(value) < float(flush_below), np.float32(0), value)
            if nudge_node and node.name == nudge_node:
                value = nudged(value, float(steps), p)
            env[name] = value
    np.savez(args.outputs, **{o.name: env[o.name] for o in model.graph.output})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
