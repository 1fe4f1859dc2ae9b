"""The per-tensor quantization table: each quantized tensor's round trip on the float model's
values, which tensors share one scale at a Concat or an Add, and which of a merging node's
inputs lose their range under the scale its output gets."""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np
import onnx

from onnx_bisect.compare.quant import COARSE_LEVELS, QParams, QuantKind, dequantize, quant_error
from onnx_bisect.engine.measure.store import TensorStore
from onnx_bisect.engine.quant.pairing import QuantPairing, initializers, qparams
from onnx_bisect.graph.qdq import QTensor, read_quantized
from onnx_bisect.graph.view import LoadedModel, NodeInfo
from onnx_bisect.graph.weights import tensor_array
from onnx_bisect.quant_result import QuantRow

__all__ = ["quant_rows", "weight_floors"]

# Where an integer kernel's weight and its scale and zero point are among its inputs.
_WEIGHTS = {"QLinearConv": (3, 4, 5), "QLinearMatMul": (3, 4, 5), "QGemm": (3, 4, 5)}

# Where inputs are forced to one scale (onnxruntime gives a Concat's inputs its output's).
_MERGING = frozenset({"Concat", "Add", "Sum", "QLinearConcat", "QLinearAdd"})
_ORDER = {
    QuantKind.SHARED: 0,
    QuantKind.CLIPPED: 1,
    QuantKind.COARSE: 2,
    QuantKind.EXCESS: 3,
    QuantKind.ROUNDING: 4,
}


def quant_rows(
    target: LoadedModel, pairing: QuantPairing, pairs: Mapping[str, str], view: TensorStore
) -> tuple[QuantRow, ...]:
    """One row per float tensor the model quantizes (its first quantizing node), worst
    first: a shared scale that loses an input, clipped, coarse, excess, then rounding."""
    shared = _shared_scales(target, pairing)
    lost = _lost_inputs(target, pairing, pairs, view)
    rows: dict[str, QuantRow] = {}
    for name, p in pairing.params.items():
        ref = pairing.pairs[name]
        producer = target.producer.get(name)
        if ref in rows or producer is None or name not in view:
            continue
        with_, at = shared.get(name, ((), ""))
        gone, where = lost.get(name, ((), ""))
        # A run-time scale is judged as the model sets it on these values (it cannot clip).
        error = quant_error(view.get(name), pairing.isolated.get(name, p))
        rows[ref] = QuantRow(ref, producer.name, p.describe(), error, with_, at or where, gone)
    return tuple(sorted(rows.values(), key=lambda r: (_ORDER[r.kind], -r.error.rel_l2)))


def _shared_scales(
    target: LoadedModel, pairing: QuantPairing
) -> dict[str, tuple[tuple[str, ...], str]]:
    """Quantized tensor -> the float tensors sharing its scale at one merging node, and that
    node."""
    out: dict[str, tuple[tuple[str, ...], str]] = {}
    for n in target.nodes:
        if n.op_type not in _MERGING:
            continue
        quantized = [q for q in (_quantized_input(target, pairing, i) for i in n.inputs) if q]
        groups: dict[bytes, list[str]] = {}
        for q in quantized:
            groups.setdefault(_key(pairing.params[q]), []).append(q)
        for members in groups.values():
            refs = [pairing.pairs[m] for m in members]
            if len(set(refs)) < 2:
                continue
            for m, r in zip(members, refs, strict=True):
                out.setdefault(m, (tuple(x for x in dict.fromkeys(refs) if x != r), n.name))
    return out


def _lost_inputs(
    target: LoadedModel, pairing: QuantPairing, pairs: Mapping[str, str], view: TensorStore
) -> dict[str, tuple[tuple[str, ...], str]]:
    """Quantized output of a merging node -> its inputs that span fewer than COARSE_LEVELS
    steps of the output's scale while another spans COARSE_LEVELS times more, and the node."""
    out: dict[str, tuple[tuple[str, ...], str]] = {}
    constants = set(target.constants) | set(target.initializers)
    for n in target.nodes:
        if n.op_type not in _MERGING or not n.outputs:
            continue
        q = _quantized_output(target, pairing, n)
        if q is None:
            continue
        step = float(np.mean(pairing.params[q].scale))
        steps = {}
        for i in n.inputs:
            # A constant operand (hard-swish's + 3) spans nothing by design.
            if i in constants or i not in view:
                continue
            if np.issubdtype(view.meta(i).dtype, np.floating):
                v = np.asarray(view.get(i), dtype=np.float64)
                spread = float(v.max() - v.min()) if v.size else 0.0
                if spread > 0.0:
                    steps[pairs.get(i, i)] = spread / step
        if not steps:
            continue
        widest = max(steps.values())
        gone = tuple(
            r
            for r, s in steps.items()
            if s < COARSE_LEVELS and widest >= COARSE_LEVELS * max(s, 1e-12)
        )
        if gone:
            out[q] = (gone, n.name)
    return out


def _quantized_output(target: LoadedModel, pairing: QuantPairing, n: NodeInfo) -> str | None:
    """The integer tensor holding a merging node's output: itself (QOperator) or what the
    QuantizeLinear reading it writes (QDQ)."""
    o = n.outputs[0]
    if o in pairing.params:
        return o
    for reader in target.nodes:
        if reader.op_type == "QuantizeLinear" and reader.inputs[0] == o:
            q = reader.outputs[0]
            return q if q in pairing.params else None
    return None


def _quantized_input(target: LoadedModel, pairing: QuantPairing, tensor: str) -> str | None:
    """The integer tensor behind an input: itself (QOperator), or what a DequantizeLinear
    reads (QDQ)."""
    if tensor in pairing.params:
        return tensor
    producer = target.producer.get(tensor)
    if producer is not None and producer.op_type == "DequantizeLinear":
        src = producer.inputs[0]
        return src if src in pairing.params else None
    return None


def _key(p: QParams) -> bytes:
    return p.scale.tobytes() + p.zero_point.tobytes() + p.dtype.encode()


def weight_floors(
    target: LoadedModel,
    view: TensorStore | None = None,
    steps: Mapping[str, QParams] | None = None,
) -> dict[str, float]:
    """Node -> the relative error its integer weights' rounding predicts (the largest over
    its weights): a QOperator kernel's own, or a QDQ node's DequantizeLinear'd initializer;
    for a dynamic model's MatMulInteger/ConvInteger also on the reference's inputs in ``view``
    with its input's rounding at the step ``steps`` gives it (``_on_inputs``)."""
    inits = initializers(target)
    quantized = read_quantized(target).tensors
    out: dict[str, float] = {}
    for n in target.nodes:
        found: list[tuple[str, str, str | None, int | None]] = []
        if n.op_type in _WEIGHTS:
            w, sc, z = _WEIGHTS[n.op_type]
            if len(n.inputs) > z and n.inputs[w] in inits:
                found.append((n.inputs[w], n.inputs[sc], n.inputs[z] or None, 0))
        if n.op_type in _INTEGER and len(n.inputs) > 1 and n.inputs[1] in inits:
            found += _dynamic_weight(target, quantized, n)
        for i in n.inputs:
            dq = target.producer.get(i)
            if dq is not None and dq.op_type == "DequantizeLinear" and dq.inputs[0] in inits:
                zp = dq.inputs[2] if len(dq.inputs) > 2 and dq.inputs[2] else None
                found.append((dq.inputs[0], dq.inputs[1], zp, _axis(target, dq)))
        floors = [f for f in (_weight_floor(target, inits, *w) for w in found) if f is not None]
        if n.op_type in _INTEGER and view is not None:
            x_step = (steps or {}).get(n.inputs[0])
            step = float(np.mean(x_step.scale)) if x_step is not None else 0.0
            floors += [_on_inputs(target, inits, n, view, step, *w) for w in found]
        if floors:
            out[n.name] = max(floors)
    return out


# Dynamic quantization's integer kernels: the weight's axis of a per-channel scale.
_INTEGER = {"MatMulInteger": 1, "ConvInteger": 0}


def _dynamic_weight(
    target: LoadedModel, quantized: Mapping[str, QTensor], n: NodeInfo
) -> list[tuple[str, str, str | None, int | None]]:
    """A MatMulInteger/ConvInteger's weight, zero point and scale: the initializer the Mul
    making the product of scales reads (the activation's is computed at run time)."""
    q = quantized.get(n.outputs[0])
    product = target.producer.get(q.scale) if q is not None else None
    if product is None or product.op_type != "Mul":
        return []
    scales = [i for i in product.inputs if i in target.initializers]
    zp = n.inputs[3] if len(n.inputs) > 3 and n.inputs[3] else None
    return [(n.inputs[1], scales[0], zp, _INTEGER[n.op_type])] if len(scales) == 1 else []


def _on_inputs(
    target: LoadedModel,
    inits: Mapping[str, onnx.TensorProto],
    n: NodeInfo,
    view: TensorStore,
    x_step: float,
    weight: str,
    scale: str,
    zero_point: str | None,
    axis: int | None,
) -> float:
    """The relative error rounding the weights of an integer MatMul/Conv adds to its output on
    the reference's input: each output channel's rounding noise (step² / 12 per weight) times
    the energy of the inputs it reads. A depthwise Conv whose large input channels meet small
    weights under one per-tensor step loses more than the weights' own norm says. Plus the
    input's rounding at ``x_step`` through the weights: each output sums its operands' noise
    times their weights squared (a DFL Conv's weights 0..15 weigh its inputs' rounding up)."""
    p = qparams(target, QTensor(weight, scale, zero_point, axis, None, "weight", True), inits)
    x_name, y_name = n.inputs[0], n.outputs[0]
    if p is None or x_name not in view or y_name not in view:
        return 0.0
    x = np.asarray(view.get(x_name), dtype=np.float64)
    y_norm = float(np.linalg.norm(np.asarray(view.get(y_name), dtype=np.float64).ravel()))
    w = tensor_array(inits[weight])
    outs = w.shape[1] if n.op_type == "MatMulInteger" else w.shape[0]
    step2 = np.broadcast_to(p.scale**2, (outs,))
    if n.op_type == "MatMulInteger":
        noise = float(np.sum(step2)) / 12.0 * float(np.sum(x**2))
    else:
        per_group = w.shape[1]  # input channels each output channel reads
        energy = np.sum(x**2, axis=tuple(i for i in range(x.ndim) if i != 1))
        groups = energy.reshape(-1, per_group).sum(axis=1)  # one per group
        reads = np.repeat(groups, outs // groups.size)
        taps = float(np.prod(w.shape[2:]))
        y_shape = view.meta(y_name).shape
        ratio = float(np.prod(y_shape[2:])) / max(float(np.prod(x.shape[2:])), 1.0)
        noise = float(np.sum(step2 * reads)) / 12.0 * taps * ratio
    size = float(np.prod(view.meta(y_name).shape))
    w_real = dequantize(w, p)
    noise += x_step**2 / 12.0 * float(np.sum(w_real**2)) * size / outs
    return math.sqrt(noise) / y_norm if y_norm > 0 else 0.0


def _axis(target: LoadedModel, n: NodeInfo) -> int | None:
    attrs = {a.name: a.i for a in target.node_protos[n.name].attribute if a.name == "axis"}
    return attrs.get("axis")


def _weight_floor(
    target: LoadedModel,
    inits: Mapping[str, onnx.TensorProto],
    weight: str,
    scale: str,
    zero_point: str | None,
    axis: int | None,
) -> float | None:
    p = qparams(target, QTensor(weight, scale, zero_point, axis, None, "weight", True), inits)
    if p is None:
        return None
    w = dequantize(tensor_array(inits[weight]), p)
    if p.scale.size > 1 and w.ndim > (axis or 0):
        shape = [1] * w.ndim
        shape[(axis if axis is not None else 0) % w.ndim] = p.scale.size
        step = np.broadcast_to(p.scale.reshape(shape), w.shape)
    else:
        step = np.broadcast_to(p.scale.reshape(()), w.shape)
    norm = float(np.linalg.norm(w.ravel()))
    return math.sqrt(float(np.sum(step**2)) / 12.0) / norm if norm > 0 else None
