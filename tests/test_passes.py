"""Pass bisection: which optimizer pass of the target makes it diverge, and how to turn it off.

Real ONNX Runtime transformers on the shipped transformer block (their names read from this
onnxruntime's own log), and the simulated runtime's named passes with faults that appear only
while a pass is on.
"""

from __future__ import annotations

import json
import math
import shlex
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

import onnx_bisect
from onnx_bisect.backends.ort_passes import modified_transformers
from onnx_bisect.cli import bisect_app
from onnx_bisect.engine.pass_search import find_guilty
from onnx_bisect.result import PassOutcome

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
    assert pb.runs <= math.ceil(math.log2(len(pb.passes))) + 2
    forms = dict(pb.workaround_forms)
    assert f"disabled_optimizers=['{pb.guilty[0]}']" in forms["Python"]
    assert "optimization.disable_specified_optimizers" in forms["C/C++"]
    assert {"/act/Erf", "/act/Div"} <= set(pb.rewritten)  # the Gelu subgraph it fused
    fixed = onnx_bisect.bisect(
        BLOCK, ref="cpu?opt=disable", target=pb.workaround, threshold=1e-9,
        shapes={"x": [2, 64, 16]},
    )  # fmt: skip
    assert not fixed.diverged


def test_a_kernel_bug_is_not_blamed_on_a_pass() -> None:
    # Wrong with every optimization off too: a kernel, not a pass.
    from tests.faulty import FaultyBackend

    result = onnx_bisect.bisect(YOLO, target=FaultyBackend("/stem/Mul"), bisect_passes="on")
    assert result.diverged and result.pass_bisection is None
    assert any("has no optimizer passes to switch off" in n for n in result.notes)


# -- a runtime of one's own: exec: with {disable} ----------------------------------------------


@pytest.mark.slow
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


@pytest.mark.slow
def test_a_fault_with_passes_off_is_a_kernel_bug() -> None:
    target = simulated("--fault", "/stem/Mul=0.05")
    result = onnx_bisect.bisect(YOLO, target=target, passes=PASSES)
    pb = result.pass_bisection
    assert pb is not None and pb.outcome is PassOutcome.NOT_OPTIMIZER and pb.runs == 1


def test_bisect_passes_off_skips_it() -> None:
    result = onnx_bisect.bisect(
        BLOCK, ref="cpu?opt=disable", target="cpu", threshold=1e-9, shapes={"x": [2, 64, 16]},
        bisect_passes="off",
    )  # fmt: skip
    assert result.diverged and result.pass_bisection is None


@pytest.mark.slow
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
