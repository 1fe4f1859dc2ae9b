"""report.json and nodes.csv: the result as plain data (the JSON schema) and as rows."""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Any

import numpy as np

from onnx_bisect.compare.criterion import Comparison
from onnx_bisect.compare.precision import PrecisionInfo
from onnx_bisect.report.curve import error_curve
from onnx_bisect.report.steps import steps_dict
from onnx_bisect.report.torchref import torch_dict

if TYPE_CHECKING:
    import pandas as pd

    from onnx_bisect.dataset_result import DatasetSummary, NodeStats, Spread
    from onnx_bisect.quant_result import KeepInFp32
    from onnx_bisect.result import BisectResult, NodeResult

__all__ = [
    "DATASET_COLUMNS",
    "NODE_COLUMNS",
    "SCHEMA",
    "dataset_dict",
    "node_columns",
    "node_dict",
    "node_rows",
    "to_dict",
    "to_frame",
]


SCHEMA = "onnx-bisect/report/v1"


NODE_COLUMNS = (
    "index", "node", "op_type", "tensor", "verdict", "accumulated", "isolated", "amplification",
    "acc_max_abs", "acc_rel_l2", "acc_cosine", "iso_max_abs", "iso_rel_l2", "threshold",
    "noise", "precision_floor", "iso_precision_floor", "status", "note",
)  # fmt: skip

# Dataset mode adds, per node, over the sampled inputs that measured it: how many, the share
# on which its accumulated error fails the criterion, the share on which it is a culprit
# (wrong alone), and mean/p95/max of its accumulated and isolated deciding numbers.
DATASET_COLUMNS = (
    "sampled", "diverged_fraction", "culprit_fraction", "acc_mean", "acc_p95", "acc_max",
    "iso_mean", "iso_p95", "iso_max",
)  # fmt: skip


def node_columns(result: BisectResult) -> tuple[str, ...]:
    """The columns of nodes.csv: a dataset's statistics after the single input's."""
    return NODE_COLUMNS + (DATASET_COLUMNS if result.dataset is not None else ())


def _opt(x: float | None) -> float:
    return math.nan if x is None else x


def _num(x: float | None) -> float | str | None:
    """JSON has no NaN or Infinity; spell them out rather than emit invalid JSON."""
    if x is None:
        return None
    if isinstance(x, float | np.floating) and not math.isfinite(x):
        return "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")
    return float(x)


def _keep_fp32(k: KeepInFp32 | None) -> dict[str, Any] | None:
    if k is None:
        return None
    return {**k.to_dict(), "before": _num(k.before), "after": _num(k.after)}


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
        "precision_floor": _num(c.precision_floor),
        "within_precision": c.within_precision,
        "range_problem": c.range_problem or None,
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

    return pd.DataFrame(node_rows(result), columns=list(node_columns(result)))


def node_rows(result: BisectResult) -> list[dict[str, Any]]:
    rows = _single_rows(result)
    if result.dataset is not None:
        stats = {n.name: n for n in result.dataset.nodes}
        for row in rows:
            row.update(_dataset_cells(stats.get(row["node"])))
    return rows


def _dataset_cells(n: NodeStats | None) -> dict[str, Any]:
    if n is None:
        return dict.fromkeys(DATASET_COLUMNS, math.nan)
    acc, iso = n.accumulated, n.isolated
    return {
        "sampled": n.inputs,
        "diverged_fraction": n.diverged_fraction,
        "culprit_fraction": n.wrong_alone_fraction,
        "acc_mean": acc.mean if acc else math.nan,
        "acc_p95": acc.p95 if acc else math.nan,
        "acc_max": acc.max if acc else math.nan,
        "iso_mean": iso.mean if iso else math.nan,
        "iso_p95": iso.p95 if iso else math.nan,
        "iso_max": iso.max if iso else math.nan,
    }


def _single_rows(result: BisectResult) -> list[dict[str, Any]]:
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
                "precision_floor": _opt(acc.precision_floor) if acc else math.nan,
                "iso_precision_floor": _opt(iso.precision_floor) if iso else math.nan,
                "status": acc.status.value if acc else "",
                "note": n.note or (acc.reason if acc else ""),
            }
        )
    return rows


def _spread(s: Spread | None) -> dict[str, Any] | None:
    return None if s is None else {"mean": _num(s.mean), "p95": _num(s.p95), "max": _num(s.max)}


def dataset_dict(d: DatasetSummary) -> dict[str, Any]:
    """report.json's ``dataset``: the inputs ranked worst first, the sample, the culprit's
    confirmation and per-node statistics over the sample."""
    c = d.confirmation
    return {
        "source": d.source,
        "inputs": len(d.screened),
        "diverged": d.diverged,
        "failed": d.failed,
        "worst": d.worst,
        "sample": list(d.sample),
        "jobs": d.jobs,
        "ray": d.ray,
        "ranking": [
            {
                "rank": rank,
                "input": s.label,
                "index": s.index,
                "diverged": s.diverged,
                "error": _num(s.error),
                "failed": s.failed or None,
                "outputs": {o.tensor: _output_numbers(o) for o in s.outputs},
            }
            for rank, s in enumerate(d.screened, 1)
        ],
        "confirmation": None if c is None else dataclasses.asdict(c) | {"nodes": list(c.nodes)},
        "nodes": [
            {
                "index": n.index,
                "node": n.name,
                "op_type": n.op_type,
                "sampled": n.inputs,
                "diverged": n.diverged,
                "diverged_fraction": n.diverged_fraction,
                "culprit": n.wrong_alone,
                "culprit_fraction": n.wrong_alone_fraction,
                "accumulated": _spread(n.accumulated),
                "isolated": _spread(n.isolated),
            }
            for n in d.nodes
        ],
        "task_checks": [
            dataclasses.asdict(t) | {"agreement_rate": t.agreement_rate} for t in d.task_checks
        ],
        "runs": dict(d.runs),
    }


def _output_numbers(c: Comparison) -> dict[str, Any]:
    return {
        "status": c.status.value,
        "score": _num(c.score),
        "rel_l2": _num(c.metrics.get("rel_l2")),
        "max_abs": _num(c.metrics.get("max_abs")),
    }


def _precision_dict(p: PrecisionInfo) -> dict[str, Any]:
    """What a side computes float32 work in, and where that is known from."""
    return {"precision": p.precision.value, "source": p.source, "how": p.how, "asked": p.asked}


def _source(result: BisectResult, *names: str) -> dict[str, Any] | None:
    """A node's origin in the exporter's source (module, class, file, line), or null."""
    src = next((result.sources[n] for n in names if n in result.sources), None)
    if src is None:
        return None
    return {
        "module": src.module,
        "class": src.class_name or None,
        "file": src.file or None,
        "line": src.line,
        "code": src.code or None,
    }


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
            "source": _source(result, fd.name),
        }
    cause = None
    if result.root_cause is not None:
        rc = result.root_cause
        cause = rc.to_dict() | {"source": _source(result, *rc.nodes[:1])}
    return {
        "schema": SCHEMA,
        "verdict": result.verdict,
        "model": result.model,
        "criterion": result.criterion.describe(),
        "metric": result.criterion.key,
        "strategy": result.strategy,
        "first_divergence": first,
        "root_cause": cause,
        "outputs": [_comparison_dict(c) for c in result.outputs],
        "nodes": [node_dict(n) for n in result.nodes],
        "not_probed": [vars(p) for p in result.not_probed],
        "ref": {
            "spec": result.ref.spec,
            "description": result.ref.description,
            "precision": _precision_dict(result.ref_precision),
        },
        "target": {
            "spec": result.target.spec,
            "description": result.target.description,
            "compiles": result.target.compiles,
            "precision": _precision_dict(result.target_precision),
        },
        "versions": dict(result.versions),
        "command": result.command,
        "runs": dict(result.runs),
        "target_runs_by_stage": dict(result.stage_runs),
        "search": result.search.to_dict() if result.search else None,
        "repro": result.repro.to_dict() if result.repro is not None else None,
        "target_model": result.target_model or None,
        "tensor_matching": result.matching.to_dict() if result.matching is not None else None,
        "quantization": result.quant.to_dict() if result.quant is not None else None,
        "keep_in_fp32": _keep_fp32(result.keep_fp32),
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
                "folded": c.folded,
                **({"stop": c.stop} if c.stop else {}),
            }
            for c in result.chain
        ],
        "timings_s": {k: round(v, 4) for k, v in result.timings.items()},
        "inputs": {
            k: {"shape": list(v.shape), "dtype": str(v.dtype)} for k, v in result.inputs.items()
        },
        "notes": list(result.notes),
        # Only in dataset mode: a single input's report keeps its keys as they were.
        **({"dataset": dataset_dict(result.dataset)} if result.dataset is not None else {}),
        # Only in multi-step mode, likewise.
        **({"steps": steps_dict(result.steps)} if result.steps is not None else {}),
        **({"torch": torch_dict(result.torch)} if result.torch is not None else {}),
    }
