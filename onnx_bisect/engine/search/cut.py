"""The cut search: binary search over topological positions with only live tensors marked.

Each target run computes a prefix of the graph and marks only the tensors live across the cut,
so the target keeps its fusions everywhere else; that is what finds a bug that hides whenever
its tensors are observed.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

import numpy.typing as npt

from onnx_bisect.compare.criterion import Comparison
from onnx_bisect.compare.tensors import compare_tensors
from onnx_bisect.engine.measure.runs import timed_run
from onnx_bisect.engine.measure.store import TensorStore
from onnx_bisect.engine.search.state import (
    CutSearch,
    SearchOutcome,
)
from onnx_bisect.engine.session import Session
from onnx_bisect.errors import BackendError
from onnx_bisect.graph.extract import live_tensors, prefix_model
from onnx_bisect.graph.view import NodeInfo
from onnx_bisect.result import SearchInfo

__all__ = ["CutRefused", "CutResult", "cut_search", "search_info"]

log = logging.getLogger(__name__)

Feeds = Mapping[str, npt.NDArray[Any]]


@dataclass(frozen=True)
class CutResult:
    outcome: SearchOutcome
    node: NodeInfo  # the node just before the transition: its outputs first diverge
    comparisons: Mapping[str, Comparison]  # every live tensor compared during the search


class CutRefused(Exception):
    """The target failed on the prefix of ``position`` nodes (its error is ``error``): the
    search for a divergence cannot go on, and a search for that failure can."""

    def __init__(self, position: int, error: BackendError) -> None:
        super().__init__(str(error))
        self.position = position
        self.error = error


def cut_search(session: Session, store: TensorStore, kept: Collection[str] = ()) -> CutResult:
    """Find the first position after which the target's live tensors diverge.

    Position 0 (nothing computed) is known good and position N (the plain model) known bad, so
    this costs about ⌈log2 N⌉ target runs.

    ``kept``: tensors whose marking changes the target's result (``engine.search.marking``):
    never marked, so the fusion across them stays whole and shows where its result is read.
    A constant's live tensor is compared but does not decide a cut: a value the target holds
    differently (an INT64_MAX Slice end held as 2^31-1) shows downstream if it matters, and
    otherwise ended the search at the constant (issue 33, a T5 encoder on OpenVINO).
    """
    s, loaded = session, session.loaded
    seen: dict[str, Comparison] = {}
    skip, constants = set(kept), set(loaded.constants)

    def diverged(position: int) -> bool:
        live = [t for t in live_tensors(loaded, position) if t not in skip]
        if not live:
            return False
        model = prefix_model(loaded, position, store.metas, live)
        try:
            out = timed_run(s.target, model, s.feeds, "target", s.stats)
        except BackendError as exc:
            raise CutRefused(position, exc) from exc
        found = False
        for t in live:
            c = compare_tensors(t, store.get(t), out.get(t), s.crit)
            seen[t] = c
            found = found or (c.diverged and t not in constants)
        log.debug("cut search: position %d (%d live) %s", position, len(live), found)
        return found

    outcome = CutSearch(0, len(loaded.nodes)).run(diverged)
    return CutResult(outcome, loaded.nodes[outcome.transition - 1], seen)


def search_info(outcome: SearchOutcome, reason: str, node: NodeInfo) -> SearchInfo:
    """How a search over cuts went, for the report."""
    return SearchInfo(
        reason=reason,
        runs=outcome.runs,
        asked=outcome.asked,
        monotone=outcome.monotone,
        refined=outcome.refined,
        transition_node=node.name,
    )
