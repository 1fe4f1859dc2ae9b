"""The torch backend against ONNX's own backend node tests (written by the ONNX project).

Every case whose operators the backend claims runs on ``torch:cpu`` as written and in float64;
the pass rate must stay at 95% or more of at least 800 cases, as written also 95% of all of
ONNX's node cases (claimed or not), and docs/torch-ops.md must be what this run generates
(regenerate with
``python -m onnx_bisect.backends.torch.coverage --write docs/torch-ops.md``).
"""

from __future__ import annotations

import re

import pytest

from tests.models import ROOT

pytest.importorskip("torch")

from onnx_bisect.backends.torch.coverage import (  # noqa: E402
    CaseResult,
    node_cases,
    render,
    run_cases,
)
from onnx_bisect.backends.torch.ops.registry import UnsupportedOperator, lookup  # noqa: E402

DOC = ROOT / "docs" / "torch-ops.md"


@pytest.fixture(scope="module")
def results() -> list[CaseResult]:
    return run_cases()


@pytest.mark.parametrize("mode", ["float32", "float64"])
def test_node_test_pass_rate(results: list[CaseResult], mode: str) -> None:
    done = [r for r in results if r.mode == mode]
    passed = sum(r.passed for r in done)
    assert len(done) >= 800, f"only {len(done)} cases claimed"
    failing = [f"{r.case}: {r.error}" for r in done if not r.passed]
    assert passed >= 0.95 * len(done), "\n".join(failing)


def test_most_of_all_onnx_node_cases_pass_as_written(results: list[CaseResult]) -> None:
    """Unclaimed cases count as failures here: string tensors, ImageDecoder, random draws."""
    passed = sum(r.passed for r in results if r.mode == "float32")
    assert passed >= 0.95 * len(node_cases()), f"{passed} of {len(node_cases())}"


def test_real_model_operators_are_claimed() -> None:
    """Every operator of YOLOv8, PP-OCRv4 det/rec/cls and silero-vad, at their opsets."""
    needed = {
        17: "Add Cast Concat ConstantOfShape Conv Div Expand Gather MaxPool Mul Range Reshape "
        "Resize Shape Sigmoid Slice Softmax Split Sub Transpose Unsqueeze",
        11: "Add BatchNormalization Cast Clip Concat Constant Conv Div GlobalAveragePool "
        "HardSigmoid Identity MatMul MaxPool Mul Relu Reshape Shape Slice Softmax",
        12: "AveragePool ConvTranspose Pow ReduceMean Resize Sigmoid Sqrt Squeeze Sub Transpose",
        16: "Equal If LSTM Not Pad Size Squeeze Unsqueeze ReduceMean Gather ConstantOfShape",
        18: "Gemm Split Tanh Pad ReduceMean",
    }
    for opset, ops in needed.items():
        for op in ops.split():
            try:
                lookup(op, opset)
            except UnsupportedOperator as exc:
                pytest.fail(str(exc))


def test_docs_table_is_generated_from_this_run(results: list[CaseResult]) -> None:
    def stable(text: str) -> str:
        return re.sub(r"the run took \d+ s", "the run took N s", text)

    assert DOC.exists(), "generate it: python -m onnx_bisect.backends.torch.coverage --write ..."
    assert stable(DOC.read_text()) == stable(render(results, 0)), (
        "docs/torch-ops.md is stale: python -m onnx_bisect.backends.torch.coverage "
        "--write docs/torch-ops.md"
    )


def test_an_operator_it_lacks_names_the_op_and_version() -> None:
    with pytest.raises(UnsupportedOperator, match=r"does not support ImageDecoder version 20"):
        lookup("ImageDecoder", 20)
