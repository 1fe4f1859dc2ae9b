"""A QDQ model with chosen nodes kept in float, as the quantizer would write it (pure; new
models, the input untouched).

Keeping nodes K in float means what ``quantize_static(nodes_to_exclude=K)`` does
(``graph/qdq_plan.py``): a tensor loses its Q/DQ pair only when no quantized node marks it any
more, so an excluded node still reads the pair its quantized producer puts on its input, and
still writes into the pair its quantized reader puts on its output. The model is the
quantized one with the difference applied, up to calibration: each tensor that loses its pair
is read in float by every reader (a weight or bias as the float model has it), and a
Relu/Clip the quantizer dropped (the pair's range clamping instead) that it would now keep is
put back, after a pair on its input when its producer still marks that (at the Relu output's
scale, the range calibration gave there).
"""

from __future__ import annotations

from collections.abc import Collection

import onnx
from onnx import helper

from onnx_bisect.graph.qdq import QDQ_OPS, WEIGHT_ONLY
from onnx_bisect.graph.qdq_plan import OP_TYPES, QDQPlan, qdq_plan
from onnx_bisect.graph.refloat import weight_only_dequantized
from onnx_bisect.graph.view import LoadedModel

__all__ = ["Unquantizer", "is_qdq", "quantized_nodes"]

_OUTPUT_SUFFIX = "_QuantizeLinear_Input"  # onnxruntime's name for a quantized graph output


def is_qdq(model: LoadedModel) -> bool:
    """Whether every quantized computation is float ops between Q/DQ pairs: no integer kernel
    (QLinearConv, MatMulInteger, ...) whose float form this module could not restore, and not
    a weight-only quantizer's QDQ form (int4 or blockwise DequantizeLinear of the weights, no
    QuantizeLinear: ``graph/refloat.py`` restores those MatMuls)."""
    kernels = ("QGemm", "MatMulInteger", "ConvInteger", "DynamicQuantizeLinear", *WEIGHT_ONLY)
    if any(n.op_type.startswith("QLinear") or n.op_type in kernels for n in model.nodes):
        return False
    weight_only = not any(n.op_type == "QuantizeLinear" for n in model.nodes) and bool(
        weight_only_dequantized(model.model)
    )
    return not weight_only


def quantized_nodes(model: LoadedModel) -> tuple[str, ...]:
    """Nodes that compute on dequantized values or have their output quantized, in graph
    order."""
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


class Unquantizer:
    """The target (a QDQ model) and the float model it was quantized from: ``candidates``,
    the nodes ``nodes_to_exclude`` can name; ``plan(keep)``, what the quantizer does with
    them excluded; ``model(keep)``, the target as the quantizer would write it then."""

    def __init__(self, target: LoadedModel, float_model: LoadedModel) -> None:
        self.target, self.float = target, float_model
        quantized = set(quantized_nodes(target))
        present = {n.name for n in target.nodes}
        # What the target's quantizer did not quantize (excluded, or an op type left out).
        self.excluded = frozenset(
            n.name
            for n in float_model.nodes
            if n.op_type in OP_TYPES and n.name in present and n.name not in quantized
        )
        # A Relu/Clip kept in the target although its input is quantized: symmetric
        # activations or QDQKeepRemovableActivations.
        dropping = qdq_plan(float_model, self.excluded)
        self.removable = not any(r in present for r in dropping.removed)
        self.base = dropping if self.removable else self.plan(())
        self.candidates = tuple(
            n.name
            for n in target.nodes
            if n.name in quantized and n.op_type in OP_TYPES and n.name in self.float.node_protos
        )
        self._stands = _dequantized(target, float_model)

    def plan(self, keep: Collection[str]) -> QDQPlan:
        return qdq_plan(self.float, self.excluded | set(keep), removable=self.removable)

    def unmatched(self) -> tuple[str, ...]:
        """Activations the replayed rules pair that the target does not: where the rules
        and the target's quantizer settings part (said in the answer's note)."""
        observed = set(self._stands.values())
        weights = self.float.initializers
        return tuple(t for t in sorted(self.base.tensors - observed) if t not in weights)

    def model(self, keep: Collection[str]) -> onnx.ModelProto:
        """The target with ``keep`` excluded from quantization (see module)."""
        plan = self.plan(keep)
        lost = self.base.tensors - plan.tensors
        out = onnx.ModelProto()
        out.CopyFrom(self.target.model)
        g = out.graph
        producer = {o: n for n in g.node for o in n.output}
        inits = {t.name: t for t in self.float.model.graph.initializer}
        taken = {t.name for t in g.initializer} | {o for n in g.node for o in n.output}
        added: dict[str, onnx.TensorProto] = {}
        for node in g.node:
            dq = node.op_type == "DequantizeLinear"
            source = self._stands.get(node.output[0]) if dq else None
            if source not in lost:
                continue
            q = producer.get(node.input[0])
            if q is not None and q.op_type == "QuantizeLinear":
                value = q.input[0]
            elif source in inits:
                w = onnx.TensorProto()
                w.CopyFrom(inits[source])
                w.name = f"{source}__float" if source in taken else source
                added.setdefault(w.name, w)
                value = w.name
            else:
                continue
            node.CopyFrom(helper.make_node("Identity", [value], [node.output[0]], name=node.name))
        for relu, read in self.base.removed.items():
            if relu not in plan.removed:
                _restore(g, self.float, relu, read, read in plan.tensors, added)
        known = {t.name for t in g.initializer}
        g.initializer.extend(w for name, w in added.items() if name not in known)
        _drop_unread(g)
        return out


def _dequantized(target: LoadedModel, float_model: LoadedModel) -> dict[str, str]:
    """Each DequantizeLinear output of the target -> the float model's tensor it stands for:
    by position at the node reading it (the quantizer keeps node names), or by name where it
    writes a graph output (onnxruntime's DequantizeLinear writes that name)."""
    floats = float_model.node_protos
    producer = target.producer
    out: dict[str, str] = {}
    for n in target.nodes:
        f = floats.get(n.name)
        if f is not None and f.op_type == n.op_type:
            for i, name in enumerate(n.inputs):
                p = producer.get(name)
                if p is not None and p.op_type == "DequantizeLinear" and i < len(f.input):
                    out.setdefault(name, f.input[i])
        if n.op_type == "DequantizeLinear" and n.outputs[0] in float_model.outputs:
            out[n.outputs[0]] = n.outputs[0]
    return out


def _restore(
    g: onnx.GraphProto,
    float_model: LoadedModel,
    relu: str,
    read: str,
    paired: bool,
    added: dict[str, onnx.TensorProto],
) -> None:
    """Put back the float model's Relu/Clip ``relu`` that the target's quantizer dropped:
    its producer writes ``read`` again (through a Q/DQ pair at the scale of the Relu's
    output's pair when ``paired``), and the activation writes what the producer wrote."""
    act = float_model.node_protos[relu]
    maker = next((n for n in g.node if act.output[0] in n.output), None)
    if maker is None:  # a graph output: the producer writes onnxruntime's suffixed name
        maker = next((n for n in g.node if f"{act.output[0]}{_OUTPUT_SUFFIX}" in n.output), None)
    if maker is None:
        return
    wrote = next(o for o in maker.output if o.startswith(act.output[0]))
    names = {o for n in g.node for o in n.output}
    value = read if read not in names else f"{read}__float"
    maker.output[list(maker.output).index(wrote)] = value
    new: list[onnx.NodeProto] = []
    q = next((n for n in g.node if n.op_type == "QuantizeLinear" and n.input[0] == wrote), None)
    if paired and q is not None:
        params = list(q.input[1:])
        new.append(helper.make_node("QuantizeLinear", [value, *params], [f"{value}_q"],
                                    name=f"{value}_QuantizeLinear"))  # fmt: skip
        new.append(helper.make_node("DequantizeLinear", [f"{value}_q", *params], [f"{value}_dq"],
                                    name=f"{value}_DequantizeLinear"))  # fmt: skip
        value = f"{value}_dq"
    restored = onnx.NodeProto()
    restored.CopyFrom(act)
    restored.input[0], restored.output[0] = value, wrote
    new.append(restored)
    for b in act.input[1:]:
        bound = next((t for t in float_model.model.graph.initializer if t.name == b), None)
        if bound is not None:
            added.setdefault(b, bound)
    at = list(g.node).index(maker) + 1
    for k, n in enumerate(new):
        g.node.insert(at + k, n)


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
