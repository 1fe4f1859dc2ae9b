"""A QDQ model with chosen nodes kept in float (pure; a new model, the input untouched).

Keeping node N in float is what ``quantize_static(nodes_to_exclude=[N])`` aims at: N reads
its activations before their QuantizeLinear, its weights as the float model has them, and its
outputs are not quantized for anyone (every DequantizeLinear of a QuantizeLinear of N's output
becomes an Identity of that output, or the Relu/Clip the quantizer dropped there, since the
QuantizeLinear's range was doing its clamping). Q/DQ nodes nobody reads any more are dropped.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

import onnx
from onnx import helper

from onnx_bisect.graph.qdq import QDQ_OPS
from onnx_bisect.graph.view import LoadedModel

__all__ = ["is_qdq", "keep_in_float", "quantized_nodes"]


def is_qdq(model: LoadedModel) -> bool:
    """Whether every quantized computation is float ops between Q/DQ pairs: no integer kernel
    (QLinearConv, MatMulInteger, ...) whose float form this module could not restore."""
    return not any(
        n.op_type.startswith("QLinear")
        or n.op_type in ("QGemm", "MatMulInteger", "ConvInteger", "DynamicQuantizeLinear")
        for n in model.nodes
    )


def quantized_nodes(model: LoadedModel) -> tuple[str, ...]:
    """Nodes that compute on dequantized values or have their output quantized: what can be
    kept in float, in graph order."""
    producer, readers = model.producer, model.readers
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
    dropped: Mapping[str, tuple[onnx.NodeProto, list[onnx.TensorProto]]] | None = None,
) -> onnx.ModelProto:
    """``model`` with the nodes ``keep`` names computing in float (see module).
    ``float_weights``: (node, input index) -> the float model's initializer for a weight the
    model dequantizes; ``dropped``: tensor -> the float model's Relu or Clip (and its bounds)
    that the quantizer removed after it, leaving the QuantizeLinear's range to clamp."""
    weights = float_weights or {}
    activations = dropped or {}
    out = onnx.ModelProto()
    out.CopyFrom(model.model)
    g = out.graph
    producer = {o: n for n in g.node for o in n.output}
    readers = model.readers
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
                for dq_info in readers.get(q.outputs[0], ()):
                    if dq_info.op_type == "DequantizeLinear":
                        _to_float(_proto(g, dq_info.name), o, activations.get(o), added)
    known = {t.name for t in g.initializer}
    g.initializer.extend(w for name, w in added.items() if name not in known)
    _drop_unread(g)
    return out


def _to_float(
    node: onnx.NodeProto,
    source: str,
    activation: tuple[onnx.NodeProto, list[onnx.TensorProto]] | None,
    added: dict[str, onnx.TensorProto],
) -> None:
    """The DequantizeLinear becomes an Identity of the float value, or the activation the
    quantizer dropped, applied to it."""
    out, name = node.output[0], node.name
    if activation is None:
        node.CopyFrom(helper.make_node("Identity", [source], [out], name=name))
        return
    act, bounds = activation
    for b in bounds:
        added.setdefault(b.name, b)
    node.CopyFrom(act)
    node.input[0], node.output[0], node.name = source, out, name


def _proto(g: onnx.GraphProto, name: str) -> onnx.NodeProto:
    found: onnx.NodeProto = next(n for n in g.node if n.name == name)
    return found


def _drop_unread(g: onnx.GraphProto) -> None:
    """Remove Q/DQ nodes (and Identities left of them) whose outputs nobody reads."""
    outputs = {o.name for o in g.output}
    while True:
        read = {i for n in g.node for i in n.input} | outputs
        dead = [
            n
            for n in g.node
            if n.op_type in (*QDQ_OPS, "Identity") and not any(o in read for o in n.output)
        ]
        if not dead:
            return
        for n in dead:
            g.node.remove(n)
