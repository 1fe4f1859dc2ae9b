"""Verdicts for a quantized model (pure): a node whose isolated error is its quantization's
rounding, as designed, is ``precision``; one whose scale clips or is too coarse for its values
stays ``culprit``; the root cause is of kind ``quantization`` either way, since rounding is no
runtime's bug."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import replace

from onnx_bisect.compare.precision import DATA_MOVEMENT
from onnx_bisect.compare.quant import COARSE_LEVELS, ROUNDING_SLACK, QuantKind
from onnx_bisect.quant_result import QuantRow
from onnx_bisect.result import CauseKind, NodeResult, RootCause, Verdict

__all__ = ["ACQUITTED", "quant_cause", "requalify"]

# What a culprit's note says once keeping it in float was measured not to help.
ACQUITTED = "kept in float it does not lower the outputs' error"


def _row_of(
    node: NodeResult, pairs: Mapping[str, str], rows: dict[str, QuantRow]
) -> QuantRow | None:
    """The table's row for what the node writes: its output's float name, or the tensor a
    QuantizeLinear reading it stands for."""
    for o in node.outputs:
        row = rows.get(pairs.get(o, o))
        if row is not None:
            return row
    return None


def requalify(
    nodes: Sequence[NodeResult],
    pairs: Mapping[str, str],
    rows: Sequence[QuantRow],
    weights: Mapping[str, float],
) -> list[NodeResult]:
    """Culprits whose isolated error the rounding of their output's scale, their quantized
    inputs' and their integer weights' (``weights``: node -> relative floor) explains become
    ``precision``; the others are told what is wrong with their quantization."""
    by_tensor = {r.tensor: r for r in rows}
    out: list[NodeResult] = []
    for n in nodes:
        row = _row_of(n, pairs, by_tensor) if n.verdict is Verdict.CULPRIT else None
        if row is None:
            out.append(n)
            continue
        e = row.error
        iso = n.isolated.metrics.get("rel_l2", math.inf) if n.isolated is not None else math.inf
        # Fed quantized operands, a node's error holds their rounding too.
        inputs = [by_tensor[r] for r in (pairs.get(i) for i in n.inputs) if r in by_tensor]
        budget = math.hypot(
            max(e.rel_l2, e.floor), weights.get(n.name, 0.0), *(r.error.rel_l2 for r in inputs)
        )
        if row.kind is QuantKind.ROUNDING and n.op_type in DATA_MOVEMENT:
            # A Split or Reshape on the integers moves its input's values as they are: its
            # error is that rounding, however a slice's relative error compares with the whole's.
            note = f"moves its quantized input's values as they are ({row.scale})"
            out.append(replace(n, verdict=Verdict.PRECISION, note=note))
        elif row.kind is QuantKind.ROUNDING and iso <= ROUNDING_SLACK * budget:
            note = (
                f"within the rounding of {row.scale} (round trip {e.rel_l2:.3g}, "
                f"uniform rounding predicts {e.floor:.3g})"
            )
            out.append(replace(n, verdict=Verdict.PRECISION, note=note))
        elif row.kind is QuantKind.ROUNDING:
            note = (
                f"quantization ({row.scale}): isolated error {iso:.3g} exceeds the "
                f"{ROUNDING_SLACK * budget:.3g} that rounding its output, quantized inputs "
                "and weights predicts"
            )
            out.append(replace(n, note=note))
        else:
            out.append(replace(n, note=_problem(row)))
    return out


def _problem(row: QuantRow) -> str:
    e = row.error
    shared = (
        f"; the scale is shared with {', '.join(row.shared_with)} at {row.shared_at}"
        if row.shared_with
        else ""
    )
    if row.lost:
        return (
            f"quantization ({row.scale}): {', '.join(row.lost)} span fewer than "
            f"{COARSE_LEVELS:g} steps of the one scale {row.shared_at} gives its inputs"
        )
    what = {
        QuantKind.SHARED: "",
        QuantKind.CLIPPED: f"{e.clipped:.1%} of {row.tensor}'s values lie outside its range",
        QuantKind.COARSE: f"{row.tensor}'s values span {e.levels:.1f} steps of its scale",
        QuantKind.EXCESS: f"{row.tensor}'s round trip loses {e.rel_l2:.3g}",
        QuantKind.ROUNDING: f"{row.tensor} rounds as designed",
    }[e.kind]
    return f"quantization ({row.scale}): {what}{shared}"


def quant_cause(
    nodes: Sequence[NodeResult],
    cause: RootCause | None,
    rows: Sequence[QuantRow],
    float_node: Mapping[str, str] | None = None,
) -> RootCause | None:
    """The root cause as quantization: the nodes whose quantization is wrong for their
    values, named as the float nodes whose outputs are quantized (``float_node``: a
    QuantizeLinear/DequantizeLinear -> the node it quantizes), or none (the model is within
    its quantization error). A culprit that is not about quantization (a wrong integer
    kernel) keeps its cause."""
    culprits = [n for n in nodes if n.verdict is Verdict.CULPRIT]
    quantized = [n for n in culprits if n.note.startswith("quantization")]
    if culprits and len(quantized) < len(culprits):
        return cause
    if quantized:
        named = (float_node or {}).get
        return RootCause(
            CauseKind.QUANTIZATION,
            tuple(dict.fromkeys(named(n.name, n.name) for n in quantized)),
            "; ".join(dict.fromkeys(n.note for n in quantized[:3])),
        )
    flagged = [r for r in rows if not r.as_designed]
    if not rows:
        return RootCause(
            CauseKind.QUANTIZATION,
            (),
            "no node is wrong alone; no quantized tensor could be read in real units, so the "
            "rounding is not measured tensor by tensor",
        )
    acquitted = sum(1 for n in nodes if ACQUITTED in n.note)
    also = (
        f", or ({acquitted}) kept in float does not lower the outputs' error" if acquitted else ""
    )
    reason = (
        "within its quantization error: every node's isolated error is the rounding its "
        f"scale predicts{also}; the outputs differ from the float model's by that rounding, "
        "not by a fault"
        if not flagged
        else f"no node is wrong alone; {len(flagged)} quantized tensors lose more than rounding "
        f"(worst: {flagged[0].tensor}, {flagged[0].kind.value})"
    )
    return RootCause(CauseKind.QUANTIZATION, (), reason)
