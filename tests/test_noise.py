"""Noise-floor thresholds (--threshold auto): subtle real faults caught, fp32 rounding not."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

import onnx_bisect
from onnx_bisect.cli import bisect_app
from onnx_bisect.compare.criterion import NOISE_EPS, NOISE_K
from onnx_bisect.engine.oracle.job import ORACLE
from tests.faulty import FaultyBackend
from tests.models import TRANSFORMER, YOLO, YOLO_FUSED

EARLY_CONV = "/stem/conv/Conv"


def test_a_subtle_early_conv_fault_is_caught_only_with_auto() -> None:
    fixed = onnx_bisect.bisect(YOLO, target=FaultyBackend(EARLY_CONV, 0.002), threshold=1e-3)
    assert fixed.verdict == "match"  # 0.2% at the first Conv stays under rel_l2 1e-3 at the end
    auto = onnx_bisect.bisect(YOLO, target=FaultyBackend(EARLY_CONV, 0.002), threshold="auto")
    assert auto.verdict == "diverged"
    assert auto.first_divergence is not None and auto.first_divergence.name == EARLY_CONV
    assert auto.root_cause is not None
    assert auto.root_cause.kind == "culprit" and auto.root_cause.nodes == (EARLY_CONV,)
    acc = auto.first_divergence.accumulated
    assert acc is not None and acc.noise is not None and acc.threshold is not None
    # Both numbers are reported: the noise floor and the threshold built from it.
    assert acc.threshold == pytest.approx(NOISE_K * acc.noise + NOISE_EPS)
    assert acc.noise < 1e-6 < acc.score
    assert "float64" in auto.timings


@pytest.mark.parametrize("model", [YOLO, YOLO_FUSED, TRANSFORMER], ids=lambda p: p.stem)
@pytest.mark.parametrize("target", ["cpu?opt=disable", "ref"])
def test_no_false_alarm_inside_the_graph(model: Path, target: str) -> None:
    result = onnx_bisect.bisect(model, target=target, threshold="auto", always_scan=True)
    assert result.verdict == "match"
    assert result.first_divergence is None, result.first_divergence
    assert not result.culprits()
    ratios = [
        n.accumulated.score / n.accumulated.threshold
        for n in result.nodes
        if n.accumulated is not None and n.accumulated.threshold
    ]
    assert ratios and max(ratios) < 0.5  # a wide margin, not a near miss


def test_auto_with_another_metric_is_the_fixed_default() -> None:
    # Noise floors exist for rel_l2 only; "auto" (the default) means 1e-3 for other metrics.
    result = onnx_bisect.bisect(YOLO, target="ref", threshold="auto", metric="max_abs")
    assert not result.criterion.auto and result.criterion.threshold == 1e-3


def test_cli_threshold_auto_writes_both_numbers(tmp_path: Path) -> None:
    res = CliRunner().invoke(
        bisect_app,
        [str(YOLO), "-t", "cpu?opt=disable", "--threshold", "auto", "--always-scan", "-o",
         str(tmp_path)],
    )  # fmt: skip
    assert res.exit_code == 0, res.output
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["criterion"] == f"rel_l2 > {NOISE_K:g} × fp32 noise + {NOISE_EPS:g}"
    node = report["nodes"][0]["accumulated"]
    assert isinstance(node["noise"], float) and isinstance(node["threshold"], float)
    header = (tmp_path / "nodes.csv").read_text().splitlines()[0]
    assert "threshold" in header and "noise" in header
    bad = CliRunner().invoke(bisect_app, [str(YOLO), "-t", "ref", "--threshold", "soon"])
    assert bad.exit_code == 2 and "a number, or 'auto'" in bad.stderr


def test_noise_k_and_eps_are_configurable() -> None:
    result = onnx_bisect.bisect(
        YOLO, target="cpu?opt=disable", threshold="auto", noise_k=2.0, noise_eps=1e-4,
        always_scan=True,
    )  # fmt: skip
    acc = result.nodes[0].accumulated
    assert acc is not None and acc.noise is not None
    assert acc.threshold == pytest.approx(2.0 * acc.noise + 1e-4)
    assert result.criterion.describe() == "rel_l2 > 2 × fp32 noise + 0.0001"


def test_without_torch_onnx_reference_is_the_oracle_and_the_note_names_the_extra(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # `make demo` installs no torch: its diagnosis must be the same, its note free of a dead
    # child's traceback.
    monkeypatch.setitem(sys.modules, "torch", None)  # ``import torch`` now fails
    auto = onnx_bisect.bisect(YOLO, target=FaultyBackend(EARLY_CONV, 0.002), threshold="auto")
    assert auto.root_cause is not None and auto.root_cause.nodes == (EARLY_CONV,)
    (note,) = (n for n in auto.notes if "float64 values from" in n)
    assert note.startswith(
        "--threshold auto: float64 values from onnx.reference.ReferenceEvaluator"
    )
    assert note.endswith(
        f" ({ORACLE}: backend '{ORACLE}' is not available: torch is not installed; "
        "install it with: pip install 'onnx-bisect[torch]')"
    )
