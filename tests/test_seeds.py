"""The seed reports, replayed on the example models.

Seed 3: a fusion backend computed LayerNorm wrongly after a dimension swap, and the error went
away with fusion off. Here the transformer block has LayerNormalization right after a
Transpose; the target is ONNX Runtime with its graph optimizations on, the reference the same
runtime with them off.

What ORT's fusions do to these numbers depends on the CPU and the ORT version (which kernels
run, which nodes get fused), so the unplanted tests measure the effect directly and check the
tool against that, instead of pinning one machine's numbers.
"""

from __future__ import annotations

import shlex
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import onnx
import onnxruntime as ort
import pytest

import onnx_bisect
from tests.models import FAULTY_RUNTIME, TRANSFORMER

LN = "/ln1/LayerNormalization"
EPS32 = float(np.finfo(np.float32).eps)  # 2**-23: one float32 ulp, relative
# A last-bit effect: fusions reorder or rewrite float32 arithmetic (ORT's BiasGelu has its own
# erf), each output element moving by about an ulp of the output's scale (ORT 1.32, x86-64:
# at most 0.6 ulp; rel_l2 4e-8, 0.3 ulp). 4 ulps leaves room for other kernels and CPUs and is
# still 1e5 times below a real fault (the planted one is 5e-2).
FUSION_ULPS = 4


def _ort(level: ort.GraphOptimizationLevel, optimized: Path | None = None) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.graph_optimization_level = level
    options.log_severity_level = 3  # no warning about saving an NCHWc-optimized model
    if optimized is not None:
        options.optimized_model_filepath = str(optimized)
    return ort.InferenceSession(str(TRANSFORMER), options, providers=["CPUExecutionProvider"])


def _fusion_effect(
    feeds: Mapping[str, npt.NDArray[Any]],
) -> tuple[npt.NDArray[np.float32], npt.NDArray[np.float32]]:
    """The transformer's output without ORT's graph optimizations, and with all of them."""
    plain = _ort(ort.GraphOptimizationLevel.ORT_DISABLE_ALL).run(None, dict(feeds))[0]
    fused = _ort(ort.GraphOptimizationLevel.ORT_ENABLE_ALL).run(None, dict(feeds))[0]
    return plain, fused


def _rewritten_nodes() -> set[str]:
    """The transformer's nodes that ORT (all optimizations, this CPU) removes, fuses away or
    replaces: every node not found under its name with its op in ORT's optimized graph."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "optimized.onnx"
        _ort(ort.GraphOptimizationLevel.ORT_ENABLE_ALL, path)
        kept = {(n.name, n.domain, n.op_type) for n in onnx.load(str(path)).graph.node}
    nodes = onnx.load(str(TRANSFORMER)).graph.node
    return {n.name for n in nodes if (n.name, n.domain, n.op_type) not in kept}


def test_ort_fusions_on_the_transformer_block_are_not_a_divergence() -> None:
    # What ORT actually does: its fusions change the output by a last-bit amount, far below
    # both the default threshold and the fp32 noise floor. No false alarm.
    for threshold in (1e-3, "auto"):
        result = onnx_bisect.bisect(
            TRANSFORMER, ref="cpu?opt=disable", target="cpu", threshold=threshold
        )
        assert result.verdict == "match", threshold
        plain, fused = _fusion_effect(result.inputs)
        diff = np.abs(plain.astype(np.float64) - fused)
        assert diff.max() <= FUSION_ULPS * EPS32 * np.abs(plain).max()
        assert result.outputs[0].metrics["rel_l2"] <= FUSION_ULPS * EPS32
        # The tool reports the effect exactly as it is: the same float64 ‖t−r‖₂ / ‖r‖₂ of the
        # same ORT outputs, equal up to float64 summation order.
        rel_l2 = np.linalg.norm(diff) / np.linalg.norm(plain.astype(np.float64))
        assert result.outputs[0].metrics["rel_l2"] == pytest.approx(rel_l2, rel=1e-12, abs=0)


def test_ort_fusion_effect_is_attributed_to_a_fused_node_not_layernorm() -> None:
    # Asked to explain even that last-bit difference, the tool must find where it comes from:
    # a window that holds a node ORT actually fused away on this machine (the fused bias+GELU
    # with ORT 1.32 on x86-64), not the LayerNorm after the Transpose that the seed suspected.
    feeds = {"x": np.random.default_rng(0).standard_normal((1, 64, 16)).astype(np.float32)}
    plain, fused = _fusion_effect(feeds)
    diff = plain.astype(np.float64) - fused
    rel_l2 = float(np.linalg.norm(diff) / np.linalg.norm(plain.astype(np.float64)))
    run = dict(model=TRANSFORMER, ref="cpu?opt=disable", target="cpu", inputs=feeds)
    if rel_l2 == 0:
        assert onnx_bisect.bisect(**run, atol=0, rtol=0).verdict == "match"
        pytest.skip(f"ORT {ort.__version__}'s fusions are bit-exact on this machine: no effect")
    # Half the measured effect: a threshold the output fails, whatever this machine's effect.
    result = onnx_bisect.bisect(**run, threshold=rel_l2 / 2)
    assert result.verdict == "diverged"
    assert result.root_cause is not None and result.root_cause.kind in ("culprit", "pattern")
    window = set(result.root_cause.nodes)
    rewritten = _rewritten_nodes()
    assert window & rewritten, (window, rewritten)
    if LN not in rewritten:
        assert LN not in window
    # Marking every tensor as an output stops ORT fusing across them; when that hides the
    # effect, auto must say so and switch to the cut search, which keeps the fusions.
    switched = any("instrumentation changes the target's result" in n for n in result.notes)
    assert result.strategy == ("scan+bisect" if switched else "scan")


def test_planted_layernorm_fusion_fault_stands_in_for_the_seed() -> None:
    # ORT shows no real LayerNorm divergence, so a fault that exists only while LayerNorm's
    # output is unobserved (a fusion bug) stands in, through an exec: runtime. Unlike ORT's
    # fusions, this is the same on every machine: scanning hides it, the marking search names
    # LayerNorm's output, and with it unobserved the window LayerNorm -> Q shows it.
    cmd = [sys.executable, str(FAULTY_RUNTIME), "{model}", "{inputs}", "{outputs}"]
    cmd += ["--hidden-fault", f"{LN}=0.05"]
    result = onnx_bisect.bisect(TRANSFORMER, target="exec:" + shlex.join(cmd))
    assert result.strategy == "scan+bisect"
    assert result.root_cause is not None and result.root_cause.kind == "pattern"
    assert LN in result.root_cause.nodes
    assert result.root_cause.nodes == (LN, "/attn/q/MatMul")
