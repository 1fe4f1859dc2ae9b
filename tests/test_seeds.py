"""The seed reports, replayed on the example models.

Seed 3: a fusion backend computed LayerNorm wrongly after a dimension swap, and the error went
away with fusion off. Here the transformer block has LayerNormalization right after a
Transpose; the target is ONNX Runtime with its graph optimizations on, the reference the same
runtime with them off.
"""

from __future__ import annotations

import shlex
import sys

import onnx_bisect
from tests.models import FAULTY_RUNTIME, TRANSFORMER

LN = "/ln1/LayerNormalization"


def test_ort_fusions_on_the_transformer_block_are_not_a_divergence() -> None:
    # What ORT actually does: its fusions change the output by ~4e-8 (rel_l2), far below both
    # the default threshold and the fp32 noise floor. No false alarm.
    for threshold in (1e-3, "auto"):
        result = onnx_bisect.bisect(
            TRANSFORMER, ref="cpu?opt=disable", target="cpu", threshold=threshold
        )
        assert result.verdict == "match", threshold
        assert result.outputs[0].metrics["rel_l2"] < 1e-6


def test_ort_fusion_effect_is_attributed_to_the_fused_gelu_not_layernorm() -> None:
    # Asked to explain even that last-bit difference, the tool must find where it comes from:
    # marking every tensor (the scan) makes it vanish, so auto switches to the cut search, and
    # the window that reproduces it is ORT's fused bias+GELU, not the LayerNorm after Transpose.
    result = onnx_bisect.bisect(TRANSFORMER, ref="cpu?opt=disable", target="cpu", threshold=1e-9)
    assert result.verdict == "diverged"
    assert result.strategy == "scan+bisect"
    assert any("instrumentation changes the target's result" in n for n in result.notes)
    assert result.root_cause is not None and result.root_cause.kind == "pattern"
    window = set(result.root_cause.nodes)
    assert {"/act/Erf", "/act/Mul_1"} <= window
    assert LN not in window


def test_planted_layernorm_fusion_fault_stands_in_for_the_seed() -> None:
    # ORT shows no real LayerNorm divergence, so a fault that exists only while LayerNorm's
    # output is unobserved (a fusion bug) stands in, through an exec: runtime.
    cmd = [sys.executable, str(FAULTY_RUNTIME), "{model}", "{inputs}", "{outputs}"]
    cmd += ["--hidden-fault", f"{LN}=0.05"]
    result = onnx_bisect.bisect(TRANSFORMER, target="exec:" + shlex.join(cmd))
    assert result.strategy == "scan+bisect"
    assert result.root_cause is not None and result.root_cause.kind == "pattern"
    assert LN in result.root_cause.nodes
    readers = {"/attn/q/MatMul", "/attn/k/MatMul", "/attn/v/MatMul"}
    assert set(result.root_cause.nodes) == {LN} | readers
