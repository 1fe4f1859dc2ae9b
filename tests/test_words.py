"""Every sentence a user reads says what it means (issue 24): the exact words of the texts new
users misread, in the terminal (a real pseudo-terminal, 80 columns), report.md, report.html,
issue.md and the repro bundle's README.md.
"""

from __future__ import annotations

import html
import re
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnx_bisect
from onnx_bisect.compare.criterion import Criterion, Status
from onnx_bisect.compare.tensors import compare_tensors
from onnx_bisect.report.html import render_html
from onnx_bisect.report.issue import render_issue
from onnx_bisect.report.markdown import render_markdown
from onnx_bisect.repro import template
from onnx_bisect.result import BisectResult, NodeResult, Verdict, nonfinite_phrase
from onnx_bisect.text import fmt
from tests.faulty import FaultyBackend, RefusingBackend
from tests.models import chain, make
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
        rf"No divergence: {said}rel_l2 0 ≤ 4 × fp32 noise \+ 1e-05 = [0-9.e-]+ \(\d+\.\d\ds\)",
        words(lines),
    )


def test_a_match_agrees_in_every_report(match: BisectResult) -> None:
    assert repr(match) == "<BisectResult match: 1 output agrees>"
    # The measured error beside the bound it was held against (the noise floor's own).
    measured = AUTO_AGREES.replace("rel_l2 ≤", "rel_l2 0 ≤")
    [bound] = [c.threshold for c in match.outputs]
    assert bound is not None
    measured += f" = {fmt(bound)}"
    md = render_markdown(match).splitlines()
    assert f"**No divergence**: every final output agrees: {measured}." in md
    assert "- criterion: a tensor diverges where rel_l2 > 4 × fp32 noise + 1e-05" in md
    page = render_html(match)
    assert (
        '<p><span class="verdict match">No divergence</span> every final output agrees: '
        f"<code>{html.escape(measured)}</code></p>"
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
    args = ("--target", CHAIN_FAULT, "--threshold", "1e-3", "--out", str(out), "--format", "md")
    ran = run_cli(str(tmp_path / "chain.onnx"), *args, tty=(True, True))
    assert ran.code == 1, ran.stdout + ran.stderr
    said = "1 node: mm1 (shrunk from 8 nodes in 1 target run)"
    bundle = f"Repro bundle {out / 'repro'} (divergence, verified): {said}"
    # At 80 columns a long temporary path folds inside itself (xdist adds popen-gwN/ to it):
    # the text is compared whole, its line breaks and spaces aside.
    assert "".join(bundle.split()) in "".join(words(ran.stdout.splitlines()).split())
    report = (out / "report.md").read_text().splitlines()
    assert f"**Repro bundle** (`{out / 'repro'}`, verified): {said}" in report
    readme = (out / "repro" / "README.md").read_text().splitlines()
    assert readme[2:5] == [
        "- shrunk from 8 nodes to 1 in 1 target run: `mm1`",
        "- fed the reference’s tensors at the cut",
        "- verified: re-run in a fresh process, it reproduces",
    ]
    assert readme[5] == ""
    run = readme.index("## Run it") + 3
    assert readme[run : run + 2] == [  # the comments in one column
        "python repro.py                  # exit 1: reproduces, exit 0: does not",
        "python repro.py --target 'cpu'   # the reference, for contrast",
    ]


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


# --- 4. NaN and Inf are shown as such, and where they first appear -------------------------


def add_relu() -> onnx.ModelProto:
    """x -> Add ``add`` (+ b) -> s -> Relu ``relu`` -> y, as in the report that read 0."""
    b = numpy_helper.from_array(np.full((1, 8), 0.5, np.float32), "b")
    nodes = [
        helper.make_node("Add", ["x", "b"], ["s"], name="add"),
        helper.make_node("Relu", ["s"], ["y"], name="relu"),
    ]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8])
    return make(nodes, [x], [y], [b])


def scale_exp() -> onnx.ModelProto:
    """x -> Mul ``scale`` (× 1) -> h -> Exp ``exp`` -> y: fed 88, a 5% error in ``scale``
    takes ``exp`` past float32's largest value, so Inf appears one node after the error."""
    one = numpy_helper.from_array(np.ones((1, 4), np.float32), "one")
    nodes = [
        helper.make_node("Mul", ["x", "one"], ["h"], name="scale"),
        helper.make_node("Exp", ["h"], ["y"], name="exp"),
    ]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])
    return make(nodes, [x], [y], [one])


def test_an_all_nan_output_reads_nan_and_says_where_nan_first_appears(tmp_path: Path) -> None:
    onnx.save(add_relu(), tmp_path / "add_relu.onnx")
    out = tmp_path / "out"
    nan = "tests.faulty:InputFaultBackend?node=add&factor=nan&trigger=0"
    args = ("--target", nan, "--threshold", "1e-3", "--out", str(out), "--format", "md")
    ran = run_cli(str(tmp_path / "add_relu.onnx"), *args, "--no-repro", tty=(True, True))
    assert ran.code == 1, ran.stdout + ran.stderr
    lines = ran.stdout.splitlines()
    assert max(len(line) for line in lines) <= 80
    said = words(lines)
    assert "output y: nonfinite-mismatch, rel_l2=NaN max_abs=NaN First divergence:" in said
    assert "First divergence: Add add (#0) tensor s: rel_l2=NaN max_abs=NaN cosine=NaN" in said
    assert (
        "NaN first appears: Add add (#0) tensor s: 8 of 8 values are NaN where the "
        "reference's are finite"
    ) in said
    assert "Amplification chain: Add add NaN → Relu relu NaN strategy" in said
    rows = [[c.strip() for c in line.split("│")[1:-1]] for line in lines if "│ " in line]
    assert rows == [
        ["0", "add", "Add", "culprit", "NaN", "NaN", "—"],
        ["1", "relu", "Relu", "propagated", "NaN", "0", "—"],
    ]
    md = (out / "report.md").read_text().splitlines()
    assert (
        "- **NaN first appears:** Add `add` (#0), tensor `s`: 8 of 8 values are NaN where the "
        "reference's are finite."
    ) in md
    assert "- **Amplification chain** (rel_l2): Add `add` NaN → Relu `relu` NaN" in md
    assert "| 0 | `add` | Add | culprit | NaN | NaN | — | `s` |" in md
    assert (
        "| `y` | nonfinite-mismatch | NaN | NaN | 8 NaN/Inf values differ from the reference |"
        in md
    )


def test_inf_is_said_where_it_first_appears_after_the_first_divergence() -> None:
    x = np.full((1, 4), 88.0, np.float32)
    result = onnx_bisect.bisect(
        scale_exp(), target=FaultyBackend("scale"), inputs={"x": x}, threshold=1e-3
    )
    assert result.first_divergence is not None and result.first_divergence.name == "scale"
    lines = result.summary().splitlines()
    assert lines[1] == "  output y: nonfinite-mismatch, rel_l2=inf max_abs=inf"
    assert lines[3] == (
        "Inf first appears: Exp exp (#1) tensor y: 4 of 4 values are Inf where the reference's "
        "are finite"
    )
    md = render_markdown(result)
    assert "| 1 | `exp` | Exp | propagated | inf | 0 | — | `y` |" in md
    assert "- **Amplification chain** (rel_l2): Mul `scale` 0.05 → Exp `exp` inf\n" in md
    assert "\n#1-1 ! " + "#" * 40 + "       inf  Exp exp\n" in md  # the error curve
    issue = render_issue(result)
    assert (
        "\nInf first appears: Exp `exp` (#1), tensor `y`: 4 of 4 values are Inf where the "
        "reference's are finite.\n"
    ) in issue
    assert "| `y` | nonfinite-mismatch | inf | inf |" in issue
    page = render_html(result)
    assert (
        "<dt>Inf first appears</dt><dd>Exp <code>exp</code> (#1), tensor <code>y</code>: 4 of 4 "
        "values are Inf where the reference&#x27;s are finite</dd>"
    ) in page


def test_misplaced_nan_and_inf_show_as_nan_and_inf_and_count_as_mismatches() -> None:
    ref = np.array([1.0, 2.0, 3.0, 4.0], np.float32)
    both = compare_tensors("t", ref, np.array([np.nan, 2.0, np.inf, 4.0], np.float32), Criterion())
    assert both.status is Status.NONFINITE
    assert (both.nonfinite, both.target_nan, both.target_inf) == ("NaN", 1, 1)
    assert [both.shown(m) for m in ("rel_l2", "max_abs", "cosine")] == ["NaN"] * 3
    # The finite values agree; the misplaced ones are outside any tolerance all the same.
    assert both.metrics["rel_l2"] == 0.0 and both.shown("mismatch") == "0.5"
    inf = compare_tensors("t", ref[:2], np.array([np.inf, 2.0], np.float32), Criterion())
    assert [inf.shown(m) for m in ("rel_l2", "cosine", "sqnr_db")] == ["inf", "NaN", "-inf"]
    node = NodeResult(3, "n", "Div", ("a",), ("t",), Verdict.PROPAGATED, both)
    assert nonfinite_phrase(node) == (
        "NaN/Inf first appear",
        "1 NaN and 1 Inf of 4 values where the reference's are finite",
    )
    assert repr(node) == "<NodeResult #3 Div n propagated: acc NaN iso —>"


# --- 5. at 80 columns, node names wrap at separators, never inside a word ------------------

SEPARATORS = "/._:"


def long_names(blocks: int = 3, width: int = 8) -> onnx.ModelProto:
    """tests.models.chain() with long, slash-separated names, as exporters write them."""
    model = chain(blocks, width)
    for node in model.graph.node:
        i, what = node.name[-1], "MatMul" if node.op_type == "MatMul" else "Tanh"
        node.name = f"/model/encoder/layers.{i}/self_attention/output_projection/{what}"
    return model


def name_cells(lines: list[str]) -> list[list[str]]:
    """The node column of the compact table, one list of lines per row: where the header's
    ``node`` starts up to where ``verdict`` starts."""
    header = next(line for line in lines if re.match(r"\s*#\s+node\s+verdict", line))
    start, end = header.index("node"), header.index("verdict")
    first = lines.index(header) + 2  # below the rule
    rows: list[list[str]] = []
    for line in lines[first:]:
        if not line.strip():
            break
        cell = line[start:end].strip()
        if line[:start].strip():
            rows.append([cell])
        else:
            rows[-1].append(cell)
    return rows


def test_at_80_columns_node_names_wrap_at_separators_only(tmp_path: Path) -> None:
    model = long_names()
    onnx.save(model, tmp_path / "long.onnx")
    fault = model.graph.node[2].name
    target = f"tests.faulty:InputFaultBackend?node={fault}&factor=0.05&trigger=0"
    args = ("--target", target, "--threshold", "1e-3")
    ran = run_cli(str(tmp_path / "long.onnx"), *args, tty=(True, True))
    assert ran.code == 1, ran.stdout + ran.stderr
    lines = ran.stdout.splitlines()
    assert max(len(line) for line in lines) <= 80
    cells = name_cells(lines)
    names = {n.name for n in model.graph.node}
    assert len(cells) == 6 and all("".join(cell) in names for cell in cells)
    assert all(len(cell) > 1 for cell in cells)  # they did need wrapping
    for cell in cells:
        assert all(line[-1] in SEPARATORS for line in cell[:-1]), cell
    assert cells[0] == ["/model/encoder/layers.1/", "self_attention/", "output_projection/MatMul"]


def dropped_log() -> onnx.ModelProto:
    """x -> Mul 1e-10 -> Log -> Max(-5) -> + x: in float16 the Log gives -inf, which the Max
    drops, so the outputs agree while a node inside diverges (issue 33)."""
    tiny = numpy_helper.from_array(np.array(1e-10, np.float32), "tiny")
    floor = numpy_helper.from_array(np.array(-5.0, np.float32), "floor")
    nodes = [
        helper.make_node("Mul", ["x", "tiny"], ["small"], name="scale"),
        helper.make_node("Log", ["small"], ["l"], name="log"),
        helper.make_node("Max", ["l", "floor"], ["m"], name="drop"),
        helper.make_node("Add", ["m", "x"], ["y"], name="add"),
    ]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 8])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 8])
    return make(nodes, [x], [y], [tiny, floor])


def test_no_divergence_never_sits_above_a_first_divergence_line() -> None:
    """ "No divergence" above "First divergence" and "Root cause" contradicted itself: what
    diverges inside a graph whose outputs agree is said to be inside."""
    result = onnx_bisect.bisect(dropped_log(), target="cpu+fp16", always_scan=True)
    text = result.summary()
    assert text.startswith("No divergence: "), text
    assert "First divergence" not in text and "Root cause" not in text, text
    lines = text.splitlines()
    inside = next(line for line in lines if line.startswith("Divergence inside the graph: "))
    assert inside.startswith("Divergence inside the graph: Mul scale (#1) tensor small: "), inside
    cause = next(line for line in lines if line.startswith("At fault inside the graph ("))
    assert "; it does not reach the outputs): " in cause, cause
    page = render_html(result)
    assert "<dt>Divergence inside the graph (it does not reach the outputs)</dt>" in page
    assert "<dt>First divergence</dt>" not in page and "<dt>Root cause</dt>" not in page
