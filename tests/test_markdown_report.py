"""report.md and issue.md sized for GitHub: a Mermaid flowchart of the root cause's
neighbourhood and amplification chain, the rows around the root cause in graph order, next
steps, and an issue body that attaches the report instead of pasting it again."""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
import subprocess
from pathlib import Path

import onnx
import pytest
from markdown_it import MarkdownIt

import onnx_bisect
from onnx_bisect.report.format import fmt
from onnx_bisect.report.issue import render_issue
from onnx_bisect.report.markdown import render_markdown
from onnx_bisect.result import PassBisection, PassOutcome, ReproInfo, Verdict
from tests.faulty import FaultyBackend
from tests.models import chain, residual

FAULT = "add40"  # block 40 of 134: 403 nodes, the fault a third of the way in


@pytest.fixture(scope="module")
def big(tmp_path_factory: pytest.TempPathFactory) -> onnx_bisect.BisectResult:
    path = tmp_path_factory.mktemp("big") / "big.onnx"
    onnx.save(residual(134, width=16), str(path))
    result = onnx_bisect.bisect(path, target=FaultyBackend(FAULT, 0.05))
    assert len(result.nodes) == 403
    assert result.root_cause is not None and result.root_cause.nodes == (FAULT,)
    assert len(result.chain) > 100  # the error travels to the output: a long chain to draw
    return result


def _mermaid(text: str) -> list[str]:
    blocks = re.findall(r"^```mermaid\n(.*?)^```$", text, flags=re.S | re.M)
    assert len(blocks) == 1
    lines: list[str] = blocks[0].splitlines()
    return lines


_NODE = re.compile(r'^  (n\d+)\["([^"]*)"\]$')
_EDGE = re.compile(r'^  (n\d+) (-->|-\.->(?:\|"[^"]*"\|)?) (n\d+)$')
_CLASSDEF = re.compile(r"^  classDef (\w+) [\w:#,.-]+$")
_CLASS = re.compile(r"^  class (n\d+(?:,n\d+)*) (\w+)$")


def check_flowchart(lines: list[str]) -> dict[str, str]:
    """Mermaid's flowchart grammar, as far as the report uses it: unique ids, quoted labels
    holding no quote or bracket of their own, edges and classes between defined nodes.
    Returns id -> label."""
    assert lines[0] == "flowchart LR"
    labels: dict[str, str] = {}
    edges, defs, classed = [], set(), []
    for line in lines[1:]:
        if m := _NODE.match(line):
            assert m[1] not in labels, f"duplicate id {m[1]}"
            assert not re.search(r"<(?!br/>)|(?<!<br/)>", m[2]), m[2]  # only <br/> is markup
            labels[m[1]] = m[2]
        elif m := _EDGE.match(line):
            edges.append((m[1], m[3]))
        elif m := _CLASSDEF.match(line):
            defs.add(m[1])
        elif m := _CLASS.match(line):
            classed.append((m[1].split(","), m[2]))
        else:
            pytest.fail(f"not a flowchart line: {line!r}")
    assert edges and all(a in labels and b in labels for a, b in edges)
    assert all(c in defs and set(ids) <= set(labels) for ids, c in classed)
    return labels


def _mmdc(lines: list[str], tmp_path: Path) -> None:
    """Mermaid's own parser and renderer, where ``mmdc`` (@mermaid-js/mermaid-cli) is here."""
    mmdc = shutil.which("mmdc")
    if mmdc is None:
        return
    (tmp_path / "chart.mmd").write_text("\n".join(lines) + "\n")
    config = {"args": ["--no-sandbox"]}
    if chromium := shutil.which("chromium"):
        config["executablePath"] = chromium  # type: ignore[assignment]
    (tmp_path / "puppeteer.json").write_text(json.dumps(config))
    proc = subprocess.run(
        [mmdc, "-p", str(tmp_path / "puppeteer.json"), "-i", str(tmp_path / "chart.mmd"),
         "-o", str(tmp_path / "chart.svg")],
        capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr


def test_report_of_a_400_node_model_fits_github(big: onnx_bisect.BisectResult) -> None:
    report = render_markdown(big)
    assert len(report.encode()) <= 20_000
    tokens = MarkdownIt("commonmark").enable(["table"]).parse(report)
    assert sum(t.type == "table_open" for t in tokens) >= 2  # the rows, the final outputs
    # Every probed node is still one file away.
    assert "(the full table, 403 probed nodes, is in `nodes.csv`)" in report
    assert "All probed nodes" not in report


def test_mermaid_draws_the_neighbourhood_and_the_amplification_chain(
    big: onnx_bisect.BisectResult, tmp_path: Path
) -> None:
    lines = _mermaid(render_markdown(big))
    labels = check_flowchart(lines)
    by_name = {n.name: n for n in big.nodes}
    root = by_name[FAULT]
    assert labels[f"n{root.index}"].startswith(f"Add {FAULT}<br/>rel_l2 0.05<br/>culprit")
    assert f"  class n{root.index} culprit" in lines
    # Its producers and consumers, the chain's end and its largest gain are drawn.
    for name in ("act40", "add39", "mm41", "add41", "out"):
        assert f"n{by_name[name].index}" in labels, name
    biggest = max(big.chain[1:], key=lambda c: c.gain or 0)
    assert f"gain ×{fmt(biggest.gain)}" in labels[f"n{biggest.index}"]
    # The chain's elided stretches are dotted hops that count what they leave out.
    hops = [line for line in lines if "-.->" in line]
    assert hops and all(re.search(r'\|"\d+ nodes?"\|', h) for h in hops)
    assert len(labels) < 20
    _mmdc(lines, tmp_path)


def test_node_table_is_in_graph_order_around_the_root_cause(
    big: onnx_bisect.BisectResult,
) -> None:
    report = render_markdown(big)
    section = report.split("**Nodes around the root cause**", 1)[1].split("\n\n", 2)[1]
    rows = [r.split(" | ") for r in section.splitlines()[2:]]
    indexes = [int(r[0].strip("| ")) for r in rows]
    root = next(n for n in big.nodes if n.name == FAULT)
    assert indexes == list(range(root.index - 3, root.index + 9))
    assert rows[3][1] == f"`{FAULT}`" and rows[3][3] == Verdict.CULPRIT.value
    # Not by error: the worst node of the model is far downstream and not shown.
    worst = big.top(1)[0]
    assert worst.index not in indexes


def test_next_steps_name_the_repro_the_issue_the_workaround_and_the_viewer(
    big: onnx_bisect.BisectResult,
) -> None:
    repro = ReproInfo(
        path="out/repro", kind="divergence", nodes=(FAULT,), nodes_before=403, runs=3,
        isolated=True, reproduces=True, message="1 node",
    )  # fmt: skip
    passes = PassBisection(
        outcome=PassOutcome.GUILTY, target="cpu", passes=("A", "B"), guilty=("B",),
        workaround="cpu?disable=B", workaround_verified=True,
    )  # fmt: skip
    found = dataclasses.replace(big, repro=repro, pass_bisection=passes)
    report = render_markdown(found, Path("out"))  # the folder the reports are written to
    steps = report.split("**Next steps**\n\n", 1)[1].split("\n\n", 1)[0].splitlines()
    assert steps == [
        "1. Reproduce it: `cd out/repro && python repro.py` (exit 1 while it reproduces; "
        "`--target 'cpu'` runs the reference for contrast).",
        "2. Report it: `out/repro/issue.md` is the issue body; attach the zipped `repro/` "
        "folder and this `report.md` as files.",
        "3. Work around it (verified): `--target 'cpu?disable=B'`.",
        "4. Look at it: `onnx-bisect view out` shows the accumulated and isolated errors on "
        "the graph in Model Explorer.",
    ]


def test_issue_attaches_the_report_instead_of_a_second_copy(
    big: onnx_bisect.BisectResult, tmp_path: Path
) -> None:
    issue = render_issue(big)
    assert len(issue.encode()) <= 25_000
    report = render_markdown(big, tmp_path)
    # Nothing of the report's own sections, and no folded copy.
    for part in ("**Environment**", "**Error curve**", "**Next steps**"):
        assert part in report and part not in issue
    assert "<details>" not in issue
    assert "The full report (`report.md`" in issue
    assert issue.count("| 122 | `add40` |") == 1  # the root cause's row, once
    check_flowchart(_mermaid(issue))


def test_a_clean_run_has_no_diagram_and_no_next_steps() -> None:
    result = onnx_bisect.bisect(chain(3), target="cpu")
    report = render_markdown(result)
    assert not result.diverged
    assert "```mermaid" not in report and "**Next steps**" not in report
