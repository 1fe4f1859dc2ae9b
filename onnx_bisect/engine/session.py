"""The session: what a diagnosis sets up once (``Setup``) and what one input adds (``Session``).

Every stage takes the session instead of the model, feeds, criterion, store and tallies one by
one; dataset mode opens one ``Session`` per input over a single ``Setup``.
"""

from __future__ import annotations

import contextvars
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor, wait
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy.typing as npt

from onnx_bisect.backends.protocol import Backend
from onnx_bisect.compare.criterion import Criterion
from onnx_bisect.compare.precision import FLOAT32_DEFAULT, PrecisionInfo
from onnx_bisect.compare.topk import TopKSpec
from onnx_bisect.engine.measure.memory import MemoryPlan
from onnx_bisect.engine.measure.runs import RunStats
from onnx_bisect.engine.measure.store import TensorStore
from onnx_bisect.engine.progress import Abandoned, NoProgress, Progress, phase
from onnx_bisect.graph.view import LoadedModel
from onnx_bisect.options import BisectOptions
from onnx_bisect.result import BackendInfo
from onnx_bisect.transforms.registry import TransformRecord

__all__ = ["Feeds", "GoalInputs", "Session", "Setup", "StageTimer"]

Feeds = Mapping[str, npt.NDArray[Any]]


@dataclass(frozen=True)
class GoalInputs:
    """The inputs the keep searches' goal is measured over where there are several (a
    dataset's, worst first): their labels, and how to load each."""

    labels: tuple[str, ...]
    load: Callable[[int], Feeds]


@dataclass(frozen=True)
class Setup:
    """Once per diagnosis: the model(s) and the backends, ready to run."""

    loaded: LoadedModel
    ref: Backend
    target: Backend
    ref_info: BackendInfo
    target_info: BackendInfo
    options: BisectOptions
    # The model the target runs when it is not ``loaded`` (--target-model or a +transform).
    target_model: LoadedModel | None = None
    target_label: str = ""
    transforms: tuple[TransformRecord, ...] = ()
    topk: tuple[TopKSpec, ...] = ()
    versions: Mapping[str, str] = field(default_factory=dict)
    # A fresh process can rebuild the target from its spec (repro.py verification).
    target_from_spec: bool = True
    notes: tuple[str, ...] = ()
    # What each side computes float32 work in, and where that is known from.
    ref_precision: PrecisionInfo = FLOAT32_DEFAULT
    target_precision: PrecisionInfo = FLOAT32_DEFAULT
    # A dataset's inputs: the keep searches' goal holds on every one (None: the session's).
    goal_inputs: GoalInputs | None = None


@dataclass
class StageTimer:
    """Seconds per stage, for the report; ``total`` counts from the timer's creation. Each
    stage is a phase for ``progress`` and the log (``engine.progress``)."""

    seconds: dict[str, float] = field(default_factory=dict)
    started: float = field(default_factory=time.perf_counter)
    progress: Progress = field(default_factory=NoProgress)

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            with phase(name, self.progress):
                yield
        except Abandoned:
            raise  # nobody waited: no time to report
        except BaseException:
            self._add(name, start)
            raise
        else:
            self._add(name, start)

    def _add(self, name: str, start: float) -> None:
        self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start

    def finish(self) -> dict[str, float]:
        self.seconds["total"] = time.perf_counter() - self.started
        return dict(self.seconds)


@dataclass
class Session:
    """One input's diagnosis over a ``Setup``: feeds, criterion, sizes and the tallies."""

    setup: Setup
    feeds: Feeds
    criterion: Criterion
    sizes: Mapping[str, int | None]
    scratch: Path
    memory: MemoryPlan
    stats: RunStats = field(default_factory=RunStats)
    timer: StageTimer = field(default_factory=StageTimer)
    notes: list[str] = field(default_factory=list)
    _pending: Future[Criterion] | None = field(default=None, repr=False)
    # Set when the criterion being measured is no longer wanted (``settle``); the float64
    # oracle checks it and registers how to stop its child (``on_cancel``).
    cancelled: threading.Event = field(default_factory=threading.Event, repr=False)
    _cancel_hooks: list[Callable[[], None]] = field(default_factory=list, repr=False)
    # Work that needs no criterion, done before waiting for one still being measured (a
    # quantized target's reference scan and per-tensor table while the float64 oracle
    # runs); what it leaves in ``prepared``, by name, is for the stage that needs it.
    early: list[Callable[[], None]] = field(default_factory=list, repr=False)
    prepared: dict[str, object] = field(default_factory=dict, repr=False)

    @property
    def crit(self) -> Criterion:
        """The criterion; one still being measured (``measure_criterion``) is waited for,
        after the ``early`` work."""
        if self._pending is not None:
            while self.early and not self._pending.done():
                self.early.pop(0)()
            pending, self._pending = self._pending, None
            self.criterion = pending.result()
        return self.criterion

    @crit.setter
    def crit(self, value: Criterion) -> None:
        self._pending, self.criterion = None, value

    def measure_criterion(self, job: Callable[[], Criterion], *, alongside: bool) -> None:
        """Measure the criterion with ``job``, in a thread beside the plain runs when
        ``alongside``: the float64 oracle (torch's import alone is 1.4 s) then costs about
        nothing on two cores, as the screen's runtimes release the GIL while they compute."""
        if not alongside:
            self.criterion = job()
            return
        pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="float64")
        # A copy of this context: the job's runs are counted in the phase it opens itself.
        self._pending = pool.submit(contextvars.copy_context().run, job)
        pool.shutdown(wait=False)

    def criterion_pending(self) -> bool:
        """Whether the criterion is still being measured."""
        return self._pending is not None and not self._pending.done()

    def settle(self, crit: Criterion) -> bool:
        """Use ``crit`` and stop measuring the pending criterion (its child is stopped, its
        thread ends without trying another oracle). False, keeping the measured criterion,
        when that finished first."""
        pending = self._pending
        if pending is None or pending.done():
            return False
        self._pending, self.criterion = None, crit
        self._stop(pending)
        return True

    def abandon(self) -> None:
        """Stop measuring a pending criterion and wait until its thread has ended: the thread
        writes into ``scratch``, which its owner removes next (even when the session ends
        with an error, such as the reference failing on the plain model)."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        if not pending.done():
            self._stop(pending)
        wait([pending])

    def _stop(self, pending: Future[Criterion]) -> None:
        self.cancelled.set()
        for hook in list(self._cancel_hooks):
            hook()
        pending.cancel()  # one that never started never runs

    def on_cancel(self, hook: Callable[[], None]) -> None:
        """Call ``hook`` if the pending criterion is abandoned (now, if it already is)."""
        self._cancel_hooks.append(hook)
        if self.cancelled.is_set():
            hook()

    @property
    def loaded(self) -> LoadedModel:
        return self.setup.loaded

    @property
    def ref(self) -> Backend:
        return self.setup.ref

    @property
    def target(self) -> Backend:
        return self.setup.target

    @property
    def options(self) -> BisectOptions:
        return self.setup.options

    def store(self, name: str, factor: int = 1) -> TensorStore:
        """A store for ``factor`` × every probe: in memory when the memory plan keeps it
        there (a small share of the budget), else on disk."""
        return TensorStore(None if self.memory.keeps(factor) else self.scratch / name)


@contextmanager
def scratch_dir() -> Iterator[Path]:
    """Where stores spill to disk; removed with everything in it when the session ends."""
    with tempfile.TemporaryDirectory(prefix="onnx-bisect-") as tmp:
        yield Path(tmp)
