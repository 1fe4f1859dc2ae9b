"""report.json and nodes.csv: the result as plain data (the JSON schema) and as rows."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import numpy as np

from onnx_bisect.compare.criterion import Comparison
from onnx_bisect.report.curve import error_curve

if TYPE_CHECKING:
    import pandas as pd

    from onnx_bisect.result import BisectResult, NodeResult

__all__ = ["NODE_COLUMNS", "SCHEMA", "node_dict", "node_rows", "to_dict", "to_frame"]


SCHEMA = "onnx-bisect/report/v1"


NODE_COLUMNS = (
    "index", "node", "op_type", "tensor", "verdict", "accumulated", "isolated", "amplification",
    "acc_max_abs", "acc_rel_l2", "acc_cosine", "iso_max_abs", "iso_rel_l2", "threshold",
    "noise", "status", "note",
)  # fmt: skip


def _opt(x: float | None) -> float:
    return math.nan if x is None else x


def _num(x: float | None) -> float | str | None:
    """JSON has no NaN or Infinity; spell them out rather than emit invalid JSON."""
    if x is None:
        return None
    if isinstance(x, float | np.floating) and not math.isfinite(x):
        return "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")
    return float(x)


def _comparison_dict(c: Comparison | None) -> dict[str, Any] | None:
    if c is None:
        return None
    return {
        "tensor": c.tensor,
        "status": c.status.value,
        "score": _num(c.score),
        "metrics": {k: _num(v) for k, v in c.metrics.items()},
        "shape": list(c.shape),
        "ref_dtype": c.ref_dtype,
        "target_dtype": c.target_dtype,
        "nonfinite_mismatch": c.nonfinite_mismatch,
        "threshold": _num(c.threshold),
        "noise": _num(c.noise),
        "reason": c.reason,
    }


def node_dict(node: NodeResult) -> dict[str, Any]:
    return {
        "index": node.index,
        "node": node.name,
        "op_type": node.op_type,
        "tensor": node.tensor,
        "verdict": node.verdict.value,
        "accumulated": _comparison_dict(node.accumulated),
        "isolated": _comparison_dict(node.isolated),
        "amplification": _num(node.amplification),
        "inputs": list(node.inputs),
        "outputs": list(node.outputs),
        "note": node.note,
    }


def to_frame(result: BisectResult) -> pd.DataFrame:
    """One row per node; the columns are those of nodes.csv."""
    import pandas as pd

    return pd.DataFrame(node_rows(result), columns=list(NODE_COLUMNS))


def node_rows(result: BisectResult) -> list[dict[str, Any]]:
    rows = []
    for n in result.nodes:
        acc, iso = n.accumulated, n.isolated
        rows.append(
            {
                "index": n.index,
                "node": n.name,
                "op_type": n.op_type,
                "tensor": n.tensor,
                "verdict": n.verdict.value,
                "accumulated": acc.score if acc else math.nan,
                "isolated": iso.score if iso else math.nan,
                "amplification": n.amplification if n.amplification is not None else math.nan,
                "acc_max_abs": acc.metrics.get("max_abs", math.nan) if acc else math.nan,
                "acc_rel_l2": acc.metrics.get("rel_l2", math.nan) if acc else math.nan,
                "acc_cosine": acc.metrics.get("cosine", math.nan) if acc else math.nan,
                "iso_max_abs": iso.metrics.get("max_abs", math.nan) if iso else math.nan,
                "iso_rel_l2": iso.metrics.get("rel_l2", math.nan) if iso else math.nan,
                "threshold": _opt(acc.threshold) if acc else math.nan,
                "noise": _opt(acc.noise) if acc else math.nan,
                "status": acc.status.value if acc else "",
                "note": n.note or (acc.reason if acc else ""),
            }
        )
    return rows


def to_dict(result: BisectResult) -> dict[str, Any]:
    fd = result.first_divergence
    first = None
    if fd is not None:
        acc = fd.accumulated
        first = {
            "node": fd.name,
            "op_type": fd.op_type,
            "index": fd.index,
            "tensor": fd.tensor,
            "status": acc.status.value if acc else fd.verdict.value,
            "reason": acc.reason if acc else fd.note,
            **({k: _num(v) for k, v in acc.metrics.items()} if acc else {}),
        }
    return {
        "schema": SCHEMA,
        "verdict": result.verdict,
        "model": result.model,
        "criterion": result.criterion.describe(),
        "metric": result.criterion.key,
        "strategy": result.strategy,
        "first_divergence": first,
        "root_cause": result.root_cause.to_dict() if result.root_cause else None,
        "outputs": [_comparison_dict(c) for c in result.outputs],
        "nodes": [node_dict(n) for n in result.nodes],
        "not_probed": [vars(p) for p in result.not_probed],
        "ref": {"spec": result.ref.spec, "description": result.ref.description},
        "target": {"spec": result.target.spec, "description": result.target.description},
        "versions": dict(result.versions),
        "command": result.command,
        "runs": dict(result.runs),
        "search": result.search.to_dict() if result.search else None,
        "repro": result.repro.to_dict() if result.repro is not None else None,
        "target_model": result.target_model or None,
        "tensor_matching": result.matching.to_dict() if result.matching is not None else None,
        "transforms": [t.to_dict() for t in result.transforms],
        "task_checks": [c.to_dict() for c in result.task_checks],
        "pass_bisection": result.pass_bisection.to_dict() if result.pass_bisection else None,
        "error_curve": [p.to_dict() for p in error_curve(result.nodes)],
        "chain": [
            {
                "node": c.node,
                "op_type": c.op_type,
                "index": c.index,
                "rel_l2": _num(c.rel_l2),
                "gain": _num(c.gain),
            }
            for c in result.chain
        ],
        "timings_s": {k: round(v, 4) for k, v in result.timings.items()},
        "inputs": {
            k: {"shape": list(v.shape), "dtype": str(v.dtype)} for k, v in result.inputs.items()
        },
        "notes": list(result.notes),
    }
