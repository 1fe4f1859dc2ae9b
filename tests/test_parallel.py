"""run_tasks in-process, in spawned worker processes and as Ray tasks: the same results in the
same order, ``shared`` sent once per worker, errors and dead workers as one-line errors, and no
worker left behind by Ctrl-C. Real processes, real ONNX Runtime sessions, a real Ray cluster."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from importlib.util import find_spec
from pathlib import Path

import numpy as np
import pytest

from onnx_bisect.engine.dataset import worker
from onnx_bisect.engine.dataset.parallel import run_tasks
from onnx_bisect.errors import BackendError, BackendUnavailableError, InputError, WorkerCrash
from tests import parallel_tasks as tasks
from tests.models import ROOT, chain

ITEMS = list(range(8))
BIN = Path(sys.executable).parent
needs_ray = pytest.mark.skipif(find_spec("ray") is None, reason="ray is not installed")


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


_UNGUARDED = """
import numpy as np
from onnx_bisect.engine.dataset.parallel import run_tasks
from onnx_bisect.errors import WorkerCrash
from tests import parallel_tasks as tasks
# No `if __name__ == "__main__":`, so a spawned worker runs this again and dies starting.
try:
    run_tasks(tasks.thread_vars, np.zeros(1 << 20), list(range(8)), jobs=2)
except WorkerCrash as exc:
    print(exc)
"""


def test_a_worker_that_cannot_start_is_an_error_not_a_hang(tmp_path: Path) -> None:
    """The workers die before reading what they are given (1 MB here, over a pipe's
    buffer): CPython's spawn would leave the parent blocked writing it, were it not in a
    file."""
    script = tmp_path / "unguarded.py"
    script.write_text(_UNGUARDED)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    done = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120
    )
    assert (done.returncode, done.stdout) == (
        0,
        "a worker process died before running any of the 8 tasks: it could not start (its"
        " error is above: an import, or a main script without"
        " `if __name__ == '__main__':`)\n",
    )
    assert "bootstrapping phase" in done.stderr  # multiprocessing's own word for it


def test_jobs_must_be_positive() -> None:
    with pytest.raises(InputError) as caught:
        run_tasks(tasks.fail_on, 3, ITEMS, jobs=0)
    assert (str(caught.value), caught.value.option) == ("jobs must be at least 1, got 0", "jobs")


def test_no_items_no_workers() -> None:
    assert run_tasks(tasks.die_on, 0, [], jobs=2) == []


_INTERRUPTED = """
import sys
from onnx_bisect.engine.dataset.parallel import run_tasks
from tests import parallel_tasks as tasks
try:
    run_tasks(tasks.sleep_marked, sys.argv[1], list(range(6)), jobs=2, ray=sys.argv[2] or None)
except KeyboardInterrupt:
    sys.exit(130)
"""


@pytest.mark.parametrize(
    "ray", ["", pytest.param("local", marks=[needs_ray, pytest.mark.slow], id="ray")]
)
def test_ctrl_c_leaves_no_process(tmp_path: Path, ray: str) -> None:
    """Ctrl-C as a terminal sends it (to the whole process group) while two tasks sleep:
    every process the run started is gone once it has exited."""
    marks = tmp_path / "marks"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    proc = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(_INTERRUPTED), str(marks), ray],
        cwd=ROOT,
        env=env,
        start_new_session=True,  # its session: every process it starts is found by that
    )
    pids = _wait_for_marks(proc, marks, 2)
    os.killpg(proc.pid, signal.SIGINT)
    assert proc.wait(timeout=60) == 130
    deadline = time.monotonic() + 20
    while _left(proc.pid, pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _left(proc.pid, pids)


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


def _left(session: int, pids: list[int]) -> list[str]:
    """Processes still running: those in the session, and the workers that marked a task."""
    left = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):
            # pid (comm) state ppid pgrp session ...; comm may hold spaces, so cut after ")".
            pid, rest = stat.read_text().split(" (", 1)
            fields = rest.rsplit(") ", 1)[1].split()
            if fields[0] != "Z" and (int(fields[3]) == session or int(pid) in pids):
                left.append(f"{pid} {rest.split(')')[0]}")
    return left


# --- Ray ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A Ray cluster of our own on this machine (``ray start --head``), at its address.

    Its workers find the tests' task module on PYTHONPATH, but not this checkout's
    onnx_bisect: run_tasks must send the package along (``py_modules``).
    """
    home = tmp_path_factory.mktemp("cluster")
    shutil.copytree(ROOT / "tests", home / "tests", ignore=shutil.ignore_patterns("test_*"))
    port = _free_port()
    log = (home / "ray.log").open("w")
    proc = subprocess.Popen(
        [str(BIN / "ray"), "start", "--head", f"--port={port}", "--num-cpus=2", "--block"]
        + ["--include-dashboard=false", "--disable-usage-stats"],
        cwd=home,
        env=dict(os.environ, PYTHONPATH=str(home)),
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,  # every process of the cluster in one group, ended as one
    )
    try:
        address = f"127.0.0.1:{port}"
        _wait_until_listening(address, proc)
        yield address
    finally:
        _end_group(proc)
        log.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@pytest.fixture
def address(cluster: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """The cluster's address, for a driver that authenticates as `ray start` expects (its
    token is in ~/.ray, where `ray start` put it)."""
    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    return cluster


def _listening(address: str) -> bool:
    host, port = address.split(":")
    try:
        socket.create_connection((host, int(port)), timeout=1).close()
    except OSError:
        return False
    return True


def _wait_until_listening(address: str, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 120
    while not _listening(address):
        assert proc.poll() is None, f"ray start ended with exit {proc.returncode}"
        assert time.monotonic() < deadline, "the Ray cluster did not start within 120 s"
        time.sleep(0.2)


def _end_group(proc: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=5)  # `ray start --block` is slow to go; the group is killed next
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=15)


@needs_ray
@pytest.mark.slow
def test_a_local_ray_cluster_gives_the_loops_results(
    model: tasks.Model, expected: list[np.ndarray]
) -> None:
    import ray

    before = len(tasks.pickled)
    runs = run_tasks(tasks.run_model, model, ITEMS, jobs=2, ray="local")
    _check_runs(runs, expected, workers=2)
    assert len(tasks.pickled) == before + 1  # ray.put, once
    assert not ray.is_initialized()  # the cluster it started is gone


@needs_ray
@pytest.mark.slow
def test_a_cluster_at_an_address_runs_this_checkout(
    address: str, model: tasks.Model, expected: list[np.ndarray]
) -> None:
    import ray

    # The package is sent along (Ray unpacks it under the session's runtime_resources). Ray
    # also puts the driver's working directory, this checkout, on a same-node worker's path.
    paths = run_tasks(tasks.package_paths, None, ITEMS, ray=address)
    assert all(any("/runtime_resources/py_modules" in p for p in path) for path in paths)
    before = len(tasks.pickled)
    runs = run_tasks(tasks.run_model, model, ITEMS, ray=address)
    _check_runs(runs, expected, workers=2)
    assert len(tasks.pickled) == before + 1
    assert not ray.is_initialized()  # disconnected, and the cluster still answers:
    assert _listening(address)


@needs_ray
@pytest.mark.slow
def test_ray_tasks_errors_and_deaths(address: str) -> None:
    with pytest.raises(InputError) as caught:
        run_tasks(tasks.fail_on, 3, ITEMS, ray=address)
    assert (type(caught.value), str(caught.value), caught.value.option) == (
        InputError,
        "values: input 3 holds a NaN",
        "values",
    )
    with pytest.raises(BackendError) as failed:
        run_tasks(tasks.fail_on, -1, ITEMS, ray=address)
    assert (failed.value.node, failed.value.role, failed.value.full) == (
        "mm1",
        "target",
        "the whole text",
    )
    with pytest.raises(WorkerCrash) as crashed:
        run_tasks(tasks.die_on, 5, ITEMS, ray=address)
    assert crashed.value.index == 5
    assert str(crashed.value).startswith("a Ray worker died while running task 5 of 8: ")
    assert "\n" not in str(crashed.value)


def test_without_ray_one_line_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray raises ImportError
    with pytest.raises(BackendUnavailableError) as caught:
        run_tasks(tasks.fail_on, 3, ITEMS, ray="local")
    assert (str(caught.value), caught.value.option) == (
        "ray: Ray is not installed; pip install 'onnx-bisect[ray]'",
        "ray",
    )


@needs_ray
def test_an_address_nothing_answers_at_is_one_line() -> None:
    address = f"127.0.0.1:{_free_port()}"
    started = time.monotonic()
    with pytest.raises(BackendUnavailableError) as caught:
        run_tasks(tasks.fail_on, 3, ITEMS, ray=address)
    assert time.monotonic() - started < 10
    assert caught.value.option == "ray"
    assert str(caught.value) == (
        f"ray: no Ray cluster answers at {address} (Connection refused); start one with"
        " `ray start --head`, or use 'local' for a cluster on this machine"
    )
