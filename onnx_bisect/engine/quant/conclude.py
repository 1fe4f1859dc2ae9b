"""What a quantized target model's diagnosis concludes: the per-tensor table, the verdicts
requalified by it, the root cause as quantization, and the keep-in-float answer (``pairs``:
every target tensor -> the float model's, by name and by quantization rule)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from onnx_bisect.engine.measure.store import TensorStore
from onnx_bisect.engine.quant.keep import search_keep_in_float
from onnx_bisect.engine.quant.pairing import QuantPairing
from onnx_bisect.engine.quant.table import quant_rows, weight_floors
from onnx_bisect.engine.quant.verdicts import quant_cause, requalify
from onnx_bisect.engine.session import Session
from onnx_bisect.graph.view import LoadedModel
from onnx_bisect.quant_result import KeepInFloat, QuantReport, QuantRow, Sensitivity
from onnx_bisect.result import NodeResult, RootCause

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
) -> QuantConclusion:
    rows = quant_rows(target, pairing, pairs, view)
    judged = tuple(requalify(nodes, pairs, rows, weight_floors(target)))
    new_cause = quant_cause(judged, cause, rows) if diverged or cause else cause
    keep: KeepInFloat | None = None
    sensitivity: tuple[Sensitivity, ...] = ()
    if diverged:
        path = None
        if session.options.repro is not None:
            folder = Path(session.options.repro)
            folder.mkdir(parents=True, exist_ok=True)
            path = str(folder / KEEP_MODEL)
        keep, sensitivity = search_keep_in_float(session, target, path, _suspects(target, rows))
        if keep is not None and keep.model_path:  # as the published --out folder has it
            shown = f"{Path(keep.model_path).parent.name}/{KEEP_MODEL}"
            keep = replace(keep, model_path=shown)
    report = QuantReport(pairing.rule_counts, pairing.unpaired, rows, keep, sensitivity)
    return QuantConclusion(judged, new_cause, report)


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
            maker = target.producer.get(t)
            if maker is not None:
                out.append(maker.name)
    return list(dict.fromkeys(out))
