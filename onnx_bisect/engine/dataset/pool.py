"""Tasks in local worker processes: a ``ProcessPoolExecutor`` over *spawned* interpreters.

Spawn, not fork: ONNX Runtime's (and OpenMP's) thread pools do not survive a fork, and the
tool may already run sessions in threads. A spawned child gets the parent's ``sys.path`` from
multiprocessing, so it imports onnx_bisect from a source checkout too.

``fn`` and ``shared`` are pickled once in the parent, into a file each worker's initializer
reads, not sent with every task. A file and not the initializer's arguments: those go down
the pipe multiprocessing starts a child with, and CPython writes that pipe while holding its
other end open, so a child that dies while starting (an import error) leaves the parent
blocked for good on a payload over the pipe's 64 kB.

Each worker notes in a shared array which item it is running, so a worker that dies (a
segfault in a runtime, the OOM killer) is reported with the item it was running rather than
as a broken pool.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import signal
import tempfile
import uuid
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path
from typing import Any, TypeVar

from onnx_bisect.engine.dataset.worker import call_task, thread_env
from onnx_bisect.errors import WorkerCrash

__all__ = ["run_in_pool"]

R = TypeVar("R")
S = TypeVar("S")
T = TypeVar("T")

# An item's state: 0 not started, a pid while that worker runs it, then _DONE.
_DONE = -1

# A worker's state, set once by the initializer: (fn, shared, run), the item states.
_work: list[Any] = []


def run_in_pool(fn: Callable[[S, T], R], shared: S, items: Sequence[T], *, jobs: int) -> list[R]:
    """``fn(shared, item)`` for every item in ``min(jobs, len(items))`` worker processes."""
    with tempfile.TemporaryDirectory(prefix="onnx-bisect-tasks-") as scratch:
        payload = Path(scratch) / "shared.pickle"
        with payload.open("wb") as f:
            pickle.dump((fn, shared, uuid.uuid4().hex), f, protocol=pickle.HIGHEST_PROTOCOL)
        try:
            return _run(payload, items, workers=min(jobs, len(items)), env=thread_env(jobs))
        except _Died as died:
            raise _crash(payload, items, died.running) from None


class _Died(Exception):
    def __init__(self, running: list[int]) -> None:
        super().__init__(running)
        self.running = running


def _run(payload: Path, items: Sequence[Any], *, workers: int, env: Mapping[str, str]) -> list[Any]:
    """Results in item order; ``_Died`` with the items under way when a worker died."""
    context = multiprocessing.get_context("spawn")
    states = context.RawArray("q", len(items))
    pool = ProcessPoolExecutor(
        workers, mp_context=context, initializer=_init_worker, initargs=(str(payload), env, states)
    )
    try:
        futures: list[Future[Any]] = [
            pool.submit(_task, index, item) for index, item in enumerate(items)
        ]
        # In item order, so the error raised is the one a loop in-process would raise first.
        return [future.result() for future in futures]
    except BrokenProcessPool:
        raise _Died([i for i, state in enumerate(states) if state > 0]) from None
    except BaseException:
        # Ctrl-C or a task's error: nothing may go on running (workers ignore SIGINT).
        _kill(pool)
        raise
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def _kill(pool: ProcessPoolExecutor) -> None:
    # The executor has no public way to end a running task; its workers are its processes.
    for process in list((pool._processes or {}).values()):
        process.kill()


def _crash(payload: Path, items: Sequence[Any], running: list[int]) -> WorkerCrash:
    """The error for a dead worker, naming its item. With several items under way at once,
    each is run again alone until one kills its worker."""
    if len(running) > 1:
        for suspect in running:
            try:
                _run(payload, [items[suspect]], workers=1, env=thread_env(1))
            except _Died:
                return _crash(payload, items, [suspect])
            except Exception:  # its own error: not the one that died
                continue
    count = len(items)
    if not running:
        return WorkerCrash(
            f"a worker process died before running any of the {count} tasks: it could not"
            " start (its error is above: an import, or a main script without"
            " `if __name__ == '__main__':`)"
        )
    if len(running) == 1:
        what = f"while running task {running[0]}"
    else:
        what = "while running tasks " + ", ".join(map(str, running)) + " (none dies alone)"
    return WorkerCrash(
        f"a worker process died {what} of {count}: a crash or a kill, not an error the"
        " task raised; run it with jobs=1 to see it",
        index=running[0] if len(running) == 1 else None,
    )


def _init_worker(payload: str, env: Mapping[str, str], states: Any) -> None:
    # Ctrl-C reaches the whole process group; the parent ends its workers itself.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # Before unpickling: a runtime that ``shared`` imports reads its thread count at start.
    os.environ.update(env)
    with open(payload, "rb") as f:
        _work[:] = [*pickle.load(f), states]


def _task(index: int, item: Any) -> Any:
    fn, shared, run, states = _work
    states[index] = os.getpid()
    try:
        return call_task(fn, shared, item, run)
    finally:
        states[index] = _DONE
