"""report.md: sized to paste as a GitHub issue body."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from onnx_bisect.graph.source import shown_source, source_lines
from onnx_bisect.report.escape import cell, code, one_line, shell
from onnx_bisect.report.format import (
    chain_line,
    curve_lines,
    fenced,
    first_divergence_phrase,
    fmt,
    fmt_amp,
    fmt_error,
    node_label,
    plural,
    search_line,
    stage_runs_line,
)
from onnx_bisect.report.mermaid import focus_node, mermaid_lines
from onnx_bisect.report.passes import pass_markdown, workaround_step
from onnx_bisect.report.quant import keep_fp32_markdown, quant_markdown
from onnx_bisect.report.steps import steps_markdown
from onnx_bisect.report.torchref import contrast_spec, torch_markdown
from onnx_bisect.result import (
    CauseKind,
    agreement,
    headline,
    no_divergence_found,
    nonfinite_origin,
    nonfinite_phrase,
    precision_phrase,
    reference_less_exact,
    target_arg,
    within_integer_steps,
    within_precision,
)

if TYPE_CHECKING:
    from onnx_bisect.result import BisectResult, NodeResult

__all__ = ["around", "next_steps", "render_markdown", "render_table", "step_list"]

# GitHub caps an issue body at 65,536 characters and a report has to be read whole; the full
# table is nodes.csv and report.json, so report.md shows the rows around the root cause.
BEFORE, AFTER = 3, 8  # rows shown before and after the root cause (and the first divergence)
TOP_K = 5  # without a node to centre on, the worst few
INPUTS_SHOWN = 10  # a dataset's worst inputs listed


def render_markdown(result: BisectResult, folder: Path | None = None) -> str:
    """report.md; ``folder``: where it and Model Explorer's files are, for the next steps."""
    lines: list[str] = [_title(result), ""]
    if result.quant is not None:
        lines += quant_markdown(result.quant) + [""]
    if result.keep_fp32 is not None:
        lines += keep_fp32_markdown(result.keep_fp32) + [""]
    lines += _summary(result)
    diagram = mermaid_lines(result)
    if diagram:
        lines += ["", "**Root cause, its neighbours and the amplification chain**", "", *diagram]
    lines += _inputs_section(result)
    lines += steps_markdown(result.steps) if result.steps is not None else []
    lines += torch_markdown(result.torch) if result.torch is not None else []
    lines += next_steps(result, folder)
    if result.pass_bisection is not None:
        lines += pass_markdown(result.pass_bisection)
    lines += _nodes_section(result)
    if result.command:
        lines += ["", "**Command**", "", *fenced(result.command, info="")]
    lines += ["", "**Environment**", ""]
    lines += [f"- reference: {code(result.ref.spec)} — {one_line(result.ref.description)}"]
    lines += [f"- target: {code(result.target.spec)} — {one_line(result.target.description)}"]
    if result.target_model:
        models = f"{code(result.target_model)} (reference model: {code(result.model)})"
        lines += [f"- target model: {models}"]
    lines += [f"- transform: {t.summary()}" for t in result.transforms]
    if result.matching is not None:
        lines += [f"- {result.matching.summary()}"]
    lines += [f"- {k}: {v}" for k, v in result.versions.items()]
    inputs = ", ".join(f"{code(k)} {list(v.shape)} {v.dtype}" for k, v in result.inputs.items())
    lines += [f"- inputs: {inputs} (saved in `inputs.npz`)"]
    lines += [f"- criterion: a tensor diverges where {result.criterion.describe()}"]
    if result.outputs:
        lines += ["", "**Final outputs**", "", "| output | status | rel_l2 | max_abs | note |"]
        lines += ["|---|---|---|---|---|"]
    for c in result.outputs:
        lines.append(
            f"| {cell(code(c.tensor))} | {c.state} | {c.shown('rel_l2')} | "
            f"{c.shown('max_abs')} | {cell(c.reason)} |"
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
                f"| {cell(code(t.output))} | top-{t.k} {cell(code(t.spec))} | {t.rows} | "
                f"{t.top1_agreement:.2%} | "
                f"{t.topk_overlap:.2%} | {t.rows_changed} | {fmt(t.strongest_flip)} |"
            )
        flips = [(t, r) for t in result.task_checks for r in t.changed]
        if flips:
            lines += [""] + [
                f"- {code(t.output)} row {list(r.row)}: label {r.ref_label} ({fmt(r.ref_score)}) "
                f"→ {r.target_label} ({fmt(r.target_score)})"
                for t, r in flips[:10]
            ]
    curve = curve_lines(result)
    if curve:
        lines += ["", "**Error curve** (`!` = segment holds a divergent tensor)", ""]
        lines += fenced("\n".join(curve))
    if result.repro is not None:
        r = result.repro
        state = "verified" if r.reproduces else "not verified"
        lines += ["", f"**Repro bundle** ({code(r.path)}, {state}): {one_line(r.message)}"]
    if result.not_probed:
        n = len(result.not_probed)
        were = "was" if n == 1 else "were"
        lines += ["", f"{plural(n, 'tensor')} inside subgraphs {were} not probed."]
    if result.notes:
        lines += ["", "**Notes**", ""] + [f"- {one_line(n)}" for n in result.notes]
    runs = ", ".join(f"{k}: {v}" for k, v in result.runs.items())
    total = result.timings.get("total", 0.0)
    by_stage = f"; {stage_runs_line(result)}" if stage_runs_line(result) else ""
    lines += ["", f"<sub>strategy {result.strategy}; runs {runs}{by_stage}; {total:.2f}s</sub>", ""]
    return "\n".join(lines)


def around(
    result: BisectResult, before: int = BEFORE, after: int = AFTER
) -> list[NodeResult | None]:
    """The rows around the root cause and the first divergence, in graph order; None marks
    rows left out between two windows."""
    focus = [n for n in (focus_node(result), result.first_divergence) if n is not None]
    if not focus:
        return []
    keep = {i for n in focus for i in range(n.index - before, n.index + after + 1)}
    rows: list[NodeResult | None] = []
    for n in sorted(result.nodes, key=lambda n: n.index):
        if n.index in keep:
            if rows and rows[-1] is not None and rows[-1].index + 1 < n.index:
                rows.append(None)
            rows.append(n)
    return rows


def _nodes_section(result: BisectResult) -> list[str]:
    if not result.nodes:
        return []
    rows = around(result)
    where = _full_table(result)
    if rows:
        title = f"**Nodes around the root cause**, in graph order ({where})"
        return ["", title, "", *render_table(result, rows)]
    top = result.top(TOP_K)
    title = f"**Largest accumulated errors** ({where})"
    return ["", title, "", *render_table(result, top)] if top else []


def _full_table(result: BisectResult) -> str:
    """Where every node's row is, counting only the nodes whose tensors were compared as
    probed: a crash's bisection lists every node and compares none."""
    total, probed = len(result.nodes), sum(n.probed for n in result.nodes)
    if probed == total:
        return f"the full table, {plural(total, 'probed node')}, is in `nodes.csv`"
    if not probed:
        listed = f"`nodes.csv` lists all {plural(total, 'node')}"
        return f"{listed}; none was probed: no node's tensors were compared"
    return f"the full table is in `nodes.csv`: {plural(total, 'node')}, {probed} of them probed"


def _title(result: BisectResult) -> str:
    if result.target_model:  # two models: name both (the backends may be the same)
        sides = f"{code(Path(result.target_model).name)} vs {code(Path(result.model).name)}"
        return f"# onnx-bisect: {sides} on {code(result.target.spec)}"
    return f"# onnx-bisect: {code(result.target.spec)} vs {code(result.ref.spec)}"


def _contrast(result: BisectResult) -> str:
    """Who ``contrast_spec`` names: the reference, or ONNX Runtime beside a PyTorch side."""
    return "the reference" if result.torch is None else "ONNX Runtime"


def next_steps(result: BisectResult, folder: Path | None = None) -> list[str]:
    """The "Next steps" section of report.md (see ``step_list``)."""
    steps = step_list(result, folder)
    if not steps:
        return []
    return ["", "**Next steps**", "", *(f"{i}. {s}" for i, s in enumerate(steps, 1))]


def step_list(result: BisectResult, folder: Path | None = None) -> list[str]:
    """What to do with the finding, in Markdown: reproduce it, report it, work around it,
    look at it. ``folder``: where the reports are, with Model Explorer's files (no "look at
    it" step without one: a made-up path would be a command that fails)."""
    if not result.diverged:
        return []
    steps: list[str] = []
    r = result.repro
    if r is not None:
        other = contrast_spec(result.ref.spec, result.target.spec, result.torch)
        also = ""
        if other is not None:
            also = f"; {code(target_arg(other))} runs {_contrast(result)} for contrast"
        steps.append(
            f"Reproduce it: {code(f'cd {shell(r.path)} && python repro.py')} (exit 1 while it "
            f"reproduces{also})."
        )
        steps.append(
            f"Report it: {code(Path(r.path) / 'issue.md')} is the issue body; attach the "
            "zipped `repro/` folder and this `report.md` as files."
        )
    pb = result.pass_bisection
    if pb is not None and pb.workaround:
        steps.append(workaround_step(pb))
    rc = result.root_cause
    if rc is not None and rc.kind is CauseKind.EXPORT:
        steps.append(
            "Fix the export, not the runtime: the exporter's translation of the module named "
            "above computes something else than torch (a `custom_translation_table` entry, or "
            "the exporter's own: report that to PyTorch's ONNX exporter)."
        )
    if rc is not None and rc.kind is CauseKind.PREPROCESSING:
        steps.append(
            "Fix the inputs, not the model: feed the ONNX model what the module's forward "
            "takes (the dtype, layout and scale named above), or export with the same "
            "preprocessing."
        )
    if rc is not None and rc.workaround:
        steps.append(f"Work around it: {code(target_arg(rc.workaround))} computes at fp32.")
    steps += [f"Work around it: {one_line(n)}." for n in result.notes if "compare at fp32" in n]
    if folder is not None:
        steps.append(
            f"Look at it: {code(f'onnx-bisect view {shell(folder)}')} shows the accumulated "
            "and isolated errors on the graph in Model Explorer."
        )
    return steps


def _summary(result: BisectResult) -> list[str]:
    said = precision_phrase(result)
    precision = [f"- **Precision:** {said}."] if said else []
    if not result.diverged:
        weaker = reference_less_exact(result)
        agree = (
            within_precision(result)
            or weaker
            or within_integer_steps(result)
            or f"every final output agrees: {agreement(result)}"
        )
        lines = [f"**No divergence**: {agree}.", *precision, *_dataset_lines(result)]
        rc = result.root_cause
        if weaker and rc is not None:  # which node of the reference's to look at
            names = ", ".join(code(n) for n in rc.nodes)
            lines.append(f"- **Root cause ({rc.kind}):** {names}. {one_line(rc.reason)}")
        return lines
    out = [f"**{headline(result)}.**", "", *precision, *_dataset_lines(result)]
    fd = result.first_divergence
    if fd is not None and fd.accumulated is not None:
        acc = fd.accumulated
        out.append(
            f"- **First divergence:** {node_label(fd)}, tensor {code(fd.tensor or '')}: "
            f"{result.criterion.key} = {acc.shown(result.criterion.key)}, "
            f"max_abs = {acc.shown('max_abs')}"
            + (f" ({acc.reason})" if acc.status.value != "diverged" else "")
        )
    elif fd is not None:
        out.append(f"- **First divergence:** {node_label(fd)}: {first_divergence_phrase(fd)}.")
    else:
        out.append(f"- **First divergence:** {no_divergence_found(result)}.")
    if fd is not None and (src := shown_source(result.sources, fd.name)) is not None:
        out.append(f"  - from {one_line(src)}")
    origin = nonfinite_origin(result)
    if origin is not None:
        said, where = nonfinite_phrase(origin)
        tensor = code(origin.tensor or "")
        out.append(f"- **{said}:** {node_label(origin)}, tensor {tensor}: {one_line(where)}.")
    rc = result.root_cause
    if rc is not None:
        names = ", ".join(code(n) for n in rc.nodes)
        reason = one_line(rc.reason)
        out.append(f"- **Root cause ({rc.kind}):** {f'{names}. ' if names else ''}{reason}")
        out += [f"  - from {one_line(line)}" for line in source_lines(result.sources, rc.nodes)]
        if rc.message:
            out += ["", "The target said:", "", *fenced(rc.message), ""]
        if rc.model_message:
            out += ["On the full model it said:", "", *fenced(rc.model_message), ""]
    if chain := chain_line(result, name=code):
        out.append(f"- **Amplification chain** (rel_l2): {chain}")
    out.append(f"- **Strategy:** {result.strategy}")
    if result.search is not None:
        said = one_line(f"{search_line(result)}. {result.search.reason}")
        out.append(f"- **Search:** {said}")
    return out


def _dataset_lines(result: BisectResult) -> list[str]:
    d, steps = result.dataset, result.steps
    out = [] if d is None else [f"- **Dataset** {code(d.source)}: {one_line(x)}" for x in d.lines()]
    return out + ([] if steps is None else [f"- **Steps:** {one_line(x)}" for x in steps.lines()])


def _inputs_section(result: BisectResult) -> list[str]:
    """The worst inputs of a dataset, ranked (all of them are in report.json)."""
    d = result.dataset
    if d is None:
        return []
    shown = d.screened[:INPUTS_SHOWN]
    where = f"{plural(len(d.screened), 'input')} in `report.json`"
    lines = ["", f"**Inputs, worst first** ({where})", ""]
    lines += ["| rank | input | outputs | worst output error | sampled |", "|---|---|---|---|---|"]
    sampled = set(d.sample)
    for rank, s in enumerate(shown, 1):
        state = f"failed: {cell(s.failed)}" if s.failed else ("diverged" if s.diverged else "ok")
        mark = "yes" if s.label in sampled else ""
        lines.append(f"| {rank} | {cell(code(s.label))} | {state} | {fmt(s.error)} | {mark} |")
    return lines


def render_table(result: BisectResult, nodes: Sequence[NodeResult | None]) -> list[str]:
    key = result.criterion.key
    rows = [
        f"| # | node | op | verdict | accumulated {key} | isolated {key} | amplification "
        "| tensor |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for n in nodes:
        if n is None:
            rows.append("| … | | | | | | | |")
            continue
        rows.append(
            f"| {n.index} | {cell(code(n.name))} | {cell(n.op_type)} | {n.verdict.value} | "
            f"{fmt_error(n.accumulated, key)} | {fmt_error(n.isolated, key)} | "
            f"{fmt_amp(n.amplification)} | "
            f"{cell(code(n.tensor)) if n.tensor else ''} |"
        )
    return rows
