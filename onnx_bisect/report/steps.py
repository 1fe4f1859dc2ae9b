"""A multi-step run in the reports: report.json's ``steps``, the per-step table of report.md
and report.html, and the error per step drawn by matplotlib (inline SVG in report.html).
"""

from __future__ import annotations

import io
import math
from html import escape
from typing import Any

from onnx_bisect.report.escape import cell
from onnx_bisect.report.plots import plots_available
from onnx_bisect.steps_result import StepRecord, StepsSummary, step_error
from onnx_bisect.text import fmt

__all__ = ["steps_dict", "steps_html", "steps_markdown"]


def _token(t: int | None) -> str:
    return "-" if t is None else str(t)


def _tokens(s: StepRecord) -> str:
    if s.ref_token is None:
        return "-"
    mark = " (tie)" if s.tie else " (flip)" if s.flipped else ""
    return f"{_token(s.ref_token)} / {_token(s.target_token)}{mark}"


def _num(x: float | None) -> float | str | None:
    if x is None:
        return None
    return x if math.isfinite(x) else ("nan" if math.isnan(x) else "inf" if x > 0 else "-inf")


def _record(s: StepRecord) -> dict[str, Any]:
    w = s.worst
    return {
        "step": s.step,
        "status": s.status(),
        "worst_output": w.tensor if w is not None else None,
        "error": _num(w.score) if w is not None else None,
        "threshold": _num(w.threshold) if w is not None else None,
        "precision_floor": _num(w.precision_floor) if w is not None else None,
        "failed": s.failed or None,
        "ref_token": s.ref_token,
        "target_token": s.target_token,
        "tie": s.tie,
    }


def steps_dict(d: StepsSummary) -> dict[str, Any]:
    """report.json's ``steps``."""
    return {
        "count": d.count,
        "mode": "teacher-forced",
        "first_divergent_step": d.first_divergent_step,
        "wiring": list(d.wiring),
        "per_step": [_record(s) for s in d.per_step],
        "free_run": None
        if d.free_run is None
        else {"parted_at": d.parted_at, "per_step": [_record(s) for s in d.free_run]},
    }


def _has_tokens(d: StepsSummary) -> bool:
    return any(s.ref_token is not None for s in d.per_step)


def _rows(d: StepsSummary) -> list[tuple[str, ...]]:
    free = {s.step: s for s in d.free_run or ()}
    tokens = _has_tokens(d)
    rows: list[tuple[str, ...]] = []
    for s in d.per_step:
        row: tuple[str, ...] = (
            str(s.step),
            s.status(),
            s.worst.tensor if s.worst is not None else "-",
            step_error(s),
            fmt(s.worst.threshold) if s.worst is not None else "-",
        )
        row += (_tokens(s),) if tokens else ()
        if d.free_run is not None:
            f = free.get(s.step)
            row += (_tokens(f) if f and tokens else "-", f.status() if f else "-")
        rows.append(row)
    return rows


def _header(d: StepsSummary) -> tuple[str, ...]:
    head: tuple[str, ...] = ("step", "status", "worst output", "error", "threshold")
    head += ("tokens ref / target",) if _has_tokens(d) else ()
    return head + (("free-run tokens", "free-run status") if d.free_run is not None else ())


def steps_markdown(d: StepsSummary) -> list[str]:
    """The per-step table (teacher-forced, with the free run beside it when asked for)."""
    head = _header(d)
    lines = ["", "**Steps** (teacher-forced: both sides fed the reference's state and token)", ""]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(cell(c) for c in row) + " |" for row in _rows(d)]
    if d.wiring:
        lines += ["", "Wiring: " + "; ".join(cell(w) for w in d.wiring)]
    return lines


def steps_html(d: StepsSummary) -> list[str]:
    """The per-step table and, with matplotlib, the error per step."""
    out = ['<h2 id="steps">Steps</h2>']
    if (svg := _steps_svg(d)) is not None:
        out.append(f'<div class="curve">{svg}</div>')
    head = "".join(f"<th>{escape(h)}</th>" for h in _header(d))
    out.append(f'<table class="steps"><thead><tr>{head}</tr></thead><tbody>')
    for row in _rows(d):
        cells = "".join(f"<td>{escape(c)}</td>" for c in row)
        out.append(f"<tr>{cells}</tr>")
    out.append("</tbody></table>")
    if d.wiring:
        out.append(f'<p class="sub">Wiring: {escape("; ".join(d.wiring))}</p>')
    return out


def _steps_svg(d: StepsSummary) -> str | None:
    points = [(s.step, s.worst.score) for s in d.per_step if s.worst is not None]
    if len(points) < 2 or not plots_available():
        return None
    from matplotlib import rc_context
    from matplotlib.figure import Figure

    with rc_context({"svg.fonttype": "none", "svg.hashsalt": "onnx-bisect", "font.size": 9.0}):
        fig = Figure(figsize=(8, 2.8), layout="constrained")
        ax = fig.add_subplot()
        ax.set_yscale("log")
        ys = [y if y > 0 else math.nan for _, y in points]
        ax.plot([x for x, _ in points], ys, marker="o", ms=3, lw=1.1, label="worst output")
        bounds = [(s.step, s.worst.threshold) for s in d.per_step if s.worst and s.worst.threshold]
        if bounds:
            ax.step(*zip(*bounds, strict=True), where="mid", color="#444", lw=0.9, ls="--",
                    label="threshold")  # fmt: skip
        if d.first_divergent_step is not None:
            ax.axvline(d.first_divergent_step, color="#d62728", ls="--", lw=1.2,
                       label="first divergent step")  # fmt: skip
        ax.set_xlabel("step")
        ax.set_ylabel("error (log scale)")
        ax.grid(True, color="#e4e4e4", lw=0.5)
        fig.legend(loc="outside lower center", ncols=3, fontsize=7.5, frameon=False)
        buf = io.BytesIO()
        meta = {"Date": None, "Creator": None, "Format": None, "Type": None}
        fig.savefig(buf, format="svg", metadata=meta)
    text = buf.getvalue().decode("utf-8")
    return text[text.index("<svg") :] if "<svg" in text else None
