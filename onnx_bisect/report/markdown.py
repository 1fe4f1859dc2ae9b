"""report.md: sized to paste as a GitHub issue body."""

from __future__ import annotations

from typing import TYPE_CHECKING

from onnx_bisect.report.format import (
    chain_line,
    curve_lines,
    fenced,
    first_divergence_phrase,
    fmt,
    fmt_amp,
    node_label,
    plural,
    search_line,
)
from onnx_bisect.report.passes import pass_markdown

if TYPE_CHECKING:
    from onnx_bisect.result import BisectResult, NodeResult

__all__ = ["render_markdown", "render_table"]

# GitHub rejects issue bodies over 65,536 characters; leave room for the user's own words.
MAX_FULL_TABLE_ROWS = 400
TOP_K = 10


def render_markdown(result: BisectResult) -> str:
    lines: list[str] = [f"# onnx-bisect: `{result.target.spec}` vs `{result.ref.spec}`", ""]
    lines += _summary(result)
    if result.pass_bisection is not None:
        lines += pass_markdown(result.pass_bisection)
    if result.command:
        lines += ["", "**Command**", "", "```", result.command, "```"]
    lines += ["", "**Environment**", ""]
    lines += [f"- reference: `{result.ref.spec}` — {result.ref.description}"]
    lines += [f"- target: `{result.target.spec}` — {result.target.description}"]
    if result.target_model:
        lines += [f"- target model: `{result.target_model}` (reference model: `{result.model}`)"]
    lines += [f"- transform: {t.summary()}" for t in result.transforms]
    if result.matching is not None:
        lines += [f"- {result.matching.summary()}"]
    lines += [f"- {k}: {v}" for k, v in result.versions.items()]
    inputs = ", ".join(f"`{k}` {list(v.shape)} {v.dtype}" for k, v in result.inputs.items())
    lines += [f"- inputs: {inputs} (saved in `inputs.npz`)"]
    lines += [f"- criterion: {result.criterion.describe()}"]
    if result.outputs:
        lines += ["", "**Final outputs**", "", "| output | status | rel_l2 | max_abs | note |"]
        lines += ["|---|---|---|---|---|"]
    for c in result.outputs:
        lines.append(
            f"| `{c.tensor}` | {c.status.value} | {fmt(c.metrics.get('rel_l2'))} | "
            f"{fmt(c.metrics.get('max_abs'))} | {_cell(c.reason)} |"
        )
    if result.task_checks:
        lines += ["", "**Task-level check** (top-k labels; informative, not part of the verdict)"]
        lines += [
            "",
            "| output | check | rows | top-1 agree | top-k overlap | rows changed "
            "| strongest flip |",
            "|---|---|---|---|---|---|---|",
        ]
        for t in result.task_checks:
            lines.append(
                f"| `{t.output}` | top-{t.k} `{t.spec}` | {t.rows} | {t.top1_agreement:.2%} | "
                f"{t.topk_overlap:.2%} | {t.rows_changed} | {fmt(t.strongest_flip)} |"
            )
        flips = [(t, r) for t in result.task_checks for r in t.changed]
        if flips:
            lines += [""] + [
                f"- `{t.output}` row {list(r.row)}: label {r.ref_label} ({fmt(r.ref_score)}) "
                f"→ {r.target_label} ({fmt(r.target_score)})"
                for t, r in flips[:10]
            ]
    curve = curve_lines(result)
    if curve:
        lines += ["", "**Error curve** (`!` = segment holds a divergent tensor)", "", "```text"]
        lines += [*curve, "```"]
    top = result.top(TOP_K)
    if top:
        lines += ["", f"**Top {plural(len(top), 'node')} by accumulated error**", ""]
        lines += render_table(result, top)
        shown = list(result.nodes[:MAX_FULL_TABLE_ROWS])
        lines += ["", "<details><summary>All probed nodes</summary>", ""]
        lines += render_table(result, shown)
        if len(result.nodes) > len(shown):
            more = plural(len(result.nodes) - len(shown), "more row")
            lines += ["", f"*Truncated: {more} in `nodes.csv`.*"]
        lines += ["", "</details>"]
    if result.repro is not None:
        r = result.repro
        state = "verified" if r.reproduces else "not verified"
        lines += ["", f"**Repro bundle** (`{r.path}`, {state}): {r.message}"]
    if result.not_probed:
        n = len(result.not_probed)
        were = "was" if n == 1 else "were"
        lines += ["", f"{plural(n, 'tensor')} inside subgraphs {were} not probed."]
    if result.notes:
        lines += ["", "**Notes**", ""] + [f"- {n}" for n in result.notes]
    runs = ", ".join(f"{k}: {v}" for k, v in result.runs.items())
    total = result.timings.get("total", 0.0)
    lines += ["", f"<sub>strategy {result.strategy}; runs {runs}; {total:.2f}s</sub>", ""]
    return "\n".join(lines)


def _summary(result: BisectResult) -> list[str]:
    if not result.diverged:
        return [f"**No divergence**: every final output passes {result.criterion.describe()}."]
    out = ["**Diverged.**", ""]
    fd = result.first_divergence
    if fd is not None and fd.accumulated is not None:
        acc = fd.accumulated
        out.append(
            f"- **First divergence:** {node_label(fd)}, tensor `{fd.tensor}`: "
            f"{result.criterion.key} = {fmt(acc.score)}, "
            f"max_abs = {fmt(acc.metrics.get('max_abs'))}"
            + (f" ({acc.reason})" if acc.status.value != "diverged" else "")
        )
    elif fd is not None:
        out.append(f"- **First divergence:** {node_label(fd)}: {first_divergence_phrase(fd)}.")
    else:
        out.append("- **First divergence:** none among the probed tensors.")
    rc = result.root_cause
    if rc is not None:
        names = ", ".join(f"`{n}`" for n in rc.nodes) or "—"
        out.append(f"- **Root cause ({rc.kind}):** {names}. {rc.reason}")
        if rc.message:
            out += ["", "The target said:", "", *fenced(rc.message), ""]
    if chain_line(result):
        out.append(f"- **Amplification chain** (rel_l2): {chain_line(result)}")
    out.append(f"- **Strategy:** {result.strategy}")
    if result.search is not None:
        out.append(f"- **Search:** {search_line(result)}. {result.search.reason}")
    return out


def render_table(result: BisectResult, nodes: list[NodeResult]) -> list[str]:
    key = result.criterion.key
    rows = [
        f"| # | node | op | verdict | accumulated {key} | isolated {key} | amplification "
        "| tensor |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for n in nodes:
        rows.append(
            f"| {n.index} | `{n.name}` | {n.op_type} | {n.verdict.value} | "
            f"{fmt(n.accumulated_error)} | {fmt(n.isolated_error)} | {fmt_amp(n.amplification)} | "
            f"`{n.tensor or ''}` |"
        )
    return rows


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")
