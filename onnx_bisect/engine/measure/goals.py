"""The keep searches' trials over every input their goal is measured on: the session's one
input, or with ``--dataset`` every input of the dataset, worst first (``Setup.goal_inputs``).
The reference runs once per input; each trial runs the target on each input and reads one
figure per input, stopping at the first input that misses where only meeting the goal
matters (a search's trial), so a set that fails costs about one run."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy.typing as npt
import onnx

from onnx_bisect.backends.protocol import Backend
from onnx_bisect.engine.measure.runs import timed_run
from onnx_bisect.engine.session import Feeds, Session

__all__ = ["GoalRuns", "goal_runs"]

Tensors = Mapping[str, npt.NDArray[Any]]
T = TypeVar("T")


@dataclass
class GoalRuns:
    """The goal's inputs (labels, feeds) and the reference's outputs on each."""

    session: Session
    labels: tuple[str, ...]
    feeds: tuple[Feeds, ...]
    _refs: list[Tensors] = field(default_factory=list)

    @property
    def several(self) -> bool:
        return len(self.feeds) > 1

    def references(self, first: Tensors | None = None) -> list[Tensors]:
        """The reference's outputs on every input (``first``: the session's input's, known
        already where the goal has one input)."""
        if not self._refs:
            s = self.session
            for i, feeds in enumerate(self.feeds):
                if i == 0 and first is not None and not self.several:
                    self._refs.append(first)
                    continue
                out = timed_run(s.ref, s.loaded.model, feeds, "ref", s.stats)
                self._refs.append({o: out[o] for o in s.loaded.outputs if o in out})
        return self._refs

    def figures(
        self,
        model: onnx.ModelProto,
        figure: Callable[[Tensors, Tensors], T],
        stop: Callable[[T], bool] | None = None,
        backend: Backend | None = None,
    ) -> list[T]:
        """``figure`` (of the reference's outputs and the target's) on each input, the target
        (or ``backend``) running ``model``; with ``stop``, the inputs after the first whose
        figure it stops at are not run (BackendError propagates)."""
        s, out = self.session, []
        runner = s.target if backend is None else backend
        for feeds, ref in zip(self.feeds, self.references(), strict=True):
            got = timed_run(runner, model, feeds, "target", s.stats)
            out.append(figure(ref, got))
            if stop is not None and stop(out[-1]):
                break
        return out


def goal_runs(session: Session, labels: Sequence[str] = ("input",)) -> GoalRuns:
    """The goal's inputs: the dataset's (``Setup.goal_inputs``, loaded once and held), else
    the session's input."""
    given = session.setup.goal_inputs
    if given is None or not given.labels:
        return GoalRuns(session, tuple(labels), (session.feeds,))
    feeds = tuple(given.load(i) for i in range(len(given.labels)))
    return GoalRuns(session, given.labels, feeds)
