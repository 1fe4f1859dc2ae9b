"""Strategies: how the verdicts are reached once the screen has seen a divergence.

Each strategy is a function of the session (and the screen's observation) to a ``Found``;
``STRATEGIES`` names them, and ``choose`` picks one from what the backends can do and what the
user asked for. A new way to search adds an entry here, not a branch in ``bisect()``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace

import onnx

from onnx_bisect.compare.criterion import Comparison
from onnx_bisect.compare.tensors import compare_tensors
from onnx_bisect.engine.chain import chain_from
from onnx_bisect.engine.found import Found
from onnx_bisect.engine.judge import (
    culprit_cause,
    dump_verdicts,
    first_divergence,
    judge,
    mark_pattern,
    observer_problem,
    root_cause,
)
from onnx_bisect.engine.measure.isolate import IsolationFailure, isolate
from onnx_bisect.engine.measure.observe import Observed, probe_runs, scan
from onnx_bisect.engine.measure.runs import timed_run
from onnx_bisect.engine.measure.store import TensorStore
from onnx_bisect.engine.quant.conclude import conclude
from onnx_bisect.engine.quant.prelude import prelude
from onnx_bisect.engine.ranking import rank_suspects
from onnx_bisect.engine.search.cut import CutRefused, CutResult, cut_search, search_info
from onnx_bisect.engine.search.effect import repaired
from onnx_bisect.engine.search.failure import failure_search
from onnx_bisect.engine.search.marking import find_marking
from onnx_bisect.engine.search.pattern import (
    EXTREME_WINDOW,
    MAX_WINDOW,
    extreme_gains,
    find_pattern,
)
from onnx_bisect.engine.session import Session
from onnx_bisect.errors import BackendError
from onnx_bisect.graph.extract import incomplete_outputs, with_outputs
from onnx_bisect.graph.sizes import fix_input_shapes, tensor_nbytes
from onnx_bisect.graph.view import LoadedModel
from onnx_bisect.result import CauseKind, NodeResult, RootCause, SearchInfo, Verdict
from onnx_bisect.text import fmt_amp

__all__ = ["STRATEGIES", "Strategy", "choose"]

log = logging.getLogger(__name__)

Strategy = Callable[[Session, Observed], Found]


def scan_strategy(session: Session, screened: Observed) -> Found:
    """Scan and isolate every node; a pattern search when none is wrong alone. With
    ``--strategy auto``, a scan that marking outputs has changed hands over to the cut search."""
    store = session.store("reference")
    try:
        with session.timer.stage("scan"):
            scanned = scan(session, store)
    except BackendError as exc:
        if exc.role != "target":
            raise
        return _refused(session, store, "the scan model (every tensor marked as an output)", exc)
    observer = observer_problem(screened, scanned, session.crit)
    if observer:
        log.info("%s", observer)
        session.notes.append(observer)
    with session.timer.stage("isolate"):
        isolated = isolate(session, store)
    failures = [r for r in isolated.values() if isinstance(r, IsolationFailure)]
    if len(isolated) > 1 and len(failures) == len(isolated):
        # It ran the whole model, so it can run these nodes: the cut models are to blame.
        error = BackendError(failures[0].message, role="target", detail=failures[0].detail)
        return _refused(session, store, "every isolation model", error)
    nodes = judge(session.loaded, scanned.comparisons, isolated, session.crit)
    first = first_divergence(nodes)
    cause = root_cause(nodes, first)
    if screened.diverged:  # several suspects: the one whose repair brings the outputs back
        nodes, first, cause = rank_suspects(session, store, nodes, first, cause)
    if first is not None and cause is not None and cause.kind is CauseKind.NONE:
        nodes, first, cause, _ = _with_pattern(session, store, nodes, first, cause, None)
    observed = bool(observer) and screened.diverged
    verified = _verified_despite_marking(session, store, cause) if observed else None
    if verified is not None:
        cause = verified  # the scan's answer, proven on the unmarked model: no cut search
    elif observer and screened.diverged and session.options.strategy == "auto":
        log.info("switching to the bisect strategy")
        session.notes.append("switched to the bisect strategy, which marks only cut tensors")
        kept = _fusion_kept(session, store, screened)
        why = "switched from the scan: " + observer
        found = _by_cut_search(session, store, why, nodes, kept=kept)
        return replace(found, strategy="scan+bisect")
    # Only a scan's accumulated errors are the target's own result all along the graph.
    chain = chain_from(session.loaded, nodes, cause, first)
    return Found("scan", tuple(nodes), first, cause, chain=chain, store=store)


def _verified_despite_marking(
    session: Session, store: TensorStore, cause: RootCause | None
) -> RootCause | None:
    """The scan's root cause where marking changed the target's result but the cause holds on
    the unmarked model: fed the reference's values at its nodes alone (no other tensor
    marked), the target's outputs agree. Isolation never marked anything, so a node found by
    it (an fp16 GlobalAveragePool whose sum overflows to Inf, tract) stands; the observer
    effect is a fusion elsewhere (a Conv and its Relu). None where the repair does not prove
    it: the cut search then runs."""
    if cause is None or cause.kind not in (CauseKind.CULPRIT, CauseKind.RANGE) or not cause.nodes:
        return None
    kept = (
        "the scan's root cause holds on the unmarked model (fed the reference's values at "
        f"{', '.join(cause.nodes)}, the target's outputs agree{{}}): the cut search, which the "
        "observer effect would call for, was not needed"
    )
    if "(verified)" in cause.reason:  # the ranking's own repair, on the unmarked model too
        session.notes.append(kept.format(""))
        return cause
    with session.timer.stage("rank"):
        fixed = repaired(session, store, cause.nodes)
    if fixed is None or not fixed.shows or not fixed.agrees:
        return None
    worst = fixed.worst(session.crit)
    said = f"{worst.tensor} rel_l2 {worst.shown('rel_l2')}" if worst is not None else ""
    session.notes.append(kept.format(f": {said}"))
    return replace(
        cause,
        reason=f"{cause.reason}; fed the reference's values there, the target's outputs agree "
        f"({said}; verified on the unmarked model)",
    )


def bisect_strategy(session: Session, screened: Observed) -> Found:
    """Reference values by a scan of the reference alone, then a search over cuts."""
    store = session.store("reference")
    with session.timer.stage("scan"):
        scan(session, store, observe_target=False)
    return _by_cut_search(session, store, "requested with --strategy bisect")


def dump_strategy(session: Session, screened: Observed) -> Found:
    """A target that replays dumped tensors cannot run a subgraph: accumulated errors only."""
    store = session.store("reference")
    with session.timer.stage("scan"):
        scanned = scan(session, store)
    session.notes.append(
        "the target is a dump: only accumulated errors can be known (no isolation, "
        "window or cut search); a node whose inputs match and whose output does not is "
        "named as the culprit"
    )
    nodes, first, cause = dump_verdicts(session.loaded, scanned.comparisons, session.crit)
    chain = chain_from(session.loaded, nodes, cause, first)
    return Found("scan", tuple(nodes), first, cause, chain=chain, store=store)


def _input_casts(model: LoadedModel) -> list[str]:
    """Outputs of Casts that read graph inputs alone (a converter's ``keep_io_types`` Casts
    into float16): the same input, re-typed. The reference backend computes them, so the
    nodes they feed (the first Conv) are isolated like any other."""
    inputs = set(model.inputs)
    return [
        out
        for n in model.nodes
        if n.op_type == "Cast" and n.inputs and set(n.inputs) <= inputs
        for out in n.outputs
    ]


def two_model_strategy(session: Session, screened: Observed) -> Found:
    """Reference model against a different target model: tensors matched by name, the
    target model's nodes isolated on the reference's values where those exist."""
    s, other = session, session.setup.target_model
    assert other is not None  # choose() picks this strategy only with a target model
    ready = prelude(s)
    store, matching, quant, pairs = ready.store, ready.matching, ready.quant, ready.pairs
    if quant is not None:
        s.notes.append(
            f"per-tensor quantization table: {len(ready.rows)} tensors, ready "
            f"{ready.ready:.2f} s after the start (once the reference was scanned)"
        )
    with s.timer.stage("scan"):
        if quant is not None:
            other = replace(other, units=quant)  # integers compared and fed in real units
        s.crit = s.crit.renamed(pairs)  # noise floors belong to the reference's tensors
        shapes = {k: v.shape for k, v in s.feeds.items()}
        other_sizes = tensor_nbytes(fix_input_shapes(other.model, shapes))

        comparisons: dict[str, Comparison] = {}

        def use(chunk: list[str], marked: onnx.ModelProto) -> None:
            # What the target model leaves untyped is typed from the reference's values.
            known = [n for n in incomplete_outputs(marked) if pairs.get(n) in store]
            if known:
                metas = {n: other.fed_meta(n, store.meta(pairs[n])) for n in known}
                marked = with_outputs(other.model, chunk, metas)
            out = timed_run(s.target, marked, s.feeds, "target", s.stats)
            for name in chunk:
                ref_value = store.get(pairs[name])
                value = other.as_real(name, out.get(name), ref_value.dtype)
                comparisons[name] = compare_tensors(name, ref_value, value, s.crit)

        probe_runs(other.model, list(pairs), other_sizes, s.memory.chunk(), use)
    view = store.view(pairs)
    # The target model's own constant arithmetic (weights folded at run time) has no
    # counterpart; the reference backend computes it from the target model, so isolation
    # still feeds every node trusted values.
    for name, value in quant.values.items() if quant is not None else ():
        view.put(name, value)  # a dynamic model's run-time scales, as its run gave them
    # Every constant as the target model holds it, paired or not: a converter's clamped
    # Constant (T5's -3.4e38 mask fill is -1e4 in its float16 model) fed at the reference's
    # value made a NaN the target never computes (zoo G4). A changed one is still found: its
    # own comparison, and a culprit computed from it is named a parameter (root_cause).
    own = [*other.constants, *(t for t in _input_casts(other) if t not in view)]
    if own:
        values = timed_run(s.ref, with_outputs(other.model, own), s.feeds, "ref", s.stats)
        for name in own:
            view.put(name, values[name])
    with s.timer.stage("isolate"):
        fed = replace(other, units=quant.for_isolation()) if quant is not None else other
        isolated = isolate(s, view, loaded=fed)
    nodes = judge(other, comparisons, isolated, s.crit)
    first = first_divergence(nodes)
    cause = root_cause(nodes, first, own_constants=other.constants)
    report = None
    if quant is not None:
        q = conclude(
            s, other, quant, pairs, view, nodes, cause, diverged=screened.diverged, rows=ready.rows
        )
        nodes, cause, report = list(q.nodes), q.cause, q.report
        first = first_divergence(nodes)
        s.notes.append(report.pairing_summary())
    s.notes.append(matching.summary())
    # A name the quantization pairing compared after all (a Conv reading dequantized
    # operands) is not excluded in the end: no note for it.
    paired = set(quant.pairs.values()) if quant is not None else set()
    excluded = [(t, why) for t, why in matching.excluded.items() if t not in paired]
    s.notes.extend(f"excluded {t}: {why}" for t, why in excluded[:5])
    chain = chain_from(other, nodes, cause, first)
    return Found(
        "scan", tuple(nodes), first, cause, chain=chain, matching=matching, store=view,
        cut_from=other, quant=report,
    )  # fmt: skip


STRATEGIES: Mapping[str, Strategy] = {
    "scan": scan_strategy,
    "bisect": bisect_strategy,
    "dump": dump_strategy,
    "two-model": two_model_strategy,
}


def choose(session: Session) -> str:
    """Two models are compared by name; a dump can only be scanned; otherwise the user's
    choice (``auto`` starts with the scan and may switch to the cut search)."""
    if session.setup.target_model is not None:
        return "two-model"
    if not session.target.capabilities.computes:
        return "dump"
    return "bisect" if session.options.strategy == "bisect" else "scan"


def _refused(session: Session, store: TensorStore, what: str, error: BackendError) -> Found:
    """The target ran the model but refused ``what``: the cut search marks fewer tensors."""
    message = error.full.removeprefix("target failed: ")
    session.notes.append(
        f"the target refused {what}: {message}; the cut search, which marks only the tensors "
        "live across each cut, ran instead"
    )
    with session.timer.stage("scan"):
        scan(session, store, observe_target=False)  # every reference value, for the cuts
    found = _by_cut_search(session, store, f"the target refused {what}")
    return replace(found, strategy=f"scan+{found.strategy}")


def _fusion_kept(session: Session, store: TensorStore, screened: Observed) -> tuple[str, ...]:
    """The tensor whose marking changes the target's result (the observer effect), noted and
    kept unmarked by the search that follows; none when no single tensor does it."""
    with session.timer.stage("marking"):
        marking = find_marking(session, store, screened.target_outputs)
    if marking is None:
        session.notes.append(
            "no single tensor's marking changes the target's result: the cut search marks "
            "only the tensors live across each cut"
        )
        return ()
    log.info("%s", marking.note())
    session.notes.append(marking.note())
    return (marking.tensor,)


def _by_cut_search(
    session: Session,
    store: TensorStore,
    reason: str,
    scan_nodes: Sequence[NodeResult] = (),
    kept: tuple[str, ...] = (),
) -> Found:
    """Binary search over cuts, then isolation of the transition node, then a pattern. A
    prefix the target cannot run ends it: the failure search then finds the node to blame.
    ``kept``: tensors the cut search and the pattern windows never mark (a fusion runs
    through them)."""
    try:
        with session.timer.stage("bisect"):
            cut = cut_search(session, store, kept)
    except CutRefused as refused:
        message = refused.error.full.removeprefix("target failed: ")
        session.notes.append(
            f"the target failed on the prefix of {refused.position} nodes ({message}); "
            "the prefix search for that failure ran instead"
        )
        why = f"the target failed on the prefix of {refused.position} nodes"
        return failure_search(
            session, refused.error, failing=refused.position, why=why, store=store
        )
    isolated = isolate(session, store, [cut.node], budget=1 << 62)
    judged = judge(session.loaded, cut.comparisons, isolated, session.crit)
    if scan_nodes:
        # Keep the scan's full table; the search decides only the transition node's row.
        by_name = {n.name: n for n in judged}
        judged = [by_name[n.name] if n.name == cut.node.name else n for n in scan_nodes]
    first = next(n for n in judged if n.name == cut.node.name)
    if not first.diverged:
        first = replace(first, accumulated=_worst_at(session, cut))
    search = search_info(cut.outcome, reason, cut.node)
    if not cut.outcome.monotone:
        session.notes.append(
            "divergence is not monotone along the topological order (it vanished one cut past "
            f"the transition); a linear pass around it chose {cut.node.name!r}"
        )
    if first.verdict in (Verdict.CULPRIT, Verdict.REFERENCE_OFF) and first.isolated is not None:
        return Found("bisect", tuple(judged), first, culprit_cause(first), search, store=store)
    fallback = RootCause(
        CauseKind.NONE, (), "no single node or small window reproduces the divergence"
    )
    nodes, first, cause, searched = _with_pattern(
        session, store, judged, first, fallback, search, kept
    )
    return Found("bisect", tuple(nodes), first, cause, searched, store=store)


def _worst_at(session: Session, cut: CutResult) -> Comparison | None:
    outs = [cut.comparisons[o] for o in cut.node.outputs if o in cut.comparisons]
    return max(outs, key=session.crit.badness) if outs else None


_FOLDED = (
    "with the tensors the input shapes alone determine embedded as constants, as the "
    "target folds them at static shapes"
)


def _with_pattern(
    session: Session,
    store: TensorStore,
    nodes: Sequence[NodeResult],
    first: NodeResult,
    fallback: RootCause | None,
    search: SearchInfo | None,
    kept: tuple[str, ...] = (),
) -> tuple[list[NodeResult], NodeResult, RootCause | None, SearchInfo | None]:
    """The smallest window that reproduces the divergence: around the largest gains of x1000
    and more first (windows of up to six nodes), then around the first divergence."""
    loaded, tried = session.loaded, 0
    seeds = [*extreme_gains(nodes, skip=first.name), first]
    # Last, the first divergence's windows with shape-determined tensors folded in.
    tries = [*((seed, False) for seed in seeds), (first, True)]
    with session.timer.stage("pattern"):
        for seed, fold in tries:
            size = MAX_WINDOW if seed is first else EXTREME_WINDOW
            pattern = find_pattern(session, store, loaded.nodes[seed.index], size, kept, fold)
            tried += pattern.tried if pattern is not None else 0
            if pattern is not None:
                break
    if pattern is None:
        return list(nodes), first, fallback, search
    worst = max(pattern.comparisons.values(), key=session.crit.badness)
    marked, at, cause = mark_pattern(nodes, seed, pattern.nodes, worst)
    if fold:
        cause = replace(cause, reason=f"{cause.reason}; {_FOLDED}")
    if seed is first:
        first = at
    else:  # the first divergence stays where it is; the window is where the gain is
        first = next(n for n in marked if n.name == first.name)
        gain = f"{fmt_amp(seed.amplification)} at {seed.name}"
        cause = replace(cause, reason=f"{cause.reason}; found around the largest gain ({gain})")
    if search is not None:
        search = replace(search, pattern_windows_tried=tried)
    return marked, first, cause, search
