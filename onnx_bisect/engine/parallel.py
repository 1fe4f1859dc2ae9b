"""Running independent tasks: ``run_tasks`` and a per-process cache, ``worker_cached``.

TEMPORARY SHIM: a sequential stand-in with the interface of the ``parallel`` branch, where
``jobs`` runs local worker processes and ``ray`` Ray tasks. That branch's module replaces this
file at merge; until then every task runs here, in this process, in order.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Any, TypeVar

__all__ = ["run_tasks", "worker_cached"]

S = TypeVar("S")
T = TypeVar("T")
R = TypeVar("R")
V = TypeVar("V")

# One entry: a worker serves one job at a time, and a finished job's values (a prepared
# setup holds a model and its backends) should not outlive it in a long-lived process.
_cache: dict[Hashable, Any] = {}


def run_tasks(
    fn: Callable[[S, T], R],
    shared: S,
    items: Sequence[T],
    *,
    jobs: int = 1,
    ray: str | None = None,
) -> list[R]:
    """``fn(shared, item)`` for each item, results in item order."""
    return [fn(shared, item) for item in items]


def worker_cached(key: Hashable, factory: Callable[[], V]) -> V:
    """The value cached under ``key`` in this process, made by ``factory`` the first time."""
    if key not in _cache:
        _cache.clear()
        _cache[key] = factory()
    value: V = _cache[key]
    return value
