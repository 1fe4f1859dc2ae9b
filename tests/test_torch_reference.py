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
from onnx_bisect.result import CauseKind
from tests import torch_models
from tests.faulty import FaultyBackend

runner = CliRunner()
MODELS = Path(torch_models.__file__)
REF = f"pytorch:{MODELS}:make"
GELU_NODES = ["node_Mul_6", "node_Sigmoid_7", "node_gelu"]


@pytest.fixture(scope="module")
def exports(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("torchref")
    return {
        "wrong": torch_models.export(d / "wrong.onnx", dynamo=True, wrong=True),
        "clean": torch_models.export(d / "clean.onnx", dynamo=True),
        "script": torch_models.export(d / "script.onnx", dynamo=False),
    }


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


@pytest.mark.slow
def test_the_clean_export_agrees_module_by_module(exports: dict[str, Path]) -> None:
    got = runner.invoke(bisect_app, [str(exports["clean"]), "--ref", REF, "--target", "cpu"])
    assert got.exit_code == 0, got.output
    assert "12 mapped to ONNX tensors, 1 unmapped (skipped)" in got.output


@pytest.mark.slow
def test_a_wrong_kernel_under_a_torchscript_export_is_a_runtime_fault(
    exports: dict[str, Path],
) -> None:
    model, _ = torch_models.make()
    target = FaultyBackend("/blocks.0/act/Gelu")
    result = onnx_bisect.bisect(exports["script"], ref=model, target=target)
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
