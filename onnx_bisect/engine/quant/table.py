"""The per-tensor quantization table: each quantized tensor's round trip on the float model's
values, which tensors share one scale at a Concat or an Add, and which of a merging node's
inputs lose their range under the scale its output gets."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from onnx_bisect.compare.quant import COARSE_LEVELS, QParams, QuantKind, dequantize, quant_error
from onnx_bisect.engine.measure.store import TensorStore
from onnx_bisect.engine.quant.pairing import QuantPairing, qparams
from onnx_bisect.graph.qdq import QTensor
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
        error = quant_error(view.get(name), p)
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


def weight_floors(target: LoadedModel) -> dict[str, float]:
    """Node -> the relative error its integer weights' rounding predicts (the largest over
    its weights): a QOperator kernel's own, or a QDQ node's DequantizeLinear'd initializer."""
    inits = {t.name: t for t in target.model.graph.initializer}
    out: dict[str, float] = {}
    for n in target.nodes:
        found: list[tuple[str, str, str | None, int | None]] = []
        if n.op_type in _WEIGHTS:
            w, sc, z = _WEIGHTS[n.op_type]
            if len(n.inputs) > z and n.inputs[w] in inits:
                found.append((n.inputs[w], n.inputs[sc], n.inputs[z] or None, 0))
        for i in n.inputs:
            dq = target.producer.get(i)
            if dq is not None and dq.op_type == "DequantizeLinear" and dq.inputs[0] in inits:
                zp = dq.inputs[2] if len(dq.inputs) > 2 and dq.inputs[2] else None
                found.append((dq.inputs[0], dq.inputs[1], zp, _axis(target, dq)))
        floors = [f for f in (_weight_floor(target, inits, *w) for w in found) if f is not None]
        if floors:
            out[n.name] = max(floors)
    return out


def _axis(target: LoadedModel, n: NodeInfo) -> int | None:
    attrs = {a.name: a.i for a in target.node_protos[n.name].attribute if a.name == "axis"}
    return attrs.get("axis")


def _weight_floor(
    target: LoadedModel,
    inits: Mapping[str, Any],
    weight: str,
    scale: str,
    zero_point: str | None,
    axis: int | None,
) -> float | None:
    p = qparams(target, QTensor(weight, scale, zero_point, axis, None, "weight", True))
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
