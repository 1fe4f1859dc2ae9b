"""A crash that the failure search's own marking hid: the observer effect, for crashes.

Every prefix marks the tensors live across its cut, so a tensor read again later stays an
output until the prefix ends at its last reader. A runtime whose crash needs that tensor
unobserved (ONNX Runtime's Transpose -> MatMul on a float16 LSTM output, at ORT_ENABLE_ALL)
then crashes first at the prefix that ends at the last reader: a node that plays no part.
Where the node found is the last reader of tensors earlier prefixes marked, the prefixes
between each one's producer and that node are searched again with it unmarked; a crash at an
earlier reader, which runs once the tensor is marked (checked), is the crash.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from onnx_bisect.engine.measure.runs import timed_run
from onnx_bisect.engine.search.state import CutSearch
from onnx_bisect.engine.session import Session
from onnx_bisect.errors import BackendCrash, BackendError
from onnx_bisect.graph.extract import live_tensors, prefix_model
from onnx_bisect.graph.view import LoadedModel, NodeInfo, TensorMeta

__all__ = ["HiddenCrash", "hidden_crash"]

log = logging.getLogger(__name__)

# Tensors tried, in graph order: a node is the last reader of few.
MOST_TENSORS = 3


@dataclass(frozen=True)
class HiddenCrash:
    """The target crashes whenever ``reader`` is in the model and reads ``tensor`` (made by
    ``producer``) unobserved; marked as an output, the same prefix runs."""

    tensor: str
    producer: NodeInfo
    reader: NodeInfo
    last_reader: NodeInfo  # where the search with every live tensor marked had it
    error: BackendCrash  # the target's own words on the prefix ending at ``reader``
    runs: int

    def words(self) -> str:
        """The reason, in the report's words."""
        p, r, last = self.producer, self.reader, self.last_reader
        return (
            f"the target crashes whenever {r.op_type} {r.name!r} is in the model and reads "
            f"{self.tensor!r}, the output of {p.op_type} {p.name!r}, unobserved, and runs that "
            f"prefix with {self.tensor!r} marked as an output (a fusion from {p.op_type} to "
            f"{r.op_type} that marking undoes); the prefixes that mark every tensor read later "
            f"ran until the last reader, {last.op_type} {last.name!r}, which plays no part "
            f"(found in {self.runs} more target runs)"
        )


def hidden_crash(
    session: Session,
    loaded: LoadedModel,
    node: NodeInfo,
    metas: Mapping[str, TensorMeta] | None,
) -> HiddenCrash | None:
    """The crash found at ``node`` (the prefix up to it crashes, the one before runs), moved
    to an earlier reader of a tensor ``node`` reads last, where that tensor unmarked makes
    the earlier reader crash; None where no such reader does."""
    cut = node.index + 1
    after = set(live_tensors(loaded, cut))
    unmarked = [t for t in live_tensors(loaded, node.index) if t not in after]
    runs = 0
    for tensor in unmarked[:MOST_TENSORS]:
        producer = loaded.producer.get(tensor)
        if producer is None or producer.index + 1 >= node.index:
            continue  # a graph input, or no prefix between the producer and the node

        def crashes(position: int, hidden: str = tensor) -> BackendError | None:
            nonlocal runs
            runs += 1
            outs = [t for t in live_tensors(loaded, position) if t != hidden]
            try:
                timed_run(
                    session.target, prefix_model(loaded, position, metas, outs), session.feeds,
                    "target", session.stats,
                )  # fmt: skip
            except BackendError as exc:
                return exc
            return None

        found = _search(crashes, producer.index + 1, cut)
        if found is None:
            continue
        position, error = found
        reader = loaded.nodes[position - 1]
        # Marked, the same prefix must run: else the tensor's marking is not what hid it.
        marked = _runs_marked(session, loaded, position, metas)
        runs += 1
        if not marked:
            continue
        return HiddenCrash(tensor, producer, reader, node, error, runs)
    return None


def _search(
    crashes: Callable[[int], BackendError | None], lo: int, hi: int
) -> tuple[int, BackendCrash] | None:
    """The first prefix in ``(lo, hi)`` that crashes (``hi`` is known to), with the target's
    error there; None where only ``hi`` does, or the first failure is not a crash."""
    errors: dict[int, BackendError] = {}

    def fails(position: int) -> bool:
        error = crashes(position)
        if error is not None:
            errors[position] = error
        return error is not None

    outcome = CutSearch(lo, hi, verify=False).run(fails)
    error = errors.get(outcome.transition)
    log.debug("hidden crash search from %d: transition %d", lo, outcome.transition)
    if outcome.transition >= hi or not isinstance(error, BackendCrash):
        return None
    return outcome.transition, error


def _runs_marked(
    session: Session,
    loaded: LoadedModel,
    position: int,
    metas: Mapping[str, TensorMeta] | None,
) -> bool:
    """Whether the target runs the prefix of ``position`` nodes with every live tensor
    marked, as the failure search ran it."""
    try:
        model = prefix_model(loaded, position, metas)
        timed_run(session.target, model, session.feeds, "target", session.stats)
    except BackendError as exc:
        log.debug("the prefix of %d nodes fails marked too: %s", position, exc)
        return False
    return True
