"""Which side is wrong: where float64 sides with the target (the reference's kernel is the less
exact one), the answer says so, names the reference's node, and the target is not called
diverged (exit 0 with that note)."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

import onnx_bisect
from onnx_bisect import Verdict
from onnx_bisect.cli import bisect_app
from onnx_bisect.report.markdown import render_markdown
from onnx_bisect.report.serialize import to_dict
from onnx_bisect.result import CauseKind
from tests.faulty import FaultyBackend
from tests.models import chain
from tests.quant_models import lstm, quantized

pytest.importorskip("torch")

runner = CliRunner()


def test_a_reference_kernel_one_percent_off_is_named_and_the_target_is_not_diverged() -> None:
    """A reference whose one node is 1% off: the target agrees with float64 everywhere."""
    model = chain(4)
    result = onnx_bisect.bisect(model, ref=FaultyBackend("mm1", 0.01), target="cpu")
    assert result.verdict == "match"
    rc = result.root_cause
    assert rc is not None and rc.kind is CauseKind.REFERENCE and rc.nodes == ("mm1",)
    row = next(n for n in result.nodes if n.name == "mm1")
    assert row.verdict is Verdict.REFERENCE_OFF
    assert (
        "the target agrees with float64 and the reference does not: the reference's kernel of "
        "MatMul 'mm1' is the less exact side, so the target is not called diverged"
    ) in result.notes
    assert (
        result.summary()
        .splitlines()[0]
        .endswith(
            "the target agrees with float64; the reference's MatMul 'mm1' is the less exact side "
            f"({result.timings['total']:.2f}s)"
        )
    )
    assert to_dict(result)["root_cause"]["kind"] == "reference"
    markdown = render_markdown(result)
    assert "**No divergence**: the target agrees with float64; the reference's MatMul" in markdown
    assert "- **Root cause (reference):** `mm1`. MatMul 'mm1': fed the same inputs" in markdown


def test_a_wrong_target_beside_a_wrong_reference_is_still_diverged() -> None:
    """The reference off at one node, the target at another: float64 does not side with the
    target at the outputs, so the divergence stands."""

    result = onnx_bisect.bisect(
        chain(4), ref=FaultyBackend("mm1", 0.01), target=FaultyBackend("mm3", 0.05)
    )
    assert result.verdict == "diverged"


def test_onnx_runtimes_dynamic_quantize_lstm_is_the_weaker_side(tmp_path: Path) -> None:
    """The measured case: com.microsoft DynamicQuantizeLSTM, whose ONNX Runtime kernel quantizes
    the activations to uint8; OpenVINO computes it on the dequantized weights in float32, as
    the float64 oracle does (backends/torch/ops/contrib.py)."""
    pytest.importorskip("openvino")
    _, dynamic = quantized(lstm(), tmp_path, "dynamic", op_types_to_quantize=["LSTM"])
    out = tmp_path / "out"
    cli = runner.invoke(
        bisect_app,
        [str(dynamic), "--ref", "cpu", "--target", "openvino?precision=f32", "--out", str(out)],
    )
    assert cli.exit_code == 0, cli.output
    first = cli.output.splitlines()[0]
    assert first.startswith("No divergence: openvino?precision=f32 vs cpu on ")
    assert "the target agrees with float64; the reference's DynamicQuantizeLSTM 'lstm_quant' is " \
        "the less exact side" in first  # fmt: skip
    assert "Root cause (reference): lstm_quant — DynamicQuantizeLSTM 'lstm_quant'" in cli.output
