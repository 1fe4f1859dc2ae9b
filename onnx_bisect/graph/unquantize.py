"""A QDQ model with chosen nodes kept in float (pure; a new model, the input untouched).

Keeping node N in float is what ``quantize_static(nodes_to_exclude=[N])`` aims at: N reads
its activations before their QuantizeLinear, its weights as the float model has them, and its
outputs are not quantized for anyone (every DequantizeLinear of a QuantizeLinear of N's output
becomes an Identity of that output). Q/DQ nodes nobody reads any more are dropped.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

import numpy as np
import onnx
from onnx import helper, numpy_helper

from onnx_bisect.graph.qdq import QDQ_OPS
from onnx_bisect.graph.view import LoadedModel, NodeInfo

__all__ = ["keep_in_float", "quantized_nodes"]


def quantized_nodes(model: LoadedModel) -> tuple[str, ...]:
    """Nodes that compute on dequantized values or have their output quantized: what can be
    kept in float, in graph order."""
    producer, readers = model.producer, _readers(model)
    out: list[str] = []
    for n in model.nodes:
        if n.op_type in QDQ_OPS or n.name in model.constant_nodes:
            continue
        reads = any(producer[i].op_type == "DequantizeLinear" for i in n.inputs if i in producer)
        writes = any(r.op_type == "QuantizeLinear" for o in n.outputs for r in readers.get(o, ()))
        if reads or writes:
            out.append(n.name)
    return tuple(out)


def keep_in_float(
    model: LoadedModel,
    keep: Collection[str],
    float_weights: Mapping[tuple[str, int], onnx.TensorProto] | None = None,
) -> onnx.ModelProto:
    """``model`` with the nodes ``keep`` names computing in float (see module).
    ``float_weights``: (node, input index) -> the float model's initializer for a weight the
    model dequantizes."""
    weights = float_weights or {}
    out = onnx.ModelProto()
    out.CopyFrom(model.model)
    g = out.graph
    producer = {o: n for n in g.node for o in n.output}
    readers = _readers(model)
    added: dict[str, onnx.TensorProto] = {}
    for node in g.node:
        if node.name not in keep:
            continue
        for i, name in enumerate(node.input):
            dq = producer.get(name)
            if dq is None or dq.op_type != "DequantizeLinear":
                continue
            q = producer.get(dq.input[0])
            if q is not None and q.op_type == "QuantizeLinear":
                node.input[i] = q.input[0]
            elif (node.name, i) in weights:
                w = weights[(node.name, i)]
                added.setdefault(w.name, w)
                node.input[i] = w.name
        for o in node.output:
            for q in readers.get(o, ()):
                if q.op_type != "QuantizeLinear":
                    continue
                op = "Relu" if _clamps_at_zero(g, q) else "Identity"
                for dq_info in readers.get(q.outputs[0], ()):
                    if dq_info.op_type == "DequantizeLinear":
                        _to_float(_proto(g, dq_info.name), o, op)
    known = {t.name for t in g.initializer}
    g.initializer.extend(w for name, w in added.items() if name not in known)
    _drop_unread(g)
    return out


def _to_float(node: onnx.NodeProto, source: str, op: str) -> None:
    out = node.output[0]
    node.CopyFrom(helper.make_node(op, [source], [out], name=node.name))


def _clamps_at_zero(g: onnx.GraphProto, q: NodeInfo) -> bool:
    """Whether the QuantizeLinear's range starts at 0 (zero point at the type's minimum): the
    quantizer then drops the Relu before it, which keeping the node in float must restore
    (a no-op where the values are never negative)."""
    if len(q.inputs) < 3 or not q.inputs[2]:
        return True  # no zero point: uint8 at 0
    zp = next((t for t in g.initializer if t.name == q.inputs[2]), None)
    if zp is None:
        return False
    value = numpy_helper.to_array(zp)
    return bool(np.all(value == np.iinfo(value.dtype).min))


def _proto(g: onnx.GraphProto, name: str) -> onnx.NodeProto:
    found: onnx.NodeProto = next(n for n in g.node if n.name == name)
    return found


def _readers(model: LoadedModel) -> dict[str, list[NodeInfo]]:
    readers: dict[str, list[NodeInfo]] = {}
    for n in model.nodes:
        for i in n.inputs:
            readers.setdefault(i, []).append(n)
    return readers


def _drop_unread(g: onnx.GraphProto) -> None:
    """Remove Q/DQ nodes (and Identities left of them) whose outputs nobody reads."""
    outputs = {o.name for o in g.output}
    while True:
        read = {i for n in g.node for i in n.input} | outputs
        dead = [
            n
            for n in g.node
            if n.op_type in (*QDQ_OPS, "Identity", "Relu") and not any(o in read for o in n.output)
        ]
        if not dead:
            return
        for n in dead:
            g.node.remove(n)
