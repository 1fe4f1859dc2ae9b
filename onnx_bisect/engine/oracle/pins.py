"""Which values the float64 oracle takes from its fp32 twin rather than computing (pure).

A node that turns floats into integers (a Cast to an integer type, DynamicQuantizeLinear,
QuantizeLinear, ArgMax, a comparison, Floor/Ceil/Round) is a step function: where its input
sits near a step, float64 lands on the other side of it from any float32 computation, and
from there on float64 answers another question. On a dynamic-int8 T5 encoder, float64 put
T5's relative-position buckets (a Log, a Mul, a Cast to int64) and the DynamicQuantizeLinear
integers elsewhere (15,981 of 16,384 values of one, up to 9 steps), and called the output's
"fp32 noise" 0.33, while float32 runtimes agree to 2e-7 (ONNX Runtime at opt=all and
disabled, OpenVINO, torch): the threshold became 1.3 and a planted 5% fault passed. Taking
those integers from the fp32 twin keeps float64 the judge of the float arithmetic around them.
"""

from __future__ import annotations

import onnx
from onnx import TensorProto

__all__ = ["pinned_values"]

_FLOATS = {TensorProto.FLOAT, TensorProto.DOUBLE, TensorProto.FLOAT16, TensorProto.BFLOAT16}
# Ops whose outputs step with their float inputs (every output of the node is pinned).
_STEPS = {
    "DynamicQuantizeLinear",
    "QuantizeLinear",
    "ArgMax",
    "ArgMin",
    "Greater",
    "Less",
    "GreaterOrEqual",
    "LessOrEqual",
    "Equal",
    "IsNaN",
    "IsInf",
    "Floor",
    "Ceil",
    "Round",
}


def pinned_values(model: onnx.ModelProto) -> list[str]:
    """The outputs of the top-level nodes that turn floats into integers (or integer-valued
    floats), in graph order."""
    types = {t.name: t.data_type for t in model.graph.initializer}
    for v in [*model.graph.input, *model.graph.value_info, *model.graph.output]:
        if v.type.HasField("tensor_type") and v.type.tensor_type.elem_type:
            types[v.name] = v.type.tensor_type.elem_type
    out: list[str] = []
    for node in model.graph.node:
        if not node.input or types.get(node.input[0]) not in _FLOATS:
            continue
        if node.op_type == "Cast":
            to = next((a.i for a in node.attribute if a.name == "to"), None)
            steps = to is not None and to not in _FLOATS
        else:
            steps = node.op_type in _STEPS
        if steps:
            out += [o for o in node.output if o]
    return out
