"""The stages in order: prepare (once), open a session (per input), screen, strategy.

``prepare`` loads the model, builds the backends and applies transforms; ``open_session`` adds
one input's feeds, sizes and criterion (with noise floors for ``--threshold auto``);
``diagnose`` screens and hands a divergence to a strategy, or a crash to the crash search;
``to_result`` turns what was found into a ``BisectResult``.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TypeVar

from onnx_bisect.backends.environment import environment
from onnx_bisect.backends.protocol import Backend, BackendBase
from onnx_bisect.backends.registry import create_backend
from onnx_bisect.backends.spec import BackendSpec, parse_spec
from onnx_bisect.compare.criterion import Criterion
from onnx_bisect.compare.noise import NoiseFloor
from onnx_bisect.compare.precision import PrecisionFloors, PrecisionInfo
from onnx_bisect.compare.topk import TopKCheck, TopKSpec, topk_checks
from onnx_bisect.engine.found import Found
from onnx_bisect.engine.judge import reference_is_off, reference_off_note
from onnx_bisect.engine.measure.memory import plan_memory
from onnx_bisect.engine.measure.observe import Observed, screen
from onnx_bisect.engine.oracle.float64 import FLOAT64_MAX_WEIGHTS, Float64Run, measure_float64
from onnx_bisect.engine.precision import (
    precision_notes,
    side_precision,
    unasked_precision,
    unasked_precision_cause,
    with_input_rounding,
)
from onnx_bisect.engine.quant.amplified import flips_amplified
from onnx_bisect.engine.quant.prelude import prepare_early
from onnx_bisect.engine.quant.steps import GRIDS, IntegerGrids, integer_grids, one_model_report
from onnx_bisect.engine.recorded import option_feeds
from onnx_bisect.engine.search.failure import failure_search
from onnx_bisect.engine.session import Feeds, Session, Setup, StageTimer
from onnx_bisect.engine.strategies import STRATEGIES, choose
from onnx_bisect.errors import BackendError, InputError
from onnx_bisect.graph.load import load_model
from onnx_bisect.graph.qdq import is_quantized
from onnx_bisect.graph.sizes import fix_input_shapes, model_bytes, tensor_nbytes
from onnx_bisect.graph.source import SourceInfo, node_source
from onnx_bisect.graph.view import LoadedModel
from onnx_bisect.inputs.feeds import input_specs, validate_feeds
from onnx_bisect.inputs.limits import nonfinite_notes
from onnx_bisect.options import BisectOptions, ModelLike
from onnx_bisect.process import REF_WORKER_ENV
from onnx_bisect.quant_result import KeepInFp32, QuantReport
from onnx_bisect.result import (
    BackendInfo,
    BisectResult,
    CauseKind,
    Outcome,
    PassBisection,
    ReproInfo,
)
from onnx_bisect.text import plural
from onnx_bisect.transforms.apply import transformed
from onnx_bisect.transforms.registry import TransformRecord

__all__ = [
    "BackendLike",
    "Diagnosis",
    "Screened",
    "diagnose",
    "open_session",
    "prepare",
    "screen_session",
    "to_result",
]

log = logging.getLogger(__name__)
T = TypeVar("T")

BackendLike = str | BackendSpec | Backend
IN_MEMORY = "<in-memory ModelProto>"


@dataclass(frozen=True)
class Diagnosis:
    """The screen's observation (None when the target crashed on the whole model) and what
    the strategy found (None when the outputs agree and nothing more was asked)."""

    screened: Observed | None
    found: Found | None
    diverged: bool


def prepare(
    model: ModelLike,
    ref: BackendLike,
    target: BackendLike,
    options: BisectOptions,
    timer: StageTimer,
) -> tuple[Setup, Feeds]:
    """Load the model, build both backends, make the feeds and apply ``+transform``s."""
    with timer.stage("load"):
        topk = options.topk_specs()
        loaded = load_model(model)
        _check_topk_outputs(topk, loaded)
        ref_spec, tgt_spec = _spec(ref), _spec(target)
        # The reference stays here by default (a worker of its own cost every run more); the
        # CLI runs the command again when it crashed here (``process.REF_WORKER_ENV``), and
        # with --isolate-crashes: then in a worker, where its crash names a node.
        again = os.environ.get(REF_WORKER_ENV, "")
        ref_in_child = None if options.isolate_crashes or again else False
        ref_b = _backend(ref, in_child=ref_in_child, timeout=None)
        tgt_b = _backend(target, in_child=options.isolate_crashes, timeout=options.timeout)
        feeds = option_feeds(loaded.model, (ref_b, tgt_b), options)
        other = load_model(options.target_model) if options.target_model is not None else None
        label = str(other.path or IN_MEMORY) if other else ""
        records: list[TransformRecord] = []
        ref_t, tgt_t = _transforms(ref_spec), _transforms(tgt_spec)
        if ref_t or tgt_t:
            loaded, other, label, records = transformed(loaded, other, ref_t, tgt_t, feeds)
        if other is not None:
            validate_feeds(feeds, input_specs(other.model))
    setup = Setup(
        loaded=loaded,
        ref=ref_b,
        target=tgt_b,
        ref_info=_info(ref_b, ref_spec),
        target_info=_info(tgt_b, tgt_spec),
        options=options,
        target_model=other,
        target_label=label,
        transforms=tuple(records),
        topk=topk,
        versions=environment(ref_b, tgt_b),
        target_from_spec=isinstance(target, str | BackendSpec),
        notes=(
            *loaded.notes,
            *nonfinite_notes(feeds),
            *(r.summary() for r in records),
            *_again_note(again),
        ),
        # A float16 model computes in float16 on both sides unless something says otherwise
        # ("float32 (default: the model's own types)" was wrong words for it).
        ref_precision=side_precision(
            ref_b,
            transforms=[r for r in records if r.role == "ref"],
            model=loaded,
            whose="the model's",
        ),
        target_precision=side_precision(
            tgt_b,
            flag=options.target_precision,
            transforms=[r for r in records if r.role == "target"],
            model=other if options.target_model is not None else loaded,
            whose="the target model's" if options.target_model is not None else "the model's",
        ),
    )
    return setup, feeds


def open_session(
    setup: Setup,
    feeds: Feeds,
    scratch: Path,
    timer: StageTimer,
    *,
    noise_for: Sequence[str] | None = None,
    oracle_in_child: bool = True,
) -> Session:
    """One input's session: sizes with the actual input shapes, and the criterion, with
    per-tensor noise floors measured against float64 for ``--threshold auto`` (of every probe,
    or of ``noise_for`` alone: a dataset's screen needs the outputs' floors only; see
    ``measure_float64`` for ``oracle_in_child``)."""
    loaded, options = setup.loaded, setup.options
    sizes = tensor_nbytes(fix_input_shapes(loaded.model, {k: v.shape for k, v in feeds.items()}))
    memory = plan_memory(
        loaded,
        sizes,
        options.max_memory,
        float64=options.auto_threshold,
        feeds=sum(v.nbytes for v in feeds.values()),
    )
    memory.require(factor=2 if options.auto_threshold else 1)
    crit = options.criterion()
    session = Session(
        setup, feeds, crit, sizes, scratch, memory, timer=timer, notes=list(setup.notes)
    )
    if setup.target_model is None and is_quantized(loaded):
        # One quantized model on two backends: integers compared in steps of their scales
        # (a dynamic model's read from one reference run), flipped inputs' effect bounded.
        grids = integer_grids(session)
        crit = replace(crit, quantized=grids.params, quant_bounds=grids.bounds)
        session.crit = crit
        session.prepared[GRIDS] = grids
        if grids.note:
            session.notes.append(grids.note)
    if options.auto_threshold:
        job = lambda: _auto_criterion(session, crit, noise_for, oracle_in_child)  # noqa: E731
        # Over 2 GB of weights the oracle runs first, alone: beside the screen, where the
        # reference and the target each hold the weights, its own reads of them would take
        # the process tree from about 2.3x to 3x the weights (measured, 2.5 GiB model).
        big = model_bytes(loaded.model).weights > FLOAT64_MAX_WEIGHTS
        alongside = memory.oracle_beside(options.parallel) > 0 and not big
        session.measure_criterion(job, alongside=alongside)
    return session


# --threshold auto without float64 values: rel_l2 > 1e-3 and max_abs above 8 fp32 ulps of
# max(1, the tensor's peak), so that outputs driven to ~1e-5 by random inputs stay quiet.
FALLBACK_ABS_FLOOR = 1e-6


def _one_model_quant(session: Session, diagnosis: Diagnosis) -> QuantReport | None:
    """One quantized model on two backends: how its integers compared (report.json's
    ``quantization``), from the outputs and every node compared."""
    grids = session.prepared.get(GRIDS)
    if not isinstance(grids, IntegerGrids):
        return None
    screened, found = diagnosis.screened, diagnosis.found
    compared = list(screened.comparisons.values()) if screened is not None else []
    if found is not None:
        compared += [c for n in found.nodes for c in (n.accumulated, n.isolated) if c is not None]
    return one_model_report(grids, compared)


def _in_order(tally: Mapping[str, T], first: tuple[str, ...]) -> dict[str, T]:
    """``tally`` with ``first`` leading: the float64 oracle runs in a thread, so when its
    entries land varies from run to run, and the report should not."""
    return {**{k: tally[k] for k in first if k in tally}, **tally}


def _auto_criterion(
    session: Session, crit: Criterion, names: Sequence[str] | None, in_child: bool
) -> Criterion:
    """``crit`` with per-tensor noise floors from float64, or the fallback floor without."""
    with session.timer.stage("float64"):
        float64 = _float64_or_none(session, names, in_child)
    if float64 is None:
        return replace(crit, abs_floor=FALLBACK_ABS_FLOOR)
    floors = NoiseFloor(
        float64.values, float64.oracle_noise, float64.inexact, _meaning_downstream(session.loaded)
    )
    crit = replace(
        session.options.noise_criterion(floors, floors.truth),
        quantized=crit.quantized,
        quant_bounds=crit.quant_bounds,
    )
    target = session.setup.target_precision
    measured = target.lowered and bool(float64.precision_isolated or float64.precision_noise)
    if float64.inexact:
        session.notes.append(_inexact_note(sorted(float64.inexact), crit, target, measured))
    if measured:
        lowered = PrecisionFloors(
            target.precision, float64.precision_noise, float64.precision_isolated
        )
        crit = replace(crit, floors=lowered)
    elif target.lowered:
        session.notes.append(
            f"the target computes in {target.describe()}, but no {target.precision.value} "
            "precision floors were measured (they need torch): it is judged against fp32 noise"
        )
    return crit


# com.microsoft kernels whose ONNX Runtime implementation quantizes the activations too, where
# the oracle computes what the op means (backends/torch/ops/contrib.py).
_QUANTIZING_KERNELS = frozenset({"DynamicQuantizeLSTM", "DynamicQuantizeMatMul"})


def _meaning_downstream(loaded: LoadedModel) -> set[str]:
    """Every tensor computed from the output of a ``_QUANTIZING_KERNELS`` node: their noise
    floor is the oracle twin's, not the reference's own distance from float64. The kernels'
    own outputs keep the reference's: a later one, fed the reference's inputs, is as far
    from its meaning on the reference as the first, where no float64 value of those inputs
    can show it (it would be a "culprit" on any target that computes the meaning)."""
    downstream: set[str] = set()
    for node in loaded.nodes:
        ins = (*node.inputs, *node.implicit_inputs)
        quantizing = node.op_type in _QUANTIZING_KERNELS
        if quantizing or any(t in downstream for t in ins):
            downstream.update(o for o in node.outputs if o)
    own = {o for n in loaded.nodes if n.op_type in _QUANTIZING_KERNELS for o in n.outputs}
    return downstream - own


def _inexact_note(
    tensors: Sequence[str], crit: Criterion, target: PrecisionInfo, floors: bool
) -> str:
    """What judges the tensors the oracle has no float64 value of (said, never silent)."""
    named = ", ".join(repr(t) for t in tensors[:5]) + (" …" if len(tensors) > 5 else "")
    if floors:
        how = f"{target.precision.value} precision floors, measured from their own operands"
    else:
        how = f"rel_l2 > {crit.threshold:g}, a fixed threshold"
    return (
        f"--threshold auto: no float64 value of {plural(len(tensors), 'tensor')} ({named}): "
        f"only ONNX Runtime computed their nodes, in float32; they are judged by {how}"
    )


def _float64_or_none(
    session: Session, names: Sequence[str] | None, in_child: bool
) -> Float64Run | None:
    try:
        return measure_float64(session, names, in_child=in_child)
    except BackendError as exc:
        session.notes.append(
            f"--threshold auto: no float64 values ({exc}); fell back to rel_l2 > 1e-3 with "
            f"max_abs > {FALLBACK_ABS_FLOOR:g} × max(1, |reference|)"
        )
        return None


Screened = Observed | BackendError


def screen_session(session: Session, *, final: bool = False) -> Screened:
    """The plain runs of both backends. The target's error is returned, being a finding; the
    reference's is raised, being a usage problem. ``final``: agreeing outputs end the
    diagnosis (see ``screen``)."""
    try:
        with session.timer.stage("screen"):
            return screen(session, final=final)
    except BackendError as exc:
        if exc.role != "target":
            raise
        return exc


def diagnose(session: Session, screened: Screened | None = None) -> Diagnosis:
    """Screen (unless ``screened`` holds the outcome already); a failure goes to the failure
    search, a divergence to the chosen strategy."""
    options = session.options
    # After a transform the per-tensor picture is the point (fp16's error curve, proof that
    # no renamed tensor moved), so the scan runs even when the outputs agree.
    scans_anyway = options.always_scan or bool(session.setup.transforms)
    if screened is None:
        prepare_early(session)  # a quantized target's table while the oracle measures
        screened = screen_session(session, final=not scans_anyway)
    if isinstance(screened, BackendError):
        log.info("the target failed on the whole model; searching for the node")
        return Diagnosis(None, failure_search(session, screened), diverged=True)
    screened = with_input_rounding(session, screened)
    # A runtime that lowered the precision on its own is a finding even where every output
    # is within what that precision predicts: the user did not ask for it.
    unasked = not screened.diverged and unasked_precision(session, screened)
    diverged = screened.diverged or unasked
    if not diverged and not scans_anyway:
        log.info("the final outputs agree; nothing more to run")
        return Diagnosis(screened, None, diverged=False)
    strategy = choose(session)
    outputs = "diverge" if diverged else "agree"
    log.info("the final outputs %s; the %s strategy runs", outputs, strategy)
    found = STRATEGIES[strategy](session, screened)
    if unasked:
        found = replace(found, cause=unasked_precision_cause(session, screened))
    if diverged and reference_is_off(screened, found):
        # float64 sides with the target: the reference's kernel is the less exact one, and
        # the target is not the one that diverged.
        session.notes.append(reference_off_note(found, screened))
        diverged = False
    amplified = flips_amplified(session, found, _worst(screened)) if diverged else None
    if amplified is not None:  # one quantized model's integers a step apart, amplified
        found, diverged = replace(found, cause=amplified), False
    return Diagnosis(screened, found, diverged)


# Causes that answer why agreeing outputs (by the diagnosis) moved: shown with exit 0.
_NOT_DIVERGED = (CauseKind.REFERENCE, CauseKind.PRECISION)


def _worst(screened: Observed) -> float | None:
    """The largest rel_l2 among the final outputs."""
    errors = [c.metrics.get("rel_l2") for c in screened.comparisons.values()]
    return max((e for e in errors if e is not None), default=None)


def to_result(
    session: Session,
    diagnosis: Diagnosis,
    repro: ReproInfo | None,
    passes: PassBisection | None = None,
    fp32: KeepInFp32 | None = None,
) -> BisectResult:
    """The ``BisectResult`` of a diagnosis, with the bundle written for it (if any)."""
    setup, found, screened = session.setup, diagnosis.found, diagnosis.screened
    notes = list(session.notes)
    # What the runtimes noted during their runs (IR versions lowered, fp warnings).
    notes += [n for b in (setup.ref, setup.target) if isinstance(b, BackendBase) for n in b.notes()]
    first = found.first if found else None
    if found is not None:
        floors = session.crit.floors is not None
        notes += precision_notes(
            found.nodes, setup.target_info, setup.target_precision, floors=floors
        )
        reference_off = found.cause is not None and found.cause.kind is CauseKind.REFERENCE
        if not diagnosis.diverged and first is not None and not reference_off:
            notes.append(
                f"the final outputs agree, but {first.name!r} and later tensors diverge inside "
                "the graph: the error does not reach the outputs beyond the threshold"
            )
    checks: tuple[TopKCheck, ...] = ()
    if screened is not None:
        notes += [
            f"output {c.tensor}: {c.insignificant}: not counted as a divergence"
            for c in screened.comparisons.values()
            if c.insignificant
        ]
        checks = tuple(topk_checks(list(setup.topk), screened.ref_outputs, screened.target_outputs))
    cause = found.cause if found else None
    named = ((first.name,) if first else ()) + (cause.nodes if cause else ())
    return BisectResult(
        sources=node_sources(setup.loaded, named),
        verdict=Outcome.DIVERGED if diagnosis.diverged else Outcome.MATCH,
        model=str(setup.loaded.path or IN_MEMORY),
        ref=setup.ref_info,
        # Read again now: an exec: program declares that it compiles in its runs' stderr.
        target=replace(setup.target_info, compiles=setup.target.capabilities.compiles),
        criterion=session.crit,
        strategy=found.strategy if found else "screen",
        outputs=tuple(screened.comparisons.values()) if screened else (),
        first_divergence=first,
        # With agreeing outputs a cause is shown only where --always-scan asked for one (a
        # transform's scan runs anyway, and its "culprit" would contradict the exit code).
        root_cause=found.cause
        if found
        and (
            diagnosis.diverged
            or (first and setup.options.always_scan)
            # The reference the weaker side, or one quantized model's flips amplified.
            or (found.cause is not None and found.cause.kind in _NOT_DIVERGED)
        )
        else None,
        nodes=found.nodes if found else (),
        not_probed=setup.loaded.not_probed,
        inputs=session.feeds,
        timings=_in_order(session.timer.finish(), ("load", "float64", "screen")),
        runs=_in_order(session.stats.runs, ("float64", "ref", "target")),
        stage_runs=dict(session.stats.target_by_stage),
        notes=tuple(notes),
        versions=setup.versions,
        command=setup.options.command,
        search=found.search if found else None,
        chain=found.chain if found else (),
        repro=repro,
        matching=found.matching if found else None,
        quant=found.quant if found and found.quant else _one_model_quant(session, diagnosis),
        keep_fp32=fp32,
        target_model=setup.target_label,
        transforms=setup.transforms,
        task_checks=tuple(checks),
        pass_bisection=passes,
        ref_precision=setup.ref_precision,
        target_precision=setup.target_precision,
    )


def node_sources(loaded: LoadedModel, names: Sequence[str]) -> dict[str, SourceInfo]:
    """Where the named nodes come from in the exporter's source, those the model says."""
    protos = loaded.node_protos
    found = {n: node_source(protos[n]) for n in names if n in protos}
    return {n: s for n, s in found.items() if s is not None}


def _backend(b: BackendLike, *, in_child: bool | None, timeout: float | None) -> Backend:
    """``b`` built (``create_backend``'s ``in_child``); a backend object as given: None
    leaves it in this process, where it was made."""
    if not isinstance(b, str | BackendSpec):
        if in_child:
            raise InputError(
                "isolate_crashes needs the backend as a spec string (e.g. 'pkg.module:Class'), "
                "so that a child process can build it"
            )
        return b
    spec = (parse_spec(b) if isinstance(b, str) else b).without_transforms()
    return create_backend(spec, in_child=in_child, timeout=timeout)


def _again_note(signal_name: str) -> tuple[str, ...]:
    if not signal_name:
        return ()
    return (
        f"the command ran twice: its first run, with the reference in the tool's process, "
        f"died of {signal_name}; this one ran the reference in a worker process",
    )


def _spec(b: BackendLike) -> BackendSpec | None:
    if isinstance(b, str):
        return parse_spec(b)
    return b if isinstance(b, BackendSpec) else None


def _transforms(spec: BackendSpec | None) -> tuple[str, ...]:
    return spec.transforms if spec is not None else ()


def _info(b: Backend, spec: BackendSpec | None) -> BackendInfo:
    # The spec as written, transforms included: the backend itself only knows the runtime part.
    text = spec.text if spec else b.spec.text
    return BackendInfo(text, b.describe(), b.versions(), compiles=b.capabilities.compiles)


def _check_topk_outputs(specs: tuple[TopKSpec, ...], loaded: LoadedModel) -> None:
    for spec in specs:
        if spec.output is not None and spec.output not in loaded.outputs:
            known = ", ".join(loaded.outputs)
            raise InputError(
                f"topk {spec.text}: the model has no output {spec.output!r} (outputs: {known})",
                option="topk",
            )
