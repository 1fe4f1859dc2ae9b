"""Localization against real runtimes with planted faults: the tool must name exactly the node."""

from __future__ import annotations

import json
import math
import shlex

import numpy as np
import pytest

import onnx_bisect
from onnx_bisect import Verdict
from onnx_bisect.graph.extract import derived_kind
from tests.faulty import FaultyBackend, RefusingBackend
from tests.models import FAULTY_RUNTIME, TRANSFORMER, YOLO, first_conv, residual

FAULT_NODE = "/down1/conv/Conv"


def exec_target(py: str, *faults: str, reject: str | None = None) -> str:
    args = [py, str(FAULTY_RUNTIME), "{model}", "{inputs}", "{outputs}"]
    for f in faults:
        args += ["--fault", f]
    if reject:
        args += ["--reject", reject]
    return "exec:" + shlex.join(args)


def _check_planted(result: onnx_bisect.BisectResult, node: str) -> None:
    assert result.verdict == "diverged"
    assert result.first_divergence is not None
    assert result.first_divergence.name == node
    assert result.root_cause is not None
    assert result.root_cause.kind == "culprit"
    assert result.root_cause.nodes == (node,)
    culprits = [n.name for n in result.culprits()]
    assert culprits == [node]
    by_name = {n.name: n for n in result.nodes}
    fault = by_name[node]
    assert fault.isolated is not None and fault.isolated.score == pytest.approx(0.05, rel=1e-3)
    # Everything before the fault is clean; everything that diverges after it is propagated.
    assert all(n.verdict is Verdict.OK for n in result.nodes if n.index < fault.index)
    after = [n for n in result.nodes if n.index > fault.index and n.diverged]
    assert after, "a 5% error must reach downstream nodes"
    assert all(n.verdict is Verdict.PROPAGATED for n in after)
    assert result.nodes[-1].verdict is Verdict.PROPAGATED  # the head sees it too


def test_planted_conv_fault_python_adapter() -> None:
    target = FaultyBackend(FAULT_NODE, 0.05)
    result = onnx_bisect.bisect(YOLO, ref="cpu", target=target)
    _check_planted(result, FAULT_NODE)
    # screen + scan + one isolation run: the simple case needs no more than that.
    assert result.runs["target"] == 3
    assert target.runs == 3


def test_planted_conv_fault_exec_runtime(py: str, tmp_path) -> None:
    result = onnx_bisect.bisect(YOLO, ref="cpu", target=exec_target(py, f"{FAULT_NODE}=0.05"))
    _check_planted(result, FAULT_NODE)
    written = onnx_bisect.write_reports(result, tmp_path)
    assert {p.relative_to(tmp_path).as_posix() for p in written} - {"error_curve.png"} == {
        "report.json", "report.md", "nodes.csv", "report.html", "inputs.npz",
        "explorer/accumulated.json", "explorer/isolated.json", "explorer/view.json",
    }  # fmt: skip  # the png: with matplotlib
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["schema"] == "onnx-bisect/report/v1"
    assert report["verdict"] == "diverged"
    assert report["first_divergence"]["node"] == FAULT_NODE
    assert report["first_divergence"]["op_type"] == "Conv"
    assert report["root_cause"] == {
        "kind": "culprit",
        "nodes": [FAULT_NODE],
        "reason": result.root_cause.reason,  # type: ignore[union-attr]
        "message": "",
        "workaround": None,
        "workaround_verified": False,
        "model_message": "",
        "fails_at": None,
        # The node's scoped name, /down1/conv/Conv, gives its module path.
        "source": {"module": "down1.conv", "class": None, "file": None, "line": None,
                   "code": None},
    }
    verdicts = {n["node"]: n["verdict"] for n in report["nodes"]}
    assert verdicts[FAULT_NODE] == "culprit"
    assert "propagated" in verdicts.values()


def test_fault_in_other_conv_and_transformer() -> None:
    node = first_conv(skip=5)
    _check_planted(onnx_bisect.bisect(YOLO, ref="cpu", target=FaultyBackend(node)), node)
    result = onnx_bisect.bisect(TRANSFORMER, target=FaultyBackend("/attn/q/MatMul"))
    _check_planted(result, "/attn/q/MatMul")


def test_amplification_through_residual_adds() -> None:
    # mm0 is wrong by 5%; the Adds and MatMuls downstream carry it at some gain.
    result = onnx_bisect.bisect(residual(4), target=FaultyBackend("mm0", 0.05))
    _check_planted(result, "mm0")
    add = {n.name: n for n in result.nodes}["add0"]
    assert add.amplification is not None and math.isfinite(add.amplification)
    assert add.amplification > 0


@pytest.mark.parametrize("model", [YOLO, TRANSFORMER], ids=["yolo", "transformer"])
@pytest.mark.parametrize("target", ["cpu?opt=disable", "ref"])
def test_no_false_alarm(model, target: str) -> None:
    result = onnx_bisect.bisect(model, ref="cpu", target=target)
    assert result.verdict == "match", [c.reason for c in result.outputs]
    assert result.first_divergence is None and result.root_cause is None
    assert {k: v for k, v in result.runs.items() if k != "float64"} == {"ref": 1, "target": 1}


def test_memory_budget_splits_scan_and_gives_same_answer() -> None:
    whole = onnx_bisect.bisect(YOLO, target=FaultyBackend(FAULT_NODE))
    target = FaultyBackend(FAULT_NODE)
    small = onnx_bisect.bisect(YOLO, target=target, max_memory=4 << 20)
    assert small.runs["target"] > whole.runs["target"] + 4
    # The reference's scan splits too; in turns with the target, as 4 MiB cannot hold both
    # runtimes' copies of the weights beside their chunks, so in chunks twice as large.
    assert small.runs["ref"] > whole.runs["ref"] + 2
    _check_planted(small, FAULT_NODE)
    a = onnx_bisect.to_frame(whole)[["node", "verdict", "accumulated", "isolated"]]
    b = onnx_bisect.to_frame(small)[["node", "verdict", "accumulated", "isolated"]]
    assert (a["verdict"] == b["verdict"]).all()
    # Different marked outputs let ORT fuse differently, so values agree to rounding only.
    np.testing.assert_allclose(a["accumulated"], b["accumulated"], rtol=1e-4, atol=1e-9)


def test_target_missing_a_kernel_is_reported_per_node() -> None:
    # The full model runs (the refusing op is absent from it) but isolation batches that
    # contain Softmax fail; the failing node is found by splitting, and named.
    class SoftmaxlessIsolation(RefusingBackend):
        def _run(self, model, feeds):  # type: ignore[no-untyped-def]
            if derived_kind(model) == "isolated":
                return super()._run(model, feeds)
            return self.inner.run(model, feeds)

    target = SoftmaxlessIsolation("Softmax")
    target.inner = FaultyBackend(FAULT_NODE)
    result = onnx_bisect.bisect(YOLO, target=target)
    softmax = [n for n in result.nodes if n.op_type == "Softmax"]
    assert softmax and all(n.verdict is Verdict.UNSUPPORTED for n in softmax)
    assert "not implemented" in softmax[0].note
    assert result.root_cause is not None and result.root_cause.nodes == (FAULT_NODE,)


def test_openvino_default_precision_diverges_on_bf16_cpus() -> None:
    pytest.importorskip("openvino")
    from onnx_bisect.backends.openvino import default_precision

    if default_precision("CPU") != "bf16":
        pytest.skip("this CPU has no bf16 support, so OpenVINO runs fp32 by default and matches")
    result = onnx_bisect.bisect(YOLO, ref="cpu", target="openvino")
    # bf16 chosen unasked: a finding, whose cause is the precision and whose workaround runs.
    assert result.verdict == "diverged"
    assert result.root_cause is not None and result.root_cause.kind == "precision"
    assert result.root_cause.workaround == "openvino?precision=f32"
    assert "bf16" in result.target.description
    assert result.target_precision.source == "observed" and not result.target_precision.asked
    assert not result.culprits()


def test_openvino_f32_matches() -> None:
    pytest.importorskip("openvino")
    result = onnx_bisect.bisect(YOLO, ref="cpu", target="openvino?precision=f32")
    assert result.verdict == "match"


def test_nodes_csv_matches_the_dataframe(tmp_path) -> None:
    import pandas as pd

    result = onnx_bisect.bisect(YOLO, target=FaultyBackend(FAULT_NODE))
    onnx_bisect.write_reports(result, tmp_path, formats=("csv",))
    from_csv = pd.read_csv(tmp_path / "nodes.csv", keep_default_na=False, na_values=[""])
    frame = onnx_bisect.to_frame(result)
    assert list(from_csv.columns) == list(frame.columns)
    assert list(from_csv["node"]) == list(frame["node"])
    np.testing.assert_allclose(from_csv["accumulated"], frame["accumulated"], rtol=1e-12)
    np.testing.assert_array_equal(from_csv["isolated"].isna(), frame["isolated"].isna())


def test_serial_and_parallel_runs_agree() -> None:
    a = onnx_bisect.bisect(YOLO, target=FaultyBackend(FAULT_NODE), parallel=False)
    b = onnx_bisect.bisect(YOLO, target=FaultyBackend(FAULT_NODE), parallel=True)
    assert [n.verdict for n in a.nodes] == [n.verdict for n in b.nodes]
    assert a.root_cause == b.root_cause


def test_always_scan_gives_per_node_errors_on_a_match() -> None:
    result = onnx_bisect.bisect(YOLO, target="cpu?opt=disable", always_scan=True)
    assert result.verdict == "match" and result.root_cause is None
    assert len(result.nodes) == 192
    assert all(n.verdict is Verdict.OK for n in result.nodes)
    assert all(n.accumulated is not None for n in result.nodes)
    # Constants compute nothing from the inputs, so they are compared but never isolated.
    computed = [n for n in result.nodes if n.op_type != "Constant"]
    assert computed and all(n.isolated is not None for n in computed)
    # A 0.01% fault stays under the output threshold but is found inside the graph.
    hidden = onnx_bisect.bisect(
        YOLO, target=FaultyBackend(FAULT_NODE, 1e-4), always_scan=True, threshold=5e-5
    )
    assert hidden.verdict == "match"
    assert hidden.first_divergence is not None and hidden.first_divergence.name == FAULT_NODE
    assert hidden.root_cause is not None and hidden.root_cause.nodes == (FAULT_NODE,)
    assert any("do not reach" in n or "does not reach" in n for n in hidden.notes)


def test_float64_reference_feeds_the_target_in_its_own_dtype() -> None:
    result = onnx_bisect.bisect(YOLO, ref="ref?dtype=float64", target=FaultyBackend(FAULT_NODE))
    _check_planted(result, FAULT_NODE)
    assert not [n for n in result.nodes if n.verdict in (Verdict.FAILED, Verdict.UNSUPPORTED)]
    clean = onnx_bisect.bisect(TRANSFORMER, ref="ref?dtype=float64", target="cpu", always_scan=True)
    assert clean.verdict == "match" and clean.first_divergence is None


def test_many_culprits_are_called_a_precision_policy() -> None:
    pytest.importorskip("openvino")
    from onnx_bisect.backends.openvino import default_precision

    if default_precision("CPU") != "bf16":
        pytest.skip("OpenVINO runs fp32 here")
    # Without precision floors (a fixed threshold) bf16 makes every Conv a culprit, and the
    # note says what explains them.
    result = onnx_bisect.bisect(YOLO, target="openvino", threshold=1e-4)
    assert len(result.culprits()) >= 5
    assert any("the target computes in bfloat16" in n for n in result.notes)
    planted = onnx_bisect.bisect(YOLO, target=FaultyBackend(FAULT_NODE))
    assert not any("computes in" in n or "lower precision" in n for n in planted.notes)
