"""A PyTorch reference's part of the reports: report.json's ``torch`` and report.md's table of
the mapped modules (the first divergent one and those around it)."""

from __future__ import annotations

import math
from typing import Any

from onnx_bisect.report.escape import cell
from onnx_bisect.text import fmt
from onnx_bisect.torch_result import ModuleRecord, TorchRefSummary

__all__ = ["contrast_spec", "torch_dict", "torch_markdown"]

# Modules shown in report.md around the first divergent one (report.json has every one).
AROUND = 5


def contrast_spec(ref: str, target: str, torch: TorchRefSummary | None) -> str | None:
    """What a bundle's ``repro.py --target`` runs for contrast: the reference; with PyTorch on
    one side (the bundle's recorded outputs are the module's), ONNX Runtime's CPU unless it is
    the backend the bundle runs already, else nothing."""
    if torch is None:
        return ref
    backend = target if torch.role == "reference" else ref
    return None if backend == "cpu" else "cpu"


def torch_dict(d: TorchRefSummary) -> dict[str, Any]:
    """report.json's ``torch``."""
    return {
        "source": d.source,
        "role": d.role,
        "preprocessing": list(d.preprocessing),
        "modules": d.modules,
        "first_divergent_module": d.first_module,
        "was_training": d.was_training,
        "unmapped": list(d.unmapped),
        "mapped": [_record(r) for r in d.mapped],
        "ops": {
            "mapped": [_record(r) for r in d.ops],
            "unmapped": d.ops_unmapped,
            "first_divergent_op": d.first_op,
        },
    }


def _record(r: ModuleRecord) -> dict[str, Any]:
    c = r.comparison
    return {
        "module": r.module,
        "class": r.class_name,
        "tensor": r.tensor,
        "node": r.node,
        "index": r.index,
        "status": c.status.value,
        "rel_l2": _num(c.metrics.get("rel_l2")),
        "max_abs": _num(c.metrics.get("max_abs")),
    }


def _num(v: float | None) -> float | str | None:
    """As ``serialize._num``: NaN and infinities spelled out (JSON has neither)."""
    if v is None:
        return None
    if not math.isfinite(v):
        return "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf")
    return float(v)


def torch_markdown(d: TorchRefSummary) -> list[str]:
    """The mapped modules around the first divergent one, in topological order."""
    rows = list(d.mapped)
    at = next((i for i, r in enumerate(rows) if r.module == d.first_module), 0)
    shown = rows[max(0, at - AROUND) : at + AROUND + 1]
    lines = ["", f"**PyTorch modules** ({', '.join(d.lines()[:1])})", ""]
    lines += ["| # | module | class | ONNX tensor | status | rel_l2 |", "|---|---|---|---|---|---|"]
    for r in shown:
        mark = " ◀ first" if r.module == d.first_module else ""
        lines.append(
            f"| {r.index} | {cell(r.module or '(top)')}{mark} | {cell(r.class_name)} | "
            f"{cell(r.tensor)} | {r.comparison.status.value} | "
            f"{fmt(r.comparison.metrics.get('rel_l2'))} |"
        )
    return lines
