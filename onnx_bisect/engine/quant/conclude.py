"""What a quantized target model's diagnosis concludes: the per-tensor table, the verdicts
requalified by it, the root cause as quantization, and the keep-in-float answer (``pairs``:
every target tensor -> the float model's, by name and by quantization rule)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from onnx_bisect.engine.measure.store import TensorStore
from onnx_bisect.engine.quant.keep import search_keep_in_float
from onnx_bisect.engine.quant.pairing import QuantPairing
from onnx_bisect.engine.quant.table import quant_rows, weight_floors
from onnx_bisect.engine.quant.verdicts import ACQUITTED, quant_cause, requalify
from onnx_bisect.engine.session import Session
from onnx_bisect.graph.refloat import integer_kernels
from onnx_bisect.graph.unquantize import is_qdq
from onnx_bisect.graph.view import LoadedModel
from onnx_bisect.quant_result import KeepInFloat, QuantReport, QuantRow, Sensitivity
from onnx_bisect.result import NodeResult, RootCause, Verdict
from onnx_bisect.text import fmt

__all__ = ["KEEP_MODEL", "QuantConclusion", "conclude"]

# The patched model's file name, in the repro folder.
KEEP_MODEL = "keep_in_float.onnx"


@dataclass(frozen=True)
class QuantConclusion:
    nodes: tuple[NodeResult, ...]
    cause: RootCause | None
    report: QuantReport


def conclude(
    session: Session,
    target: LoadedModel,
    pairing: QuantPairing,
    pairs: Mapping[str, str],
    view: TensorStore,
    nodes: Sequence[NodeResult],
    cause: RootCause | None,
    *,
    diverged: bool,
    rows: Sequence[QuantRow] | None = None,
) -> QuantConclusion:
    """``rows``: the per-tensor table when it was built already (``prelude.py``)."""
    if rows is None:
        rows = quant_rows(target, pairing, pairs, view)
    judged = tuple(requalify(nodes, pairs, rows, weight_floors(target, view, pairing.isolated)))
    named = _float_nodes(target, session.loaded)
    keep: KeepInFloat | None = None
    sensitivity: tuple[Sensitivity, ...] = ()
    if diverged:
        path = None
        if session.options.repro is not None:
            folder = Path(session.options.repro)
            folder.mkdir(parents=True, exist_ok=True)
            path = str(folder / KEEP_MODEL)
        flagged = [*_suspects(target, rows), *_culprits(judged, named)]
        ranked = _ranked(judged, named)
        keep, sensitivity = search_keep_in_float(session, target, path, flagged, ranked)
        if keep is not None and keep.model_path:  # as the published --out folder has it
            shown = f"{Path(keep.model_path).parent.name}/{KEEP_MODEL}"
            keep = replace(keep, model_path=shown)
        if keep is not None and (keep.within or (keep.verified and keep.nodes)):
            judged = tuple(_acquit(judged, named, sensitivity, keep))
    new_cause = quant_cause(judged, cause, rows, named) if diverged or cause else cause
    report = QuantReport(pairing.rule_counts, pairing.unpaired, tuple(rows), keep, sensitivity)
    return QuantConclusion(judged, new_cause, report)


def _acquit(
    nodes: Sequence[NodeResult],
    named: Mapping[str, str],
    sensitivity: Sequence[Sensitivity],
    keep: KeepInFloat,
) -> Iterator[NodeResult]:
    """A quantization culprit whose node kept in float was measured not to lower the output
    error is rounding after all: its isolated excess over the predicted floor (a Conv whose
    output cancels, so its weights' and inputs' rounding weigh more than their norms say) does
    not reach the outputs. With the model within its quantization error that is every measured
    culprit; beside a verified set, the culprits outside it that alone recover under
    ``MARGINAL`` of what the set recovers (the answer is the set, not a list of suspects)."""
    measured = {s.node: s.error for s in sensitivity}
    recovered = keep.before - keep.after
    for n in nodes:
        at = named.get(n.name, n.name)
        error = measured.get(at)
        quantized = n.verdict is Verdict.CULPRIT and n.note.startswith("quantization")
        if not quantized or error is None or at in keep.nodes:
            yield n
        elif keep.within or keep.before - error < MARGINAL * recovered:
            besides = "" if keep.within else "the verified set meets the goal without it; "
            note = (
                f"{n.note}; {besides}{ACQUITTED} ({fmt(keep.before)} -> {fmt(error)}): "
                "rounding, as designed"
            )
            yield replace(n, verdict=Verdict.PRECISION, note=note)
        else:
            yield n


# A culprit outside the verified set that alone recovers less than this share of what the set
# recovers does not matter to the outputs (YOLOv8n QOperator's dfl Conv: none of 0.416).
MARGINAL = 0.1


def _culprits(nodes: Sequence[NodeResult], named: Mapping[str, str]) -> list[str]:
    """The float nodes behind the culprits: quantized more coarsely than rounding predicts."""
    found = (named.get(n.name, n.name) for n in nodes if n.verdict is Verdict.CULPRIT)
    return list(dict.fromkeys(found))


def _ranked(nodes: Sequence[NodeResult], named: Mapping[str, str]) -> list[str]:
    """Float nodes by the most error one of them, or one of its Q/DQ nodes, adds fed the
    reference's values (isolated rel_l2), most first: the order to measure sensitivity in."""
    worst: dict[str, float] = {}
    for n in nodes:
        iso = n.isolated.metrics.get("rel_l2", 0.0) if n.isolated is not None else 0.0
        iso = iso if iso == iso else 0.0
        at = named.get(n.name, n.name)
        worst[at] = max(worst.get(at, 0.0), iso)
    return sorted(worst, key=lambda k: -worst[k])


_QDQ = frozenset({"QuantizeLinear", "DequantizeLinear"})


def _float_nodes(target: LoadedModel, ref: LoadedModel) -> dict[str, str]:
    """Each QuantizeLinear/DequantizeLinear -> the float node whose output it quantizes (back
    through the Q/DQ chain), and each integer kernel of a QOperator or dynamic model -> the
    float node it stands for: the node to name, and to keep in float."""
    kernels: dict[str, str] = {}
    if not is_qdq(target):
        kernels = {k: n for n, k in integer_kernels(target.model, ref.model).kernels.items()}
    out: dict[str, str] = dict(kernels)
    # An op onnxruntime runs on the integers as they are (a Split) has no float form to
    # restore, but keeps its float node's name with ``_quant`` added: named as nodes_to_exclude
    # takes it, like the kernels.
    float_names = {n.name for n in ref.nodes}
    for n in target.nodes:
        plain = n.name.removesuffix("_quant")
        if plain != n.name and plain in float_names:
            out.setdefault(n.name, plain)
    for n in target.nodes:
        if n.op_type not in _QDQ:
            continue
        at = n
        while at.op_type in _QDQ and at.inputs and at.inputs[0] in target.producer:
            at = target.producer[at.inputs[0]]
        if at.op_type not in _QDQ:
            out[n.name] = kernels.get(at.name, at.name)
    return out


def _suspects(target: LoadedModel, rows: Sequence[QuantRow]) -> list[str]:
    """Nodes the table points at: the merging node of a lost input and what made that input,
    and the maker of each tensor quantized other than as designed."""
    names = {n.name for n in target.nodes}
    out: list[str] = []
    for r in rows:
        if r.as_designed:
            continue
        if r.shared_at in names:
            out.append(r.shared_at)
        for t in (*r.lost, r.tensor):
            # A QOperator model has the float tensor's integers only (``<name>_quantized``).
            maker = target.producer.get(t) or target.producer.get(f"{t}_quantized")
            if maker is not None:
                out.append(maker.name)
    return list(dict.fromkeys(out))
