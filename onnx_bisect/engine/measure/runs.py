"""Running a backend with probes: memory-bounded chunks and an on-disk tensor cache.

The reference's probe values are needed twice, to compare against the target and to feed the
isolation model, so they are written to disk once and memory-mapped back: a model whose
activations exceed RAM can still be diagnosed within ``max_memory``.
"""

from __future__ import annotations

import contextvars
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from threading import Lock
from typing import Any, TypeVar

import numpy.typing as npt
import onnx

from onnx_bisect.backends.protocol import Backend, BackendBase, Emit, Tensors
from onnx_bisect.engine.progress import count_run, current_phase
from onnx_bisect.errors import BackendError
from onnx_bisect.result import REPRO_CHECK

__all__ = ["TARGET_ROLES", "RunStats", "plan_chunks", "run_pair", "timed_run", "timed_stream"]

T = TypeVar("T")

U = TypeVar("U")

# The roles whose runs are the target's runtime at work: its own runs, a pass bisection's
# (the target with some passes off) and a precision workaround's.
TARGET_ROLES = ("target", "passes", "workaround")
CHECK = REPRO_CHECK


@dataclass
class RunStats:
    """Mutable tallies for the report: runs and seconds spent per backend role (each run is
    also counted in the phase that asked for it, for progress and the log)."""

    runs: dict[str, int] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)
    # The target's runs per stage (the innermost phase open when each was asked for, "other"
    # outside any): where a run is a compile, this is where the diagnosis spent its time.
    target_by_stage: dict[str, int] = field(default_factory=dict)
    # Runs record from several threads at once (the pair, the float64 oracle beside them).
    _lock: Lock = field(default_factory=Lock, repr=False, compare=False)

    def record(self, role: str, seconds: float) -> None:
        with self._lock:
            self.runs[role] = self.runs.get(role, 0) + 1
            self.seconds[role] = self.seconds.get(role, 0.0) + seconds
            if role in TARGET_ROLES:
                # Outside any phase, a workaround's or a pass bisection's run is its own stage.
                stage = current_phase() or ("other" if role == "target" else role)
                self.target_by_stage[stage] = self.target_by_stage.get(stage, 0) + 1
        count_run(role)

    def record_check(self) -> None:
        """A run of the target's runtime that the tool did not make itself (a repro bundle's
        check by its own repro.py): tallied as the stage "repro check" only, not as a run."""
        with self._lock:
            self.target_by_stage[CHECK] = self.target_by_stage.get(CHECK, 0) + 1


def plan_chunks(
    names: Sequence[str], sizes: Mapping[str, int | None], budget: int
) -> list[list[str]]:
    """Split ``names`` (kept in order) into runs whose outputs fit ``budget`` bytes.

    A tensor of unknown size counts as the largest known one; one over budget runs alone.
    """
    known = [s for s in sizes.values() if s is not None]
    fallback = max(known) if known else 0
    chunks: list[list[str]] = []
    current: list[str] = []
    used = 0
    for name in names:
        size = sizes.get(name)
        size = fallback if size is None else size
        if current and used + size > budget:
            chunks.append(current)
            current, used = [], 0
        current.append(name)
        used += size
    if current:
        chunks.append(current)
    return chunks


def timed_run(
    backend: Backend,
    model: onnx.ModelProto,
    feeds: Mapping[str, npt.NDArray[Any]],
    role: str,
    stats: RunStats,
) -> Tensors:
    start = time.perf_counter()
    try:
        return backend.run(model, feeds)
    except BackendError as exc:
        who = "reference" if role == "ref" else role
        raise type(exc)(
            f"{who} failed: {exc}", node=exc.node, role=role, detail=exc.detail
        ) from exc
    finally:
        stats.record(role, time.perf_counter() - start)


def timed_stream(
    backend: BackendBase,
    model: onnx.ModelProto,
    feeds: Mapping[str, npt.NDArray[Any]],
    emit: Emit,
    role: str,
    stats: RunStats,
) -> None:
    """``backend.stream``, counted and timed as one run of ``role``."""
    start = time.perf_counter()
    try:
        backend.stream(model, feeds, emit)
    finally:
        stats.record(role, time.perf_counter() - start)


def run_pair(
    ref_job: Callable[[], T], target_job: Callable[[], U], parallel: bool = True
) -> tuple[T, U]:
    """Run the reference's and the target's jobs, concurrently when ``parallel``.

    Runtimes release the GIL while compiling and running, so on two cores the pair costs about
    as much as the slower one. A reference failure is reported first: it is the trusted side.
    """
    if not parallel:
        return ref_job(), target_job()
    with ThreadPoolExecutor(max_workers=1) as pool:
        # The caller's context goes along, so the reference's run counts in the caller's phase.
        future = pool.submit(contextvars.copy_context().run, ref_job)
        try:
            target_value = target_job()
        except BaseException:
            future.result()  # raises the reference's error if it failed too
            raise
        return future.result(), target_value
