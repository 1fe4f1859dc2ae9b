"""What runs inside a task's process, whichever way tasks run: the per-process cache and the
thread cap a worker's environment gets.

A cache entry lives for one ``run_tasks`` call: a Ray worker outlives the call (and in-process
the tool goes on after it), and an ONNX Runtime session kept past its dataset would hold its
model's memory for nothing.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Hashable
from typing import Any, TypeVar

__all__ = [
    "THREAD_VARIABLES",
    "call_task",
    "close_run",
    "enter_run",
    "thread_env",
    "worker_cached",
]

R = TypeVar("R")
S = TypeVar("S")
T = TypeVar("T")
V = TypeVar("V")

# Read by OpenMP (torch, OpenVINO's CPU plugin), OpenBLAS and MKL when they start. ONNX
# Runtime's own intra-op pool reads none of them: its size is a session option (``threads=``
# in an ``ort:`` spec).
THREAD_VARIABLES = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")

_cache: dict[Hashable, Any] = {}
_run: list[str] = []  # the run the cache belongs to (a list: no ``global`` statement)


def worker_cached(key: Hashable, factory: Callable[[], V]) -> V:
    """The value for ``key``, made by ``factory`` once per worker process (or once in-process)
    and kept until the ``run_tasks`` call that is running ends."""
    if key not in _cache:
        _cache[key] = factory()
    value: V = _cache[key]
    return value


def call_task(fn: Callable[[S, T], R], shared: S, item: T, run: str) -> R:
    """``fn(shared, item)`` with the cache of run ``run``."""
    enter_run(run)
    return fn(shared, item)


def enter_run(run: str) -> None:
    """Make the cache run ``run``'s: another run's entries are dropped."""
    if _run != [run]:
        close_run()
        _run.append(run)


def close_run() -> None:
    _cache.clear()
    _run.clear()


def thread_env(jobs: int) -> dict[str, str]:
    """Thread counts for one of ``jobs`` workers on this machine: the cores shared out, at
    least one each, so that N workers do not run N × cores threads. A variable the user set
    is left alone."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    threads = str(max(1, (cores or 1) // jobs))
    return {name: threads for name in THREAD_VARIABLES if name not in os.environ}
