"""Observing the backends: the plain screen, and every probe run on one loop.

``probe_runs`` is the one place that marks tensors as outputs in memory-bounded chunks; the
scan (both backends), the float64 noise reference, the two-model target run and ``dump`` all
run through it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Container, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy.typing as npt
import onnx

from onnx_bisect.backends.protocol import Backend
from onnx_bisect.compare.criterion import Comparison, Criterion
from onnx_bisect.compare.tensors import compare_tensors
from onnx_bisect.engine.measure.runs import plan_chunks, run_pair, timed_run
from onnx_bisect.engine.measure.store import TensorStore
from onnx_bisect.engine.session import Session
from onnx_bisect.errors import BackendError
from onnx_bisect.graph.extract import incomplete_outputs, strict_copy, with_outputs
from onnx_bisect.text import plural

__all__ = [
    "Observed",
    "answered",
    "probe_runs",
    "scan",
    "screen",
]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Observed:
    """Comparisons from a run of both backends, and the target's final outputs from it (kept
    to tell whether marking outputs changed what the target computes)."""

    comparisons: Mapping[str, Comparison]
    target_outputs: Mapping[str, npt.NDArray[Any]]
    ref_outputs: Mapping[str, npt.NDArray[Any]] = field(default_factory=dict)

    @property
    def diverged(self) -> bool:
        return any(c.diverged for c in self.comparisons.values())


def probe_runs(
    model: onnx.ModelProto,
    names: Sequence[str],
    sizes: Mapping[str, int | None],
    budget: int,
    use: Callable[[list[str], onnx.ModelProto], None],
) -> None:
    """``names`` marked as outputs of ``model`` in chunks of at most ``budget`` bytes; ``use``
    runs each chunk's model. A callback, not a generator: what ``use`` computed for one chunk
    is gone before the next runs (a loop variable would hold it through the next run)."""
    chunks = plan_chunks(names, sizes, budget)
    log.debug("%d probes in %s", len(names), plural(len(chunks), "chunk"))
    for i, chunk in enumerate(chunks):
        log.debug("probe run %d/%d (%d tensors)", i + 1, len(chunks), len(chunk))
        use(chunk, with_outputs(model, chunk))


def screen(session: Session, *, final: bool = False) -> Observed:
    """Plain runs of both backends, compared on the final outputs only (those of both models
    when the target runs another model).

    ``final``: agreeing outputs end the diagnosis. Then, while ``--threshold auto``'s float64
    oracle is still measuring, outputs within ``eps`` (rel_l2) of the reference are judged
    without it: every noise-floor threshold is at least ``eps``, and the reference-off check
    needs the two to differ by more. Only outputs outside it wait for the oracle."""
    s, loaded = session, session.loaded
    other = s.setup.target_model or loaded
    ref_out, tgt_out = run_pair(
        lambda: timed_run(s.ref, loaded.model, s.feeds, "ref", s.stats),
        lambda: timed_run(s.target, strict_copy(other.model), s.feeds, "target", s.stats),
        s.options.parallel and s.memory.side_by_side,
    )
    names = [n for n in loaded.outputs if n in set(other.outputs)]
    shown = [n for n in names if answered(n, s.ref, ref_out, s.target, tgt_out)]
    if not shown:
        raise BackendError(
            "no final output to compare: the models share no output name, or neither backend "
            "holds one"
        )

    def judged(crit: Criterion) -> dict[str, Comparison]:
        return {n: compare_tensors(n, ref_out.get(n), tgt_out.get(n), crit) for n in shown}

    comparisons = None
    if final and s.criterion_pending():  # only --threshold auto's criterion is measured
        within = Criterion(metric="rel_l2", threshold=s.options.noise_eps)
        quick = judged(within)
        agree = not any(c.diverged for c in quick.values())
        if agree and s.settle(s.options.noise_criterion(_unknown)):
            s.notes.append(
                f"--threshold auto: every final output is within rel_l2 {within.threshold:g} "
                f"of the reference, under any noise-floor threshold; the float64 oracle "
                f"was not waited for"
            )
            comparisons = quick
    return Observed(
        judged(s.crit) if comparisons is None else comparisons,
        {n: tgt_out[n] for n in shown if n in tgt_out},
        {n: ref_out[n] for n in shown if n in ref_out},
    )


def _unknown(tensor: str, ref: npt.NDArray[Any]) -> float | None:
    """No noise floor measured for any tensor."""
    return None


def answered(
    name: str,
    ref: Backend,
    ref_out: Container[str],
    target: Backend | None,
    tgt_out: Container[str],
) -> bool:
    """A partial backend (a dump) that does not hold a tensor says nothing about it."""
    missing_ref = name not in ref_out and ref.capabilities.partial
    missing_tgt = name not in tgt_out and target is not None and target.capabilities.partial
    return not (missing_ref or missing_tgt)


def scan(session: Session, store: TensorStore, *, observe_target: bool = True) -> Observed:
    """Both backends with every probe marked, in chunks within the memory budget.

    The reference's values go to ``store`` for isolation; the target's are compared and dropped
    (its final outputs are kept). Without ``observe_target`` only the reference runs, to fill
    ``store`` for a search that observes the target elsewhere. The two run side by side when
    the budget holds a chunk and the weights of each (``MemoryPlan.pair``); otherwise the
    reference's values are stored and dropped before the target runs, and each chunk may be
    twice as large.
    """
    s, loaded = session, session.loaded
    pair = observe_target and s.options.parallel and s.memory.pair
    comparisons: dict[str, Comparison] = {}
    finals: dict[str, npt.NDArray[Any]] = {}
    outputs = set(loaded.outputs)

    def use(chunk: list[str], marked: onnx.ModelProto) -> None:
        # Outputs shape inference could not type are typed from the reference's values before
        # the target sees them (strict importers refuse a bare name), so the target waits.
        untyped = incomplete_outputs(marked) if observe_target else []
        if pair and not untyped:
            ref_out, tgt_out = run_pair(
                lambda: timed_run(s.ref, marked, s.feeds, "ref", s.stats),
                lambda: timed_run(s.target, marked, s.feeds, "target", s.stats),
            )
        else:
            ref_out, tgt_out = timed_run(s.ref, marked, s.feeds, "ref", s.stats), None
        held = [n for n in chunk if n in ref_out]  # a dump reference may lack some
        for name in held:
            store.put(name, ref_out[name])
        if not observe_target:
            return
        ref_names = set(held)
        if tgt_out is None:
            del ref_out  # in the store now; the target's run gets its room
            if untyped:
                metas = {n: loaded.fed_meta(n, store.meta(n)) for n in untyped if n in store}
                marked = with_outputs(loaded.model, chunk, metas)
            tgt_out = timed_run(s.target, marked, s.feeds, "target", s.stats)
        for name in held:
            if not answered(name, s.ref, ref_names, s.target, tgt_out):
                continue
            ref_value = store.get(name)
            comparisons[name] = compare_tensors(name, ref_value, tgt_out.get(name), s.crit)
            if name in outputs and name in tgt_out:
                finals[name] = tgt_out[name]

    chunk_bytes = s.memory.pair_chunk if pair else s.memory.chunk()
    probe_runs(loaded.model, loaded.probes, s.sizes, chunk_bytes, use)
    return Observed(comparisons, finals)
