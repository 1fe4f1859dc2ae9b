"""The tests' forked float64 oracle (tests/oracle_zygote.py) behaves as the product's own
process: the same values, a fresh process per diagnosis, and a kill that ends it."""

from __future__ import annotations

import signal
import subprocess
import threading
import time
import types
from pathlib import Path

import numpy as np
import pytest

from onnx_bisect.engine.diagnose import open_session, prepare
from onnx_bisect.engine.oracle import child as oracle_child
from onnx_bisect.engine.oracle import float64
from onnx_bisect.engine.session import Session, StageTimer
from onnx_bisect.options import BisectOptions
from tests import oracle_zygote
from tests.models import YOLO

pytestmark = [
    pytest.mark.fresh_oracle,  # each test picks its processes itself
    pytest.mark.skipif(not oracle_zygote.supported(), reason="the zygote is for Linux + torch"),
]


def _session(tmp_path: Path) -> Session:
    options = BisectOptions(threshold=1e-3)
    timer = StageTimer()
    setup, feeds = prepare(YOLO, "cpu", "cpu", options, timer)
    return open_session(setup, feeds, tmp_path, timer)


def test_a_forked_oracle_computes_what_a_started_one_does(
    tmp_path: Path, zygote: oracle_zygote.Zygote, monkeypatch: pytest.MonkeyPatch
) -> None:
    session = _session(tmp_path)
    started = float64._in_child(session)
    monkeypatch.setattr(
        oracle_child, "subprocess", types.SimpleNamespace(Popen=zygote.popen, PIPE=subprocess.PIPE)
    )
    forks = zygote.forks
    forked = float64._in_child(session)
    assert zygote.forks == forks + 1
    assert forked.describe == started.describe and forked.notes == started.notes
    # The noise is numpy's rel_l2, summed by one BLAS thread in the fork (tests/blas.py).
    assert forked.run.oracle_noise == pytest.approx(started.run.oracle_noise, rel=1e-12)
    for name in session.loaded.probes:
        np.testing.assert_array_equal(forked.run.values.get(name), started.run.values.get(name))


def test_a_forked_oracle_is_a_process_of_its_own_that_a_kill_ends(
    zygote: oracle_zygote.Zygote,
) -> None:
    args = ["python", "-m", oracle_zygote.CHILD_MODULE]
    pipes = {"stdin": subprocess.PIPE, "stdout": subprocess.PIPE, "stderr": subprocess.PIPE}
    first = zygote.popen(args, start_new_session=True, **pipes)
    second = zygote.popen(args, start_new_session=True, **pipes)
    assert len({first.pid, second.pid}) == 2
    assert first.poll() is None and second.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        first.wait(timeout=0.1)
    first.kill()
    assert first.wait(timeout=30) == -signal.SIGKILL
    assert first.stdout.read() == b""  # its end of the pipe closed with it
    second.stdin.close()  # end of input ends the child's loop: exit status 0
    assert second.wait(timeout=30) == 0
    first.stdin.close()
    for proc in (first, second):
        proc.stdout.close()
        proc.stderr.close()


def test_a_kill_from_another_thread_ends_a_wait(zygote: oracle_zygote.Zygote) -> None:
    """As a cancelled diagnosis does: one thread waits on the process, another kills it."""
    args = ["python", "-m", oracle_zygote.CHILD_MODULE]
    pipes = {"stdin": subprocess.PIPE, "stdout": subprocess.PIPE, "stderr": subprocess.PIPE}
    proc = zygote.popen(args, start_new_session=True, **pipes)
    waited: list[int] = []
    waiter = threading.Thread(target=lambda: waited.append(proc.wait()))
    waiter.start()
    time.sleep(0.2)  # the waiter is reading the exit status now
    assert proc.poll() is None  # and poll does not wait for it
    proc.kill()
    waiter.join(timeout=30)
    assert waited == [-signal.SIGKILL] and proc.returncode == -signal.SIGKILL
    proc.kill()  # an ended process: nothing to signal, no error
    for pipe in (proc.stdin, proc.stdout, proc.stderr):
        pipe.close()
