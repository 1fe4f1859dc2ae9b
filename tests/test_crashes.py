"""A runtime that dies in process (a segfault, an abort, an exit) never takes the tool down:
by default every in-process runtime runs in a long-lived worker process, and a crash is
localized as under ``--isolate-crashes``: exit 1, the node named, a report and a verified
bundle. The runtime is a plugin adapter (tests/crashing_runtime.py) in front of ONNX Runtime."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from typer.testing import CliRunner

import onnx_bisect
from onnx_bisect.backends.registry import create_backend
from onnx_bisect.cli import bisect_app
from onnx_bisect.errors import BackendCrash, BackendError
from onnx_bisect.process import REF_WORKER_ENV
from onnx_bisect.result import CauseKind, Verdict
from tests.models import chain

runner = CliRunner()
PLUGIN = Path(__file__).with_name("crashing_runtime.py")
NODE = "act5"  # the Tanh of the 6th of 12 blocks
REASON = (
    f"the target crashes whenever Tanh '{NODE}' is in the model, and runs every smaller "
    "prefix of the graph"
)


@pytest.fixture
def model(tmp_path: Path) -> Path:
    path = tmp_path / "chain.onnx"
    onnx.save(chain(12), path)
    return path


def crashing(how: str, node: str = NODE) -> str:
    return f"{PLUGIN}:Crashing?node={node}&how={how}"


@pytest.mark.slow
@pytest.mark.parametrize(("how", "signal"), [("segv", 11), ("abort", 6)])
def test_a_runtime_that_dies_in_process_is_localized_with_no_flag(
    how: str, signal: int, model: Path, tmp_path: Path
) -> None:
    out = tmp_path / "r"
    spec = crashing(how)
    res = runner.invoke(bisect_app, [str(model), "--target", spec, "-o", str(out)])
    assert res.exit_code == 1, res.output
    report = json.loads((out / "report.json").read_text())
    cause = report["root_cause"]
    assert (cause["kind"], cause["nodes"], cause["reason"]) == ("crash", [NODE], REASON)
    assert cause["message"] == f"{spec}: exited with signal {signal}:\ndying on {NODE}"
    assert report["repro"]["kind"] == "crash" and report["repro"]["nodes"] == [NODE]
    assert report["repro"]["reproduces"], report["repro"]["message"]
    assert (out / "report.md").is_file() and (out / "repro" / "repro.py").is_file()
    # The first crash was in the worker; the search ran each prefix in a fresh child.
    notes = "\n".join(report["notes"])
    assert f"{spec} crashed in its worker process" in notes


def test_the_api_survives_a_crash_too(model: Path) -> None:
    result = onnx_bisect.bisect(model, target=crashing("abort"), repro=None)
    assert result.root_cause is not None and result.root_cause.kind is CauseKind.CRASH
    assert result.root_cause.nodes == (NODE,)
    assert result.first_divergence is not None
    assert result.first_divergence.verdict is Verdict.CRASHED


def test_one_worker_serves_every_run_until_a_crash_then_a_child_per_run() -> None:
    backend = create_backend(crashing("exit", node="mm1"), in_child=None)
    feeds = {"x": np.ones((2, 8), np.float32)}
    for _ in range(3):
        backend.run(chain(1), feeds)  # no mm1 in a chain of one block
    pids = [n for n in backend.notes() if n.startswith("ran in process")]
    assert len(pids) == 1, backend.notes()
    with pytest.raises(BackendCrash) as err:
        backend.run(chain(2), feeds)
    assert str(err.value) == f"{crashing('exit', node='mm1')}: exited with code 3: dying on mm1"
    assert backend.capabilities.process_per_run
    for _ in range(2):
        backend.run(chain(1), feeds)
    pids = [n for n in backend.notes() if n.startswith("ran in process")]
    assert len(pids) == 3, backend.notes()  # the worker (which died), two fresh ones


def test_an_error_the_runtime_reports_keeps_the_worker() -> None:
    backend = create_backend("cpu", in_child=None)
    model = chain(1)
    model.graph.node[0].op_type = "NoSuchOp"
    with pytest.raises(BackendError) as err:
        backend.run(model, {"x": np.ones((2, 8), np.float32)})
    assert not isinstance(err.value, BackendCrash)
    assert "NoSuchOp" in str(err.value)
    assert not backend.capabilities.process_per_run
    out = backend.run(chain(1), {"x": np.ones((2, 8), np.float32)})
    assert set(out) == {"y"}


def ref_crash_error(spec: str, signal: int) -> str:
    return (
        f"error: reference failed: {spec} crashes whenever Tanh '{NODE}' (#11) is in the model, "
        f"and runs every smaller prefix of the graph (exited with signal {signal}: dying on "
        f"{NODE}); choose another --ref"
    )


def test_a_crashing_reference_is_an_error_not_a_dead_tool(model: Path, tmp_path: Path) -> None:
    """With --isolate-crashes the reference runs in a worker from the start: its crash is an
    error naming the node (exit 2), found by the binary search over prefixes."""
    spec = crashing("segv")
    argv = [str(model), "--ref", spec, "--target", "cpu", "--isolate-crashes"]
    argv += ["-o", str(tmp_path / "r")]
    res = runner.invoke(bisect_app, argv)
    assert res.exit_code == 2, res.output
    assert res.output.strip() == ref_crash_error(spec, 11)
    assert not (tmp_path / "r").exists()


@pytest.mark.slow
@pytest.mark.parametrize(("how", "signal"), [("segv", 11), ("abort", 6)])
def test_a_reference_that_dies_in_the_tools_process_is_an_error_naming_the_node(
    how: str, signal: int, model: Path, tmp_path: Path
) -> None:
    """By default the reference runs in the tool's process, and the command in a forked
    child (process.survive_reference_crash): the child dies, the command runs again with the
    reference in a worker, whose crash names the node. One line of ours, exit 2, no
    traceback; before it only what the dying runtime printed itself."""
    bisect = Path(sys.executable).with_name("bisect")
    spec = crashing(how)
    argv = [str(bisect), str(model), "--ref", spec, "--target", "cpu", "-o", str(tmp_path / "r")]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stdout == ""
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert lines[-1] == ref_crash_error(spec, signal)
    assert set(lines[:-1]) == {f"dying on {NODE}"}, proc.stderr  # the runtime's own words
    assert not (tmp_path / "r").exists()


@pytest.mark.slow
def test_in_process_on_request_a_crash_takes_the_tool_down(model: Path, tmp_path: Path) -> None:
    """``--no-isolate-crashes``: everything in this process, as asked; a segfault then ends
    the tool, with no report. What the default's worker is there to prevent."""
    bisect = Path(sys.executable).with_name("bisect")
    argv = [str(bisect), str(model), "--target", crashing("segv"), "--no-isolate-crashes"]
    argv += ["-o", str(tmp_path / "r")]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert proc.returncode == -11, proc.stdout + proc.stderr
    assert not (tmp_path / "r" / "report.json").exists()


def test_a_command_run_again_after_a_crash_says_so_and_runs_the_reference_in_a_worker(
    model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The run again (process.survive_reference_crash sets the variable) of a crash that does
    not come back (one that needed the tool's process): the report says what happened."""
    monkeypatch.setenv(REF_WORKER_ENV, "SIGSEGV")
    result = onnx_bisect.bisect(model, ref=crashing("segv", node="nothing"), target="cpu")
    assert result.first_divergence is None
    assert (
        "the command ran twice: its first run, with the reference in the tool's process, died "
        "of SIGSEGV; this one ran the reference in a worker process"
    ) in result.notes
    ran = [n for n in result.notes if n.startswith("ran in process")]
    assert ran and str(os.getpid()) not in ran[0]  # the reference's runs: not this process


def test_the_entry_point_called_inside_another_program_never_forks(
    model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Only the console script as the process's main program forks: a caller that runs the
    entry point in its own process (tests/test_docs.py does) would go on twice after it."""
    from onnx_bisect.entry import bisect_entry

    def fork() -> int:
        raise AssertionError("forked")

    monkeypatch.setattr(os, "fork", fork)
    bisect = Path(sys.executable).with_name("bisect")
    argv = [str(bisect), str(model), "-t", "cpu", "-o", str(tmp_path / "r"), "-q"]
    monkeypatch.setattr(sys, "argv", argv)
    with pytest.raises(SystemExit) as ended:
        bisect_entry()
    assert ended.value.code == 0
