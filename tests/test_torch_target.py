"""PyTorch on either side: the module as the target under test (``--target
pytorch:FILE.py:FACTORY``, an ``nn.Module`` as ``target``) against the ONNX model on the
reference; float64 noise floors from the module's precision twin; a float64 module against
its float32 export; the culprit module's repro bundle, verified."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

import onnx_bisect
from onnx_bisect.cli import bisect_app
from onnx_bisect.errors import InputError
from onnx_bisect.result import CauseKind, Verdict
from tests.faulty import FaultyBackend

torch = pytest.importorskip("torch")

from tests import torch_models  # noqa: E402  (imports torch)

runner = CliRunner()
MODELS = Path(torch_models.__file__)
FAULTY = (
    "exec:{python} examples/faulty_runtime.py {model} {inputs} {outputs} "
    "--fault /blocks.0/act/Gelu=0.05"
)


@pytest.fixture(scope="module")
def script(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The TorchScript export of ``make()``: node names carry the module paths."""
    return torch_models.export(tmp_path_factory.mktemp("script") / "script.onnx", dynamo=False)


def test_a_module_changed_after_its_export_is_an_export_mismatch_as_the_target(
    script: Path, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    target = f"pytorch:{MODELS}:make_drifted"
    got = runner.invoke(
        bisect_app, [str(script), "--ref", "cpu", "--target", target, "--out", str(out)]
    )
    assert got.exit_code == 1, got.output
    report = json.loads((out / "report.json").read_text())
    assert report["ref"]["spec"] == "cpu"
    assert report["target"]["spec"] == "pytorch:torch_models.py:make_drifted"
    assert report["torch"]["role"] == "target"
    assert report["torch"]["first_divergent_module"] == "blocks.1.act"
    cause = report["root_cause"]
    assert cause["kind"] == "export"
    assert cause["nodes"] == ["/blocks.1/act/Gelu"]
    assert cause["source"]["module"] == "blocks.1.act"
    assert "Root cause (export): /blocks.1/act/Gelu — module blocks.1.act (SiLU)" in got.output
    # The bundle: the GELU fed the SiLU's captured input, expecting its output, on cpu.
    assert report["repro"]["reproduces"] is True
    assert report["repro"]["nodes"] == ["/blocks.1/act/Gelu"]
    # The bundle runs cpu already: no other runtime to contrast with.
    assert "for contrast" not in (out / "repro" / "README.md").read_text()


def test_a_wrong_kernel_on_the_reference_is_the_reference_off(script: Path) -> None:
    model, _ = torch_models.make()
    ref = FaultyBackend("/blocks.0/act/Gelu")
    result = onnx_bisect.bisect(script, ref=ref, target=model)
    cause = result.root_cause
    assert cause is not None and cause.kind is CauseKind.REFERENCE
    assert cause.nodes == ("/blocks.0/act/Gelu",)
    assert cause.reason.endswith(
        "its ONNX nodes agree with torch in float64, and the reference's run of them, fed the "
        "same inputs, does not (rel_l2=0.05): the reference's kernel is off"
    )
    row = next(n for n in result.nodes if n.name == "/blocks.0/act/Gelu")
    assert row.verdict is Verdict.REFERENCE_OFF
    assert result.target.spec == "pytorch:Net" and result.torch is not None
    assert result.torch.role == "target"


def test_a_clean_export_agrees_with_its_module_as_the_target(script: Path) -> None:
    model, _ = torch_models.make()
    result = onnx_bisect.bisect(script, ref="cpu", target=model)
    assert not result.diverged and result.root_cause is None
    assert result.runs == {"reference": 1}


def test_both_sides_pytorch_is_refused(script: Path) -> None:
    model, _ = torch_models.make()
    with pytest.raises(InputError, match=r"^target: both ref and target are PyTorch modules"):
        onnx_bisect.bisect(script, ref=model, target=f"pytorch:{MODELS}:make")


def test_auto_thresholds_are_the_fp32_noise_of_each_module_from_its_float64_run(
    script: Path,
) -> None:
    model, _ = torch_models.make()
    result = onnx_bisect.bisect(script, ref=model, target="cpu", threshold="auto")
    assert not result.diverged
    assert result.notes[1] == (
        "--threshold auto: each tensor's fp32 noise from the module run in float64 (12 "
        "tensors; 1e-3 where none)"
    )
    assert result.torch is not None
    floors = [r.comparison.noise for r in result.torch.mapped]
    # Every mapped module has its own floor: fp32 rounding, far below the fixed 1e-3.
    assert all(f is not None and 1e-9 < f < 1e-5 for f in floors), floors
    act = next(r.comparison for r in result.torch.mapped if r.module == "blocks.0.act")
    assert act.noise is not None and act.threshold == pytest.approx(4 * act.noise + 1e-5)


def test_a_faulty_kernel_within_a_fixed_threshold_is_found_over_noise_floors(
    script: Path,
) -> None:
    model, _ = torch_models.make()
    target = FaultyBackend("/blocks.0/act/Gelu", factor=1e-4)
    fixed = onnx_bisect.bisect(script, ref=model, target=target, threshold=1e-3)
    assert not fixed.diverged
    auto = onnx_bisect.bisect(script, ref=model, target=target, threshold="auto")
    cause = auto.root_cause
    assert cause is not None and cause.kind is CauseKind.RUNTIME
    assert cause.nodes == ("/blocks.0/act/Gelu",)


def test_a_float64_module_against_its_float32_export_is_named(script: Path) -> None:
    ref = f"pytorch:{MODELS}:make64"
    tight = onnx_bisect.bisect(script, ref=ref, target="cpu", threshold=1e-9)
    cause = tight.root_cause
    assert cause is not None and cause.kind is CauseKind.EXPORT
    assert cause.nodes == ("/embed/MatMul", "/embed/Add")
    assert "module embed (Linear): the module computes in float64, the ONNX model in float32, " in (
        cause.reason
    )
    said = (
        "the module computes in float64, the ONNX model in float32: differences up to "
        "float32's noise are expected (--threshold auto measures it per tensor); export "
        "after model.float() to compare like with like"
    )
    assert said in tight.notes
    # Its float32 twin gives the noise floors: the float32 export is within them.
    auto = onnx_bisect.bisect(script, ref=ref, target="cpu", threshold="auto")
    assert not auto.diverged
    assert "each tensor's fp32 noise from the module run in float32" in " ".join(auto.notes)


def test_the_culprit_modules_bundle_reproduces_in_a_fresh_process(
    script: Path, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    ref = f"pytorch:{MODELS}:make"
    got = runner.invoke(
        bisect_app, [str(script), "--ref", ref, "--target", FAULTY, "--out", str(out)]
    )
    assert got.exit_code == 1, got.output
    report = json.loads((out / "report.json").read_text())
    assert report["root_cause"]["kind"] == "runtime"
    repro = report["repro"]
    assert (repro["nodes"], repro["reproduces"]) == (["/blocks.0/act/Gelu"], True)
    bundle = out / "repro"
    ran = subprocess.run(
        [sys.executable, "repro.py"], cwd=bundle, capture_output=True, text=True, check=False
    )
    assert ran.returncode == 1, ran.stdout + ran.stderr
    assert "reference  dump:test_data_set_0: matches expected outputs (rel_l2 0)" in ran.stdout
    assert "REPRODUCED: the target diverges from the reference on this subgraph" in ran.stdout
    # Against a right kernel, the module's output is what the GELU computes: not reproduced.
    right = subprocess.run(
        [sys.executable, "repro.py", "--target", "cpu"],
        cwd=bundle, capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert right.returncode == 0, right.stdout + right.stderr
    # Beside the module's recorded outputs, ONNX Runtime is the contrast the docs offer.
    readme = (bundle / "README.md").read_text()
    assert "python repro.py --target 'cpu'   # ONNX Runtime, for contrast" in readme
    assert "`--target 'cpu'` runs ONNX Runtime for contrast" in (out / "report.md").read_text()


def test_weights_changed_after_the_export_were_captured_at_export_time(script: Path) -> None:
    result = onnx_bisect.bisect(script, ref=f"pytorch:{MODELS}:make_retrained", target="cpu")
    cause = result.root_cause
    assert cause is not None and cause.kind is CauseKind.EXPORT
    assert cause.nodes == ("/blocks.1/fc/MatMul", "/blocks.1/fc/Add")
    # The TorchScript export renamed the transposed weight: found through its reader's module.
    assert cause.reason == (
        "module blocks.1.fc (Linear): its ONNX nodes read onnx::MatMul_44 (the module's "
        "blocks.1.fc.weight, rel_l2=0.0909), captured at export time, where the module holds "
        "other values at run time: the module changed after its export; export it again"
    )
    assert (
        "initializers captured at export time that differ from the module's parameters or "
        "buffers at run time (1): onnx::MatMul_44 (the module's blocks.1.fc.weight, "
        "rel_l2=0.0909)"
    ) in result.notes


def test_inputs_in_another_layout_and_scale_are_preprocessing(tmp_path: Path) -> None:
    path = torch_models.export_nhwc(tmp_path / "nhwc.onnx")
    image = np.random.default_rng(0).uniform(0, 255, (1, 8, 8, 3)).astype(np.float32)
    ref = f"pytorch:{MODELS}:make_nchw"
    result = onnx_bisect.bisect(path, ref=ref, target="cpu", inputs={"x": image})
    cause = result.root_cause
    assert cause is not None and cause.kind is CauseKind.PREPROCESSING
    assert cause.nodes == ("/conv/Conv",)
    assert result.torch is not None
    layout, scale = result.torch.preprocessing
    assert layout == (
        "preprocessing: layout: the ONNX model takes x as (1, 8, 8, 3) (NHWC; the module's "
        "NCHW), the module as (1, 3, 8, 8): the module was fed it transposed"
    )
    assert scale == (
        "preprocessing: scale: x is fed up to 254.289 (0–255), the module's example inputs up "
        "to 0.994619 (0–1 or normalized): the ONNX model is fed values the module was not "
        "made for"
    )
    assert cause.reason.startswith(
        "module conv (Conv2d): fed the module's own inputs, its ONNX nodes agree with torch; "
        "the ONNX model's inputs differ from the module's: layout: the ONNX model takes x as"
    )


def test_an_input_of_another_dtype_is_named() -> None:
    from onnx_bisect.engine.torchref.faults import preprocessing

    image = np.zeros((1, 3, 4, 4), np.uint8)
    said = preprocessing(["x"], {"x": image}, [np.zeros((1, 3, 4, 4), np.float32)]).said
    assert said == ("preprocessing: dtype: the ONNX model takes x as uint8, the module float32",)


@pytest.mark.slow
def test_inside_a_module_of_several_ops_the_first_divergent_op_is_the_culprit(
    tmp_path: Path,
) -> None:
    pytest.importorskip("onnxscript")
    path = torch_models.export_attn(tmp_path / "attn.onnx")
    ref = f"pytorch:{MODELS}:make_attn"
    bundle = tmp_path / "repro"
    result = onnx_bisect.bisect(
        path, ref=ref, target=FaultyBackend("node_softmax"), repro=str(bundle)
    )
    cause = result.root_cause
    assert cause is not None and cause.kind is CauseKind.RUNTIME
    # Hooks see only Attn's output (six ONNX nodes); its ops, from torch.export, name one.
    assert cause.nodes == ("node_softmax",)
    assert cause.reason.startswith("module attn (Attn), op softmax (aten.softmax.int): ")
    summary = result.torch
    assert summary is not None and summary.first_module == "attn"
    assert [r.module for r in summary.ops] == [
        "transpose", "matmul", "div", "softmax", "matmul_1", "tanh",
    ]  # fmt: skip
    assert (summary.ops_unmapped, summary.first_op) == (0, "softmax")
    assert summary.lines()[-1] == (
        "inside attn: 6 torch ops mapped (torch.export), 0 unmapped; first divergent op: "
        "softmax (aten.softmax.int)"
    )
    assert result.repro is not None and result.repro.reproduces
    assert result.repro.nodes == ("node_softmax",)


def test_a_python_value_baked_in_at_export_time_is_named(tmp_path: Path) -> None:
    example = torch.full((2, 8), 0.5)
    example[0, 0] = 4.0
    path = torch_models.export_scaled(tmp_path / "scaled.onnx", example)
    x = np.linspace(-1.25, 1.0, 16, dtype=np.float32).reshape(2, 8)
    result = onnx_bisect.bisect(
        path, ref=f"pytorch:{MODELS}:make_scaled", target="cpu", inputs={"x": x}
    )
    cause = result.root_cause
    assert cause is not None and cause.kind is CauseKind.EXPORT
    # No submodule holds the division: the top module's own nodes, its output the model's.
    assert cause.nodes == ("/fc/Gemm", "/Constant", "/Div")
    assert cause.reason == (
        "module (top): the constant /Constant = 4 was captured at export time: with 1.25 in "
        "its place, its nodes compute what the module computes at run time (a Python value, "
        "input- or shape-dependent, baked into the export)"
    )
    assert result.torch is not None and result.torch.first_module == ""
