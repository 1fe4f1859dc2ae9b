"""Every sentence a user reads says what it means (issue 24): the exact words of the texts new
users misread, in the terminal (a real pseudo-terminal, 80 columns), report.md, report.html,
issue.md and the repro bundle's README.md.
"""

from __future__ import annotations

import html
import re
from pathlib import Path

import onnx
import pytest

import onnx_bisect
from onnx_bisect.compare.criterion import Criterion
from onnx_bisect.report.html import render_html
from onnx_bisect.report.issue import render_issue
from onnx_bisect.report.markdown import render_markdown
from onnx_bisect.repro import template
from onnx_bisect.result import BisectResult
from tests.faulty import FaultyBackend, RefusingBackend
from tests.models import chain
from tests.test_terminal import one_node, run_cli

AUTO_AGREES = "rel_l2 ≤ 4 × fp32 noise + 1e-05"
# mm1 of tests.models.chain() 5% off, as a spec the console script can build.
CHAIN_FAULT = "tests.faulty:InputFaultBackend?node=mm1&factor=0.05&trigger=0"


def words(lines: list[str]) -> str:
    """Lines a terminal wrapped, joined again: one space wherever rich broke a line."""
    return " ".join(" ".join(lines).split())


@pytest.fixture(scope="module")
def one_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("words") / "one.onnx"
    onnx.save(one_node(), path)
    return path


@pytest.fixture(scope="module")
def match() -> BisectResult:
    return onnx_bisect.bisect(one_node(), target="cpu?opt=disable")


# --- 1. agreeing outputs are said to agree, within the criterion ---------------------------


def test_the_criterion_reads_as_agreement_for_outputs_that_agree() -> None:
    assert Criterion().agreement() == "rel_l2 ≤ 0.001"
    assert Criterion(metric="cosine", threshold=0.99).agreement() == "cosine ≥ 0.99"
    assert Criterion(noise=lambda tensor, ref: None).agreement() == AUTO_AGREES
    floor = Criterion(abs_floor=1e-6).agreement()
    assert floor == "rel_l2 ≤ 0.001 or max_abs ≤ 1e-06 × max(1, |reference|)"
    assert Criterion(atol=0.1).agreement() == "allclose(atol=0.1, rtol=0.001)"
    # repro.py says the same in ASCII, as everything it prints.
    script = template.Criterion("cosine", 0.99, None, None)
    assert script.agreement() == "cosine >= 0.99"


def test_a_match_in_a_terminal_says_its_output_agrees(one_path: Path) -> None:
    ran = run_cli(str(one_path), "--target", "cpu?opt=disable", tty=(True, True))
    assert ran.code == 0, ran.stdout + ran.stderr
    lines = ran.stdout.splitlines()
    assert max(len(line) for line in lines) <= 80
    said = rf"cpu\?opt=disable vs cpu on {re.escape(str(one_path))}: 1 output agrees: "
    assert re.fullmatch(
        rf"No divergence: {said}rel_l2 ≤ 4 × fp32 noise \+ 1e-05 \(\d+\.\d\ds\)", words(lines)
    )


def test_a_match_agrees_in_every_report(match: BisectResult) -> None:
    assert repr(match) == "<BisectResult match: 1 output agrees>"
    md = render_markdown(match).splitlines()
    assert f"**No divergence**: every final output agrees: {AUTO_AGREES}." in md
    assert "- criterion: a tensor diverges where rel_l2 > 4 × fp32 noise + 1e-05" in md
    page = render_html(match)
    assert (
        '<p><span class="verdict match">No divergence</span> every final output agrees: '
        f"<code>{html.escape(AUTO_AGREES)}</code></p>"
    ) in page


def test_an_issue_says_when_an_output_is_ok() -> None:
    # A fixed threshold: no float64 oracle to wait for; the words are the same function's.
    result = onnx_bisect.bisect(one_node(), target=FaultyBackend("only"), threshold=1e-3)
    assert "\nAn output is `ok` where rel_l2 ≤ 0.001.\n" in render_issue(result)
    assert (
        '<p><span class="verdict diverged">Diverged</span> a tensor diverges where '
        "<code>rel_l2 &gt; 0.001</code></p>"
    ) in render_html(result)


# --- 2. the repro bundle says how many target runs shrank it -------------------------------


def test_a_repro_bundle_says_how_many_target_runs_shrank_it(tmp_path: Path) -> None:
    onnx.save(chain(), tmp_path / "chain.onnx")
    out = tmp_path / "out"
    args = ("--target", CHAIN_FAULT, "--threshold", "1e-3", "--out", str(out))
    ran = run_cli(str(tmp_path / "chain.onnx"), *args, tty=(True, True))
    assert ran.code == 1, ran.stdout + ran.stderr
    said = "1 node: mm1 (shrunk from 8 nodes in 1 target run)"
    bundle = f"Repro bundle {out / 'repro'} (divergence, verified): {said}"
    assert bundle in words(ran.stdout.splitlines())
    report = (out / "report.md").read_text().splitlines()
    assert f"**Repro bundle** (`{out / 'repro'}`, verified): {said}" in report
    readme = (out / "repro" / "README.md").read_text().splitlines()
    assert readme[2:5] == [
        "- shrunk from 8 nodes to 1 in 1 target run: `mm1`",
        "- fed the reference’s tensors at the cut",
        "- verified: re-run in a fresh process, it reproduces",
    ]
    assert readme[5] == ""


# --- 3. report.md counts the nodes actually probed -----------------------------------------


def test_a_report_counts_only_the_nodes_it_probed() -> None:
    # A target that cannot run Tanh: its bisection runs prefixes and compares no tensor.
    refused = onnx_bisect.bisect(chain(), target=RefusingBackend("Tanh"), threshold=1e-3)
    assert not any(n.probed for n in refused.nodes)
    md = render_markdown(refused).splitlines()
    assert (
        "**Nodes around the root cause**, in graph order (`nodes.csv` lists all 8 nodes; none "
        "was probed: no node's tensors were compared)"
    ) in md
    # A row without a tensor has an empty cell, not an empty code span.
    assert "| 2 | `mm1` | MatMul | not-probed | — | — | — |  |" in md
    assert "with every node in `nodes.csv`" in render_issue(refused)
    # The cut search compares the tensors around its cuts only.
    found = onnx_bisect.bisect(
        chain(12), target=FaultyBackend("mm7"), threshold=1e-3, strategy="bisect"
    )
    assert sum(n.probed for n in found.nodes) == 6
    assert (
        "**Nodes around the root cause**, in graph order (the full table is in `nodes.csv`: "
        "24 nodes, 6 of them probed)"
    ) in render_markdown(found).splitlines()
