"""``bisect()``: the whole diagnosis as one typed call. The CLI is a thin layer over it."""

from __future__ import annotations

import dataclasses
import functools
from collections import Counter
from contextlib import ExitStack
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from onnx_bisect.engine.control_flow import with_control_flow_inlined
from onnx_bisect.engine.dataset.job import dataset_job, measure_input, screen_input
from onnx_bisect.engine.dataset.parallel import run_tasks
from onnx_bisect.engine.dataset.stats import MeasuredInput, rank, summarize
from onnx_bisect.engine.diagnose import (
    BackendLike,
    diagnose,
    open_session,
    prepare,
    to_result,
)
from onnx_bisect.engine.found import Found
from onnx_bisect.engine.keep16 import keep_in_fp32
from onnx_bisect.engine.measure.observe import scan
from onnx_bisect.engine.passes.bisection import bisect_passes
from onnx_bisect.engine.progress import NoProgress, Progress
from onnx_bisect.engine.search.failure import reference_crash
from onnx_bisect.engine.session import GoalInputs, Session, Setup, StageTimer, scratch_dir
from onnx_bisect.engine.steps.loop import one_step, run_steps
from onnx_bisect.engine.torchref.capture import is_torch_ref
from onnx_bisect.engine.torchref.run import bisect_torch
from onnx_bisect.errors import BackendCrash, InputError
from onnx_bisect.options import DEFAULT_SAMPLE, BisectOptions, ModelLike
from onnx_bisect.report.files import write_bundle_docs
from onnx_bisect.repro.bundle import BundleJob, write_repro
from onnx_bisect.repro.torchref import torch_repro
from onnx_bisect.result import BisectResult, CauseKind, ReproInfo

if TYPE_CHECKING:
    from torch.nn import Module

__all__ = ["BackendLike", "bisect"]


def bisect(
    model: ModelLike,
    *,
    target: BackendLike | Module,
    ref: BackendLike | Module = "cpu",
    options: BisectOptions | None = None,
    progress: Progress | None = None,
    **overrides: Any,
) -> BisectResult:
    """Find the first node where ``target`` departs from ``ref`` and the node that causes it.

    ``target`` has no default, as on the command line: a default would compare ``ref`` with
    itself and answer "no divergence" to a question nobody asked.

    Options are the fields of ``BisectOptions``, given as ``options=`` or as keywords:

    - ``inputs``: a path (.npz/.npy/test-case dir) or a dict of arrays; without it, seeded
      random inputs (``seed``; ``shapes`` fixes dynamic dims).
    - ``metric``/``threshold`` or ``atol``/``rtol``: what diverged means. ``threshold="auto"``
      measures each tensor's fp32 noise against a float64 reference and flags errors above
      ``noise_k`` × noise + ``noise_eps``.
    - ``strategy``: ``scan`` marks every tensor and isolates every node; ``bisect`` searches
      over cuts, marking only the tensors live across each (keeps the target's fusions);
      ``auto`` scans and switches to bisect when marking outputs changes the target's result.
    - ``parallel``: run the reference and the target concurrently where both are needed.
    - ``always_scan``: scan and isolate even when the final outputs agree (the verdict still
      follows the outputs).
    - ``isolate_crashes``: where a target named by spec runs. None (default): in a
      long-lived worker process, so that a segfault, abort or panic ends the worker, not the
      caller, and the crash is bisected to its node (its runs after a crash each in a fresh
      process); the reference in this process. True: the target in a fresh child process
      per run from the start, the reference in a worker. False: both in this process (a
      crash ends it). ``exec:`` is a child per run always;
      a backend object stays in this process. ``timeout`` (seconds per target run) turns a
      hang into a crash.
    - ``target_model``: run a different model on the target (an optimized copy, say), matching
      tensors by name and leaving out names whose meaning changed.
    - ``topk``: task-level checks on the final outputs (``"5:logits"``), reported only.
    - ``repro``: a directory for a minimal repro bundle, written and verified on divergence.
    - ``bisect_passes``: after a divergence, find which of the target's optimizer passes
      cause it and how to turn them off (``"auto"``, the default, where the target has
      passes: ONNX Runtime above ``opt=disable``, or an ``exec:`` runtime whose command takes
      ``{disable}`` with its pass names in ``passes``; ``"on"`` also says when it has none;
      ``"off"``).
    - ``unroll_max``: a Loop running at most this many iterations for these inputs is
      unrolled, so its body's nodes are probed and can be named (default 64).
    - ``max_memory``: bytes of tensors the diagnosis may hold at once, across the process
      tree (probe outputs, runtimes' working sets, kept values; weights and a fixed
      overhead come on top, see docs/guide.md); ``command``: for the report.
    - ``dataset``: many inputs instead of one: a directory of .npz files or test_data_set_*
      folders, a glob, or one .npz whose arrays are split along their leading axis. Every
      input is screened and ranked by its outputs' error, the worst ``sample`` (default 8)
      are scanned and isolated, and the worst is diagnosed in full; ``result.dataset`` holds
      the ranking, per-node statistics over the sample and the culprit's confirmation.
      ``jobs`` runs the per-input work in that many local processes, ``ray`` as Ray tasks
      (a cluster address, or ``"local"``).

    ``ref`` may be PyTorch: an ``nn.Module`` or ``"pytorch:FILE.py:FACTORY"`` (``FACTORY()``
    returns a module or ``(module, example_inputs)``). The module runs in eval mode on the same
    inputs with a hook on every submodule; each module's output is compared with the ONNX
    tensor that stands for it (``graph.source``'s module paths) on the target, and the first
    divergent module's nodes are fed its own inputs in float64: kind ``export`` (the
    translation is wrong) or ``runtime`` (the target's kernel); ``result.torch`` holds the
    modules. ``target`` may be PyTorch instead: the module under test against the ONNX model
    on ``ref`` (kind ``reference`` where ``ref``'s kernel is the one off). ``threshold="auto"``
    takes each tensor's fp32 noise from the module run in float64; ``repro`` writes the
    culprit module's ONNX nodes fed its captured inputs, expecting its output.

    ``progress`` hears each phase start and end and each backend run as it happens (the CLI
    shows it on a terminal); every phase is logged at INFO with its time and runs either way.

    Raises ``OnnxBisectError`` subclasses for bad input and unusable backends; an error about
    one option's value names it first and has it in ``option``.
    """
    opts = _options(options, overrides)  # bad values fail here, before any work
    timer = StageTimer(progress=progress or NoProgress())
    if is_torch_ref(ref) or is_torch_ref(target):
        bundler = None
        if opts.repro is not None:
            bundler = functools.partial(torch_repro, out_dir=Path(opts.repro))
        result = bisect_torch(model, ref, target, opts, timer, bundler)
        write_bundle_docs(result)
        return result
    ref, target = cast(BackendLike, ref), cast(BackendLike, target)
    if opts.dataset is not None:
        return _bisect_dataset(model, ref, target, opts, timer)
    if opts.steps is not None:
        return _bisect_steps(model, ref, target, opts, timer)
    return _bisect_one(model, ref, target, opts, timer)


def _bisect_one(
    model: ModelLike,
    ref: BackendLike,
    target: BackendLike,
    opts: BisectOptions,
    timer: StageTimer,
    goal_inputs: GoalInputs | None = None,
) -> BisectResult:
    """One input: prepare, open a session, diagnose, bisect passes, cut a bundle; the keep
    searches' goal measured on ``goal_inputs`` where given (a dataset's)."""
    setup, feeds = prepare(model, ref, target, opts, timer)
    if goal_inputs is not None:
        setup = dataclasses.replace(setup, goal_inputs=goal_inputs)
    with scratch_dir() as scratch, ExitStack() as opened:

        def begin(chosen: Setup) -> Session:
            # Abandoned before the scratch folder goes: its oracle thread writes there.
            session = open_session(chosen, feeds, scratch, timer)
            opened.callback(session.abandon)
            return session

        session = begin(setup)
        try:
            session, screened = with_control_flow_inlined(session, begin)
            diagnosis = diagnose(session, screened)
        except BackendCrash as exc:
            if exc.role != "ref":
                raise
            # The reference, in a worker, died: which node kills it (exit 2).
            raise reference_crash(session, exc) from None
        found = diagnosis.found
        # A setting to change (a precision the runtime chose) has no bug to bisect or file.
        bug = diagnosis.diverged and not (found and found.cause and not found.cause.is_bug)
        passes = None
        if bug and diagnosis.screened is not None:
            passes = bisect_passes(session, diagnosis.screened, found)
        bundle = None
        if opts.repro is not None and bug and found is not None:
            with timer.stage("repro"):
                bundle = _repro(session, found, Path(opts.repro))
        # A float16 conversion at fault: which nodes to keep in float32, verified as applied.
        fp32 = keep_in_fp32(session, diagnosis)
        result = to_result(session, diagnosis, bundle, passes, fp32)
    write_bundle_docs(result)
    return result


def _bisect_dataset(
    model: ModelLike, ref: BackendLike, target: BackendLike, opts: BisectOptions, timer: StageTimer
) -> BisectResult:
    """Every input screened (in workers with ``jobs``/``ray``), the worst ``sample`` scanned and
    isolated, the worst diagnosed in full; its culprit confirmed over the sample."""
    with timer.stage("inputs"):
        job = dataset_job(model, ref, target, opts)
    run = functools.partial(run_tasks, jobs=opts.jobs, ray=opts.ray)
    with timer.stage("screen inputs"):
        ranked = rank(run(screen_input, job, range(len(job.items))))
    sample = opts.sample or DEFAULT_SAMPLE
    measured: list[MeasuredInput] = []
    if ranked[0].diverged or opts.always_scan:  # as with one input: agreeing outputs end it
        with timer.stage("sample"):
            chosen = [s.index for s in ranked[:sample] if not s.failed]
            measured = run(measure_input, job, chosen)
    worst = dataclasses.replace(
        opts, dataset=None, sample=None, jobs=1, ray=None, inputs=job.feeds(ranked[0].index)
    )
    # The keep searches' goal holds on every input that ran, worst first.
    ran = [s.index for s in ranked if not s.failed]
    goals = GoalInputs(tuple(job.label(i) for i in ran), lambda i: job.feeds(ran[i]))
    result = _bisect_one(model, ref, target, worst, timer, goals)
    source, cause = str(opts.dataset), result.root_cause
    summary = summarize(
        source, ranked, measured, cause, sample=sample, jobs=opts.jobs, ray=opts.ray
    )
    runs = Counter(result.runs) + Counter(summary.runs)
    first = ("inputs", "screen inputs", "sample")  # in the order they ran
    timings = {**{k: result.timings[k] for k in first if k in result.timings}, **result.timings}
    screened = {
        "screen inputs": sum(s.runs.get("target", 0) for s in ranked),
        "sample": sum(m.runs.get("target", 0) for m in measured),
    }
    stage_runs = {**{k: v for k, v in screened.items() if v}, **result.stage_runs}
    return dataclasses.replace(
        result, dataset=summary, runs=dict(runs), timings=timings, stage_runs=stage_runs
    )


def _bisect_steps(
    model: ModelLike, ref: BackendLike, target: BackendLike, opts: BisectOptions, timer: StageTimer
) -> BisectResult:
    """Every step screened in lockstep; the first that diverges (else the last) diagnosed in
    full on its own inputs, so its bundle and inputs.npz hold that step's inputs."""
    stepped = run_steps(model, ref, target, opts, timer)
    summary = stepped.summary
    chosen = summary.first_divergent_step
    step = chosen if chosen is not None else len(stepped.feeds) - 1
    one = one_step(opts, stepped.feeds[step])
    result = _bisect_one(model, ref, target, one, timer)
    runs = Counter(result.runs) + Counter(stepped.runs)
    timings = {k: result.timings[k] for k in ("load", "steps", "free run") if k in result.timings}
    stepping = stepped.runs.get("target", 0)
    stage_runs = {**({"steps": stepping} if stepping else {}), **result.stage_runs}
    return dataclasses.replace(
        result,
        steps=summary,
        runs=dict(runs),
        timings={**timings, **result.timings},
        stage_runs=stage_runs,
    )


def _options(options: BisectOptions | None, overrides: dict[str, Any]) -> BisectOptions:
    known = {f.name for f in dataclasses.fields(BisectOptions)}
    unknown = ", ".join(sorted(set(overrides) - known))
    if unknown:
        raise InputError(f"bisect() got unknown option(s) {unknown}; see BisectOptions")
    return dataclasses.replace(options or BisectOptions(), **overrides)


# What a bundle must show, by root-cause kind: a crash, an error, or else a divergence.
SYMPTOMS = {CauseKind.CRASH: "crash", CauseKind.UNSUPPORTED: "error", CauseKind.ERROR: "error"}


def _repro(session: Session, found: Found, out_dir: Path) -> ReproInfo:
    """The smallest subgraph that reproduces what was found, written and verified."""
    store = found.store
    if store is None:
        # The crash search ran no scan; the reference's values at the cut feed the bundle.
        store = session.store("bundle")
        scan(session, store, observe_target=False)
    cause, first = found.cause, found.first
    start = cause.nodes if cause and cause.nodes else ((first.name,) if first else ())
    start = found.bundle_from or start
    symptom = SYMPTOMS.get(cause.kind, "divergence") if cause is not None else "divergence"
    job = BundleJob(
        session,
        found.cut_from or session.loaded,
        store,
        symptom=symptom,
        failed_alone=found.failed_alone,
        ran_alone=found.ran_alone,
        unmarked=found.unmarked,
    )
    return write_repro(job, start, out_dir, verify_in_process=not session.setup.target_from_spec)
