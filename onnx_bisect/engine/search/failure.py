"""Failure search: the node whose presence makes the target crash or fail.

A target that dies (a signal, or a hang past ``--timeout``) or reports an error (a conversion
failure, a missing kernel, a shape-inference or runtime error) on the full model is run on ever
shorter prefixes of the graph, by binary search over topological positions, until the first
node whose presence makes it fail stands out. An error is then checked on that node alone, fed
the reference's values: failing there too, the node is the finding; running there, it fails
only in the context of the graph before it, and the report says so.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping, Sequence
from dataclasses import replace

from onnx_bisect.backends.unsupported import unsupported
from onnx_bisect.engine.found import Found
from onnx_bisect.engine.measure.isolate import IsolationFailure, isolate
from onnx_bisect.engine.measure.observe import scan
from onnx_bisect.engine.measure.runs import timed_run
from onnx_bisect.engine.measure.store import TensorStore
from onnx_bisect.engine.search.cut import search_info
from onnx_bisect.engine.search.hidden import HiddenCrash, hidden_crash
from onnx_bisect.engine.search.state import CutSearch
from onnx_bisect.engine.search.typecheck import TypeChange, type_change
from onnx_bisect.engine.search.typeloss import TypeLoss, type_loss
from onnx_bisect.engine.session import Session
from onnx_bisect.errors import BackendCrash, BackendError
from onnx_bisect.graph.extract import identity_model, prefix_model
from onnx_bisect.graph.view import NodeInfo, complete_type
from onnx_bisect.result import CauseKind, NodeResult, RootCause, SearchInfo, Verdict

__all__ = ["failure_search", "reference_crash"]

log = logging.getLogger(__name__)

_TIMED_OUT = re.compile(r"timed out after [0-9.]+\s*s")


def failure_search(
    session: Session,
    failure: BackendError,
    *,
    failing: int | None = None,
    why: str = "",
    store: TensorStore | None = None,
) -> Found:
    """The target fails on the full model (or, with ``failing``, on the prefix of that many
    nodes): find the first node whose presence makes it fail.

    Every failure counts, whatever its kind (a crash, a hang, an error, a missing kernel, a
    nonzero exit): a runtime that errors on a prefix does not run it, so that prefix cannot
    clear the nodes in it. ``why``: how the search came to be asked, for the report;
    ``store``: the reference's values of every probe, when a search before this one took them.
    """
    s = session
    loaded = s.setup.target_model or s.loaded
    errors: dict[int, BackendError] = {}
    store = store or _typing_store(session)
    metas = store.metas if store is not None else None

    def fails(position: int) -> bool:
        try:
            model = prefix_model(loaded, position, metas)
            out = timed_run(s.target, model, s.feeds, "target", s.stats)
        except BackendError as exc:
            log.debug("prefix %d fails: %s", position, exc)
            errors[position] = exc
            return True
        # A prefix that runs but hands on a tensor of another type than the model's has
        # failed already: what the later nodes are fed is wrong, and one of them refuses it.
        changed = type_change(loaded, model, out)
        if changed is not None:
            log.debug("prefix %d: %s", position, changed)
            errors[position] = changed
        return changed is not None

    hi = len(loaded.nodes) if failing is None else failing
    # A compiler's every answer costs a compile: its answer is not checked a position further.
    verify = not s.target.capabilities.compiles
    with s.timer.stage("bisect"):
        outcome = CutSearch(0, hi, verify=verify).run(fails)
    node = loaded.nodes[outcome.transition - 1]
    if node.index == 0:
        # Asked only here, where it decides something: a runtime that fails on the first node
        # may fail on anything (a missing license, a flag that breaks every model).
        with s.timer.stage("bisect"):  # its runs are the search's, in the report
            _check_runs_anything(session, failure)
    error = errors.get(outcome.transition, failure)
    message = _message(error)
    # The runtime may fail the full model for another reason than the first prefix (TVM:
    # LSTM unsupported there, a computed Pad here): both belong in the report.
    own = _message(failure)
    model_message = own if own != message else ""
    if not outcome.monotone:
        s.notes.append("failures were not monotone along the order; a linear pass decided")
    whole = "on the full model" if failing is None else f"on the prefix of {failing} nodes"
    search = search_info(outcome, why or f"the target {_did(failure)} {whole}", node)
    if isinstance(error, BackendCrash):
        # A hang is not searched again: each run of a hanging prefix costs the whole timeout.
        hidden = None
        if node.index > 0 and not _TIMED_OUT.search(message):
            with s.timer.stage("bisect"):
                hidden = hidden_crash(s, loaded, node, metas)
        if hidden is not None:
            found = _hidden_found(hidden, model_message or message, search, loaded.nodes)
            if loaded is not s.loaded:  # cut from the model the target ran; fed its inputs
                found = replace(found, cut_from=loaded, store=s.store("bundle"))
            return found
        hang = _TIMED_OUT.search(message)
        how = f"hangs ({hang.group(0)})" if hang else "crashes"
        cause = RootCause(
            CauseKind.CRASH,
            (node.name,),
            f"the target {how} whenever {node.op_type} {node.name!r} is in the model"
            f"{_smaller(node, ', ')}",
            message,
            model_message=model_message,
        )
        note = f"the target crashes when this node is in the model: {message}"
        rows = _rows(loaded.nodes, {node.index: (Verdict.CRASHED, note)})
        return Found("crash-bisect", rows, rows[node.index], cause, search)
    if isinstance(error, TypeChange):
        return _type_found(node, error, own, search, loaded.nodes)
    with s.timer.stage("bisect"):
        found = _error_found(session, node, message, search, store)
    if found.cause is not None and model_message:
        found = replace(found, cause=replace(found.cause, model_message=model_message))
    return found


def _hidden_found(
    hidden: HiddenCrash, said: str, search: SearchInfo, nodes: Sequence[NodeInfo]
) -> Found:
    """A crash that needs ``hidden.tensor`` unobserved: the producer and the reader are named,
    and the bundle marks only what the reader's closure gives (``unmarked``)."""
    message = _message(hidden.error)
    model_message = said if said != message else ""
    p, r = hidden.producer, hidden.reader
    cause = RootCause(
        CauseKind.CRASH, (p.name, r.name), hidden.words(), message, model_message=model_message
    )
    note = f"the target crashes when this node reads {hidden.tensor!r} unobserved: {message}"
    rows = _rows(nodes, {r.index: (Verdict.CRASHED, note)})
    return Found("crash-bisect", rows, rows[r.index], cause, search, unmarked=(hidden.tensor,))


def _smaller(node: NodeInfo, sep: str) -> str:
    """What the search showed about the prefixes before ``node``: none is run before the
    first node, so nothing is claimed of them there."""
    if node.index == 0:
        return "; it is the first node of the graph (a model of it alone fails, an Identity runs)"
    return f"{sep}and runs every smaller prefix of the graph"


def _typing_store(session: Session) -> TensorStore | None:
    """The reference's values of every probe, where the model leaves some tensor's type or
    shape undeclared: prefix models declare their outputs from them (strict importers refuse
    a bare name). None where the model declares them all, or for a second target model."""
    s = session
    if s.setup.target_model is not None:
        return None
    declared = s.loaded.declared
    if all(t in declared and complete_type(declared[t]) for t in s.loaded.probes):
        return None
    store = s.store("failure")
    scan(s, store, observe_target=False)
    return store


def _error_found(
    session: Session,
    node: NodeInfo,
    message: str,
    search: SearchInfo,
    store: TensorStore | None = None,
) -> Found:
    """An error localized to ``node``: checked on the node alone where the reference's values
    can feed it, and classified as a missing kernel or a failure."""
    s = session
    loaded = s.setup.target_model or s.loaded
    alone: str | None = None  # the node's own error, or None when it runs alone
    checked = s.setup.target_model is None and node.name not in loaded.constant_nodes
    if checked:
        if store is None:
            store = s.store("failure")
            scan(s, store, observe_target=False)
        result = isolate(s, store, [node]).get(node.name)
        if isinstance(result, IsolationFailure):
            alone = result.detail or result.message
        elif result is None:
            checked = False
    kind = CauseKind.UNSUPPORTED if unsupported(message) else CauseKind.ERROR
    verdict = Verdict.UNSUPPORTED if kind is CauseKind.UNSUPPORTED else Verdict.FAILED
    what = "cannot run" if kind is CauseKind.UNSUPPORTED else "fails on"
    if checked and alone is None and store is not None:
        # It runs alone: what it is fed in the model differs. A rank or a type the target
        # lost upstream (its static view) names the node that lost it.
        loss = type_loss(s, loaded, node, store)
        if loss is not None:
            return _loss_found(node, loss, kind, message, search, loaded.nodes, store)
    reason = (
        f"the target {what} {node.op_type} {node.name!r}: it fails whenever the node is in the "
        f"model{_smaller(node, ' ')}"
    )
    if checked and alone is not None:
        reason += ", and fails on the node alone, fed the reference's inputs"
    elif checked:
        reason += (
            "; fed the reference's inputs it runs alone, so the failure needs the graph before "
            "it (a shape, a dtype or a fusion the runtime derives there)"
        )
    rows = _rows(loaded.nodes, {node.index: (verdict, message)})
    cause = RootCause(kind, (node.name,), reason, message)
    strategy = "failure-bisect"
    failed_alone = (node.name,) if checked and alone is not None else ()
    ran_alone = (node.name,) if checked and alone is None else ()
    return Found(
        strategy, rows, rows[node.index], cause, search, store=store,
        failed_alone=failed_alone, ran_alone=ran_alone,
    )  # fmt: skip


def _type_found(
    node: NodeInfo, change: TypeChange, said: str, search: SearchInfo, nodes: Sequence[NodeInfo]
) -> Found:
    """A node whose output the target gives another dtype or shape than the model's, which a
    later node then fails on: ``said``, the target's own error on the full model."""
    reason = (
        f"{change}; it runs every smaller prefix of the graph, and fails on the full model "
        "where a later node is fed that tensor"
    )
    rows = _rows(nodes, {node.index: (Verdict.FAILED, str(change))})
    cause = RootCause(CauseKind.ERROR, (node.name,), reason, said)
    return Found("failure-bisect", rows, rows[node.index], cause, search)


def _loss_found(
    failing: NodeInfo,
    loss: TypeLoss,
    kind: CauseKind,
    message: str,
    search: SearchInfo,
    nodes: Sequence[NodeInfo],
    store: TensorStore,
) -> Found:
    """``failing`` runs alone but fails in the model, fed a tensor whose rank or type the
    target lost at ``loss.node``: that node is named, ``failing`` is where the target gives
    up (in the reason, in ``fails_at``, and in its row)."""
    root = loss.node
    between = loss.path[1:]
    through = f" through {_listed(between)}" if between else ""
    what = "cannot run" if kind is CauseKind.UNSUPPORTED else "fails on"
    reason = (
        f"as it reads the model, before any run, the target {loss.words}, and types every "
        f"input of that {root.op_type} right; {failing.op_type} {failing.name!r} reads that "
        f"tensor{through} and is where the target gives up: it {what} it whenever the node is "
        f"in the model{_smaller(failing, ' ')}; fed the reference's inputs it runs alone"
    )
    if loss.confirmed:
        reason += ", and fails alone once that input is declared as the target types it"
    verdict = Verdict.UNSUPPORTED if kind is CauseKind.UNSUPPORTED else Verdict.FAILED
    note = f"the target {loss.words}; {failing.op_type} {failing.name!r} fails on it"
    marks = {root.index: (Verdict.FAILED, note)}
    marks[failing.index] = (verdict, message)
    rows = _rows(nodes, marks)
    cause = RootCause(kind, (root.name,), reason, message, fails_at=failing.name)
    return Found(
        "failure-bisect", rows, rows[root.index], cause, search, store=store,
        ran_alone=(failing.name,), bundle_from=tuple(n.name for n in (*loss.path, failing)),
    )  # fmt: skip


def _listed(nodes: Sequence[NodeInfo], most: int = 4) -> str:
    """Nodes by op and name, the first ``most`` of them."""
    named = [f"{n.op_type} {n.name!r}" for n in nodes[:most]]
    rest = len(nodes) - most
    return ", ".join(named) + (f" and {rest} more" if rest > 0 else "")


def _rows(
    nodes: Sequence[NodeInfo], marks: Mapping[int, tuple[Verdict, str]]
) -> tuple[NodeResult, ...]:
    """A row per node: those ``marks`` names by index with their verdict and note, the rest
    not probed."""
    return tuple(
        NodeResult.of(n, marks[n.index][0], note=marks[n.index][1])
        if n.index in marks
        else NodeResult.of(n, Verdict.NOT_PROBED)
        for n in nodes
    )


def _did(failure: BackendError) -> str:
    return "crashed" if isinstance(failure, BackendCrash) else "failed"


def _message(error: BackendError) -> str:
    """The runtime's own words, without our role prefix."""
    return error.full.removeprefix("target failed: ")


def _check_runs_anything(session: Session, failure: BackendError) -> None:
    """Raise ``failure``, saying so, where the target fails on a one-node Identity model too."""
    probe = _fails_on_anything(session)
    if probe is not None:
        hung = _TIMED_OUT.search(_message(probe))
        crash = isinstance(probe, BackendCrash)
        what = f"hangs ({hung.group(0)})" if hung else "crashes" if crash else "fails"
        # The runtime's words once: where it says the same on both models (a missing module,
        # a wrong interpreter), repeating its whole stderr would only double the message.
        same = _said(probe) == _said(failure)
        said = "" if same else f": {_message(probe)}"
        raise type(failure)(
            f"{failure} (it also {what} on a one-node Identity model, so no node is to blame"
            f"{said})",
            role="target",
            detail=failure.detail,
        )


def _said(error: BackendError) -> str:
    """What the runtime said, without our role prefix and the run's temporary paths."""
    return re.sub(r"/\S*onnx-bisect-\S*", "PATH", _message(error)).strip()


def _fails_on_anything(session: Session) -> BackendError | None:
    """The target's failure on a one-node Identity model, of any kind: a runtime that fails
    there fails on anything, so no node of the model is to blame. None when it runs."""
    loaded, feeds = session.loaded, session.feeds
    first = next(i.name for i in loaded.model.graph.input if i.name in feeds)
    try:
        timed_run(
            session.target, identity_model(loaded, first), {first: feeds[first]}, "target",
            session.stats,
        )  # fmt: skip
    except BackendError as exc:
        return exc
    return None


def reference_crash(session: Session, crash: BackendCrash) -> BackendError:
    """The reference died in its worker (it cannot run the model: a usage problem, exit 2,
    not the target's fault): the error to raise, naming the first node whose presence kills
    it, found by the same binary search over prefixes as the target's, each run in a fresh
    child (the worker went to a child per run at the crash)."""
    s = session
    loaded = s.loaded
    crashes: dict[int, BackendError] = {}

    def fails(position: int) -> bool:
        try:
            timed_run(s.ref, prefix_model(loaded, position), s.feeds, "ref", s.stats)
        except BackendError as exc:  # an error there keeps the prefix from clearing it too
            crashes[position] = exc
            return True
        return False

    with s.timer.stage("bisect"):
        outcome = CutSearch(0, len(loaded.nodes)).run(fails)
    node = loaded.nodes[outcome.transition - 1]
    error = crashes.get(outcome.transition, crash)
    spec = s.setup.ref_info.spec
    how = str(error).removeprefix("reference failed: ").removeprefix(f"{spec}: ")
    return BackendError(
        f"reference failed: {spec} crashes whenever {node.op_type} {node.name!r} (#{node.index}) "
        f"is in the model{_before(node)} ({how}); choose another --ref",
        role="ref",
        detail=error.detail,
    )


def _before(node: NodeInfo) -> str:
    if node.index == 0:
        return ", the first node of the graph"
    return ", and runs every smaller prefix of the graph"
