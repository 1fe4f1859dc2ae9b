"""Integer kernels put back in float (pure; a new model, the input untouched): what keeping a
node in float means for QOperator and dynamic models, where no Q/DQ pair marks it.

A QOperator kernel (QLinearConv, QLinearMatMul, QGemm, QLinearAdd, ...) becomes
DequantizeLinear of each activation (or the float value its QuantizeLinear read) -> the float
op with the float model's weights and bias (found by the quantizer's ``<name>_quantized``
naming; dequantized from the model where the float model lacks them) -> QuantizeLinear with
the kernel's output scale, so that its neighbours still read the integers they expect. A
dynamic chain (DynamicQuantizeLinear -> MatMulInteger/ConvInteger -> Cast -> Mul by the
product of scales) becomes the float MatMul/Conv of the chain's float input and the float
weight, writing the Mul's output; the DynamicQuantizeLinear and scales Mul stay while another
node reads them.

Weight-only kernels (onnxruntime's MatMulNBitsQuantizer) keep float activations: a MatMulNBits
becomes the float MatMul, a GatherBlockQuantized the float Gather, each with the float model's
weight; in its QDQ form (``quant_format=QDQ``: a blockwise int4 DequantizeLinear of the weight
read by a MatMul) the MatMul reads the float weight instead.

Kernels are named as ``quantize_static/quantize_dynamic(nodes_to_exclude=...)`` takes them:
the node onnxruntime's quantizer quantized (the kernel's name less ``_quant``), else the float
node reading its weight.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx
from onnx import helper, numpy_helper

__all__ = [
    "FloatKernels",
    "float_activations",
    "integer_kernels",
    "restore_float",
    "weight_only_dequantized",
]

# op -> (float op, first input of each quantized operand, output scale's input or None, bias)
_QOPERATOR: dict[str, tuple[str, tuple[int, ...], int | None, int | None]] = {
    "QLinearConv": ("Conv", (0, 3), 6, 8),
    "QLinearMatMul": ("MatMul", (0, 3), 6, None),
    "QGemm": ("Gemm", (0, 3), 7, 6),
    "QLinearAdd": ("Add", (0, 3), 6, None),
    "QLinearMul": ("Mul", (0, 3), 6, None),
    "QLinearSigmoid": ("Sigmoid", (0,), 3, None),
    "QLinearLeakyRelu": ("LeakyRelu", (0,), 3, None),
    "QLinearSoftmax": ("Softmax", (0,), 3, None),
    "QLinearAveragePool": ("AveragePool", (0,), 3, None),
    "QLinearGlobalAveragePool": ("GlobalAveragePool", (0,), 3, None),
    "QLinearConcat": ("Concat", (), 0, None),
}
_DYNAMIC = {"MatMulInteger": "MatMul", "ConvInteger": "Conv"}
# Weight-only kernels: activations stay float, the float model's weight goes back in; the
# quantized weight's input.
_WEIGHT_ONLY = {"MatMulNBits": 1, "GatherBlockQuantized": 0}
# A float op reading a blockwise-dequantized weight (MatMulNBitsQuantizer's QDQ form).
_QDQ_READERS = {"MatMul": 1}
# Attributes of the integer kernel that its float op lacks.
_DROPPED_ATTRS = frozenset({"opset", "channels_last"})
_SUFFIX = "_quant"
# MatMulNBitsQuantizer's names for what it quantized: the node and weight ``<name>_Q4`` (bits),
# in QDQ form the MatMul ``<name>_matmul_Q4`` and the weight ``<name>_DQ_Q4``.
_NBITS_SUFFIX = re.compile(r"(_matmul|_DQ)?_Q\d+$")


@dataclass(frozen=True)
class FloatKernels:
    """``kernels``: float model's node name -> the target's integer kernel standing for it,
    in graph order; ``skipped``: kernel -> why it cannot be put back in float."""

    kernels: dict[str, str]
    skipped: dict[str, str]


def integer_kernels(model: onnx.ModelProto, float_model: onnx.ModelProto) -> FloatKernels:
    """The target's integer kernels that ``restore_float`` can put back in float."""
    weight_readers: dict[str, str] = {}
    for n in float_model.graph.node:
        for i in n.input:
            weight_readers.setdefault(i, n.name)
    inits = {t.name for t in model.graph.initializer}
    kernels: dict[str, str] = {}
    skipped: dict[str, str] = {}
    blockwise = weight_only_dequantized(model)
    for n in model.graph.node:
        weight = _weight_only_weight(n, blockwise)
        if weight is not None:
            name = weight_readers.get(_NBITS_SUFFIX.sub("", weight), _NBITS_SUFFIX.sub("", n.name))
            kernels.setdefault(name, n.name)
            continue
        if n.op_type not in _QOPERATOR and n.op_type not in _DYNAMIC:
            if n.op_type.startswith("QLinear"):
                skipped[n.name] = f"{n.op_type} has no float form here"
            continue
        why = _unrestorable(n, model)
        if why:
            skipped[n.name] = why
            continue
        # onnxruntime names a kernel after the node it quantized, which is what its
        # nodes_to_exclude matches: a float node, or the ``<Gemm>_MatMul`` quantize_dynamic
        # splits a Gemm into (excluding the Gemm's own name leaves that MatMul quantized).
        name = n.name.removesuffix(_SUFFIX)
        if not n.name.endswith(_SUFFIX) or not name:
            weights = [i.removesuffix("_quantized") for i in n.input if i in inits]
            name = next((weight_readers[w] for w in weights if w in weight_readers), name)
        if name in kernels:
            skipped[n.name] = f"{kernels[name]} already stands for {name}"
            continue
        kernels[name] = n.name
    return FloatKernels(kernels, skipped)


def _weight_only_weight(n: onnx.NodeProto, blockwise: Mapping[str, onnx.NodeProto]) -> str | None:
    """The quantized weight a weight-only kernel reads ("" if none is named); None: ``n`` is
    not one."""
    at = _WEIGHT_ONLY.get(n.op_type)
    if at is not None:
        return n.input[at] if len(n.input) > at else ""
    at = _QDQ_READERS.get(n.op_type)
    dq = blockwise.get(n.input[at]) if at is not None and len(n.input) > at else None
    return dq.input[0] if dq is not None else None


def weight_only_dequantized(model: onnx.ModelProto) -> dict[str, onnx.NodeProto]:
    """Output -> DequantizeLinear of an initializer holding int4/uint4 values or dequantized
    blockwise (``block_size``): a weight-only quantizer's QDQ form."""
    inits = {t.name: t for t in model.graph.initializer}
    narrow = (onnx.TensorProto.INT4, onnx.TensorProto.UINT4)
    out: dict[str, onnx.NodeProto] = {}
    for n in model.graph.node:
        if n.op_type != "DequantizeLinear" or n.input[0] not in inits:
            continue
        block = next((a.i for a in n.attribute if a.name == "block_size"), 0)
        if block > 0 or inits[n.input[0]].data_type in narrow:
            out[n.output[0]] = n
    return out


def _unrestorable(node: onnx.NodeProto, model: onnx.ModelProto) -> str:
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    if attrs.get("channels_last"):
        return f"{node.op_type} with channels_last has no float op of that layout"
    if node.op_type in _DYNAMIC:
        producers = {o: p for p in model.graph.node for o in p.output}
        q = producers.get(node.input[0])
        if q is None or q.op_type != "DynamicQuantizeLinear":
            return f"its input is not from a DynamicQuantizeLinear ({node.op_type})"
        if _chain(node, model.graph) is None:
            return f"{node.op_type} is not followed by Cast and Mul by its scales"
    return ""


def _chain(node: onnx.NodeProto, graph: onnx.GraphProto) -> tuple[onnx.NodeProto, ...] | None:
    """The dynamic kernel's Cast and scale Mul, each the only reader of what it reads."""
    readers: dict[str, list[onnx.NodeProto]] = {}
    for n in graph.node:
        for i in n.input:
            readers.setdefault(i, []).append(n)
    cast = readers.get(node.output[0], [])
    if len(cast) != 1 or cast[0].op_type != "Cast":
        return None
    mul = readers.get(cast[0].output[0], [])
    if len(mul) != 1 or mul[0].op_type != "Mul":
        return None
    return cast[0], mul[0]


def restore_float(
    model: onnx.ModelProto, kernels: Mapping[str, str], float_model: onnx.ModelProto
) -> onnx.ModelProto:
    """``model`` with the integer kernels ``kernels`` names (the target's node -> the float
    model's) computing in float (see module)."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    g = out.graph
    before = _unread(g)
    ctx = _Context(g, float_model)
    for node in list(g.node):
        if node.name not in kernels:
            continue
        if node.op_type in _WEIGHT_ONLY or node.op_type in _QDQ_READERS:
            ctx.weight_only(node, kernels[node.name])
        elif node.op_type in _DYNAMIC:
            ctx.dynamic(node, kernels[node.name])
        else:
            name = kernels[node.name]
            ctx.qoperator(node, name, ctx.fused_activation(name))
    g.initializer.extend(ctx.added.values())
    _drop_newly_unread(g, before)
    return out


class _Context:
    """The graph being rewritten and what it needs: producers, initializers, new names."""

    def __init__(self, g: onnx.GraphProto, float_model: onnx.ModelProto) -> None:
        self.g, self.float_model = g, float_model
        self.floats = {t.name: t for t in float_model.graph.initializer}
        self.inits = {t.name: t for t in g.initializer}
        self.producer = {o: n for n in g.node for o in n.output}
        self.names = {t for n in g.node for t in (*n.input, *n.output, n.name)} | set(self.inits)
        self.added: dict[str, onnx.TensorProto] = {}

    def fresh(self, name: str) -> str:
        out, k = name, 0
        while out in self.names:
            k += 1
            out = f"{name}_float{k}"
        self.names.add(out)
        return out

    def float_weight(self, quantized: str) -> str | None:
        """The float model's initializer for a quantized one (same shape), added."""
        name = quantized.removesuffix("_quantized")
        f, q = self.floats.get(name), self.inits.get(quantized)
        if f is None or q is None or tuple(f.dims) != tuple(q.dims):
            return None
        return self.float_weight_named(name)

    def float_weight_named(self, name: str) -> str:
        """The float model's initializer ``name`` (a weight, a Clip's bound), added once under
        a name the graph does not hold yet; "" if absent."""
        f = self.floats.get(name)
        if not name or f is None:
            return ""
        if name not in self.added:
            w = onnx.TensorProto()
            w.CopyFrom(f)
            w.name = self.fresh(name) if name in self.names else name
            self.names.add(w.name)
            self.added[name] = w
        return self.added[name].name

    def operand(
        self, node: onnx.NodeProto, at: int, axis: int | None
    ) -> tuple[str, list[onnx.NodeProto]]:
        """The float value of the quantized operand at ``at`` (value, scale, zero point)."""
        q, scale, zp = node.input[at : at + 3]
        if q in self.inits:
            w = self.float_weight(q)
            if w is not None:
                return w, []
        else:
            p = self.producer.get(q)
            if p is not None and p.op_type == "QuantizeLinear":
                return p.input[0], []
        value = self.fresh(f"{q}_dequantized")
        dq = helper.make_node(
            "DequantizeLinear", [q, scale, zp], [value], name=self.fresh(f"{node.name}_dq{at}")
        )
        if axis is not None and self._size(scale) > 1:  # per channel
            dq.attribute.append(helper.make_attribute("axis", axis))
        return value, [dq]

    def fused_activation(self, float_name: str) -> onnx.NodeProto | None:
        """The float model's Relu/Clip after ``float_name`` that the quantizer fused into the
        kernel (its output scale's range clamps instead; absent from the target): the float
        op must apply it before requantizing, or a later float kernel reads it unclamped."""
        fg = self.float_model.graph
        node: onnx.NodeProto | None = next((n for n in fg.node if n.name == float_name), None)
        if node is None or not node.output:
            return None
        readers = [n for n in fg.node if node.output[0] in n.input]
        if len(readers) != 1 or readers[0].op_type not in ("Relu", "Clip"):
            return None
        act: onnx.NodeProto = readers[0]
        present = {n.name for n in self.g.node}
        if act.name in present or f"{act.name}{_SUFFIX}" in present:
            return None
        return act

    def _size(self, name: str) -> int:
        t = self.inits.get(name)
        return int(np.prod(t.dims)) if t is not None else 1

    def bias(self, node: onnx.NodeProto, at: int) -> tuple[str, list[onnx.NodeProto]]:
        """The float bias: the float model's, else the int32 one times x_scale × w_scale."""
        b = node.input[at] if len(node.input) > at else ""
        if not b:
            return "", []
        w = self.float_weight(b)
        if w is not None:
            return w, []
        arrays = [self.inits.get(n) for n in (b, node.input[1], node.input[4])]
        if any(a is None for a in arrays):
            return "", []
        bq, xs, ws = (numpy_helper.to_array(a) for a in arrays)  # type: ignore[arg-type]
        value = (bq.astype(np.float64) * xs * ws).astype(np.float32)
        t = numpy_helper.from_array(value, self.fresh(f"{b}_float"))
        self.added[t.name] = t
        return t.name, []

    def qoperator(self, node: onnx.NodeProto, name: str, activation: onnx.NodeProto | None) -> None:
        op, starts, out_at, bias_at = _QOPERATOR[node.op_type]
        if op == "Concat":
            starts = tuple(range(2, len(node.input), 3))
        new: list[onnx.NodeProto] = []
        inputs: list[str] = []
        for k, at in enumerate(starts):
            axis = 0 if op == "Conv" and k == 1 else None
            value, nodes = self.operand(node, at, axis)
            inputs.append(value)
            new.extend(nodes)
        if bias_at is not None:
            b, nodes = self.bias(node, bias_at)
            if b:
                inputs.append(b)
            new.extend(nodes)
        attrs = {
            a.name: helper.get_attribute_value(a)
            for a in node.attribute
            if a.name not in _DROPPED_ATTRS
        }
        y = node.output[0]
        quantize = out_at is not None and len(node.input) > out_at + 1 and node.input[out_at]
        result = self.fresh(f"{y}_float") if quantize else y
        raw = self.fresh(f"{y}_preactivation") if activation is not None else result
        new.append(helper.make_node(op, inputs, [raw], name=self.fresh(name), **attrs))
        if activation is not None:
            bounds = [self.float_weight_named(b) for b in activation.input[1:]]
            new.append(
                helper.make_node(
                    activation.op_type, [raw, *bounds], [result],
                    name=self.fresh(activation.name),
                )
            )  # fmt: skip
        if quantize:
            assert out_at is not None
            scale, zp = node.input[out_at], node.input[out_at + 1]
            new.append(
                helper.make_node(
                    "QuantizeLinear", [result, scale, zp], [y], name=self.fresh(f"{y}_requantize")
                )
            )
        self._replace(node, new)
        if quantize:
            self._float_for_dequantizers(y, result)

    def _float_for_dequantizers(self, y: str, result: str) -> None:
        """A DequantizeLinear of the kernel's output (a model output's, say) reads the float
        result instead, as an Identity: the value is not quantized for anyone there."""
        for n in self.g.node:
            if n.op_type == "DequantizeLinear" and n.input[0] == y:
                n.CopyFrom(helper.make_node("Identity", [result], [n.output[0]], name=n.name))

    def dynamic(self, node: onnx.NodeProto, name: str) -> None:
        # The graph itself, not a model around a copy of it (with every weight in it).
        chain = _chain(node, self.g)
        assert chain is not None
        cast, mul = chain
        source = self.producer[node.input[0]].input[0]
        w = self.float_weight(node.input[1])
        new: list[onnx.NodeProto] = []
        if w is None:  # the float model lacks it: dequantize the model's own weight
            scale = next(i for i in mul.input if i != cast.output[0])
            w_scale = self.producer.get(scale)
            if w_scale is None or len(w_scale.input) != 2:
                return
            w = self.fresh(f"{node.input[1]}_dequantized")
            zp = node.input[3] if len(node.input) > 3 else ""
            new.append(
                helper.make_node(
                    "DequantizeLinear", [node.input[1], w_scale.input[1], zp], [w],
                    name=self.fresh(f"{node.name}_dq"),
                )
            )  # fmt: skip
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        new.append(
            helper.make_node(
                _DYNAMIC[node.op_type], [source, w], [mul.output[0]],
                name=self.fresh(name), **attrs,
            )
        )  # fmt: skip
        self._replace(node, new)
        self.g.node.remove(cast)
        self.g.node.remove(mul)

    def weight_only(self, node: onnx.NodeProto, name: str) -> None:
        """MatMulNBits (or a MatMul of a dequantized weight) -> MatMul of its float input and
        the float model's weight (the float node's own weight input), plus its bias;
        GatherBlockQuantized -> Gather of the float weight along its gather axis."""
        f = next((n for n in self.float_model.graph.node if n.name == name), None)
        gather = node.op_type == "GatherBlockQuantized"
        at = 0 if gather else 1
        w = self.float_weight_named(f.input[at]) if f is not None and len(f.input) > at else ""
        if not w:
            return
        if gather:
            attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
            axis = int(attrs.get("gather_axis", 0))
            self._replace(node, [helper.make_node("Gather", [w, node.input[1]], [node.output[0]],
                                                  name=self.fresh(name), axis=axis)])  # fmt: skip
            return
        bias = node.input[5] if len(node.input) > 5 and node.input[5] else ""
        out = self.fresh(f"{node.output[0]}_matmul") if bias else node.output[0]
        new = [helper.make_node("MatMul", [node.input[0], w], [out], name=self.fresh(name))]
        if bias:
            new.append(helper.make_node("Add", [out, bias], [node.output[0]],
                                        name=self.fresh(f"{name}_bias")))  # fmt: skip
        self._replace(node, new)

    def _replace(self, node: onnx.NodeProto, new: list[onnx.NodeProto]) -> None:
        at = list(self.g.node).index(node)
        self.g.node.remove(node)
        for k, n in enumerate(new):
            self.g.node.insert(at + k, n)
            for o in n.output:
                self.producer[o] = n


def _unread(g: onnx.GraphProto) -> set[str]:
    """Nodes (by first output) and initializers whose values nobody reads."""
    read = {i for n in g.node for i in n.input} | {o.name for o in g.output}
    nodes = {n.output[0] for n in g.node if n.output and not any(o in read for o in n.output)}
    return nodes | {t.name for t in g.initializer if t.name not in read}


_REMOVABLE = frozenset({"QuantizeLinear", "DequantizeLinear", "DynamicQuantizeLinear", "Mul"})


def _drop_newly_unread(g: onnx.GraphProto, before: set[str]) -> None:
    """Remove the quantizing nodes and initializers nobody reads any more (not those unread
    from the start)."""
    while True:
        unread = _unread(g) - before
        dead = [n for n in g.node if n.op_type in _REMOVABLE and n.output[0] in unread]
        if not dead:
            break
        for n in dead:
            g.node.remove(n)
    unread = _unread(g) - before
    for t in [t for t in g.initializer if t.name in unread]:
        g.initializer.remove(t)


def float_activations(model: onnx.ModelProto, kernels: Collection[str]) -> onnx.ModelProto:
    """``model`` with the MatMulNBits ``kernels`` names computing as a float MatMul of their
    own int4 weights, dequantized into an initializer: the same weight rounding without the
    kernel's ``accuracy_level`` (its int8 activations). Not a DequantizeLinear: ONNX Runtime
    fuses DequantizeLinear -> MatMul back into MatMulNBits at accuracy_level 4."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    g = out.graph
    before = _unread(g)
    inits = {t.name: t for t in g.initializer}
    for node in list(g.node):
        if node.name not in kernels or node.op_type != "MatMulNBits":
            continue
        w = _dequantized_nbits(node, inits)
        if w is None:
            continue
        name = f"{node.name}_dequantized"
        g.initializer.append(numpy_helper.from_array(w, name))
        at = list(g.node).index(node)
        bias = node.input[5] if len(node.input) > 5 and node.input[5] else ""
        y = f"{node.output[0]}_matmul" if bias else node.output[0]
        new = [helper.make_node("MatMul", [node.input[0], name], [y], name=f"{node.name}_float")]
        if bias:
            new.append(helper.make_node("Add", [y, bias], [node.output[0]], name=f"{name}_bias"))
        g.node.remove(node)
        for k, n in enumerate(new):
            g.node.insert(at + k, n)
    _drop_newly_unread(g, before)
    return out


def _unpacked(q: np.ndarray[Any, Any], bits: int) -> np.ndarray[Any, Any]:
    """Bytes packing ``8 // bits`` values each, low bits first, one value per element."""
    v = q.astype(np.int32)
    if bits == 8:
        return v
    shifts = np.arange(0, 8, bits, dtype=np.int32)
    v = (v[..., None] >> shifts) & ((1 << bits) - 1)
    return v.reshape(*q.shape[:-1], q.shape[-1] * (8 // bits))


def _dequantized_nbits(
    node: onnx.NodeProto, inits: Mapping[str, onnx.TensorProto]
) -> np.ndarray[Any, Any] | None:
    """A MatMulNBits' weight [K, N] in float32: (q - zero point) × scale per block."""
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    k, n, bits, block = (int(attrs[a]) for a in ("K", "N", "bits", "block_size"))
    named = [inits.get(i) for i in node.input[1:4]] + [None] * 3
    b, scales, zp = named[:3]
    if b is None or scales is None or (len(node.input) > 4 and any(node.input[4:5])):
        return None  # g_idx: act-order, not read here
    blocks = -(-k // block)
    q = _unpacked(numpy_helper.to_array(b).reshape(n, blocks, -1), bits).reshape(n, -1)[:, :k]
    s = numpy_helper.to_array(scales).astype(np.float32).reshape(n, blocks)
    if zp is None:
        z = np.full_like(s, float(1 << (bits - 1)))
    else:
        zv = numpy_helper.to_array(zp)
        packed = zv.dtype == np.uint8
        z = (_unpacked(zv.reshape(n, -1), bits)[:, :blocks] if packed
             else zv.reshape(n, blocks)).astype(np.float32)  # fmt: skip
    at = np.arange(k) // block
    w = (q.astype(np.float32) - z[:, at]) * s[:, at]
    return np.ascontiguousarray(w.T)
