"""The quantization section of report.md: the keep-in-float answer, the per-node sensitivity
and the per-tensor table, first, since they are what a quantized model's user came for."""

from __future__ import annotations

from onnx_bisect.quant_result import QuantReport
from onnx_bisect.report.escape import cell, code
from onnx_bisect.text import fmt

__all__ = ["quant_markdown"]

ROWS = 12  # table rows shown; report.json has them all


def quant_markdown(q: QuantReport) -> list[str]:
    out = ["## Quantization", ""]
    k = q.keep
    if k is not None and k.nodes:
        state = "verified by a run of the patched model" if k.verified else "NOT verified"
        out += [
            f"**Keep in float** ({state}; {k.runs} runs): {k.goal}: "
            f"{fmt(k.before)} → {fmt(k.after)}",
            "",
            "```python",
            f"quantize_static(..., {k.nodes_to_exclude})",
            "```",
            "",
        ]
        if k.model_path:
            out += [f"The patched model: {code(k.model_path)}", ""]
    if k is not None and k.note:
        out += [k.note, ""]
    out += [f"- {q.pairing_summary()}"]
    out += [f"- unpaired {code(t)}: {cell(r)}" for t, r in list(q.unpaired.items())[:ROWS]]
    if q.sensitivity:
        out += ["", "**Sensitivity** (the goal's number with only that node in float)", ""]
        out += ["| node | error |", "| --- | --- |"]
        out += [f"| {code(s.node)} | {fmt(s.error)} |" for s in q.sensitivity[:ROWS]]
    if q.rows:
        out += ["", "**Quantized tensors** (round trip on the float model's values)", ""]
        out += [
            "| tensor | kind | scale | rel_l2 | rounding floor | SQNR dB | clipped | steps "
            "| shared scale |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        for r in q.rows[:ROWS]:
            e = r.error
            shared = f"{', '.join(code(x) for x in r.shared_with)} at {code(r.shared_at)}"
            out.append(
                f"| {code(r.tensor)} | {e.kind.value} | {cell(r.scale)} | {fmt(e.rel_l2)} | "
                f"{fmt(e.floor)} | {e.sqnr_db:.1f} | {e.clipped:.1%} | {e.levels:.1f} | "
                f"{shared if r.shared_with else ''} |"
            )
    return out
