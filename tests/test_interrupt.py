"""Ctrl-C in real processes: ``bisect`` started with ``subprocess.Popen`` and sent SIGINT in the
middle of a scan and in the middle of writing its repro bundle.

The target is the simulated faulty runtime with ``--sleep`` (every run slow enough to hit) and
``--mark`` (a line per run as it starts), so each test signals while a chosen run is under
way rather than after a guessed delay. Afterwards: exit 130, one line on stderr, ``--out`` as
the last complete run left it, no staging directory beside it, no temporary directory, and no
process of ours still alive.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import onnx
import pytest
from typer.testing import CliRunner

from onnx_bisect.cli import bisect_app
from onnx_bisect.report.manifest import MANIFEST
from tests.models import FAULTY_RUNTIME, ROOT, chain

BIN = Path(sys.executable).parent
WAIT_S = 180.0  # two shared cores and a Python start per run: generous, never a sleep


def _target(marks: Path, sleep: float) -> str:
    cmd = [sys.executable, str(FAULTY_RUNTIME), "{model}", "{inputs}", "{outputs}"]
    flags = ["--fault", "mm1=0.05", "--sleep", str(sleep), "--mark", str(marks)]
    return "exec:" + shlex.join([*cmd, *flags])


def _start(tmp_path: Path, target: str, out: Path) -> subprocess.Popen[str]:
    model = tmp_path / "chain.onnx"
    onnx.save(chain(4), model)
    tmp = tmp_path / "tmp"
    tmp.mkdir(exist_ok=True)
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    # TMPDIR of its own, so that a temporary directory left behind is seen.
    env = dict(os.environ, TMPDIR=str(tmp), PYTHONPATH=path)
    argv = [str(BIN / "bisect"), str(model), "--target", target, "--out", str(out)]
    return subprocess.Popen(
        argv, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def _wait_for(
    proc: subprocess.Popen[str], marks: Path, ready: Callable[[list[str]], bool]
) -> list[str]:
    """The runs marked so far, once ``ready`` says so (the process must still be running)."""
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        lines = marks.read_text().splitlines() if marks.exists() else []
        if ready(lines):
            return lines
        if proc.poll() is not None:
            out, err = proc.communicate()
            pytest.fail(f"bisect ended (exit {proc.returncode}) before the moment: {out}{err}")
        time.sleep(0.05)
    proc.kill()
    pytest.fail(f"no such run within {WAIT_S:g} s")


def _verifies(mark: str) -> bool:
    """A run of repro.py checking the bundle (the tool's own runs get a temporary copy)."""
    return mark.endswith("/repro/model.onnx")


def _interrupt(proc: subprocess.Popen[str]) -> tuple[int, str]:
    proc.send_signal(signal.SIGINT)
    try:
        _, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail("bisect did not stop within 60 s of SIGINT")
    return proc.returncode, err


def _ours_alive(marker: str) -> list[str]:
    """Processes whose command line names ``marker`` (this test's directory)."""
    alive = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue  # gone meanwhile
        if marker in cmdline:
            alive.append(f"{entry.name}: {cmdline}")
    return alive


def _assert_clean(tmp_path: Path, out: Path) -> None:
    leftovers = [p.name for p in tmp_path.iterdir() if p.name.startswith(f".{out.name}")]
    assert leftovers == []  # no staging directory beside --out
    assert [p.name for p in (tmp_path / "tmp").iterdir() if p.is_dir()] == []
    if out.is_dir():
        hidden = [p.name for p in out.iterdir() if p.name.startswith(".")]
        assert hidden in ([], [MANIFEST])  # no staging directory inside --out either
    # Checked at once: children are reaped before bisect exits, and an orphan would still be
    # in the middle of its --sleep.
    assert _ours_alive(str(tmp_path)) == []


pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="reads /proc; POSIX signals")


def test_ctrl_c_in_the_middle_of_a_scan(tmp_path: Path) -> None:
    marks, out = tmp_path / "marks", tmp_path / "out"
    proc = _start(tmp_path, _target(marks, sleep=2.0), out)
    # Run 1 is the screen, run 2 the scan (every tensor marked); the signal lands during it.
    runs = _wait_for(proc, marks, lambda lines: len(lines) >= 2)
    code, err = _interrupt(proc)
    assert code == 130
    assert err.strip() == "interrupted" and "Traceback" not in err
    assert len(runs) == 2 and not out.exists()  # nothing was complete, so nothing was written
    _assert_clean(tmp_path, out)


def test_ctrl_c_while_the_repro_bundle_is_verified(tmp_path: Path) -> None:
    """The issue's case: interrupted while repro.py re-runs the new bundle, when model.onnx,
    repro.py and test_data_set_0 exist and README.md and issue.md do not yet. ``--out`` holds
    an earlier clean run and a file of the user's: both must be as they were."""
    marks, out = tmp_path / "marks", tmp_path / "out"
    model = tmp_path / "chain.onnx"
    onnx.save(chain(4), model)
    earlier = CliRunner().invoke(bisect_app, [str(model), "-t", "cpu", "-o", str(out), "-q"])
    assert earlier.exit_code == 0, earlier.output
    (out / "mine.txt").write_text("the user's\n")
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    # Long enough that a runtime orphaned by the interrupt would still be asleep when checked.
    proc = _start(tmp_path, _target(marks, sleep=4.0), out)
    # The bundle's check: repro.py runs the target on the bundle's own model.onnx, staged.
    runs = _wait_for(proc, marks, lambda lines: any(_verifies(ln) for ln in lines))
    assert f"/.{out.name}.onnx-bisect-" in runs[-1]
    code, err = _interrupt(proc)
    assert code == 130
    assert err.strip() == "interrupted" and "Traceback" not in err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    _assert_clean(tmp_path, out)


def test_an_uninterrupted_run_publishes_a_complete_bundle(tmp_path: Path) -> None:
    """The control for the two above: the same target, not interrupted, writes the whole
    set (so the tests above do signal in the middle of something)."""
    marks, out = tmp_path / "marks", tmp_path / "out"
    proc = _start(tmp_path, _target(marks, sleep=0.0), out)
    _, err = proc.communicate(timeout=WAIT_S)
    assert proc.returncode == 1, err
    bundle = out / "repro"
    assert sorted(p.name for p in bundle.iterdir()) == [
        "README.md", "issue.md", "model.onnx", "repro.py", "test_data_set_0",
    ]  # fmt: skip
    assert any(_verifies(ln) for ln in marks.read_text().splitlines())
    _assert_clean(tmp_path, out)
