#!/usr/bin/env python3
"""A SIMULATED faulty runtime for the exec: protocol: ONNX Runtime with a planted kernel bug.

    python examples/faulty_runtime.py MODEL INPUTS OUTPUTS [--fault NODE=0.05] [--reject OP]

It runs MODEL on INPUTS (.npz keyed by input name) with ONNX Runtime and writes OUTPUTS (.npz
keyed by output name), exactly as the exec: protocol asks (docs/exec-protocol.md). With
``--fault NODE=F`` every output of node NODE is multiplied by (1 + F) wherever NODE appears,
which is what a wrong kernel looks like from outside. With ``--reject OP`` it refuses models
containing that op type, like a runtime that lacks a kernel. It needs only onnx, numpy and
onnxruntime, so it doubles as a template for wrapping your own runtime.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np
import onnx
import onnxruntime as ort
from onnx import helper


def plant_fault(model: onnx.ModelProto, node_name: str, factor: float) -> onnx.ModelProto:
    """A copy of ``model`` whose node ``node_name`` outputs (1 + factor) × the right value."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    extra = []
    for node in out.graph.node:
        if node.name != node_name:
            continue
        for i, name in enumerate(node.output):
            if not name:
                continue
            raw = f"{name}__unfaulted"
            node.output[i] = raw
            scale = f"{name}__fault_scale"
            extra.append(helper.make_node("Constant", [], [scale], value=_scalar(factor)))
            extra.append(helper.make_node("Mul", [raw, scale], [name], name=f"{node_name}__fault"))
    out.graph.node.extend(extra)
    return out


def _scalar(factor: float) -> onnx.TensorProto:
    return helper.make_tensor("v", onnx.TensorProto.FLOAT, [], [1.0 + factor])


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model")
    p.add_argument("inputs")
    p.add_argument("outputs")
    p.add_argument("--fault", action="append", default=[], help="NODE=FRACTION, e.g. conv1=0.05")
    p.add_argument("--reject", action="append", default=[], help="op type this runtime lacks")
    args = p.parse_args(argv)
    model = onnx.load(args.model)
    for node in model.graph.node:
        if node.op_type in args.reject:
            print(
                f"error: op {node.op_type} (node {node.name}) is not implemented", file=sys.stderr
            )
            return 2
    for fault in args.fault:
        name, _, frac = fault.rpartition("=")
        model = plant_fault(model, name, float(frac))
    # Mul of a float16/float64 tensor by a float scale would not type-check; keep to float32.
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    with np.load(args.inputs) as z:
        feeds = {i.name: z[i.name] for i in sess.get_inputs()}
    names = [o.name for o in sess.get_outputs()]
    values = sess.run(names, feeds)
    np.savez(args.outputs, **dict(zip(names, values, strict=True)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
