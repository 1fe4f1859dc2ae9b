"""The float64 oracle in its own process: the same values as in this one, prewarmed by the
console script, and a fallback when the process dies."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import onnx_bisect
from onnx_bisect.engine.diagnose import open_session, prepare
from onnx_bisect.engine.oracle import child as oracle_child
from onnx_bisect.engine.oracle import float64
from onnx_bisect.engine.oracle.job import ORACLE, TWIN
from onnx_bisect.engine.session import Session, StageTimer
from onnx_bisect.entry import bisect_entry, wants_float64
from onnx_bisect.options import BisectOptions
from tests.models import YOLO

pytest.importorskip("torch")
pytestmark = pytest.mark.fresh_oracle  # the child's own life: started, used once, closed


@pytest.mark.parametrize(
    ("args", "wanted"),
    [
        (["m.onnx", "-t", "cpu"], True),
        (["m.onnx", "-t", "cpu", "--threshold", "auto"], True),
        (["m.onnx", "-t", "cpu", "--threshold=auto"], True),
        (["m.onnx", "-t", "cpu", "--threshold", "1e-3"], False),
        (["m.onnx", "-t", "cpu", "--threshold=1e-3"], False),
        (["m.onnx", "-t", "cpu", "--metric", "max_abs"], False),
        (["m.onnx", "-t", "cpu", "--atol", "1e-4"], False),
        (["m.onnx", "--help"], False),
        (["--version"], False),
    ],
)
def test_the_command_line_is_peeked_at_for_auto(args: list[str], wanted: bool) -> None:
    assert wants_float64(args) is wanted


def _session(tmp_path: Path) -> Session:
    options = BisectOptions(threshold=1e-3)  # no measuring on opening: the test measures
    timer = StageTimer()
    setup, feeds = prepare(YOLO, "cpu", "cpu", options, timer)
    return open_session(setup, feeds, tmp_path, timer)


def test_the_child_computes_what_this_process_would(tmp_path: Path) -> None:
    session = _session(tmp_path)
    there = float64._in_child(session)
    here = float64._here(session, ORACLE, TWIN)
    probes = session.loaded.probes
    assert set(there.run.oracle_noise) == set(here.run.oracle_noise)
    assert there.run.oracle_noise == pytest.approx(here.run.oracle_noise, rel=1e-9)
    for name in probes:
        a, b = there.run.values.get(name), here.run.values.get(name)
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(a, b)
    assert there.describe == here.describe
    assert session.stats.runs["float64"] == 4  # two in the child, two here


def test_a_dead_child_falls_back_to_the_next_oracle(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    made: list[oracle_child.OracleChild] = []

    def dead() -> oracle_child.OracleChild:
        child = oracle_child.OracleChild()
        child._proc.kill()  # as an out-of-memory kill would
        made.append(child)
        return child

    monkeypatch.setattr(oracle_child, "take_child", dead)
    # --always-scan: agreeing outputs would not wait for the oracle (tests/test_settle.py).
    result = onnx_bisect.bisect(YOLO, target="cpu?opt=disable", threshold="auto", always_scan=True)
    assert made, "the child was not asked"
    assert result.verdict == "match"
    note = next(n for n in result.notes if "float64 values from" in n)
    assert "onnx.reference" in note or "reference" in note
    assert "the float64 oracle's process exited" in note


def test_the_console_script_prewarms_and_uses_the_child(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    taken: list[oracle_child.OracleChild] = []
    take = oracle_child.take_child

    def recorded() -> oracle_child.OracleChild:
        prewarmed = oracle_child._prewarmed
        child = take()
        assert child is prewarmed, "the prewarmed child was not the one used"
        taken.append(child)
        return child

    monkeypatch.setattr(oracle_child, "take_child", recorded)
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as exit_:
        bisect_entry([str(YOLO), "-t", "cpu?opt=disable", "-o", str(out), "-q"])
    assert exit_.value.code == 0
    assert len(taken) == 1
    # Closed after its one job: joined, or (outputs that agree settle the diagnosis without
    # the oracle) killed by its cancel hook, which on busy cores can land a moment after the
    # command returns.
    assert taken[0]._proc.wait(timeout=60) is not None
    assert oracle_child._prewarmed is None


def test_a_prewarmed_child_nobody_used_is_stopped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    started: list[oracle_child.OracleChild] = []
    prewarm = oracle_child.prewarm

    def recorded() -> None:
        prewarm()
        assert oracle_child._prewarmed is not None
        started.append(oracle_child._prewarmed)

    monkeypatch.setattr(oracle_child, "prewarm", recorded)
    with pytest.raises(SystemExit) as exit_:
        bisect_entry([str(tmp_path / "missing.onnx"), "-t", "cpu"])
    assert exit_.value.code == 2
    assert len(started) == 1 and started[0]._proc.poll() is not None
    assert oracle_child._prewarmed is None
