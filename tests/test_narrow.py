"""Root causes one node alone does not show: pattern windows, observer effects, cut search."""

from __future__ import annotations

import math
import shlex
import sys

import pytest

import onnx_bisect
from onnx_bisect import Verdict
from onnx_bisect.engine.search.state import (
    CutSearch,
    backward_windows,
    closure_windows,
    forward_windows,
)
from tests.faulty import FaultyBackend, HiddenFaultBackend, PatternFaultBackend
from tests.models import FAULTY_RUNTIME, TRANSFORMER, YOLO_FUSED, residual

SILU = ("/down1/conv/Conv", "/down1/Sigmoid", "/down1/Mul")


def runtime(*args: str) -> str:
    cmd = [sys.executable, str(FAULTY_RUNTIME), "{model}", "{inputs}", "{outputs}", *args]
    return "exec:" + shlex.join(cmd)


def _check_pattern(result: onnx_bisect.BisectResult, window: tuple[str, ...]) -> None:
    assert result.verdict == "diverged"
    assert result.root_cause is not None
    assert result.root_cause.kind == "pattern"
    assert result.root_cause.nodes == window
    assert result.first_divergence is not None
    assert result.first_divergence.name == window[-1]
    assert result.first_divergence.verdict is Verdict.PATTERN
    assert not result.culprits()


@pytest.mark.parametrize("via", ["adapter", "exec"])
def test_silu_pattern_fault_is_a_three_node_pattern(via: str) -> None:
    target = (
        PatternFaultBackend("/down1/Mul")
        if via == "adapter"
        else runtime("--pattern-fault", "/down1/Mul=0.05")
    )
    result = onnx_bisect.bisect(YOLO_FUSED, target=target)
    assert result.strategy == "scan"
    _check_pattern(result, SILU)
    assert "Conv -> Sigmoid -> Mul" in result.root_cause.reason  # type: ignore[union-attr]


@pytest.mark.parametrize("via", ["adapter", "exec"])
def test_fault_hidden_when_observed_is_found_by_bisect(
    via: str, caplog: pytest.LogCaptureFixture
) -> None:
    node = "/down1/conv/Conv"
    target = (
        HiddenFaultBackend(node) if via == "adapter" else runtime("--hidden-fault", f"{node}=0.05")
    )
    with caplog.at_level("INFO"):
        result = onnx_bisect.bisect(YOLO_FUSED, target=target)
    assert "switching to the bisect strategy" in caplog.text
    assert result.strategy == "scan+bisect"
    assert any("instrumentation changes the target's result" in n for n in result.notes)
    assert result.search is not None and result.search.monotone
    # Observed, the Conv is right. The marking search names its output as the tensor whose
    # marking hides the fault; left unmarked, the cut after the Sigmoid shows it, and the
    # window Conv -> Sigmoid (the Conv's output unobserved) reproduces it.
    conv_out = "/down1/conv/Conv_output_0"
    assert any(n.startswith(f"marking {conv_out!r} alone changes") for n in result.notes)
    assert result.root_cause is not None and result.root_cause.kind == "pattern"
    assert result.root_cause.nodes == SILU[:2]


def test_transformer_hidden_fault_in_layernorm() -> None:
    node = "/ln1/LayerNormalization"
    result = onnx_bisect.bisect(TRANSFORMER, target=HiddenFaultBackend(node))
    assert result.strategy == "scan+bisect"
    # LayerNorm is wrong only while unobserved: its output is the tensor kept unmarked, and
    # the window of it and its first reader (Q) reproduces the fault.
    assert any(
        n.startswith("marking '/ln1/LayerNormalization_output_0' alone changes")
        for n in result.notes
    )
    assert result.root_cause is not None and result.root_cause.kind == "pattern"
    assert result.root_cause.nodes == (node, "/attn/q/MatMul")


def test_explicit_bisect_strategy_run_count_on_a_1000_node_model() -> None:
    model = residual(334, width=16)  # 3 nodes a block + the output Identity
    n = len(model.graph.node)
    assert n >= 1000
    planted = "add300"  # scales the residual stream, so the error reaches the output
    target = FaultyBackend(planted, 0.05)
    result = onnx_bisect.bisect(model, target=target, strategy="bisect")
    assert result.strategy == "bisect"
    assert result.search is not None
    assert result.search.runs <= math.ceil(math.log2(n)) + 3
    assert result.search.transition_node == planted
    assert result.first_divergence is not None and result.first_divergence.name == planted
    assert result.root_cause is not None
    assert result.root_cause.kind == "culprit" and result.root_cause.nodes == (planted,)
    # screen + search + one isolation of the transition node: nothing else runs the target.
    assert result.runs["target"] == 1 + result.search.runs + 1
    assert sum(1 for r in result.nodes if r.verdict is Verdict.NOT_PROBED) > n // 2


def test_bisect_strategy_on_a_plain_kernel_fault_agrees_with_the_scan() -> None:
    scan = onnx_bisect.bisect(YOLO_FUSED, target=FaultyBackend("/c2f1/cv1/conv/Conv"))
    cut = onnx_bisect.bisect(
        YOLO_FUSED, target=FaultyBackend("/c2f1/cv1/conv/Conv"), strategy="bisect"
    )
    assert scan.root_cause == cut.root_cause
    assert cut.root_cause is not None and cut.root_cause.nodes == ("/c2f1/cv1/conv/Conv",)


def test_scan_strategy_reports_the_observer_effect_without_switching() -> None:
    result = onnx_bisect.bisect(
        YOLO_FUSED, target=HiddenFaultBackend("/down1/conv/Conv"), strategy="scan"
    )
    assert result.strategy == "scan" and result.search is None
    assert any("instrumentation changes" in n for n in result.notes)


def test_unknown_strategy_is_an_input_error() -> None:
    with pytest.raises(onnx_bisect.InputError, match="strategy: 'guess' is not one of auto, "):
        onnx_bisect.bisect(YOLO_FUSED, target="ref", strategy="guess")


# The pure search state.


def _monotone(first_bad: int):  # type: ignore[no-untyped-def]
    return lambda p: p >= first_bad


@pytest.mark.parametrize("n", [2, 3, 10, 1000, 1025])
def test_cut_search_finds_every_transition_in_log_steps(n: int) -> None:
    for first_bad in sorted({1, 2, n // 3, n // 2, n - 1, n} - {0}):
        out = CutSearch(0, n).run(_monotone(first_bad))
        assert out.transition == first_bad
        assert out.monotone
        assert out.runs <= math.ceil(math.log2(n)) + 1


def test_cut_search_notices_a_non_monotone_predicate_and_refines() -> None:
    # Diverged at 500 and from 502 on: the binary search lands at 500, the check at 501
    # contradicts it, and the linear pass settles on 502 (diverged and still diverged after).
    out = CutSearch(0, 1000).run(lambda p: p == 500 or p >= 502)
    assert not out.monotone and out.refined
    assert out.transition == 502
    assert out.runs <= math.ceil(math.log2(1000)) + 1 + 9


def test_windows_grow_breadth_first_in_both_directions() -> None:
    # 0 -> 1 -> 3, 0 -> 2 -> 3, 3 -> 4
    producers = {1: [0], 2: [0], 3: [1, 2], 4: [3]}
    consumers = {0: [1, 2], 1: [3], 2: [3], 3: [4]}
    assert list(backward_windows(3, producers, 8)) == [(1, 3), (1, 2, 3), (0, 1, 2, 3)]
    assert list(forward_windows(0, consumers, 3)) == [(0, 1), (0, 1, 2)]
    # Node 0 fans out to 1 and 2: closing over it pulls in the sibling 2.
    assert list(closure_windows(1, {1: [0]}, consumers, 8)) == [(0, 1, 2)]


# Crashes.

CRASH_NODE = "/c2f1/m.0/cv2/Mul"


def _check_crash(result: onnx_bisect.BisectResult, node: str = CRASH_NODE) -> None:
    assert result.verdict == "diverged" and result.strategy == "crash-bisect"
    assert result.root_cause is not None
    assert result.root_cause.kind == "crash" and result.root_cause.nodes == (node,)
    assert result.first_divergence is not None
    assert result.first_divergence.verdict is Verdict.CRASHED
    assert result.search is not None
    assert result.search.runs <= math.ceil(math.log2(len(result.nodes))) + 3


def test_exec_runtime_that_aborts_on_one_node() -> None:
    _check_crash(onnx_bisect.bisect(YOLO_FUSED, target=runtime("--abort-on", CRASH_NODE)))


def test_in_process_backend_that_aborts_runs_in_a_child() -> None:
    spec = f"tests.faulty:AbortingBackend?node={CRASH_NODE}"
    result = onnx_bisect.bisect(YOLO_FUSED, target=spec, isolate_crashes=True, timeout=120)
    _check_crash(result)
    assert "child process" in result.target.description


# Every probe that holds the hanging node waits out the whole timeout, so the hang sits near
# the end of the graph (#160 of 162): most prefixes the search asks about run normally and fast.
HANG_NODE = "/detect/Sigmoid"


def _hang_timeout(argv: list[str]) -> float:
    """A per-run timeout for the hang test: 6 times what one normal (warm) run of the same
    runtime on the whole model takes here, at least 1 s. Too short, and a normal run would count
    as a hang; a fixed 6 s made the test wait ~40 s. A warm run is ~0.2 s on a 2-core machine,
    so this is ~1.2 s there, and slower machines get proportionally more."""
    import subprocess
    import tempfile
    import time
    from pathlib import Path

    import numpy as np

    k = argv.index("--hang-on")
    argv = argv[:k] + argv[k + 2 :]  # the same runtime, without the hang
    with tempfile.TemporaryDirectory() as tmp:
        names = {"model": "m.onnx", "inputs": "in.npz", "outputs": "out.npz"}
        paths = {key: str(Path(tmp) / name) for key, name in names.items()}
        Path(paths["model"]).write_bytes(YOLO_FUSED.read_bytes())
        np.savez(paths["inputs"], images=np.zeros((1, 3, 160, 160), np.float32))
        command = [a.format(**paths) for a in argv]
        took = []
        for _ in range(2):  # the first run warms the caches; time the second
            start = time.perf_counter()
            subprocess.run(command, check=True, capture_output=True, timeout=300)
            took.append(time.perf_counter() - start)
    return max(1.0, 6 * took[-1])


@pytest.mark.slow  # a hang waited out, its timeout measured first
def test_a_hang_past_the_timeout_is_a_crash() -> None:
    target = runtime("--hang-on", HANG_NODE)
    timeout = _hang_timeout(shlex.split(target.removeprefix("exec:")))
    result = onnx_bisect.bisect(YOLO_FUSED, target=target, timeout=timeout)
    _check_crash(result, HANG_NODE)
    assert "timed out" in result.root_cause.reason  # type: ignore[union-attr]


def test_isolate_crashes_needs_a_spec() -> None:
    with pytest.raises(onnx_bisect.InputError, match="spec string"):
        onnx_bisect.bisect(YOLO_FUSED, target=FaultyBackend("x"), isolate_crashes=True)


def test_crash_cli_exits_1_with_a_report(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import json
    import subprocess
    from pathlib import Path

    from tests.models import ROOT

    bisect_bin = Path(sys.executable).parent / "bisect"
    proc = subprocess.run(
        [str(bisect_bin), str(YOLO_FUSED), "-t", runtime("--abort-on", CRASH_NODE), "-o",
         str(tmp_path)],
        capture_output=True, text=True, cwd=ROOT, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 1, proc.stderr
    assert "Root cause (crash)" in proc.stdout
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["root_cause"]["kind"] == "crash"
    assert report["first_divergence"]["status"] == "crashed"


def test_amplification_chain_runs_from_the_root_cause_to_an_output() -> None:
    from tests.models import residual

    result = onnx_bisect.bisect(residual(12), target=FaultyBackend("mm2", 1e-3), threshold=1e-5)
    chain = result.chain
    assert chain[0].node == "mm2" and chain[-1].node == "out"
    assert [c.index for c in chain] == sorted(c.index for c in chain)
    by_name = {n.name: n for n in result.nodes}
    for link in chain[1:]:
        assert link.gain is None or link.gain == pytest.approx(by_name[link.node].amplification)
    report = onnx_bisect.to_dict(result)
    assert [c["node"] for c in report["chain"]] == [c.node for c in chain]


def test_transformer_crash_and_pattern_through_exec() -> None:
    crash = onnx_bisect.bisect(TRANSFORMER, target=runtime("--abort-on", "/attn/Softmax"))
    assert crash.root_cause is not None
    assert crash.root_cause.kind == "crash" and crash.root_cause.nodes == ("/attn/Softmax",)
    hidden = onnx_bisect.bisect(
        TRANSFORMER, target=runtime("--hidden-fault", "/attn/q/MatMul=0.05")
    )
    assert hidden.strategy == "scan+bisect"
    assert hidden.root_cause is not None and hidden.root_cause.kind == "pattern"
    assert "/attn/q/MatMul" in hidden.root_cause.nodes
