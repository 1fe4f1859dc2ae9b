"""report.html: one self-contained page, the summary, the error curve, the root cause's
neighbourhood and every node in a sortable, filterable table.

Self-contained means no request leaves the page: CSS, JS and SVG are inline, and a
Content-Security-Policy forbids loading anything else, so a report opened from a mail or an
air-gapped machine looks the same and cannot phone home. The plot comes from ``plots`` (an
optional extra); without matplotlib the page says how to get it and is otherwise whole.
"""

from __future__ import annotations

import math
import re
from html import escape
from importlib.resources import files
from pathlib import Path
from typing import TYPE_CHECKING

from onnx_bisect.graph.source import shown_source, source_lines
from onnx_bisect.report.escape import shell
from onnx_bisect.report.format import chain_line, first_divergence_phrase, fmt_error, search_line
from onnx_bisect.report.markdown import step_list
from onnx_bisect.report.neighbourhood import MAX_NODES, neighbourhood, neighbourhood_svg
from onnx_bisect.report.plots import PLOTS_HINT, curve_svg
from onnx_bisect.report.quant import keep_fp32_html, quant_html
from onnx_bisect.report.steps import steps_html
from onnx_bisect.result import (
    INSIDE,
    INSIDE_CAUSE,
    INSIDE_FIRST,
    CauseKind,
    agreement,
    headline,
    lowered_by_runtime,
    no_divergence_found,
    nonfinite_origin,
    nonfinite_phrase,
    precision_phrase,
    within_precision,
)
from onnx_bisect.text import fmt, fmt_amp, plural

if TYPE_CHECKING:
    from onnx_bisect.compare.criterion import Comparison
    from onnx_bisect.result import BisectResult, NodeResult

__all__ = ["CSP", "render_html"]

CSP = "default-src 'none'; style-src 'unsafe-inline'; script-src 'unsafe-inline'; img-src data:"


def _asset(name: str) -> str:
    return (files("onnx_bisect.report") / "assets" / name).read_text(encoding="utf-8")


def render_html(result: BisectResult, folder: Path | None = None) -> str:
    """report.html; ``folder``: where it and Model Explorer's files are, for the next steps."""
    title = f"onnx-bisect: {result.target.spec} vs {result.ref.spec}"
    if result.target_model:  # two models: name both (the backends may be the same)
        sides = f"{Path(result.target_model).name} vs {Path(result.model).name}"
        title = f"onnx-bisect: {sides} on {result.target.spec}"
    body = [
        f"<h1>{escape(title)}</h1>",
        f'<p class="sub path">{escape(result.model)}'
        + (f" (the target runs {escape(result.target_model)})" if result.target_model else "")
        + "</p>",
        *(quant_html(result.quant) if result.quant is not None else []),
        *(keep_fp32_html(result.keep_fp32) if result.keep_fp32 is not None else []),
        *_summary(result),
        *(steps_html(result.steps) if result.steps is not None else []),
        *_steps(result, folder),
        *_curve(result),
        *_graph(result),
        *_table(result),
        *_footer(result),
    ]
    return "\n".join(
        [
            "<!DOCTYPE html>",
            '<html lang="en"><head><meta charset="utf-8">',
            f'<meta http-equiv="Content-Security-Policy" content="{CSP}">',
            '<meta name="viewport" content="width=device-width, initial-scale=1">',
            f"<title>{escape(title)}</title>",
            f"<style>\n{_asset('report.css')}</style>",
            "</head><body>",
            *body,
            f"<script>\n{_asset('report.js')}</script>",
            "</body></html>",
            "",
        ]
    )


def _summary(r: BisectResult) -> list[str]:
    crit = r.criterion
    if lowered_by_runtime(r):
        state, said = ("lowered", headline(r)), ("each tensor judged against", crit.describe())
    elif r.diverged:
        state, said = ("diverged", "Diverged"), ("a tensor diverges where", crit.describe())
    elif agrees := within_precision(r):
        head, _, numbers = agrees.partition(": ")
        state, said = ("match", "No divergence"), (escape(head) + ":", numbers)
    else:
        state, said = ("match", "No divergence"), ("every final output agrees:", agreement(r))
    out = [
        f'<p><span class="verdict {state[0]}">{state[1]}</span> '
        f"{said[0]} <code>{escape(said[1])}</code></p>"
    ]
    if r.outputs:
        out.append(
            '<table class="outputs"><thead><tr><th>output</th><th>status</th><th>rel_l2</th>'
            "<th>max_abs</th><th>note</th></tr></thead><tbody>"
        )
        for c in r.outputs:
            out.append(
                f"<tr><td><code>{escape(c.tensor)}</code></td><td>{escape(c.state)}</td>"
                f'<td class="num">{c.shown("rel_l2")}</td>'
                f'<td class="num">{c.shown("max_abs")}</td><td>{escape(c.reason)}</td>'
                "</tr>"
            )
        out.append("</tbody></table>")
    facts = _facts(r)
    if facts:
        out.append('<dl class="facts">')
        out += [f"<dt>{k}</dt><dd>{v}</dd>" for k, v in facts]
        out.append("</dl>")
    return out


def _facts(r: BisectResult) -> list[tuple[str, str]]:
    """The summary's list of facts: modes, the first divergence, the root cause, the rest."""
    facts: list[tuple[str, str]] = []
    if precision := precision_phrase(r):
        facts.append(("Precision", escape(precision)))
    if r.dataset is not None:
        lines = "<br>".join(escape(line) for line in r.dataset.lines())
        facts.append(("Dataset", f"<code>{escape(r.dataset.source)}</code>: {lines}"))
    if r.steps is not None:
        facts.append(("Steps", "<br>".join(escape(line) for line in r.steps.lines())))
    if r.torch is not None:
        facts.append(("PyTorch", "<br>".join(escape(line) for line in r.torch.lines())))
    fd = r.first_divergence
    if fd is not None:
        acc = fd.accumulated
        what = (
            f"{r.criterion.key} = {acc.shown(r.criterion.key)}, max_abs = {acc.shown('max_abs')}"
            if acc is not None and acc.diverged
            else first_divergence_phrase(fd)
        )
        if (src := shown_source(r.sources, fd.name)) is not None:
            what += f" (from {src})"
        label = "First divergence" if r.diverged else f"{INSIDE_FIRST} ({INSIDE})"
        facts.append((label, f"{_node(fd)}: {escape(what)}"))
    elif r.diverged:
        facts.append(("First divergence", escape(no_divergence_found(r))))
    if (origin := nonfinite_origin(r)) is not None:
        appears, where = nonfinite_phrase(origin)
        tensor = f"tensor <code>{escape(origin.tensor or '')}</code>"
        facts.append((appears, f"{_node(origin)}, {tensor}: {escape(where)}"))
    rc = r.root_cause
    if rc is not None:
        names = ", ".join(f"<code>{escape(n)}</code>" for n in rc.nodes)
        text = f"<b>{escape(rc.kind.value)}</b>: {f'{names}. ' if names else ''}{escape(rc.reason)}"
        text += "".join(f"<br>from {escape(line)}" for line in source_lines(r.sources, rc.nodes))
        if rc.message:
            text += f"<br>The target said:<pre>{escape(rc.message)}</pre>"
        if rc.model_message:
            text += f"On the full model it said:<pre>{escape(rc.model_message)}</pre>"
        # The reference the weaker side, or a quantized model's flips: a cause of its own.
        own = r.diverged or rc.kind in (CauseKind.REFERENCE, CauseKind.PRECISION)
        facts.append(("Root cause" if own else f"{INSIDE_CAUSE} ({INSIDE})", text))
    if chain := chain_line(r):
        facts.append(("Amplification chain", escape(chain)))
    if r.pass_bisection is not None:
        facts.append(("Optimizer pass", escape(r.pass_bisection.summary())))
    if r.repro is not None:
        facts.append(("Repro bundle", _repro(r)))
    if r.search is not None:
        facts.append(("Search", escape(f"{search_line(r)}. {r.search.reason}")))
    if r.notes:
        items = "".join(f"<li>{escape(n)}</li>" for n in r.notes)
        facts.append(("Notes", f"<ul>{items}</ul>"))
    return facts


def _node(n: NodeResult) -> str:
    return f"{escape(n.op_type)} <code>{escape(n.name)}</code> (#{n.index})"


def _repro(r: BisectResult) -> str:
    rp = r.repro
    assert rp is not None
    state = (
        "verified: re-run in a fresh process, it reproduces" if rp.reproduces else "not verified"
    )
    run = f"cd {shell(rp.path)} && python repro.py   # exit 1: reproduces, exit 0: does not"
    return (
        f"<code>{escape(rp.path)}</code> ({plural(len(rp.nodes), 'node')} of {rp.nodes_before}; "
        f"{escape(state)}). {escape(rp.message)}<pre>{escape(run)}</pre>"
    )


_CODE_SPAN = re.compile(r"(`+) ?(.*?) ?\1")


def _steps(r: BisectResult, folder: Path | None) -> list[str]:
    """report.md's next steps, as a list: its code spans as ``<code>``."""
    steps = step_list(r, folder)
    if not steps:
        return []

    def html(step: str) -> str:
        parts = _CODE_SPAN.split(step)  # text, fence, code, text, fence, code, ...
        out = [escape(parts[0])]
        for i in range(1, len(parts), 3):
            out += [f"<code>{escape(parts[i + 1])}</code>", escape(parts[i + 2])]
        return "".join(out)

    items = "".join(f"<li>{html(s)}</li>" for s in steps)
    return [f'<h2>Next steps</h2><ol class="steps">{items}</ol>']


def _curve(r: BisectResult) -> list[str]:
    out = ["<h2>Error curve</h2>"]
    if not any(n.rel_l2 is not None for n in r.nodes):
        return [*out, '<p class="note">No node has a measured error to draw.</p>']
    svg = curve_svg(r)
    if svg is None:
        return [
            *out,
            f'<p class="note">The plot needs matplotlib: <code>{escape(PLOTS_HINT)}</code></p>',
        ]
    return [
        *out,
        '<p class="sub">Each node\'s error in the full run (accumulated) and fed the '
        "reference's inputs (isolated); a node whose isolated error stays low only carries "
        "what it was given.</p>",
        f'<div class="figure">{svg}</div>',
    ]


def _graph(r: BisectResult) -> list[str]:
    hood = neighbourhood(r)
    if hood is None:
        return []
    verdicts = sorted({n.verdict.value for n in hood.nodes})
    legend = " ".join(f'<span class="badge v-{v}">{v}</span>' for v in verdicts)
    return [
        "<h2>Root cause neighbourhood and amplification chain</h2>",
        f'<p class="sub">Up to {MAX_NODES} nodes: the root cause (thick border), its producers '
        "and consumers up to three steps away, and the chain its error takes towards the "
        "outputs (red; dashed over nodes left out). Hover a box for its full name. "
        '<span class="legend">'
        f"{legend}</span></p>",
        f'<div class="scroll">{neighbourhood_svg(hood, r.criterion.key)}</div>',
    ]


_COLUMNS = (  # header, sort type, worst first on the first click
    ("#", "num", False),
    ("node", "str", False),
    ("op", "str", False),
    ("verdict", "str", False),
    ("accumulated", "num", True),
    ("isolated", "num", True),
    ("amplification", "num", True),
    ("threshold", "num", True),
    ("tensor", "str", False),
)


def _table(r: BisectResult) -> list[str]:
    if not r.nodes:
        return []
    key = r.criterion.key
    verdicts = sorted({n.verdict.value for n in r.nodes})
    ops = sorted({n.op_type for n in r.nodes})
    out = [
        f"<h2>Nodes ({len(r.nodes)})</h2>",
        '<div class="controls">',
        '<label>verdict <select id="f-verdict"><option value="">all</option>'
        + "".join(f'<option value="{escape(v)}">{escape(v)}</option>' for v in verdicts)
        + "</select></label>",
        '<label>op <select id="f-op"><option value="">all</option>'
        + "".join(f'<option value="{escape(o)}">{escape(o)}</option>' for o in ops)
        + "</select></label>",
        '<label>name <input id="f-name" type="search" placeholder="part of a node name"></label>',
        f'<span id="shown">{plural(len(r.nodes), "node")}</span>',
        "</div>",
        f'<p class="sub">Errors are {escape(key)}; click a column to sort.</p>',
        '<table id="nodes"><thead><tr>'
        + "".join(
            f'<th data-type="{t}"' + (' data-desc="1"' if desc else "") + f">{h}</th>"
            for h, t, desc in _COLUMNS
        )
        + "</tr></thead><tbody>",
    ]
    for n in r.nodes:
        threshold = n.accumulated.threshold if n.accumulated is not None else None
        out.append(
            f'<tr data-verdict="{escape(n.verdict.value)}" data-op="{escape(n.op_type)}" '
            f'data-name="{escape(n.name)}">'
            + _num(n.index, str(n.index))
            + f'<td class="name">{escape(n.name)}</td><td>{escape(n.op_type)}</td>'
            f'<td><span class="badge v-{n.verdict.value}">{n.verdict.value}</span></td>'
            + _error_cell(n.accumulated, key)
            + _error_cell(n.isolated, key)
            + _num(n.amplification, fmt_amp(n.amplification))
            + _num(threshold, fmt(threshold))
            + f'<td class="mono">{escape(n.tensor or "")}</td></tr>'
        )
    out.append("</tbody></table>")
    return out


def _error_cell(c: Comparison | None, key: str) -> str:
    """An error cell; NaN and Inf errors sort as the largest, whatever the finite values'."""
    value = None if c is None else math.inf if c.nonfinite else c.score
    return _num(value, fmt_error(c, key))


def _num(value: float | None, text: str) -> str:
    """A number cell; ``data-v`` is what the table sorts by (empty: unknown, sorted last)."""
    v = "" if value is None or math.isnan(value) else repr(float(value))
    return f'<td class="num" data-v="{v.replace("inf", "Infinity")}">{escape(text)}</td>'


def _footer(r: BisectResult) -> list[str]:
    rows: list[tuple[str, str]] = []
    if r.command:
        rows.append(("command", f"<code>{escape(r.command)}</code>"))
    rows.append(("reference", f"<code>{escape(r.ref.spec)}</code> — {escape(r.ref.description)}"))
    rows.append(
        ("target", f"<code>{escape(r.target.spec)}</code> — {escape(r.target.description)}")
    )
    rows += [("transform", escape(t.summary())) for t in r.transforms]
    inputs = ", ".join(f"{k} {list(v.shape)} {v.dtype}" for k, v in r.inputs.items())
    rows.append(("inputs", escape(inputs) + " (saved in inputs.npz)"))
    rows += [(escape(k), escape(v)) for k, v in r.versions.items()]
    runs = ", ".join(f"{k}: {v}" for k, v in r.runs.items())
    rows.append(("runs", escape(f"{runs}; {r.timings.get('total', 0.0):.2f}s")))
    return [
        "<h2>Environment</h2>",
        '<dl class="facts">',
        *(f"<dt>{k}</dt><dd>{v}</dd>" for k, v in rows),
        "</dl>",
    ]
