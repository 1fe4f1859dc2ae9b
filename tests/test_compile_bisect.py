"""Pass bisection of ``torch:*?compile=`` targets: torch's own CompilerBisector, with our
comparison as its test. The wrong part of the compiler is made in this process: inductor's
lowering of ``aten.exp`` patched to compute exp(1.01 x), which the bisector must name."""

from __future__ import annotations

from pathlib import Path

import pytest

import onnx_bisect
from onnx_bisect.backends.torch.compile_bisect import fallback_compiler
from onnx_bisect.report.passes import pass_markdown
from onnx_bisect.result import PassBisection, PassOutcome


def test_the_workaround_is_the_last_backend_before_the_guilty_one_that_compile_takes() -> None:
    assert fallback_compiler("inductor") == "aot_eager"
    assert fallback_compiler("aot_eager_decomp_partition") == "aot_eager"
    assert fallback_compiler("aot_eager") == "eager"
    assert fallback_compiler("eager") is None  # dynamo itself: no compile at all


def test_torchs_findings_are_reported() -> None:
    details = (("backend", "inductor"), ("subsystem", "lowerings"), ("application", "0"),
               ("debug info", "exp"))  # fmt: skip
    pb = PassBisection(
        PassOutcome.GUILTY, "torch:cpu?compile=inductor", ("eager", "inductor"),
        ("inductor/lowerings",), 9, "torch:cpu?compile=aot_eager", (), True, reason="r",
        details=details,
    )  # fmt: skip
    assert "subsystem: lowerings; application: 0; debug info: exp" in pb.summary()
    assert pb.to_dict()["details"]["debug info"] == "exp"
    assert "| debug info | `exp` |" in pass_markdown(pb)


def _tiny(path: Path) -> Path:
    from onnx import TensorProto, helper, save

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 8])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 8])
    nodes = [helper.make_node("Exp", ["x"], ["e"], name="exp"),
             helper.make_node("Add", ["e", "x"], ["y"], name="add")]  # fmt: skip
    graph = helper.make_graph(nodes, "tiny", [x], [y])
    save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


@pytest.mark.slow
def test_a_wrong_inductor_lowering_is_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("torch")
    import torch
    from torch._inductor import lowering

    exp = torch.ops.aten.exp.default
    right, mul = lowering.lowerings[exp], lowering.lowerings[torch.ops.aten.mul.Tensor]
    monkeypatch.setitem(lowering.lowerings, exp, lambda a: right(mul(a, 1.01)))
    # A kernel cached on disk by an earlier compile (a worker's) would bypass the plant.
    monkeypatch.setattr(torch._inductor.config, "fx_graph_cache", False, raising=False)
    model = _tiny(tmp_path / "tiny.onnx")
    # In this process: the planted lowering is a patch of this process's inductor.
    result = onnx_bisect.bisect(model, target="torch:cpu?compile=inductor", isolate_crashes=False)
    pb = result.pass_bisection
    assert result.diverged and pb is not None and pb.outcome is PassOutcome.GUILTY, pb
    details = dict(pb.details)
    assert details["backend"] == "inductor" and details["subsystem"] == "lowerings"
    assert details["debug info"] == "exp" and "application" in details
    assert pb.guilty == ("inductor/lowerings",)
    assert pb.workaround == "torch:cpu?compile=aot_eager" and pb.workaround_verified
    assert dict(pb.workaround_forms)["Python"] == "torch.compile(model, backend='aot_eager')"
    # Eager torch agrees, and torch's bisector is left off for what follows.
    assert pb.reason.startswith("torch:cpu agrees")
    from torch._inductor.compiler_bisector import CompilerBisector

    assert not CompilerBisector.bisection_enabled


@pytest.mark.slow
def test_an_eager_kernel_bug_is_not_blamed_on_the_compiler(tmp_path: Path) -> None:
    # float16 eager torch against float64 at a tight threshold: wrong without compile too.
    pytest.importorskip("torch")
    model = _tiny(tmp_path / "tiny.onnx")
    result = onnx_bisect.bisect(
        model, target="torch:cpu?dtype=float16&compile=inductor", threshold=1e-6
    )
    pb = result.pass_bisection
    assert result.diverged and pb is not None and pb.outcome is PassOutcome.NOT_OPTIMIZER
    assert pb.runs == 1 and "without torch.compile" in pb.reason


@pytest.mark.slow
def test_a_config_flip_that_fixes_inductor_is_named_with_its_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # An inductor bug that only its default config shows: the lowering of aten.exp is wrong
    # unless fallback_random is on. Disabling pre-, joint- or post-grad passes does not fix
    # it; the bisector's first config flip does, and that is what it must report.
    pytest.importorskip("torch")
    import torch
    from torch._inductor import config, lowering

    exp = torch.ops.aten.exp.default
    right, mul = lowering.lowerings[exp], lowering.lowerings[torch.ops.aten.mul.Tensor]

    def planted(a: object) -> object:
        return right(a) if config.fallback_random else right(mul(a, 1.01))

    monkeypatch.setitem(lowering.lowerings, exp, planted)
    # A kernel cached on disk by an earlier compile (a worker's) would bypass the plant.
    monkeypatch.setattr(torch._inductor.config, "fx_graph_cache", False, raising=False)
    result = onnx_bisect.bisect(
        _tiny(tmp_path / "tiny.onnx"), target="torch:cpu?compile=inductor", isolate_crashes=False
    )
    pb = result.pass_bisection
    assert result.diverged and pb is not None and pb.outcome is PassOutcome.GUILTY, pb
    line = "torch._inductor.config.fallback_random = True"
    assert dict(pb.details) == {
        "backend": "inductor", "subsystem": "inductor_fallback_random", "config": line
    }  # fmt: skip
    assert pb.guilty == ("inductor/inductor_fallback_random",)
    assert pb.reason == (
        "torch:cpu agrees; torch's bisector finds the inductor backend wrong unless "
        "inductor_fallback_random is flipped"
    )
    assert dict(pb.workaround_forms) == {
        "Python": "torch.compile(model, backend='aot_eager')", "Python (config)": line
    }  # fmt: skip
    assert pb.workaround == "torch:cpu?compile=aot_eager" and pb.workaround_verified
    assert f"config: {line}" in pb.summary()
