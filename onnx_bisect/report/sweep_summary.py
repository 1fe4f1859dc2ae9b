"""summary.md (to paste in an issue or a CI comment) and summary.html (to open): the models x
targets matrix coloured by outcome, the root causes tallied by op type across models
("tract: 3 models stop at Pad"), the baseline's changes, and a link to each case's report
and repro bundle. The page is self-contained like report.html (no request leaves it)."""

from __future__ import annotations

from collections import defaultdict
from html import escape

from onnx_bisect.report.escape import cell, code
from onnx_bisect.report.html import CSP
from onnx_bisect.sweep_result import CaseOutcome, CaseResult, Change, SweepResult
from onnx_bisect.text import plural

__all__ = [
    "OUTCOME_COLOURS",
    "render_summary_html",
    "render_summary_md",
    "root_tally",
    "tally_line",
]

# Green passes, amber precision, red wrong numbers, purple a runtime that cannot, grey dead.
OUTCOME_COLOURS = {
    CaseOutcome.AGREE: "#c8e6c9",
    CaseOutcome.PRECISION: "#fff3c4",
    CaseOutcome.DIVERGED: "#ffcdd2",
    CaseOutcome.UNSUPPORTED: "#e1d5f0",
    CaseOutcome.CRASH: "#b0b0b0",
    CaseOutcome.HANG: "#cfcfcf",
    CaseOutcome.ERROR: "#e0e0e0",
}


def root_tally(result: SweepResult) -> list[tuple[str, str, str, list[str]]]:
    """(target, op type, outcome, models) for every failing case's root op, most models first:
    one runtime bug blocking many models stands out from many bugs blocking one each."""
    groups: dict[tuple[str, str, str], list[str]] = defaultdict(list)
    for case in result.cases:
        if case.passed:
            continue
        for op in dict.fromkeys(case.root_ops or ("",)):
            groups[(case.target, op or "(no node)", case.outcome.value)].append(case.model)
    ranked = sorted(groups.items(), key=lambda kv: (-len(kv[1]), kv[0]))
    return [(target, op, outcome, models) for (target, op, outcome), models in ranked]


def tally_line(target: str, op: str, outcome: str, models: list[str]) -> str:
    """``tract: 3 models stop at Pad (diverged: a, b, c)``."""
    return f"{target}: {plural(len(models), 'model')} stop at {op} ({outcome}: {', '.join(models)})"


def _cell_text(case: CaseResult | None) -> str:
    if case is None:
        return "-"
    where = f" at {', '.join(case.root_nodes)}" if case.root_nodes else ""
    return f"{case.outcome}{where}"


def _changes(result: SweepResult) -> list[tuple[str, list[tuple[str, str]]]]:
    diff = result.baseline
    if diff is None:
        return []
    return [
        ("New regressions", diff.keys(Change.REGRESSION)),
        ("Fixed", diff.keys(Change.FIXED)),
        ("Unchanged failures", diff.keys(Change.UNCHANGED)),
    ]


def render_summary_md(result: SweepResult) -> str:
    counts = ", ".join(f"{n} {o}" for o, n in result.counts().items())
    lines = [
        f"# onnx-bisect sweep: {plural(len(result.models), 'model')} x "
        f"{plural(len(result.targets), 'target')} against {code(result.ref)}",
        "",
        f"{plural(len(result.cases), 'case')} in {result.seconds:.1f} s: {counts}.",
        "",
        "| model | " + " | ".join(cell(t) for t in result.targets) + " |",
        "| --- |" + " --- |" * len(result.targets),
    ]
    for model in result.models:
        cells = []
        for target in result.targets:
            case = result.case(model, target)
            text = cell(_cell_text(case))
            cells.append(f"[{text}]({case.report})" if case and case.report else text)
        lines.append(f"| {cell(model)} | " + " | ".join(cells) + " |")
    tally = root_tally(result)
    if tally:
        lines += ["", "## Root causes by op type", ""]
        for target, op, outcome, models in tally:
            lines.append(f"- {cell(tally_line(target, op, outcome, models))}")
    for title, keys in _changes(result):
        lines += ["", f"## {title} ({len(keys)})", ""]
        lines += [f"- {cell(m)} x {cell(t)}: {_was(result, m, t)}" for m, t in keys] or ["none"]
    failing = [c for c in result.cases if not c.passed]
    if failing:
        lines += ["", "## Failing cases", ""]
        for case in failing:
            lines.append(f"- **{cell(case.model)} x {cell(case.target)}**: {cell(case.reason)}")
            lines.append(f"  - repro: {code(case.command)}")
            if case.bundle:
                lines.append(f"  - bundle: [{case.bundle}]({case.bundle})")
    return "\n".join(lines) + "\n"


def _was(result: SweepResult, model: str, target: str) -> str:
    assert result.baseline is not None
    before = result.baseline.before.get((model, target))
    case = result.case(model, target)
    now = _cell_text(case)
    return f"{before} -> {now}" if before is not None else f"new case, {now}"


_STYLE = """
body{font-family:system-ui,sans-serif;margin:2em;color:#222}
table{border-collapse:collapse;margin:1em 0}
td,th{border:1px solid #bbb;padding:.35em .6em;text-align:left;vertical-align:top}
td a{color:inherit}
.legend span{display:inline-block;padding:.15em .5em;margin-right:.4em;border:1px solid #bbb}
code{font-size:90%}
.sub{color:#555}
"""


def render_summary_html(result: SweepResult) -> str:
    title = f"onnx-bisect sweep against {result.ref}"
    counts = ", ".join(f"{n} {o}" for o, n in result.counts().items())
    body = [
        f"<h1>{escape(title)}</h1>",
        f'<p class="sub">{escape(plural(len(result.cases), "case"))} '
        f"in {result.seconds:.1f} s: {escape(counts)}</p>",
        '<p class="legend">'
        + "".join(
            f'<span style="background:{colour}">{o}</span>' for o, colour in OUTCOME_COLOURS.items()
        )
        + "</p>",
        *_matrix_html(result),
        *_tally_html(result),
        *_changes_html(result),
    ]
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f'<meta http-equiv="Content-Security-Policy" content="{CSP}">'
        f"<title>{escape(title)}</title><style>{_STYLE}</style></head><body>\n"
        + "\n".join(body)
        + "\n</body></html>\n"
    )


def _matrix_html(result: SweepResult) -> list[str]:
    head = "".join(f"<th>{escape(t)}</th>" for t in result.targets)
    rows = [f"<table><tr><th>model</th>{head}</tr>"]
    for model in result.models:
        cells = []
        for target in result.targets:
            case = result.case(model, target)
            if case is None:
                cells.append("<td>-</td>")
                continue
            colour = OUTCOME_COLOURS[case.outcome]
            text = escape(_cell_text(case))
            page = f"{case.folder}/report.html"
            link = f'<a href="{escape(page)}">{text}</a>' if case.report else text
            bundle = f' <a href="{escape(case.bundle)}/">bundle</a>' if case.bundle else ""
            tip = escape(case.reason, quote=True)
            cells.append(
                f'<td style="background:{colour}" title="{tip}">{link}{bundle}'
                f'<br><span class="sub">{case.stage}, {case.seconds:.1f} s</span></td>'
            )
        rows.append(f"<tr><th>{escape(model)}</th>{''.join(cells)}</tr>")
    return [*rows, "</table>"]


def _tally_html(result: SweepResult) -> list[str]:
    tally = root_tally(result)
    if not tally:
        return []
    items = [
        f"<li>{escape(tally_line(target, op, outcome, models))}</li>"
        for target, op, outcome, models in tally
    ]
    return ["<h2>Root causes by op type</h2>", "<ul>", *items, "</ul>"]


def _changes_html(result: SweepResult) -> list[str]:
    out: list[str] = []
    for title, keys in _changes(result):
        out.append(f"<h2>{escape(title)} ({len(keys)})</h2>")
        items = [
            f"<li>{escape(m)} x {escape(t)}: {escape(_was(result, m, t))}</li>" for m, t in keys
        ]
        out += ["<ul>", *items, "</ul>"] if items else ["<p>none</p>"]
    return out
