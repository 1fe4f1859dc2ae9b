"""Progress while a diagnosis runs: phases begun and ended, and the backend runs in each.

``StageTimer.stage`` opens a phase; ``RunStats.record`` counts each run against the phase open
where the run was asked for. That is a context variable, not an argument: the float64 oracle
runs its own phase in a thread beside the screen, and ``run_pair`` carries its caller's phase
into its worker, so each run lands in the phase that asked for it without threading a phase
through every ``timed_run``. Every phase that ends is logged at INFO with its time and runs
(``--verbose``); a ``Progress`` observer (the CLI's live line on a terminal) hears the same
events as they happen.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from threading import Lock
from typing import Protocol

from onnx_bisect.text import runs_text

__all__ = ["Abandoned", "NoProgress", "Progress", "count_run", "current_phase", "phase"]

log = logging.getLogger(__name__)


class Progress(Protocol):
    """Hears a diagnosis as it goes; called from the engine's threads, so it must be
    thread-safe, and quick (it runs between backend runs)."""

    def phase_started(self, phase: str) -> None: ...

    def run_done(self, phase: str, runs: Mapping[str, int]) -> None:
        """A backend run finished in ``phase``; ``runs`` counts the phase's runs by role."""

    def phase_done(self, phase: str, seconds: float, runs: Mapping[str, int]) -> None: ...


class NoProgress:
    """The default: nobody is watching."""

    def phase_started(self, phase: str) -> None:
        pass

    def run_done(self, phase: str, runs: Mapping[str, int]) -> None:
        pass

    def phase_done(self, phase: str, seconds: float, runs: Mapping[str, int]) -> None:
        pass


class Abandoned(Exception):  # noqa: N818 -- not an error: the work is no longer wanted
    """Raised in work nobody waits for any more (the float64 oracle after ``Session.settle``):
    its phase ends without a log line or a time."""


@dataclass
class _Phase:
    name: str
    progress: Progress
    outer: _Phase | None  # a phase opened inside another counts its runs in both
    runs: dict[str, int] = field(default_factory=dict)
    _lock: Lock = field(default_factory=Lock)

    def count(self, role: str) -> None:
        with self._lock:
            self.runs[role] = self.runs.get(role, 0) + 1
            runs = dict(self.runs)
        self.progress.run_done(self.name, runs)
        if self.outer is not None:
            self.outer.count(role)


_CURRENT: ContextVar[_Phase | None] = ContextVar("onnx_bisect_phase", default=None)


def count_run(role: str) -> None:
    """Count a finished run of ``role`` in the phase open here (none outside a phase)."""
    current = _CURRENT.get()
    if current is not None:
        current.count(role)


def current_phase() -> str | None:
    """The name of the innermost phase open here (None outside any): the stage a run is
    tallied against in the report."""
    current = _CURRENT.get()
    return current.name if current is not None else None


@contextmanager
def phase(name: str, progress: Progress) -> Iterator[None]:
    """A phase named ``name``: announced, its runs counted, logged with its time at the end."""
    current = _Phase(name, progress, _CURRENT.get())
    token = _CURRENT.set(current)
    progress.phase_started(name)
    start = time.perf_counter()
    ended: str | None = "ended by an error"
    try:
        yield
        ended = "done"
    except Abandoned:
        ended = None
        raise
    finally:
        _CURRENT.reset(token)
        seconds = time.perf_counter() - start
        if ended is not None:
            log.info("phase %s %s in %.2f s (%s)", name, ended, seconds, runs_text(current.runs))
        progress.phase_done(name, seconds, dict(current.runs))
