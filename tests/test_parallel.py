"""run_tasks in-process, in spawned worker processes and as Ray tasks: the same results in the
same order, ``shared`` sent once per worker, errors and dead workers as one-line errors, and no
worker left behind by Ctrl-C. Real processes, real ONNX Runtime sessions, a real Ray cluster."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from onnx_bisect.engine import worker
from onnx_bisect.engine.parallel import run_tasks
from onnx_bisect.errors import BackendError, InputError, WorkerCrash
from tests import parallel_tasks as tasks
from tests.models import ROOT, chain

ITEMS = list(range(8))


@pytest.fixture(scope="module")
def model() -> tasks.Model:
    return tasks.Model(chain(3).SerializeToString(), np.zeros(1 << 18, np.float32))


@pytest.fixture(scope="module")
def expected(model: tasks.Model) -> list[np.ndarray]:
    return [r.y for r in run_tasks(tasks.run_model, model, ITEMS)]


def _check_runs(runs: list[tasks.Ran], expected: list[np.ndarray], workers: int) -> None:
    """Same outputs in item order; one session and one copy of the model per process."""
    for got, want in zip(runs, expected, strict=True):
        np.testing.assert_array_equal(got.y, want)
    pids = {r.pid for r in runs}
    assert 1 <= len(pids) <= workers
    assert os.getpid() not in pids
    for pid in pids:
        assert {(r.sessions, r.unpickled) for r in runs if r.pid == pid} == {(1, 1)}


def test_in_process_loop_pickles_nothing(model: tasks.Model) -> None:
    before = len(tasks.pickled)
    runs = run_tasks(tasks.run_model, model, ITEMS)
    assert {r.pid for r in runs} == {os.getpid()}
    assert len(tasks.pickled) == before
    # One session for the call, dropped when it returned.
    assert {r.sessions for r in runs} == {runs[0].sessions}
    assert worker._cache == {}


def test_worker_processes_give_the_loops_results(
    model: tasks.Model, expected: list[np.ndarray]
) -> None:
    before = len(tasks.pickled)
    runs = run_tasks(tasks.run_model, model, ITEMS, jobs=2)
    _check_runs(runs, expected, workers=2)
    assert len(tasks.pickled) == before + 1  # once for all workers, not per task


def test_workers_share_the_cores(model: tasks.Model) -> None:
    cores = len(os.sched_getaffinity(0))
    seen = set(run_tasks(tasks.thread_vars, None, ITEMS, jobs=2))
    preset = {name for name in worker.THREAD_VARIABLES if name in os.environ}
    assert seen == {
        tuple(
            os.environ[name] if name in preset else str(max(1, cores // 2))
            for name in worker.THREAD_VARIABLES
        )
    }


@pytest.mark.parametrize("jobs", [1, 2])
def test_a_tasks_error_arrives_whole(jobs: int) -> None:
    with pytest.raises(InputError) as caught:
        run_tasks(tasks.fail_on, 3, ITEMS, jobs=jobs)
    assert type(caught.value) is InputError
    assert str(caught.value) == "values: input 3 holds a NaN"
    assert caught.value.option == "values"
    with pytest.raises(BackendError) as failed:
        run_tasks(tasks.fail_on, -1, ITEMS, jobs=jobs)
    assert (str(failed.value), failed.value.node, failed.value.role, failed.value.full) == (
        "target failed",
        "mm1",
        "target",
        "the whole text",
    )


def test_a_dead_worker_names_its_task() -> None:
    with pytest.raises(WorkerCrash) as caught:
        run_tasks(tasks.die_on, 5, ITEMS, jobs=2)
    assert caught.value.index == 5
    assert str(caught.value) == (
        "a worker process died while running task 5 of 8: a crash or a kill, not an error the"
        " task raised; run it with jobs=1 to see it"
    )


def test_jobs_must_be_positive() -> None:
    with pytest.raises(InputError) as caught:
        run_tasks(tasks.fail_on, 3, ITEMS, jobs=0)
    assert (str(caught.value), caught.value.option) == ("jobs must be at least 1, got 0", "jobs")


def test_no_items_no_workers() -> None:
    assert run_tasks(tasks.die_on, 0, [], jobs=2) == []


_INTERRUPTED = """
import sys
from onnx_bisect.engine.parallel import run_tasks
from tests import parallel_tasks as tasks
try:
    run_tasks(tasks.sleep_marked, sys.argv[1], list(range(6)), jobs=2)
except KeyboardInterrupt:
    sys.exit(130)
"""


def test_ctrl_c_leaves_no_worker(tmp_path: Path) -> None:
    marks = tmp_path / "marks"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    proc = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(_INTERRUPTED), str(marks)],
        cwd=ROOT,
        env=env,
        start_new_session=True,  # a group of its own, signalled as a terminal would
    )
    pids = _wait_for_marks(proc, marks, 2)
    os.killpg(proc.pid, signal.SIGINT)
    assert proc.wait(timeout=60) == 130
    deadline = time.monotonic() + 10
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [pid for pid in pids if _alive(pid)]


def _wait_for_marks(proc: subprocess.Popen[bytes], marks: Path, count: int) -> list[int]:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        pids = [int(p) for p in marks.read_text().split()] if marks.exists() else []
        if len(pids) >= count:
            return pids
        assert proc.poll() is None, f"ended early with exit {proc.returncode}"
        time.sleep(0.05)
    proc.kill()
    pytest.fail("the workers did not start within 120 s")


def _alive(pid: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/stat").read_text().split()[2]
    except FileNotFoundError:
        return False
    return status != "Z"
