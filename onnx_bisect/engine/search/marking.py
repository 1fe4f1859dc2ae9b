"""The observer effect, localized: which tensor's marking changes the target's result.

Marking a tensor as an output can break a fusion that runs through it (OpenVINO at static
shapes computes a T5 encoder's attention mask wrong, but right once the mask tensor is
observed). The scan shows only that marking *everything* changes the result; this search
marks halves of the probes on the whole model, compares the final outputs with the plain run
and recurses into the half that changes them: about ⌈log2 N⌉ target runs. The tensor found
is then kept unmarked by the cut search and the pattern windows, so the fusion stays whole
and its wrong result shows where it is read.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy.typing as npt

from onnx_bisect.compare.criterion import Comparison
from onnx_bisect.compare.tensors import compare_tensors
from onnx_bisect.engine.measure.runs import plan_chunks, timed_run
from onnx_bisect.engine.measure.store import TensorStore
from onnx_bisect.engine.session import Session
from onnx_bisect.errors import BackendError
from onnx_bisect.graph.extract import incomplete_outputs, with_outputs

__all__ = ["Marking", "find_marking"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Marking:
    """The first tensor (in graph order) whose marking alone changes the target's result."""

    tensor: str
    producer: str  # the node that computes it ("" for a graph input)
    producer_op: str
    readers: tuple[str, ...]  # the nodes reading it: the fusion spans producer -> readers
    change: Comparison  # the worst final output, marked against the plain run
    runs: int  # target runs the search took

    def note(self) -> str:
        """One line for the report."""
        readers = ", ".join(self.readers[:3]) + (" ..." if len(self.readers) > 3 else "")
        how = self.change.shown("rel_l2")  # NaN where marking turned the output NaN, not 0
        return (
            f"marking {self.tensor!r} alone changes the target's result ({self.change.tensor} "
            f"moves rel_l2 {how} from the plain run; found in {self.runs} target runs): a "
            f"fusion from {self.producer_op} {self.producer!r} to its readers ({readers}) "
            "that marking undoes; the cut search and the pattern windows never mark it"
        )


def find_marking(
    session: Session,
    store: TensorStore,
    plain: Mapping[str, npt.NDArray[Any]],
    candidates: Sequence[str] | None = None,
) -> Marking | None:
    """The first of ``candidates`` (default: every probe but the outputs) whose marking alone
    changes the target's final outputs from ``plain`` (the unmarked run's); None when none
    does alone (several together, or the target refuses a marked model).

    The probes are split into chunks within the memory budget, as the scan marks them; the
    first chunk that changes the result is halved until one tensor is left, which is then
    checked alone.
    """
    s, loaded = session, session.loaded
    finals = [o for o in loaded.outputs if o in plain]
    names = [t for t in (candidates or loaded.probes) if t not in set(loaded.outputs)]
    runs = 0

    def changed(subset: Sequence[str]) -> Comparison | None:
        nonlocal runs
        runs += 1
        marked = with_outputs(loaded.model, [*finals, *subset])
        untyped = [n for n in incomplete_outputs(marked) if n in store]
        if untyped:
            metas = {n: loaded.fed_meta(n, store.meta(n)) for n in untyped}
            marked = with_outputs(loaded.model, [*finals, *subset], metas)
        out = timed_run(s.target, marked, s.feeds, "target", s.stats)
        moved = [compare_tensors(o, plain[o], out.get(o), s.crit) for o in finals]
        worst = max(moved, key=s.crit.badness, default=None)
        return worst if worst is not None and worst.diverged else None

    try:
        for chunk in plan_chunks(names, s.sizes, s.memory.chunk()):
            if changed(chunk) is None:
                continue
            while len(chunk) > 1:  # the earlier half first: the first tensor that does it
                half = chunk[: len(chunk) // 2]
                chunk = half if changed(half) is not None else chunk[len(chunk) // 2 :]
            alone = changed(chunk)
            if alone is None:
                log.debug("marking: no single tensor changes the result (%d runs)", runs)
                return None
            return _marking(session, chunk[0], alone, runs)
    except BackendError as exc:
        log.debug("marking: the target refused a marked model: %s", exc)
    return None


def _marking(session: Session, tensor: str, change: Comparison, runs: int) -> Marking:
    loaded = session.loaded
    producer = loaded.producer.get(tensor)
    readers = tuple(n.name for n in loaded.readers.get(tensor, ()))
    return Marking(
        tensor,
        producer.name if producer is not None else "",
        producer.op_type if producer is not None else "input",
        readers,
        change,
        runs,
    )
