"""Number and label formatting shared by the text reports.

``fmt``, ``fmt_amp`` and ``plural`` come from ``onnx_bisect.text`` (the result's own summary
uses them too) and are re-exported here for the report modules.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable

from onnx_bisect.compare.criterion import Comparison
from onnx_bisect.report.curve import error_curve
from onnx_bisect.report.escape import code, one_line
from onnx_bisect.result import REPRO_CHECK, BisectResult, NodeResult, first_divergence_phrase
from onnx_bisect.text import fmt, fmt_amp, plural

__all__ = [
    "chain_line",
    "curve_lines",
    "fenced",
    "first_divergence_phrase",
    "fmt",
    "fmt_amp",
    "fmt_error",
    "node_label",
    "plural",
    "search_line",
    "stage_runs_line",
]


def fmt_error(c: Comparison | None, metric: str) -> str:
    """A comparison's ``metric`` as shown: NaN or inf where NaN/Inf sit in different places
    (``Comparison.shown``), "—" where nothing was compared."""
    return "—" if c is None else c.shown(metric)


def node_label(n: NodeResult) -> str:
    return f"{one_line(n.op_type)} {code(n.name)} (#{n.index})"


def search_line(result: BisectResult) -> str:
    s = result.search
    if s is None:
        return ""
    shape = "monotone" if s.monotone else "not monotone, refined linearly"
    windows = plural(s.pattern_windows_tried, "pattern window")
    extra = f", {windows}" if s.pattern_windows_tried else ""
    return (
        f"cut search: {plural(s.runs, 'target run')} over {plural(len(result.nodes), 'node')} "
        f"({shape}), transition after {s.transition_node}{extra}"
    )


def chain_line(result: BisectResult, most: int = 6, name: Callable[[str], str] = one_line) -> str:
    """``Conv a 0.05 → … → Concat z 0.002 (×0.04 overall; largest gains: Add b ×12)``, each
    node's name shown by ``name`` (a code span in Markdown)."""
    chain = [
        dataclasses.replace(c, op_type=one_line(c.op_type), node=name(c.node)) for c in result.chain
    ]
    if len(chain) < 2:
        return ""
    first, last = chain[0], chain[-1]
    # A NaN or Inf error has no ratio to speak of, and nor has an error of 0.
    finite = not (first.nonfinite or last.nonfinite) and first.rel_l2
    growth = [f"×{fmt(last.rel_l2 / first.rel_l2)} overall"] if finite else []
    gains = sorted((c for c in chain[1:] if c.gain is not None), key=lambda c: -(c.gain or 0))
    big = ", ".join(f"{c.op_type} {c.node} ×{fmt(c.gain)}" for c in gains[:3] if (c.gain or 0) > 1)
    said = "; ".join(growth + ([f"largest gains: {big}"] if big else []))
    tail = f" ({said})" if said else ""
    stop = f"; it stops there: {last.stop}" if last.stop else ""
    if len(chain) <= most and not any(c.folded for c in chain):
        return " → ".join(f"{c.op_type} {c.node} {c.shown}" for c in chain) + tail + stop
    folded = sum(c.folded for c in chain)
    between = plural(len(chain) + folded - 2, "node")
    if folded:
        between += f", {folded} of them folded in report.json"
    path = f"{first.op_type} {first.node} {first.shown} → … ({between}) → "
    return f"{path}{last.op_type} {last.node} {last.shown}{tail}{stop}"


def curve_lines(result: BisectResult, width: int = 40) -> list[str]:
    """The error curve as text bars on a log scale, one line per segment of the graph:
    ``#0-7   ! ########      3.1e-04  Conv /stem/conv``; ``!`` marks a divergent segment."""
    points = error_curve(result.nodes)
    if len(points) < 2:
        return []
    positive = [p.error for p in points if 0 < p.error < math.inf]
    if not positive:
        return []
    # The scale spans the errors seen, a decade below the smallest: shape, not absolute size.
    top = max(positive)
    floor = max(min(positive) / 10, top * 1e-9)
    span = math.log10(top) - math.log10(floor)
    label_width = max(len(f"#{p.first}-{p.last}") for p in points)
    lines = [f"accumulated rel_l2, worst node per segment (log scale, {fmt(floor)} .. {fmt(top)})"]
    for p in points:
        level = (math.log10(min(max(p.error, floor), top)) - math.log10(floor)) / span
        bar = "#" * round(level * width)
        where = f"#{p.first}-{p.last}".ljust(label_width)
        mark = "!" if p.diverged else " "
        node = one_line(p.node)
        name = node if len(node) <= 36 else "…" + node[-35:]
        error = p.nonfinite or fmt(p.error)
        lines.append(f"{where} {mark} {bar.ljust(width)} {error:>9}  {one_line(p.op_type)} {name}")
    return lines


def fenced(text: str, info: str = "text") -> list[str]:
    """``text`` verbatim in a Markdown code block, with a fence longer than any run of
    backticks inside it (runtime messages quote code, node names may hold backticks)."""
    longest = max((len(run) for run in re.findall(r"`+", text)), default=0)
    fence = "`" * max(3, longest + 1)
    return [fence + info, *text.splitlines(), fence]


def stage_runs_line(result: BisectResult) -> str:
    """ "target compiles by stage: screen 1, bisect 9, repro 1 (11 in all)": where the target's
    runs went, so that a user of a slow compiler sees which stage cost the time ("target runs"
    where the target does not declare that its runs compile). Empty when it never ran."""
    stages = {k: v for k, v in result.stage_runs.items() if v}
    if not stages:
        return ""
    what = "compiles" if result.target.compiles else "runs"
    # The bundle's own repro.py ran the runtime outside this process: said apart, so that
    # "in all" is the sum of the runs line's target roles (target, passes, workaround).
    checked = stages.pop(REPRO_CHECK, 0)
    listed = ", ".join(f"{k} {v}" for k, v in stages.items())
    line = f"target {what} by stage: {listed} ({sum(stages.values())} in all)"
    return line + (f"; and {checked} by the repro bundle's own repro.py" if checked else "")
