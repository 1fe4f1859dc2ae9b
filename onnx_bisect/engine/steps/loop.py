"""Steps in lockstep: each step screened as one input is (both sides' plain runs, the outputs
judged with the noise and precision floors of that step), teacher-forced: both sides get the
reference's state and token, so a step that diverges is a defect of that step rather than
drift that accumulates. ``free_run`` then lets the target feed itself, against the
reference's own chain (which teacher forcing does not change: the reference feeds itself).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy.typing as npt
import onnx

from onnx_bisect.compare.criterion import Comparison, Criterion
from onnx_bisect.compare.tensors import compare_tensors
from onnx_bisect.engine.diagnose import BackendLike, open_session, prepare, screen_session
from onnx_bisect.engine.measure.runs import RunStats, timed_run
from onnx_bisect.engine.session import Feeds, Setup, StageTimer, scratch_dir
from onnx_bisect.errors import BackendError
from onnx_bisect.graph.load import load_model
from onnx_bisect.inputs.feeds import generate_feeds, make_feeds
from onnx_bisect.inputs.npz import read_npz
from onnx_bisect.inputs.shapes import default_dim
from onnx_bisect.inputs.signature import InputSpec, input_specs
from onnx_bisect.inputs.steps import (
    Wiring,
    detect_wiring,
    first_feeds,
    greedy_token,
    next_feeds,
    split_chunks,
)
from onnx_bisect.options import BisectOptions, ModelLike
from onnx_bisect.steps_result import StepRecord, StepsSummary

__all__ = ["Stepped", "one_step", "run_steps"]

log = logging.getLogger(__name__)
Arrays = Mapping[str, npt.NDArray[Any]]


@dataclass(frozen=True)
class Stepped:
    """What the steps found, and each step's inputs (the diagnosed step's go to ``bisect``)."""

    summary: StepsSummary
    feeds: tuple[Feeds, ...]
    runs: Mapping[str, int]


@dataclass(frozen=True)
class _Plan:
    specs: tuple[InputSpec, ...]
    wiring: Wiring
    chunks: tuple[Feeds, ...]
    first: Feeds


def one_step(options: BisectOptions, feeds: Feeds) -> BisectOptions:
    """The options of one step's diagnosis: its inputs given, so nothing of the steps' or of
    generated inputs' options is left (``--shape``, ``--value`` made step 0's inputs)."""
    return dataclasses.replace(
        options,
        steps=None,
        state=(),
        chunks=None,
        free_run=False,
        inputs=feeds,
        shapes=None,
        values=None,
        ranges=None,
    )


def run_steps(
    model: ModelLike,
    ref: BackendLike,
    target: BackendLike,
    options: BisectOptions,
    timer: StageTimer,
) -> Stepped:
    """``options.steps`` steps, teacher-forced (and free-running with ``free_run``)."""
    assert options.steps is not None
    plan = _plan(model, options)
    single = one_step(options, plan.first)
    setup, _ = prepare(model, ref, target, single, timer)
    runs: dict[str, int] = {}
    records: list[StepRecord] = []
    feeds_seen: list[Feeds] = []
    crits: list[Criterion] = []
    ref_chain: list[Arrays] = []
    feeds: Feeds = plan.first
    with timer.stage("steps"):
        for k in range(options.steps):
            feeds_seen.append(feeds)
            record, ref_out, crit = _step(setup, k, feeds, plan.wiring, runs)
            records.append(record)
            crits.append(crit)
            if ref_out is None:  # the target failed here: the reference's chain ends too
                break
            ref_chain.append(ref_out)
            if k + 1 < options.steps:
                chunk = plan.chunks[k + 1] if plan.chunks else None
                feeds = next_feeds(plan.wiring, plan.specs, feeds, ref_out, chunk)
    free = None
    if options.free_run and ref_chain:
        with timer.stage("free run"):
            free = _free_run(setup, plan, ref_chain, crits, runs)
    first = next((r.step for r in records if r.diverged or r.failed), None)
    summary = StepsSummary(
        count=len(records),
        first_divergent_step=first,
        per_step=tuple(records),
        wiring=plan.wiring.lines(),
        free_run=free,
    )
    return Stepped(summary, tuple(feeds_seen), runs)


def _plan(model: ModelLike, options: BisectOptions) -> _Plan:
    loaded = load_model(model)
    specs = tuple(input_specs(loaded.model))
    arrays = (
        read_npz(Path(options.chunks), what="chunks") if options.chunks is not None else {}
    )
    assert options.steps is not None
    chunks = tuple(split_chunks(arrays, options.steps)) if arrays else ()
    wiring = detect_wiring(specs, loaded.outputs, tuple(options.state), tuple(arrays))
    if options.inputs is not None:
        given = make_feeds(
            loaded.model,
            inputs=options.inputs,
            max_memory=options.max_memory,
            allow_nonfinite=options.allow_nonfinite,
        )
        first: Feeds = {**given, **(chunks[0] if chunks else {})}
    else:
        first = _generated(loaded.model, specs, wiring, options, chunks[0] if chunks else None)
    return _Plan(specs, wiring, chunks, first)


def _generated(
    model: onnx.ModelProto,
    specs: Sequence[InputSpec],
    wiring: Wiring,
    options: BisectOptions,
    chunk: Feeds | None,
) -> Feeds:
    """Step 0's inputs: seeded for what nothing feeds (a prompt of 1 where its length is
    dynamic), an empty state for what the steps carry."""
    carried = {i for _, i in wiring.state} | set(chunk or {})
    shapes = dict(options.shapes or {})
    free = [s for s in specs if s.name not in carried]
    for s in free:
        if s.name not in shapes:
            dims = [default_dim(i, d) for i, d in enumerate(s.dims)]
            if None in dims:  # a prompt's or a mask's length: 1 token
                shapes[s.name] = [1 if d is None else d for d in dims]
    generated = generate_feeds(
        free,
        {k: v for k, v in shapes.items() if k in {s.name for s in free}},
        options.seed,
        values=options.values,
        ranges=options.ranges,
    )
    return first_feeds(wiring, specs, generated, options.shapes, chunk)


def _step(
    setup: Setup, k: int, feeds: Feeds, wiring: Wiring, runs: dict[str, int]
) -> tuple[StepRecord, Arrays | None, Criterion]:
    """One step screened as an input is: both plain runs, the outputs judged."""
    outputs = setup.loaded.outputs
    with scratch_dir() as scratch, ExitStack() as opened:
        session = open_session(
            setup, feeds, scratch, StageTimer(), noise_for=outputs, oracle_in_child=False
        )
        opened.callback(session.abandon)  # before the scratch folder goes
        screened = screen_session(session)
        for role, n in session.stats.runs.items():
            runs[role] = runs.get(role, 0) + n
        crit = session.crit
    if isinstance(screened, BackendError):
        line = str(screened).splitlines()[0] if str(screened) else type(screened).__name__
        log.info("step %d: the target failed: %s", k, line)
        return StepRecord(k, True, None, failed=line), None, crit
    worst = max(screened.comparisons.values(), key=crit.badness)
    record = _tokens(
        StepRecord(k, screened.diverged, worst),
        wiring,
        screened.ref_outputs,
        screened.target_outputs,
    )
    log.info("step %d: %s (worst %s)", k, record.status(), worst.tensor)
    return record, screened.ref_outputs, crit


def _tokens(record: StepRecord, wiring: Wiring, ref: Arrays, target: Arrays) -> StepRecord:
    """Each side's greedy token; a flip within the target's error on the two is a tie."""
    if wiring.token is None or wiring.token[0] not in ref or wiring.token[0] not in target:
        return record
    name = wiring.token[0]
    r, t = int(greedy_token(ref[name])[0, 0]), int(greedy_token(target[name])[0, 0])
    # The logits passed their judgement: a flip is the precision deciding a near-tie.
    tie = r != t and not record.diverged
    return dataclasses.replace(record, ref_token=r, target_token=t, tie=tie)


def _free_run(
    setup: Setup,
    plan: _Plan,
    ref_chain: Sequence[Arrays],
    crits: Sequence[Criterion],
    runs: dict[str, int],
) -> tuple[StepRecord, ...]:
    """The target fed its own outputs, against the reference's own chain."""
    stats = RunStats()
    other = setup.target_model or setup.loaded
    feeds = plan.first
    out: list[StepRecord] = []
    for k, (ref_out, crit) in enumerate(zip(ref_chain, crits, strict=False)):
        try:
            got = timed_run(setup.target, other.model, feeds, "target", stats)
        except BackendError as exc:
            out.append(StepRecord(k, True, None, failed=str(exc).splitlines()[0]))
            break
        shown = [n for n in ref_out if n in got]
        compared = [compare_tensors(n, ref_out[n], got[n], crit) for n in shown]
        worst: Comparison | None = max(compared, key=crit.badness) if compared else None
        diverged = any(c.diverged for c in compared)
        out.append(_tokens(StepRecord(k, diverged, worst), plan.wiring, ref_out, got))
        if k + 1 < len(ref_chain):
            chunk = plan.chunks[k + 1] if plan.chunks else None
            feeds = next_feeds(plan.wiring, plan.specs, feeds, got, chunk)
    runs["target"] = runs.get("target", 0) + stats.runs.get("target", 0)
    return tuple(out)
