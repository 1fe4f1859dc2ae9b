"""Pass bisection: which optimizer pass of the target makes it diverge, and how to turn it off.

Real ONNX Runtime transformers on the shipped transformer block (their names read from this
onnxruntime's own log) and a real rewrite rule inside its rule-based transformer, and the
simulated runtime's named passes with faults that appear only while a pass is on.
"""

from __future__ import annotations

import ast
import json
import math
import shlex
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from typer.testing import CliRunner

import onnx_bisect
from onnx_bisect.backends.ort_passes import OrtPasses, modified_transformers
from onnx_bisect.backends.spec import parse_spec
from onnx_bisect.cli import bisect_app
from onnx_bisect.engine.passes.search import find_guilty
from onnx_bisect.report.passes import WIDTH, pass_markdown, shell_lines, workaround_step
from onnx_bisect.result import PassBisection, PassOutcome, PassScope

ROOT = Path(__file__).resolve().parents[1]
BLOCK = ROOT / "examples" / "models" / "transformer_block.onnx"
YOLO = ROOT / "examples" / "models" / "yolo_like.onnx"
PASSES = ("ConstFold", "BnFusion", "SiluFusion", "LayerNormFusion", "GeluFusion", "CSE",
          "ReshapeFusion", "MatMulAdd")  # fmt: skip
runner = CliRunner()


def simulated(*faults: str) -> str:
    cmd = [sys.executable, str(ROOT / "examples" / "faulty_runtime.py")]
    cmd += ["{model}", "{inputs}", "{outputs}", "--disable", "{disable}", *faults]
    return "exec:" + shlex.join(cmd)


# -- the search alone ------------------------------------------------------------------------


@pytest.mark.parametrize("count", [1, 2, 3, 5, 8, 13, 20])
def test_one_guilty_pass_is_named_in_log2_runs_plus_one(count: int) -> None:
    passes = [f"p{i}" for i in range(count)]
    for guilty in passes:
        search = find_guilty(passes, lambda on, g=guilty: g in on)  # type: ignore[misc]
        assert search.guilty == (guilty,)
        # + 1 for the optimizations-off run the caller spends: ⌈log2 P⌉ + 2 in all.
        assert search.runs <= math.ceil(math.log2(count)) + 1


def test_two_passes_needed_together_are_named_as_the_pair() -> None:
    passes = [f"p{i}" for i in range(10)]
    search = find_guilty(passes, lambda on: {"p1", "p7"} <= on)
    assert search.guilty == ("p1", "p7")


def test_no_subset_that_diverges_names_nothing_cheaply() -> None:
    search = find_guilty([f"p{i}" for i in range(16)], lambda on: False)
    assert search.guilty == () and search.runs <= 6


def test_transformer_names_come_from_the_log() -> None:
    log = (
        "[I:onnxruntime:, graph_transformer.cc:15 Apply] GraphTransformer A modified: 0 with\n"
        "[I:onnxruntime:, graph_transformer.cc:15 Apply] GraphTransformer GeluFusionL2 modified: "
        "1 with status: OK\n"
        "[I:onnxruntime:, graph_transformer.cc:15 Apply] GraphTransformer B modified: 1 with\n"
        "[I:onnxruntime:, graph_transformer.cc:15 Apply] GraphTransformer GeluFusionL2 modified: "
        "1 with status: OK\n"
    )
    assert modified_transformers(log) == ["GeluFusionL2", "B"]


# -- ONNX Runtime ----------------------------------------------------------------------------


def test_onnx_runtime_gelu_fusion_is_named_with_a_workaround_that_works() -> None:
    result = onnx_bisect.bisect(
        BLOCK, ref="cpu?opt=disable", target="cpu", threshold=1e-9, shapes={"x": [2, 64, 16]}
    )
    pb = result.pass_bisection
    assert result.diverged and pb is not None and pb.outcome is PassOutcome.GUILTY
    # The names are this onnxruntime's: the one that fuses Gelu, read from its log.
    assert len(pb.guilty) == 1 and pb.guilty[0] in pb.passes and "Gelu" in pb.guilty[0]
    assert pb.workaround == f"cpu?disable={pb.guilty[0]}" and pb.workaround_verified
    # Searched on the 7-node Gelu window localization found, fed the reference's values: only
    # the passes that rewrite those nodes are listed, and the runs are runs of 7 nodes.
    assert result.root_cause is not None and len(result.root_cause.nodes) == 7
    assert pb.scope is PassScope.SUBGRAPH and pb.scope_nodes == 7 and not pb.scope_note
    assert pb.runs <= math.ceil(math.log2(len(pb.passes))) + 2
    assert pb.to_dict()["scope"] == "subgraph" and pb.to_dict()["scope_nodes"] == 7
    forms = dict(pb.workaround_forms)
    assert f"disabled_optimizers=['{pb.guilty[0]}']" in forms["Python"]
    assert "optimization.disable_specified_optimizers" in forms["C/C++"]
    # The nodes it rewrote, read from the optimized whole model.
    assert {"/act/Erf", "/act/Div"} <= set(pb.rewritten)
    fixed = onnx_bisect.bisect(
        BLOCK, ref="cpu?opt=disable", target=pb.workaround, threshold=1e-9,
        shapes={"x": [2, 64, 16]},
    )  # fmt: skip
    assert not fixed.diverged


def _reciprocal(path: Path) -> Path:
    """y = Relu(b * (1 / Identity(a))). ONNX Runtime's rule-based transformer removes the
    Identity (EliminateIdentity: exact) and turns 1/a * b into b/a (DivMulFusion: one rounding
    fewer, so the last bits change)."""
    shape = [4, 64]
    inputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, shape) for n in "ab"]
    nodes = [
        helper.make_node("Identity", ["a"], ["a_copy"], name="copy"),
        helper.make_node("Div", ["one", "a_copy"], ["inverse"], name="recip"),
        helper.make_node("Mul", ["inverse", "b"], ["scaled"], name="scale"),
        helper.make_node("Relu", ["scaled"], ["y"], name="relu"),
    ]
    one = numpy_helper.from_array(np.array(1.0, np.float32), "one")
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, shape)
    graph = helper.make_graph(nodes, "reciprocal", inputs, [y], [one])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


def test_a_rule_based_transformers_rules_are_those_that_change_its_graph(tmp_path: Path) -> None:
    model = onnx.load(str(_reciprocal(tmp_path / "reciprocal.onnx")))
    cpu = ["CPUExecutionProvider"]
    control = OrtPasses(parse_spec("cpu"), cpu, [])
    rules = control.parts("Level1_RuleBasedTransformer", model)
    assert rules == ["EliminateIdentity", "DivMulFusion"]
    assert control.parts("GeluFusionL2", model) is None  # one piece, not rules
    assert control.parts("Level2_RuleBasedTransformer", model) == []  # none of its rules fires
    # A rule the user already switched off is not one to search.
    off = OrtPasses(parse_spec("cpu?disable=EliminateIdentity"), cpu, ["EliminateIdentity"])
    assert off.parts("Level1_RuleBasedTransformer", model) == ["DivMulFusion"]


def test_the_guilty_rule_inside_a_rule_based_transformer_is_named(tmp_path: Path) -> None:
    path = _reciprocal(tmp_path / "reciprocal.onnx")
    # Bitwise: one rounding fewer is the whole difference.
    result = onnx_bisect.bisect(
        path, ref="cpu?opt=disable", target="cpu", threshold=0.0, metric="max_abs"
    )
    pb = result.pass_bisection
    assert result.diverged and pb is not None and pb.outcome is PassOutcome.GUILTY, pb
    # onnxruntime's log names the transformer; its rule comes from switching rules off.
    assert pb.passes == ("Level1_RuleBasedTransformer",)
    assert pb.parts_of == "Level1_RuleBasedTransformer" and pb.parts == ("DivMulFusion",)
    assert pb.guilty == ("DivMulFusion",) and pb.scope is PassScope.SUBGRAPH
    assert pb.workaround == "cpu?disable=DivMulFusion" and pb.workaround_verified
    assert "disabled_optimizers=['DivMulFusion']" in dict(pb.workaround_forms)["Python"]
    assert pb.rewritten == ("scale",)  # the Mul it folded into the Div
    assert "DivMulFusion alone makes it diverge" in pb.summary()
    fixed = onnx_bisect.bisect(
        path, ref="cpu?opt=disable", target=pb.workaround, threshold=0.0, metric="max_abs"
    )
    assert not fixed.diverged


def test_a_kernel_bug_is_not_blamed_on_a_pass() -> None:
    # Wrong with every optimization off too: a kernel, not a pass.
    from tests.faulty import FaultyBackend

    result = onnx_bisect.bisect(YOLO, target=FaultyBackend("/stem/Mul"), bisect_passes="on")
    assert result.diverged and result.pass_bisection is None
    assert any("has no optimizer passes to switch off" in n for n in result.notes)


# -- a runtime of one's own: exec: with {disable} ----------------------------------------------


@pytest.mark.parametrize("guilty", ["ConstFold", "LayerNormFusion", "MatMulAdd"])
def test_the_simulated_runtimes_guilty_pass_is_named(guilty: str) -> None:
    target = simulated("--pass-fault", f"{guilty}:/stem/Mul=0.05")
    result = onnx_bisect.bisect(YOLO, target=target, passes=PASSES)
    pb = result.pass_bisection
    assert pb is not None and pb.outcome is PassOutcome.GUILTY
    assert pb.guilty == (guilty,) and pb.passes == PASSES
    assert pb.runs <= math.ceil(math.log2(len(PASSES))) + 2
    assert pb.workaround_verified
    argv = shlex.split(pb.workaround.removeprefix("exec:"))
    assert argv[argv.index("--disable") + 1] == guilty


@pytest.mark.slow
def test_a_fault_that_needs_two_passes_is_named_as_the_pair() -> None:
    target = simulated("--pass-fault", "BnFusion+GeluFusion:/stem/Mul=0.05")
    result = onnx_bisect.bisect(YOLO, target=target, passes=PASSES)
    pb = result.pass_bisection
    assert pb is not None and pb.guilty == ("BnFusion", "GeluFusion")
    assert pb.workaround_verified


def test_a_fault_with_passes_off_is_a_kernel_bug() -> None:
    target = simulated("--fault", "/stem/Mul=0.05")
    result = onnx_bisect.bisect(YOLO, target=target, passes=PASSES)
    pb = result.pass_bisection
    assert pb is not None and pb.outcome is PassOutcome.NOT_OPTIMIZER and pb.runs == 1


def test_a_pass_bug_the_subgraph_does_not_show_is_searched_on_the_whole_model() -> None:
    # The fault needs 20 nodes around it (a fusion whose pattern spans the graph): isolation's
    # batch of nodes shows it, the one-node subgraph does not, so the search there names
    # nothing and the whole model is searched instead, and says why.
    target = simulated("--pass-fault", "LayerNormFusion:/stem/Mul=0.05:20")
    result = onnx_bisect.bisect(YOLO, target=target, passes=PASSES)
    pb = result.pass_bisection
    assert pb is not None and pb.outcome is PassOutcome.GUILTY, pb
    assert pb.guilty == ("LayerNormFusion",) and pb.workaround_verified
    assert pb.scope is PassScope.MODEL and pb.scope_nodes == 192
    assert pb.scope_note == (
        "on the subgraph around the root cause, no set of the 8 passes tried diverges on its own"
    )
    # The optimizations-off run spelled out as a command would bury the sentence.
    assert pb.reason.startswith("the target with every optimization off agrees")


def test_a_subgraph_answer_that_does_not_fix_the_whole_model_is_searched_there_again() -> None:
    # Two independent pass bugs: the root cause's subgraph shows only SiluFusion's, and with it
    # off the whole model still diverges (GeluFusion's, further on). The whole model is searched
    # then; its answer names one guilty pass too, and the report says it is not verified.
    target = simulated(
        "--pass-fault", "SiluFusion:/stem/Mul=0.05",
        "--pass-fault", "GeluFusion:/detect/cv3.1/cv3.1.1/Mul=0.05",
    )  # fmt: skip
    result = onnx_bisect.bisect(YOLO, target=target, passes=PASSES)
    pb = result.pass_bisection
    assert pb is not None and pb.outcome is PassOutcome.GUILTY, pb
    assert pb.scope is PassScope.MODEL
    assert pb.scope_note == "the workaround found on the subgraph (SiluFusion off) still diverges"
    assert pb.guilty == ("SiluFusion",) and not pb.workaround_verified
    assert "(NOT verified: it still diverges)" in pb.summary()


def test_bisect_passes_off_skips_it() -> None:
    result = onnx_bisect.bisect(
        BLOCK, ref="cpu?opt=disable", target="cpu", threshold=1e-9, shapes={"x": [2, 64, 16]},
        bisect_passes="off",
    )  # fmt: skip
    assert result.diverged and result.pass_bisection is None


def test_cli_reports_the_pass_in_every_format(tmp_path: Path) -> None:
    target = simulated("--pass-fault", "SiluFusion:/stem/Mul=0.05")
    out = tmp_path / "report"
    res = runner.invoke(
        bisect_app,
        [str(YOLO), "--target", target, "--passes", ",".join(PASSES), "--out", str(out),
         "--no-repro"],
    )  # fmt: skip
    assert res.exit_code == 1, res.output
    assert "Optimizer pass: SiluFusion" in res.stdout
    report = json.loads((out / "report.json").read_text())
    assert report["pass_bisection"]["guilty"] == ["SiluFusion"]
    assert report["pass_bisection"]["workaround"]["verified"] is True
    assert "**Optimizer pass**" in (out / "report.md").read_text()


# -- reports ---------------------------------------------------------------------------------


def test_a_long_workaround_is_shortened_and_wrapped_so_that_it_still_runs() -> None:
    kept = [f"pass_number_{i}" for i in range(38)]
    spec = f"cpu?opt=disable+onnxoptimizer={','.join(kept)}"
    python = f"onnxoptimizer.optimize(model, {kept!r})"
    pb = PassBisection(
        PassOutcome.GUILTY, "cpu?opt=disable+onnxoptimizer", (*kept, "bad"), ("bad",), 7, spec,
        (("Python", python),), True, reason="r",
    )  # fmt: skip
    summary = pb.summary()
    short = "'cpu?opt=disable+onnxoptimizer=pass_number_0,pass_number_1,…35 more…,pass_number_37'"
    assert f"Workaround: --target {short}" in summary
    assert "shortened here, whole in report.md and report.json" in summary
    md = pass_markdown(pb)
    fences = [i for i, line in enumerate(md) if line.startswith("```")]
    sh, py = md[fences[0] + 1 : fences[1]], md[fences[2] + 1 : fences[3]]
    assert md[fences[0]] == "```sh" and md[fences[2]] == "```python"
    assert len(sh) > 1 and all(len(line) <= WIDTH for line in [*sh, *py])
    # Pasted, each runs as the one-line form would: bash joins the spec back into one word.
    script = "set -- " + "\n".join(sh) + '\nprintf %s "$2"'
    assert subprocess.run(["bash", "-c", script], capture_output=True, text=True).stdout == spec
    assert ast.dump(ast.parse("\n".join(py))) == ast.dump(ast.parse(python))
    assert workaround_step(pb) == "Work around it (verified): as **Optimizer pass** above gives it."


def test_a_short_workaround_stays_one_line() -> None:
    assert shell_lines("cpu?disable=GeluFusionL2") == ["--target 'cpu?disable=GeluFusionL2'"]
    pb = PassBisection(
        PassOutcome.GUILTY, "cpu", ("A", "B"), ("A",), 2, "cpu?disable=A", (), True, reason="r"
    )
    assert "Workaround: --target 'cpu?disable=A' (verified: it agrees" in pb.summary()
    assert "| onnx-bisect | `--target 'cpu?disable=A'` |" in pass_markdown(pb)
