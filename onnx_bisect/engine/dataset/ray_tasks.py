"""Tasks on a Ray cluster: a local one started for the call (``"local"``) or one at an address.

``shared`` goes into Ray's object store once (``ray.put``) and every task gets its reference,
inside a list so that Ray passes the reference rather than the value: the worker fetches it
from the node's shared memory and unpickles it once (``worker_cached``), like a pool worker
given it by its initializer. The model is not serialized again per task, nor shipped again to
a node that already holds it. Ray is an optional extra,
imported only here and only when asked for.

Workers must import onnx_bisect. On a local cluster they get this process's ``sys.path`` as
PYTHONPATH (a source checkout, tests' own modules); on a cluster at an address the package
itself travels as a ``py_modules`` entry of the runtime environment, so the workers run this
code, not whatever version the cluster has installed (its other dependencies must be there).
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import sys
import uuid
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

from onnx_bisect.engine.dataset.worker import enter_run, worker_cached
from onnx_bisect.errors import BackendUnavailableError, OnnxBisectError, WorkerCrash

__all__ = ["run_on_ray"]

R = TypeVar("R")
S = TypeVar("S")
T = TypeVar("T")

# A cluster at an address must answer this fast; ray.init itself retries for minutes.
_CONNECT_TIMEOUT_S = 5.0

# The cache key of the shared value in a worker: a tuple no key of fn's is equal to.
_SHARED = ("onnx_bisect.engine.dataset.ray_tasks", "shared")


def run_on_ray(
    fn: Callable[[S, T], R],
    shared: S,
    items: Sequence[T],
    *,
    jobs: int,
    address: str,
    done: Callable[[int, R], None] | None = None,
    resources: Callable[[T], Mapping[str, Any]] | None = None,
) -> list[R]:
    """``fn(shared, item)`` for every item as Ray tasks. ``done(index, result)`` is called as
    each task finishes, in the order they finish (a sweep writes each case's files then);
    ``resources(item)``, Ray's options for that item's task (``num_gpus``, ``memory``). On
    the way out (Ctrl-C included) a cluster started here is shut down; from one at an address
    we only disconnect."""
    ray = _import_ray()
    connected = _connect(ray, address, jobs)
    refs: list[Any] = []
    try:
        shared_ref = ray.put(shared)
        # No retries: a task that killed its worker would kill the next one too.
        task = ray.remote(max_retries=0)(_task)
        run = uuid.uuid4().hex
        refs = [
            (task.options(**resources(item)) if resources else task).remote(
                fn, [shared_ref], item, run
            )
            for item in items
        ]
        if done is None:
            return [_result(ray, ref, index, len(items)) for index, ref in enumerate(refs)]
        return _as_finished(ray, refs, done)
    except BaseException:
        _collect(ray, refs)
        raise
    finally:
        if connected:
            ray.shutdown()


def _as_finished(ray: Any, refs: list[Any], done: Callable[[int, Any], None]) -> list[Any]:
    """Each result as its task finishes, handed to ``done``; all of them in item order."""
    index = {ref: i for i, ref in enumerate(refs)}
    results: dict[int, Any] = {}
    pending = list(refs)
    while pending:
        ready, pending = ray.wait(pending, num_returns=1)
        for ref in ready:
            i = index[ref]
            results[i] = _result(ray, ref, i, len(refs))
            done(i, results[i])
    return [results[i] for i in range(len(refs))]


def _task(fn: Callable[[Any, Any], Any], shared: list[Any], item: Any, run: str) -> Any:
    """In a Ray worker: ``fn`` on the value of the reference in ``shared``."""
    import ray

    enter_run(run)
    value = worker_cached(_SHARED, lambda: ray.get(shared[0]))
    return fn(value, item)


def _import_ray() -> Any:
    try:
        import ray
    except ImportError:
        raise BackendUnavailableError(
            "ray: Ray is not installed; pip install 'onnx-bisect[ray]'", option="ray"
        ) from None
    return ray


def _collect(ray: Any, refs: list[Any]) -> None:
    """After an error or Ctrl-C: fetch the outcomes there are, so that Ray does not print the
    errors of tasks nobody asked for.

    Nothing is cancelled: Ray 2.60's driver aborts (a failed RAY_CHECK, "Tried to complete
    task that was not pending") when a cancel, forced or not, meets a task that is finishing.
    Disconnecting ends our job, and Ray then stops its tasks; a local cluster is shut down.
    """
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
    for ref in ready:
        with contextlib.suppress(Exception):
            ray.get(ref)


def _connect(ray: Any, address: str, jobs: int) -> bool:
    """Connect to the cluster at ``address`` or start a local one; whether we did (and so
    must shut down or disconnect): a connection the caller made is theirs."""
    if ray.is_initialized():  # the caller's own connection: use it as it is
        return False
    quiet: dict[str, Any] = {"logging_level": logging.ERROR, "log_to_driver": False}
    if address == "local":
        path = os.pathsep.join(p for p in sys.path if p)
        ray.init(
            # "local" starts a new cluster even where `ray start` left one to find.
            address="local",
            num_cpus=jobs if jobs > 1 else None,
            include_dashboard=False,
            runtime_env={"env_vars": {"PYTHONPATH": path}},
            **quiet,
        )
        return True
    _check_reachable(address)
    # The top package's folder, wherever this module sits in it (a fixed parents[N] sent
    # onnx_bisect/engine/ alone once the engine grew rooms).
    package = Path(sys.modules[__name__.partition(".")[0]].__file__ or "").resolve().parent
    try:
        ray.init(
            address=address,
            runtime_env={"py_modules": [str(package)], "excludes": ["__pycache__"]},
            **quiet,
        )
    except Exception as exc:  # ConnectionError, version or authentication mismatches
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise BackendUnavailableError(
            f"ray: cannot connect to the Ray cluster at {address}: {first} (a cluster with token"
            " authentication needs RAY_AUTH_MODE=token and its token here)",
            option="ray",
        ) from None
    return True


def _check_reachable(address: str) -> None:
    """A HOST:PORT that nothing listens on is one line now, not minutes of Ray's retries."""
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not host or not port.isdigit():
        return  # "auto" and the like: Ray finds the cluster itself
    try:
        socket.create_connection((host, int(port)), timeout=_CONNECT_TIMEOUT_S).close()
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        raise BackendUnavailableError(
            f"ray: no Ray cluster answers at {address} ({reason}); start one with"
            " `ray start --head`, or use 'local' for a cluster on this machine",
            option="ray",
        ) from None


def _result(ray: Any, ref: Any, index: int, count: int) -> Any:
    try:
        return ray.get(ref)
    except ray.exceptions.RayTaskError as exc:
        # The task's own error: ours arrive as themselves, anything else (a bug) as Ray's
        # error, which carries the worker's traceback.
        if isinstance(exc.cause, OnnxBisectError):
            raise exc.cause from None
        raise
    except ray.exceptions.RayError as exc:  # the worker died, was killed for memory, ...
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise WorkerCrash(
            f"a Ray worker died while running task {index} of {count}: {first}", index=index
        ) from None
