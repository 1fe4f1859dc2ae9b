"""The per-tensor quantization table: each quantized tensor's round trip on the float model's
values, and which tensors share one scale at a Concat or an Add."""

from __future__ import annotations

from collections.abc import Mapping

from onnx_bisect.compare.quant import QParams, QuantKind, quant_error
from onnx_bisect.engine.measure.store import TensorStore
from onnx_bisect.engine.quant.pairing import QuantPairing
from onnx_bisect.graph.view import LoadedModel
from onnx_bisect.quant_result import QuantRow

__all__ = ["quant_rows"]

# Where inputs are forced to one scale (onnxruntime gives a Concat's inputs its output's).
_MERGING = frozenset({"Concat", "Add", "Sum", "QLinearConcat", "QLinearAdd"})
_ORDER = {QuantKind.CLIPPED: 0, QuantKind.COARSE: 1, QuantKind.EXCESS: 2, QuantKind.ROUNDING: 3}


def quant_rows(
    target: LoadedModel, pairing: QuantPairing, view: TensorStore
) -> tuple[QuantRow, ...]:
    """One row per float tensor the model quantizes (its first quantizing node), worst
    first: clipped, coarse, excess, then rounding by error."""
    shared = _shared_scales(target, pairing)
    rows: dict[str, QuantRow] = {}
    for name, p in pairing.params.items():
        ref = pairing.pairs[name]
        producer = target.producer.get(name)
        if ref in rows or producer is None or name not in view:
            continue
        with_, at = shared.get(name, ((), ""))
        error = quant_error(view.get(name), p)
        rows[ref] = QuantRow(ref, producer.name, p.describe(), error, with_, at)
    return tuple(sorted(rows.values(), key=lambda r: (_ORDER[r.error.kind], -r.error.rel_l2)))


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


def rows_by_node(rows: tuple[QuantRow, ...]) -> Mapping[str, QuantRow]:
    return {r.node: r for r in rows}
