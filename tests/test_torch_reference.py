"""PyTorch as the reference: each module's output (forward hooks) against the ONNX tensor that
stands for it on the target; the first divergent module named with its source line, and its
ONNX nodes fed its own inputs in float64 to tell a wrong export from a wrong kernel."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

import onnx_bisect
from onnx_bisect.cli import bisect_app
from onnx_bisect.errors import InputError
from onnx_bisect.result import CauseKind
from tests.faulty import FaultyBackend

torch = pytest.importorskip("torch")
pytest.importorskip("onnxscript")  # the dynamo exporter's, for the wrong translation

from tests import torch_models  # noqa: E402  (imports torch)

runner = CliRunner()
MODELS = Path(torch_models.__file__)
REF = f"pytorch:{MODELS}:make"
GELU_NODES = ["node_Mul_6", "node_Sigmoid_7", "node_gelu"]


@pytest.fixture(scope="module")
def exports(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The dynamo exports (seconds each): with the wrong GELU, and clean."""
    d = tmp_path_factory.mktemp("torchref")
    return {
        "wrong": torch_models.export(d / "wrong.onnx", dynamo=True, wrong=True),
        "clean": torch_models.export(d / "clean.onnx", dynamo=True),
    }


@pytest.fixture(scope="module")
def script(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The TorchScript export: node names carry the module paths, no metadata."""
    return torch_models.export(tmp_path_factory.mktemp("script") / "script.onnx", dynamo=False)


@pytest.mark.slow
def test_a_wrong_translation_is_an_export_fault_of_the_first_gelu_module(
    exports: dict[str, Path], tmp_path: Path
) -> None:
    out = tmp_path / "out"
    got = runner.invoke(
        bisect_app, [str(exports["wrong"]), "--ref", REF, "--target", "cpu", "--out", str(out)]
    )
    assert got.exit_code == 1, got.output
    report = json.loads((out / "report.json").read_text())
    cause = report["root_cause"]
    assert cause["kind"] == "export"
    assert cause["nodes"] == GELU_NODES
    assert cause["source"]["module"] == "blocks.0.act"
    assert cause["source"]["file"] == str(MODELS)
    assert cause["source"]["line"] == torch_models.act_line()
    assert report["first_divergence"]["node"] == "node_gelu"
    line = torch_models.act_line()
    assert f"module blocks.0.act (GELU) at {MODELS}:{line}" in got.output
    assert "Root cause (export): node_Mul_6, node_Sigmoid_7, node_gelu — module blocks.0.act" in (
        got.output
    )
    # A fresh module is in training mode: the tool says it put it in eval mode.
    assert "make was in training mode; it was put in eval mode" in got.output
    md = (out / "report.md").read_text()
    assert f"module blocks.0.act (GELU) at {MODELS}:{line}" in md
    assert "export" in md
    # The bundle: the GELU's three nodes fed the module's captured input, expecting its
    # output; any runtime computes the wrong translation, so cpu reproduces it.
    repro = report["repro"]
    assert (repro["nodes"], repro["reproduces"]) == (GELU_NODES, True)


@pytest.mark.slow
def test_the_clean_export_agrees_module_by_module(exports: dict[str, Path]) -> None:
    got = runner.invoke(bisect_app, [str(exports["clean"]), "--ref", REF, "--target", "cpu"])
    assert got.exit_code == 0, got.output
    assert "12 mapped to ONNX tensors, 1 unmapped (skipped)" in got.output


def test_a_wrong_kernel_under_a_torchscript_export_is_a_runtime_fault(script: Path) -> None:
    model, _ = torch_models.make()
    target = FaultyBackend("/blocks.0/act/Gelu")
    result = onnx_bisect.bisect(script, ref=model, target=target)
    assert result.diverged
    cause = result.root_cause
    assert cause is not None and cause.kind is CauseKind.RUNTIME
    assert cause.nodes == ("/blocks.0/act/Gelu",)
    assert result.first_divergence is not None
    assert result.first_divergence.name == "/blocks.0/act/Gelu"
    src = result.sources["/blocks.0/act/Gelu"]
    assert (src.module, src.class_name) == ("blocks.0.act", "GELU")
    assert result.torch is not None and result.torch.first_module == "blocks.0.act"
    assert "module blocks.0.act (GELU)" in result.summary()


def test_a_clean_torchscript_export_agrees_and_every_called_module_is_mapped(
    script: Path,
) -> None:
    model, _ = torch_models.make()
    result = onnx_bisect.bisect(script, ref=model, target="cpu")
    assert not result.diverged and result.root_cause is None
    summary = result.torch
    assert summary is not None and summary.first_module is None
    # The ModuleList is never called: no output, so nothing to map.
    assert summary.unmapped == ("blocks",)
    assert [r.module for r in summary.mapped][:4] == [
        "embed",
        "blocks.0.norm",
        "blocks.0.fc",
        "blocks.0.act",
    ]
    act = summary.mapped[3]
    assert (act.node, act.tensor, act.class_name) == (
        "/blocks.0/act/Gelu",
        "/blocks.0/act/Gelu_output_0",
        "GELU",
    )
    # Block's output is the residual Add, the last tensor of its scope.
    block = next(r for r in summary.mapped if r.module == "blocks.0")
    assert block.node == "/blocks.0/Add"
    assert "was in training mode; it was put in eval mode" in " ".join(result.notes)


def test_inputs_go_by_position_where_the_onnx_names_are_not_forwards(tmp_path: Path) -> None:
    model, example = torch_models.make()
    path = tmp_path / "unnamed.onnx"
    torch.onnx.export(model.eval(), example, str(path), dynamo=False, input_names=["input.1"])
    result = onnx_bisect.bisect(path, ref=model, target=FaultyBackend("/blocks.1/act/Gelu"))
    assert result.root_cause is not None and result.root_cause.kind is CauseKind.RUNTIME
    assert result.root_cause.nodes == ("/blocks.1/act/Gelu",)
    assert result.torch is not None and result.torch.first_module == "blocks.1.act"


@pytest.mark.parametrize(
    ("ref", "said"),
    [
        ("pytorch:nowhere.py:make", "error: ref pytorch:nowhere.py:make: no such file nowhere.py"),
        (
            f"pytorch:{MODELS}:nothing",
            f"error: ref pytorch:{MODELS}:nothing: {MODELS} has no nothing",
        ),
        (
            f"pytorch:{MODELS}:act_line",
            "error: ref: torch_models.py:act_line gave int, not an nn.Module",
        ),
    ],
)
def test_a_bad_factory_is_a_one_line_usage_error(script: Path, ref: str, said: str) -> None:
    got = runner.invoke(bisect_app, [str(script), "--ref", ref, "--target", "cpu"])
    assert got.exit_code == 2, got.output
    assert said in " ".join(got.output.split())


def test_a_model_exported_in_training_mode_is_said_so(tmp_path: Path) -> None:
    path = torch_models.export_training(tmp_path / "train.onnx")
    result = onnx_bisect.bisect(path, ref=f"pytorch:{MODELS}:make_bn", target="cpu")
    cause = result.root_cause
    assert cause is not None and cause.kind is CauseKind.EXPORT
    assert cause.nodes == ("/1/BatchNormalization",)
    assert cause.reason.endswith(
        "it was exported in training mode (BatchNormalization /1/BatchNormalization has "
        "training_mode=1): export the model after model.eval()"
    )
    assert result.notes[0] == (
        "the ONNX model was exported in training mode: BatchNormalization "
        "/1/BatchNormalization has training_mode=1; torch ran in eval mode"
    )
    # make_bn's module is in training mode as built: put in eval mode, and said so.
    assert result.torch is not None and result.torch.was_training
    assert result.torch.first_module == "1"


def test_what_the_mode_does_not_take_yet_is_refused(script: Path) -> None:
    model, _ = torch_models.make()
    with pytest.raises(InputError, match=r"^target cpu\+fp16: \+transforms are not taken"):
        onnx_bisect.bisect(script, ref=model, target="cpu+fp16")
    with pytest.raises(InputError, match=r"^ref pytorch: cannot be combined with --steps yet$"):
        onnx_bisect.bisect(script, ref=model, target="cpu", steps=2)
