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
from collections.abc import Sequence

from onnx_bisect.engine.found import Found
from onnx_bisect.engine.measure.isolate import IsolationFailure, isolate, unsupported
from onnx_bisect.engine.measure.observe import scan
from onnx_bisect.engine.measure.runs import timed_run
from onnx_bisect.engine.measure.store import TensorStore
from onnx_bisect.engine.search.cut import search_info
from onnx_bisect.engine.search.state import CutSearch
from onnx_bisect.engine.session import Session
from onnx_bisect.errors import BackendCrash, BackendError
from onnx_bisect.graph.extract import identity_model, prefix_model
from onnx_bisect.graph.view import NodeInfo
from onnx_bisect.result import CauseKind, NodeResult, RootCause, SearchInfo, Verdict

__all__ = ["failure_search"]

log = logging.getLogger(__name__)

_TIMED_OUT = re.compile(r"timed out after [0-9.]+\s*s")


def failure_search(session: Session, failure: BackendError) -> Found:
    """The target fails on the full model: find the first node whose presence makes it fail."""
    s = session
    loaded = s.setup.target_model or s.loaded
    crash = isinstance(failure, BackendCrash)
    errors: dict[int, BackendError] = {}

    def fails(position: int) -> bool:
        try:
            timed_run(s.target, prefix_model(loaded, position), s.feeds, "target", s.stats)
        except BackendCrash as exc:
            errors[position] = exc
            return True
        except BackendError as exc:
            if crash:  # an error is not the symptom being searched for
                log.debug("prefix %d failed without crashing: %s", position, exc)
                return False
            errors[position] = exc
            return True
        return False

    if _fails_on_anything(session, crash):
        what = "crashes" if crash else "fails"
        raise type(failure)(
            f"{failure} (it also {what} on a one-node Identity model, so no node is to blame)",
            role="target",
            detail=failure.detail,
        )
    with s.timer.stage("bisect"):
        outcome = CutSearch(0, len(loaded.nodes)).run(fails)
    node = loaded.nodes[outcome.transition - 1]
    error = errors.get(outcome.transition, failure)
    message = _message(error)
    if not outcome.monotone:
        s.notes.append("failures were not monotone along the order; a linear pass decided")
    search = search_info(outcome, f"the target {_did(crash)} on the full model", node)
    if crash:
        hang = _TIMED_OUT.search(message)
        how = f"hangs ({hang.group(0)})" if hang else "crashes"
        cause = RootCause(
            CauseKind.CRASH,
            (node.name,),
            f"the target {how} whenever {node.op_type} {node.name!r} is in the model, and "
            "runs every smaller prefix of the graph",
            message,
        )
        note = f"the target crashes when this node is in the model: {message}"
        rows = _rows(loaded.nodes, node, Verdict.CRASHED, note)
        return Found("crash-bisect", rows, rows[node.index], cause, search)
    return _error_found(session, node, message, search)


def _error_found(session: Session, node: NodeInfo, message: str, search: SearchInfo) -> Found:
    """An error localized to ``node``: checked on the node alone where the reference's values
    can feed it, and classified as a missing kernel or a failure."""
    s = session
    loaded = s.setup.target_model or s.loaded
    store: TensorStore | None = None
    alone: str | None = None  # the node's own error, or None when it runs alone
    checked = s.setup.target_model is None and node.name not in loaded.constant_nodes
    if checked:
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
    reason = (
        f"the target {what} {node.op_type} {node.name!r}: it fails whenever the node is in the "
        "model and runs every smaller prefix of the graph"
    )
    if checked and alone is not None:
        reason += ", and fails on the node alone, fed the reference's inputs"
    elif checked:
        reason += (
            "; fed the reference's inputs it runs alone, so the failure needs the graph before "
            "it (a shape, a dtype or a fusion the runtime derives there)"
        )
    rows = _rows(loaded.nodes, node, verdict, message)
    cause = RootCause(kind, (node.name,), reason, message)
    strategy = "failure-bisect"
    return Found(strategy, rows, rows[node.index], cause, search, store=store)


def _rows(
    nodes: Sequence[NodeInfo], node: NodeInfo, verdict: Verdict, note: str
) -> tuple[NodeResult, ...]:
    return tuple(
        NodeResult.of(n, verdict, note=note) if n is node else NodeResult.of(n, Verdict.NOT_PROBED)
        for n in nodes
    )


def _did(crash: bool) -> str:
    return "crashed" if crash else "failed"


def _message(error: BackendError) -> str:
    """The runtime's own words, without our role prefix."""
    return error.full.removeprefix("target failed: ")


def _fails_on_anything(session: Session, crash: bool) -> bool:
    """Whether the target fails even on Identity: then no node is to blame."""
    loaded, feeds = session.loaded, session.feeds
    first = next(i.name for i in loaded.model.graph.input if i.name in feeds)
    try:
        timed_run(
            session.target, identity_model(loaded, first), {first: feeds[first]}, "target",
            session.stats,
        )  # fmt: skip
    except BackendCrash:
        return True
    except BackendError:
        return not crash
    return False
