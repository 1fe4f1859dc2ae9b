"""The quantization section of report.md and report.html: the keep-in-float answer, the
per-node sensitivity and the per-tensor table, first, since they are what a quantized model's
user came for."""

from __future__ import annotations

from html import escape

from onnx_bisect.quant_result import (
    InputFigure,
    KeepInFloat,
    KeepInFp32,
    QuantReport,
    QuantRow,
    figure_lines,
)
from onnx_bisect.report.escape import cell, code
from onnx_bisect.text import fmt

__all__ = [
    "figures_markdown",
    "keep_fp32_html",
    "keep_fp32_markdown",
    "quant_html",
    "quant_markdown",
]

ROWS = 12  # table rows shown; report.json has them all


def _answer(k: KeepInFloat) -> tuple[str, str, str]:
    """What verified the answer, its measured effect, and the call to paste."""
    if k.requantized is not None:
        state = "verified by re-quantizing with onnxruntime's quantizer"
        b, a = k.requantized
        measured = f"{fmt(b)} → {fmt(a)} re-quantized; {fmt(k.before)} → {fmt(k.after)} patched"
    else:
        state = "verified by a run of the model patched as the quantizer would write it"
        measured = f"{fmt(k.before)} → {fmt(k.after)}"
    if not k.verified:
        state = "NOT verified"
    return state, measured, k.call or f"quantize_static(..., {k.nodes_to_exclude})"


def keep_fp32_markdown(k: KeepInFp32) -> list[str]:
    """A float16 conversion's keep-in-fp32 answer: the set, its effect, the call to paste."""
    out = ["## Keep in float32", ""]
    if not (k.nodes or k.ops):
        return [*out, f"No set found ({k.runs} runs): {k.note}"]
    state = f"verified by {k.verified_by}" if k.verified else "NOT verified"
    named = k.ops if k.kind == "op_block_list" else k.nodes
    out += [
        f"**{k.kind}** {', '.join(code(n) for n in named)} ({state}; {k.runs} runs): "
        f"{k.goal}; {_worst(k.per_input)}{k.figure} "
        f"{fmt(k.before)} → {fmt(k.after)}",
        "",
        "```python",
        "from onnxconverter_common import float16",
        *([k.prepare] if k.prepare else []),
        f"model = {k.call}",
        "```",
    ]
    if k.modules:
        out += ["", f"Modules to keep in float32: {', '.join(code(m) for m in k.modules)}"]
    out += figures_markdown(k.figure, k.per_input)
    return out + (["", k.note] if k.note else [])


def _worst(per_input: tuple[InputFigure, ...]) -> str:
    return "worst input's " if len(per_input) > 1 else ""


def figures_markdown(figure: str, per_input: tuple[InputFigure, ...]) -> list[str]:
    """The goal's figure on each input, a table row each, where there are several."""
    if len(per_input) < 2:
        return []
    out = ["", f"| input | {cell(figure)} | with the set | goal met |", "| --- | --- | --- | --- |"]
    for f in per_input:
        after = "" if f.after is None else fmt(f.after)
        out.append(f"| {code(f.input)} | {fmt(f.before)} | {after} | {'yes' if f.met else 'no'} |")
    return out


def quant_markdown(q: QuantReport) -> list[str]:
    out = ["## Quantization", ""]
    k = q.keep
    if k is not None and k.nodes:
        state, measured, call = _answer(k)
        out += [
            f"**Keep in float** ({state}; {k.runs} runs): {k.goal}: {measured}",
            "",
            "```python",
            call,
            "```",
            "",
        ]
        if k.model_path:
            out += [f"The patched model: {code(k.model_path)}", ""]
    if k is not None and len(k.per_input) > 1:
        out += [*figures_markdown(k.figure, k.per_input)[1:], ""]
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
                f"| {code(r.tensor)} | {r.kind.value} | {cell(r.scale)} | {fmt(e.rel_l2)} | "
                f"{fmt(e.floor)} | {e.sqnr_db:.1f} | {e.clipped:.1%} | {e.levels:.1f} | "
                f"{shared if r.shared_with else ''} |"
            )
    return out


_HEAD = ("tensor", "kind", "scale", "rel_l2", "rounding floor", "SQNR dB", "clipped", "steps",
         "shared scale")  # fmt: skip


def keep_fp32_html(k: KeepInFp32) -> list[str]:
    """The keep-in-fp32 answer for report.html: the line the terminal prints, and the call."""
    out = ["<h2>Keep in float32</h2>", f"<p>{escape(k.line())}</p>"]
    if k.nodes or k.ops:
        code_lines = [line for line in (k.prepare, f"model = {k.call}") if line]
        out.append(f"<pre><code>{escape(chr(10).join(code_lines))}</code></pre>")
    return out + [f"<p>{escape(line)}</p>" for line in k.lines()]


def quant_html(q: QuantReport) -> list[str]:
    """The same section for report.html: the answer, the sensitivity, the flagged tensors
    first in the per-tensor table."""
    out = ["<h2>Quantization</h2>"]
    k = q.keep
    if k is not None and k.nodes:
        state, measured, call = _answer(k)
        out += [
            f"<p><strong>Keep in float</strong> ({state}; {k.runs} runs): {escape(k.goal)}: "
            f"{measured}</p>",
            f"<pre><code>{escape(call)}</code></pre>",
        ]
        if k.model_path:
            out.append(
                f'<p>The patched model: <span class="mono">{escape(k.model_path)}</span></p>'
            )
    if k is not None:
        out += [f"<p>{escape(line)}</p>" for line in figure_lines(k.figure, k.per_input)]
    if k is not None and k.note:
        out.append(f"<p>{escape(k.note)}</p>")
    out.append(f'<p class="sub">{escape(q.pairing_summary())}</p>')
    if q.sensitivity:
        out += [
            "<h3>Sensitivity (the goal's number with only that node in float)</h3>",
            "<table><thead><tr><th>node</th><th>error</th></tr></thead><tbody>",
            *(
                f'<tr><td class="mono">{escape(s.node)}</td><td>{fmt(s.error)}</td></tr>'
                for s in q.sensitivity[:ROWS]
            ),
            "</tbody></table>",
        ]
    if q.rows:
        out += [
            "<h3>Quantized tensors (round trip on the float model's values)</h3>",
            "<table><thead><tr>" + "".join(f"<th>{h}</th>" for h in _HEAD) + "</tr></thead><tbody>",
            *(_html_row(r) for r in q.rows[:ROWS]),
            "</tbody></table>",
        ]
    return out


def _html_row(r: QuantRow) -> str:
    e = r.error
    shared = f"{', '.join(r.shared_with)} at {r.shared_at}" if r.shared_with else ""
    cells = (r.tensor, r.kind.value, r.scale, fmt(e.rel_l2), fmt(e.floor), f"{e.sqnr_db:.1f}",
             f"{e.clipped:.1%}", f"{e.levels:.1f}", shared)  # fmt: skip
    return "<tr>" + "".join(f"<td>{escape(c)}</td>" for c in cells) + "</tr>"
