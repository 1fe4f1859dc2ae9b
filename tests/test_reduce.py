"""Repro bundles: smallest reproducing subgraph, ONNX test-case layout, verified repro.py."""

from __future__ import annotations

import shlex
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from markdown_it import MarkdownIt
from onnx import numpy_helper
from onnx.reference import ReferenceEvaluator
from typer.testing import CliRunner

import onnx_bisect
from onnx_bisect.cli import app, bisect_app
from onnx_bisect.repro.verify import load_bundle
from tests.faulty import FaultyBackend
from tests.models import FAULTY_RUNTIME, YOLO, YOLO_FUSED, residual

FAULT = "/down1/conv/Conv"


def runtime(*args: str) -> str:
    cmd = [sys.executable, str(FAULTY_RUNTIME), "{model}", "{inputs}", "{outputs}", *args]
    return "exec:" + shlex.join(cmd)


def _run_script(bundle: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(bundle / "repro.py"), *extra],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip


def _check_layout(bundle: Path) -> None:
    model = onnx.load(str(bundle / "model.onnx"))
    onnx.checker.check_model(model, full_check=True)
    _, inputs, expected = load_bundle(bundle)
    assert set(inputs) == {i.name for i in model.graph.input}
    # The reference, run on the test case, reproduces the recorded outputs.
    got = ReferenceEvaluator(model).run(None, inputs)
    for out, value in zip(model.graph.output, got, strict=True):
        np.testing.assert_allclose(value, expected[out.name], rtol=1e-6, atol=1e-6)
    for f in (bundle / "test_data_set_0").glob("*.pb"):
        t = onnx.TensorProto()
        t.ParseFromString(f.read_bytes())
        assert t.name and numpy_helper.to_array(t).size > 0


def test_kernel_fault_bundle_is_one_node(tmp_path: Path) -> None:
    bundle = tmp_path / "repro"
    result = onnx_bisect.bisect(YOLO, target=runtime("--fault", f"{FAULT}=0.05"), repro=bundle)
    r = result.repro
    assert r is not None and r.reproduces and r.isolated
    assert r.nodes == (FAULT,)
    assert r.nodes_before == 192
    model = onnx.load(str(bundle / "model.onnx"))
    assert [n.name for n in model.graph.node] == [FAULT]
    _check_layout(bundle)
    proc = _run_script(bundle)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "REPRODUCED" in proc.stdout and "rel_l2" in proc.stdout
    assert {p.name for p in bundle.iterdir()} >= {
        "model.onnx", "repro.py", "README.md", "issue.md", "test_data_set_0",
    }  # fmt: skip
    # The same bundle on a correct runtime does not reproduce.
    assert _run_script(bundle, "--target", "cpu?opt=disable").returncode == 0


def test_pattern_bundle_is_exactly_the_three_nodes(tmp_path: Path) -> None:
    bundle = tmp_path / "repro"
    result = onnx_bisect.bisect(
        YOLO_FUSED, target=runtime("--pattern-fault", "/down1/Mul=0.05"), repro=bundle
    )
    r = result.repro
    assert r is not None and r.reproduces
    assert r.nodes == ("/down1/conv/Conv", "/down1/Sigmoid", "/down1/Mul")
    _check_layout(bundle)
    assert _run_script(bundle).returncode == 1


def test_context_only_divergence_is_not_claimed_to_reproduce_in_isolation(
    tmp_path: Path,
) -> None:
    node = "/detect/cv2.1/cv2.1.1/conv/Conv"  # index 106: only a 100-node graph shows it
    bundle = tmp_path / "repro"
    result = onnx_bisect.bisect(
        YOLO_FUSED, target=runtime("--context-fault", f"{node}=0.05:100"), repro=bundle
    )
    r = result.repro
    assert r is not None and r.reproduces and not r.isolated
    assert r.message.startswith("does not reproduce in isolation, smallest reproducing subgraph")
    assert f"has {len(r.nodes)} nodes" in r.message
    assert len(r.nodes) >= 100
    assert _run_script(bundle).returncode == 1


def test_crash_bundle_reproduces_the_crash(tmp_path: Path) -> None:
    bundle = tmp_path / "repro"
    node = "/c2f1/m.0/cv2/Mul"
    result = onnx_bisect.bisect(YOLO_FUSED, target=runtime("--abort-on", node), repro=bundle)
    r = result.repro
    assert r is not None and r.kind == "crash" and r.reproduces
    assert r.nodes == (node,)
    proc = _run_script(bundle)
    assert proc.returncode == 1 and "crash" in proc.stdout.lower()


def test_target_object_is_verified_in_process(tmp_path: Path) -> None:
    result = onnx_bisect.bisect(YOLO, target=FaultyBackend(FAULT), repro=tmp_path / "r")
    assert result.repro is not None and result.repro.reproduces
    assert result.repro.nodes == (FAULT,)


def test_issue_md_is_valid_markdown_and_small_for_a_1000_node_model(tmp_path: Path) -> None:
    model = residual(334, width=16)
    path = tmp_path / "big.onnx"
    onnx.save(model, str(path))
    out = tmp_path / "out"
    res = CliRunner().invoke(
        bisect_app, [str(path), "-t", runtime("--fault", "add300=0.05"), "-o", str(out)]
    )
    assert res.exit_code == 1, res.output
    issue = (out / "repro" / "issue.md").read_text()
    assert len(issue.encode()) <= 25_000
    tokens = MarkdownIt("commonmark").enable(["table", "strikethrough"]).parse(issue)
    assert tokens[0].type == "heading_open"
    assert any(t.type == "table_open" for t in tokens)
    assert "```mermaid" in issue and "<details>" not in issue  # the report is attached
    assert "add300" in issue and "python repro.py" in issue


def test_reduce_and_repro_subcommands(tmp_path: Path) -> None:
    runner = CliRunner()
    bundle = tmp_path / "b"
    res = runner.invoke(
        app, ["reduce", str(YOLO), "-t", runtime("--fault", f"{FAULT}=0.05"), "-o", str(bundle)]
    )
    assert res.exit_code == 1, res.output
    assert "1 of 192 nodes" in res.stdout
    res = runner.invoke(app, ["repro", str(bundle)])
    assert res.exit_code == 1 and "REPRODUCED" in res.stdout
    res = runner.invoke(app, ["repro", str(bundle), "--target", "cpu"])
    assert res.exit_code == 0
    res = runner.invoke(app, ["repro", str(tmp_path / "nothing")])
    assert res.exit_code == 2 and "not a repro bundle" in res.stderr
    res = runner.invoke(app, ["reduce", str(YOLO), "-t", "cpu?opt=disable", "-o", str(bundle)])
    assert res.exit_code == 0


@pytest.mark.parametrize("flag", ["--no-repro"])
def test_no_repro_flag(tmp_path: Path, flag: str) -> None:
    res = CliRunner().invoke(
        bisect_app,
        [str(YOLO), "-t", runtime("--fault", f"{FAULT}=0.05"), "-o", str(tmp_path), flag],
    )
    assert res.exit_code == 1 and not (tmp_path / "repro").exists()


def test_a_region_bug_is_reduced_to_a_range_of_ancestors(tmp_path: Path) -> None:
    # Wrong only in graphs of at least 20 nodes: no window of 8 shows it, a range does.
    node = "/detect/cv2.1/cv2.1.1/conv/Conv"
    result = onnx_bisect.bisect(
        YOLO_FUSED, target=runtime("--context-fault", f"{node}=0.05:20"), repro=tmp_path / "r"
    )
    r = result.repro
    assert r is not None and r.reproduces and r.isolated
    assert 20 <= len(r.nodes) <= 64 and r.nodes[-1] == node
    assert len(r.nodes) < r.nodes_before
