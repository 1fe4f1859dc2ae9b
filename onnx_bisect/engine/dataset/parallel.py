"""Independent tasks (one per input of a dataset) in-process, in local worker processes, or as
Ray tasks, with results in item order whichever way they ran.

``fn(shared, item)`` must be a module-level function, and ``shared``, the items and the
results picklable. ``shared`` (the model, the options) reaches each worker process once, not
with every task: the pool's initializer (``pool.py``) or Ray's object store
(``ray_tasks.py``). A task keeps what it builds from ``shared`` (a backend, a session)
with ``worker_cached``.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Sequence
from typing import TypeVar

from onnx_bisect.engine.dataset.worker import call_task, close_run, worker_cached
from onnx_bisect.errors import InputError

__all__ = ["run_tasks", "worker_cached"]

R = TypeVar("R")
S = TypeVar("S")
T = TypeVar("T")


def run_tasks(
    fn: Callable[[S, T], R],
    shared: S,
    items: Sequence[T],
    *,
    jobs: int = 1,
    ray: str | None = None,
) -> list[R]:
    """``fn(shared, item)`` for every item, results in item order.

    ``jobs=1`` and no ``ray``: a plain loop in this process (nothing pickled). ``jobs=N``: N
    spawned worker processes. ``ray``: Ray tasks, on a local cluster started for the call
    (``"local"``, ``jobs`` CPUs when above 1) or on the cluster at that address. The error a
    task raises is raised here (the first in item order); a worker that dies is a
    ``WorkerCrash`` naming its task.
    """
    if jobs < 1:
        raise InputError(f"jobs must be at least 1, got {jobs}", option="jobs")
    if ray is not None and not ray.strip():
        raise InputError("ray must be 'local' or a cluster address, got ''", option="ray")
    if not items:
        return []
    if ray is not None:
        from onnx_bisect.engine.dataset.ray_tasks import run_on_ray

        return run_on_ray(fn, shared, items, jobs=jobs, address=ray.strip())
    if jobs > 1:
        from onnx_bisect.engine.dataset.pool import run_in_pool

        return run_in_pool(fn, shared, items, jobs=jobs)
    run = uuid.uuid4().hex
    try:
        return [call_task(fn, shared, item, run) for item in items]
    finally:
        close_run()
