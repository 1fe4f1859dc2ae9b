"""Crash search: the node whose presence kills the target.

A target that dies (a signal, or a hang past ``--timeout``) on the full model is run on ever
shorter prefixes of the graph, by binary search over topological positions, until the first
node whose presence kills it stands out.
"""

from __future__ import annotations

import logging

from onnx_bisect.engine.cut import search_info
from onnx_bisect.engine.found import Found
from onnx_bisect.engine.runs import timed_run
from onnx_bisect.engine.search import CutSearch
from onnx_bisect.engine.session import Session
from onnx_bisect.errors import BackendCrash, BackendError
from onnx_bisect.graph.extract import identity_model, prefix_model
from onnx_bisect.result import CauseKind, NodeResult, RootCause, Verdict

__all__ = ["crash_search"]

log = logging.getLogger(__name__)


def crash_search(session: Session, crash: BackendCrash) -> Found:
    """The target dies on the full model: find the first node whose presence kills it."""
    s, loaded = session, session.loaded

    def crashes(position: int) -> bool:
        try:
            timed_run(s.target, prefix_model(loaded, position), s.feeds, "target", s.stats)
        except BackendCrash:
            return True
        except BackendError as exc:
            log.info("prefix %d failed without crashing: %s", position, exc)
        return False

    if _crashes_on_anything(session):
        raise BackendCrash(f"{crash} (it also crashes on a one-node Identity model)", role="target")
    with s.timer.stage("bisect"):
        outcome = CutSearch(0, len(loaded.nodes)).run(crashes)
    node = loaded.nodes[outcome.transition - 1]
    message = str(crash).removeprefix("target failed: ")
    rows = tuple(
        NodeResult.of(n, Verdict.NOT_PROBED)
        if n is not node
        else NodeResult.of(
            n, Verdict.CRASHED, note=f"the target crashes when this node is in the model: {message}"
        )
        for n in loaded.nodes
    )
    cause = RootCause(
        CauseKind.CRASH,
        (node.name,),
        f"the target crashes whenever {node.op_type} {node.name!r} is in the model, and runs "
        f"every smaller prefix of the graph ({message})",
    )
    if not outcome.monotone:
        s.notes.append("crashes were not monotone along the order; a linear pass decided")
    search = search_info(outcome, "the target crashed on the full model", node)
    return Found("crash-bisect", rows, rows[node.index], cause, search)


def _crashes_on_anything(session: Session) -> bool:
    """Whether the target dies even on Identity: then no node is to blame."""
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
        return False
    return False
