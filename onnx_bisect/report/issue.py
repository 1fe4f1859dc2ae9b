"""The repro bundle's README.md and issue.md: what a runtime's maintainers read first."""

from __future__ import annotations

from typing import TYPE_CHECKING

from onnx_bisect.pass_result import target_arg
from onnx_bisect.report.escape import cell, code, one_line
from onnx_bisect.report.format import fenced, plural
from onnx_bisect.report.markdown import around, render_table
from onnx_bisect.report.mermaid import mermaid_lines
from onnx_bisect.report.runtime import env_assignments, runtime_name
from onnx_bisect.report.torchref import contrast_spec
from onnx_bisect.result import CauseKind, nonfinite_origin, nonfinite_phrase

if TYPE_CHECKING:
    from onnx_bisect.result import BisectResult

__all__ = ["MAX_ISSUE_CHARS", "render_bundle_readme", "render_issue"]

# GitHub caps an issue body at 65,536 characters; an issue that long is not read, though.
MAX_ISSUE_CHARS = 25_000
_FAILS = {
    CauseKind.CRASH: "crashes on",
    CauseKind.UNSUPPORTED: "cannot run",
    CauseKind.ERROR: "fails on",
}


def _headline(result: BisectResult) -> str:
    """The runtimes by name and version (their specs, whole command lines for ``exec:``, are
    in the body), then what went wrong where."""
    rc = result.root_cause
    target = code(runtime_name(result.target.spec, result.versions))
    ref = code(runtime_name(result.ref.spec, result.versions))
    if rc is not None and rc.kind in _FAILS and rc.nodes and rc.fails_at:
        # The node named lost a rank or type; the runtime refuses a later one.
        lost = f"loses the type of {code(rc.nodes[0])}'s output"
        return f"{target} {lost} and {_FAILS[rc.kind]} {code(rc.fails_at)}"
    if rc is not None and rc.kind in _FAILS and rc.nodes:
        return f"{target} {_FAILS[rc.kind]} {code(rc.nodes[0])}"
    if rc is not None and rc.nodes:
        first, last = code(rc.nodes[0]), code(rc.nodes[-1])
        what = first if len(rc.nodes) == 1 else f"{first} … {last}"
        return f"{target} diverges from {ref} at {what} ({rc.kind})"
    fd = result.first_divergence
    where = f" from {code(fd.name)}" if fd is not None else ""
    return f"{target} diverges from {ref}{where}"


def _bundle_lines(result: BisectResult) -> list[str]:
    r = result.repro
    if r is None:
        return ["No repro bundle was written."]
    state = (
        "verified: re-run in a fresh process, it reproduces"
        if r.reproduces
        else ("NOT verified: " + r.message)
    )
    pair = []
    if result.target_model:
        # The subgraph comes from the model the target ran; its expected values from the other.
        pair = [
            f"- cut from the target model {code(result.target_model)}; the expected outputs are "
            f"the reference model's ({code(result.model)}) values of the tensors they stand "
            "for, so the reference runtime disagreeing with them on this subgraph means the "
            "*graph* changed the numbers, not a kernel"
        ]
    shrunk = f"shrunk from {plural(r.nodes_before, 'node')} to {len(r.nodes)}"
    # The message repeats the nodes (and a failed verification's words, already in ``state``);
    # only a bundle that needs the graph before it says more there.
    prefix = [f"- {one_line(r.message)}"] if r.reproduces and not r.isolated else []
    return [
        *pair,
        f"- {shrunk} in {plural(r.runs, 'target run')}: "
        + ", ".join(code(n) for n in r.nodes[:8])
        + (" …" if len(r.nodes) > 8 else ""),
        f"- fed {'the reference’s tensors at the cut' if r.isolated else 'the model’s own inputs'}",
        f"- {one_line(state)}",
        *prefix,
    ]


def _commented(*lines: tuple[str, str]) -> list[str]:
    """Shell commands with their comments in one column, whatever the spec's length."""
    width = max(len(command) for command, _ in lines) + 3
    return [f"{command:<{width}}# {comment}" for command, comment in lines]


def render_bundle_readme(result: BisectResult) -> str:
    r = result.repro
    lines = [f"# Repro: {_headline(result)}", ""]
    lines += _bundle_lines(result)
    other = contrast_spec(result.ref.spec, result.target.spec, result.torch)
    runs = [("python repro.py", "exit 1: reproduces, exit 0: does not")]
    if other is not None:
        said = "the reference" if result.torch is None else "ONNX Runtime"
        runs.append((f"python repro.py {target_arg(other)}", f"{said}, for contrast"))
    lines += [
        "",
        "## Run it",
        "",
        "```bash",
        *_commented(*runs),
        "```",
        "",
        "Files: `model.onnx` (the subgraph, original node names; its weights in `model.onnx.data`",
        "when the model kept them in external data), `test_data_set_0/input_N.pb` (the",
        "reference's tensors at the cut) and `output_N.pb` (the reference's outputs), in the",
        "ONNX backend test-case layout, and `repro.py`, which needs only numpy, onnx and the",
        "backends it names.",
        "",
        "## Found with",
        "",
        *fenced(result.command or "onnx_bisect.bisect(...)", info="bash"),
        "",
        "## Versions",
        "",
    ]
    lines += [f"- {k}: {v}" for k, v in result.versions.items()]
    if r is not None and not r.reproduces:
        lines += ["", f"**Caution:** {one_line(r.message)}"]
    return "\n".join(lines) + "\n"


def render_issue(result: BisectResult) -> str:
    """A GitHub-issue body: title, environment, repro steps, expected vs actual, the root
    cause's neighbourhood as a diagram and a table. The full report is attached, not pasted:
    a second copy made the body as long as the report."""
    head = [f"# {_headline(result)}", "", "## Environment", ""]
    head += [f"- reference: {code(result.ref.spec)} ({one_line(result.ref.description)})"]
    head += [f"- target: {code(result.target.spec)} ({one_line(result.target.description)})"]
    for role, side in (("reference", result.ref), ("target", result.target)):
        # `exec:env NAME=VALUE …`: the settings that made it happen, said where they are seen.
        settings = env_assignments(side.spec)
        if settings:
            shown = ", ".join(code(f"{k}={v}") for k, v in settings.items())
            head += [f"- {role} environment (set by its spec): {shown}"]
    head += [f"- {k}: {v}" for k, v in result.versions.items()]
    head += ["", "## Minimal repro", ""]
    head += _bundle_lines(result)
    head += ["", "```bash", "cd repro && python repro.py   # exits 1 when it reproduces", "```"]
    if result.outputs:
        head += ["", "## Expected vs actual", ""]
        head += ["| output | status | rel_l2 | max_abs |", "|---|---|---|---|"]
    for c in result.outputs:
        rel, mx = c.shown("rel_l2"), c.shown("max_abs")
        head.append(f"| {cell(code(c.tensor))} | {c.state} | {rel} | {mx} |")
    if result.outputs:
        # What `ok` means, said as agreement: the bare criterion reads as the failing test.
        head += ["", f"An output is `ok` where {result.criterion.agreement()}."]
    rc, fd = result.root_cause, result.first_divergence
    if fd is not None:
        acc = fd.accumulated
        detail = acc.reason if acc is not None else fd.verdict.value
        at = f"{one_line(fd.op_type)} {code(fd.name)} (#{fd.index})"
        head += ["", f"First divergence: {at}: {one_line(detail)}."]
    if (origin := nonfinite_origin(result)) is not None:
        said, where = nonfinite_phrase(origin)
        at = f"{one_line(origin.op_type)} {code(origin.name)} (#{origin.index}), tensor "
        at += code(origin.tensor or "")
        head += [f"{said}: {at}: {where}."]
    if rc is not None:
        head += [f"Root cause ({rc.kind}): {one_line(rc.reason)}."]
        if rc.message:
            head += ["", "## What the target said", "", *fenced(rc.message)]
        if rc.model_message:
            head += ["", "On the full model it said:", "", *fenced(rc.model_message)]
    tail = [
        "",
        "The full report (`report.md`, with every node in `nodes.csv`) is attached; "
        "it was written by onnx-bisect.",
        "",
    ]
    diagram = mermaid_lines(result)
    rows = around(result, before=2, after=5)
    table = ["", "## Nodes around the root cause", "", *render_table(result, rows)] if rows else []
    for extra in ([*_diagram_section(diagram), *table], table, []):
        body = "\n".join([*head, *extra, *tail])
        if len(body) <= MAX_ISSUE_CHARS:
            return body
    return body[: MAX_ISSUE_CHARS - 80].rsplit("\n", 1)[0] + "\n\n*Truncated to fit an issue.*\n"


def _diagram_section(diagram: list[str]) -> list[str]:
    return ["", "## Where it starts", "", *diagram] if diagram else []
