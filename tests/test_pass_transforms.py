"""Pass bisection of a ``+transform``'s pass list: which of the passes the transform applies
makes the transformed model diverge. onnxoptimizer's and onnxslim's own BatchNorm fusions
only move the last bits (named at threshold 0 here); wrong passes come from a test plugin
(``tests/pass_plugin.py``) registered as a real ``onnx_bisect.transforms`` entry point, which
the transform's child process finds too.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

import onnx_bisect
from onnx_bisect.backends.spec import parse_spec
from onnx_bisect.backends.transform_passes import TransformPasses, pass_transform
from onnx_bisect.cli import bisect_app
from onnx_bisect.report.passes import WIDTH, pass_markdown
from onnx_bisect.result import PassOutcome
from onnx_bisect.transforms.registry import transform_kinds

ROOT = Path(__file__).resolve().parents[1]
CONV_BN = ROOT / "examples" / "models" / "conv_bn.onnx"
REAL = ("fuse_bn_into_conv", "eliminate_identity", "eliminate_nop_transpose")


@pytest.fixture
def wrongopt(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """``+wrongopt`` installed as a plugin: a dist-info with the entry point, on sys.path."""
    dist = tmp_path / "wrongopt_plugin-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: wrongopt-plugin\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(
        "[onnx_bisect.transforms]\nwrongopt = tests.pass_plugin:WRONGOPT\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    transform_kinds.cache_clear()
    yield
    transform_kinds.cache_clear()


def test_onnxoptimizer_passes_are_the_named_ones_or_the_default_list() -> None:
    import onnx
    import onnxoptimizer

    model = onnx.load(str(CONV_BN))
    named = parse_spec("cpu+onnxoptimizer=fuse_bn_into_conv,eliminate_identity")
    control = TransformPasses(named, 0, model, {})
    assert control.passes(model, {}) == ["fuse_bn_into_conv", "eliminate_identity"]
    assert control.all_off() == "cpu"
    assert control.only(["eliminate_identity"], REAL) == "cpu+onnxoptimizer=eliminate_identity"
    # No pass on is the transform left out: +onnxoptimizer= alone means the default list.
    assert control.only([], REAL) == "cpu"
    fix = control.workaround(["fuse_bn_into_conv"])
    assert fix.spec == "cpu+onnxoptimizer=eliminate_identity"
    assert dict(fix.forms)["Python"] == "onnxoptimizer.optimize(model, ['eliminate_identity'])"
    default = TransformPasses(parse_spec("cpu+fp16+onnxoptimizer"), 1, model, {})
    assert default.passes(model, {}) == onnxoptimizer.get_fuse_and_elimination_passes()
    assert default.all_off() == "cpu+fp16"  # the other transforms stay
    assert pass_transform(parse_spec("cpu+fp16")) is None
    assert pass_transform(parse_spec("cpu+onnxoptimizer+fp16")) == 0


def test_onnxslim_runs_only_the_named_optimizations() -> None:
    import onnx

    from onnx_bisect.transforms.apply import apply_transforms

    model, shapes = onnx.load(str(CONV_BN)), {"images": [1, 3, 32, 32]}
    fused, _ = apply_transforms(model, ["onnxslim=FusionConvBN"], "target", shapes)
    kept, _ = apply_transforms(model, ["onnxslim=constant_folding"], "target", shapes)
    assert "BatchNormalization" not in {n.op_type for n in fused.graph.node}
    assert len(kept.graph.node) == len(model.graph.node)
    control = TransformPasses(parse_spec("cpu+onnxslim"), 0, model, shapes)
    every = control.passes(model, {})
    assert {"constant_folding", "FusionConvBN", "weight_tying"} <= set(every)
    assert "graph_fusion" not in every  # it is its fusion patterns, one by one
    form = dict(control.workaround(["FusionConvBN"]).forms)["Python"]
    assert form == "onnxslim.slim(model, skip_fusion_patterns=['FusionConvBN'])"


@pytest.mark.parametrize(
    ("transform", "guilty", "rewritten"),
    [
        ("onnxoptimizer", "fuse_bn_into_conv", {"stem/bn", "stage3/bn"}),
        ("onnxslim", "FusionConvBN", {"stem/conv", "stem/bn", "stage3/bn"}),
    ],
)
def test_a_real_fusion_is_named_among_the_default_passes(
    transform: str, guilty: str, rewritten: set[str]
) -> None:
    # The fused BatchNorm rounds differently: bitwise, the target diverges, and the runtime
    # without the transform does not (same runtime, same model, optimizations off).
    result = onnx_bisect.bisect(
        CONV_BN, ref="cpu?opt=disable", target=f"cpu?opt=disable+{transform}",
        threshold=0.0, metric="max_abs",
    )  # fmt: skip
    pb = result.pass_bisection
    assert result.diverged and pb is not None and pb.outcome is PassOutcome.GUILTY, pb
    assert pb.guilty == (guilty,) and len(pb.passes) > 20
    assert pb.runs <= math.ceil(math.log2(len(pb.passes))) + 2
    rest = ",".join(p for p in pb.passes if p != guilty)
    assert pb.workaround == f"cpu?opt=disable+{transform}={rest}" and pb.workaround_verified
    assert rewritten <= set(pb.rewritten)
    # The list less one pass is hundreds of characters: shortened in the terminal's summary,
    # wrapped in report.md's code blocks.
    assert f"more…,{pb.passes[-1]}'" in pb.summary()
    code = [line for line in pass_markdown(pb) if line.startswith(("--target", "'"))]
    assert len(code) > 2 and all(len(line) <= WIDTH for line in code)


def test_the_wrong_pass_in_the_list_is_named(wrongopt: None) -> None:
    passes = [*REAL[:2], "scale_conv_weight", REAL[2]]
    target = f"cpu+wrongopt={','.join(passes)}"
    result = onnx_bisect.bisect(CONV_BN, target=target)
    pb = result.pass_bisection
    assert result.diverged and pb is not None, result.notes
    assert pb.outcome is PassOutcome.GUILTY, pb.reason
    assert pb.passes == tuple(passes) and pb.guilty == ("scale_conv_weight",)
    assert pb.workaround == f"cpu+wrongopt={','.join(p for p in passes if p != pb.guilty[0])}"
    assert pb.workaround_verified
    assert pb.runs <= 4  # the plain runtime, then log2(4) + 1 subsets
    assert not onnx_bisect.bisect(CONV_BN, target=pb.workaround).diverged


def test_two_passes_that_are_wrong_together_are_named_as_the_pair(wrongopt: None) -> None:
    passes = ["tag_conv", *REAL, "scale_tagged_conv"]
    result = onnx_bisect.bisect(CONV_BN, target=f"cpu+wrongopt={','.join(passes)}")
    pb = result.pass_bisection
    assert pb is not None and pb.outcome is PassOutcome.GUILTY, pb and pb.reason
    assert pb.guilty == ("tag_conv", "scale_tagged_conv")
    assert pb.workaround == f"cpu+wrongopt={','.join(REAL)}" and pb.workaround_verified


def test_a_runtime_bug_is_not_blamed_on_the_transforms_passes(wrongopt: None) -> None:
    # Wrong without the transform too (ONNX Runtime with its own optimizations, against a
    # threshold they exceed): none of the transform's passes is to blame.
    result = onnx_bisect.bisect(
        CONV_BN, ref="cpu?opt=disable", target="cpu+wrongopt=eliminate_identity",
        threshold=0.0, metric="max_abs",
    )  # fmt: skip
    pb = result.pass_bisection
    if not result.diverged:
        pytest.skip("onnxruntime's optimizations are exact on this model here")
    assert pb is not None and pb.outcome is PassOutcome.NOT_OPTIMIZER and pb.runs == 1
    assert pb.reason.startswith("cpu diverges too: without +wrongopt the target is still wrong")


def test_cli_names_the_transforms_pass(wrongopt: None, tmp_path: Path) -> None:
    target = f"cpu+wrongopt={REAL[0]},scale_conv_weight"
    out = tmp_path / "report"
    res = CliRunner().invoke(
        bisect_app, [str(CONV_BN), "--target", target, "--out", str(out), "--no-repro"]
    )
    assert res.exit_code == 1, res.output
    assert "Optimizer pass: scale_conv_weight" in res.stdout
    assert f"--target 'cpu+wrongopt={REAL[0]}'" in res.stdout
