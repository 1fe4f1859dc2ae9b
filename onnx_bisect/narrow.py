"""Narrowing down a root cause that one node alone does not show.

- ``cut_search``: binary search over topological positions, where each target run marks only
  the tensors live across the cut, so the target keeps its fusions everywhere else.
- ``find_pattern``: the smallest window of connected nodes that reproduces the divergence when
  fed the reference's inputs, grown backward along producers and forward along consumers.

The search state lives in ``search``; graph surgery in ``model``; this module runs the target
and compares.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy.typing as npt

from onnx_bisect.adapters.base import Backend
from onnx_bisect.errors import BackendError
from onnx_bisect.locate import is_constant, reference_operands
from onnx_bisect.metrics import Comparison, Criterion, compare_tensors
from onnx_bisect.model import (
    METADATA_OPS,
    LoadedModel,
    NodeInfo,
    live_tensors,
    prefix_model,
    window_model,
)
from onnx_bisect.run import RunStats, TensorStore, timed_run
from onnx_bisect.search import (
    CutSearch,
    SearchOutcome,
    backward_windows,
    closure_windows,
    forward_windows,
)

__all__ = ["CutResult", "Pattern", "cut_search", "find_pattern", "window_candidates"]

log = logging.getLogger(__name__)

Feeds = Mapping[str, npt.NDArray[Any]]
MAX_WINDOW = 8
T = TypeVar("T")


@dataclass(frozen=True)
class CutResult:
    outcome: SearchOutcome
    node: NodeInfo  # the node just before the transition: its outputs first diverge
    comparisons: Mapping[str, Comparison]  # every live tensor compared during the search


@dataclass(frozen=True)
class Pattern:
    nodes: tuple[NodeInfo, ...]
    comparisons: Mapping[str, Comparison]  # the window's exits
    tried: int  # windows run, this one included


def cut_search(
    target: Backend,
    loaded: LoadedModel,
    feeds: Feeds,
    crit: Criterion,
    store: TensorStore,
    stats: RunStats,
) -> CutResult:
    """Find the first position after which the target's live tensors diverge.

    Position 0 (nothing computed) is known good and position N (the plain model) known bad, so
    this costs about ⌈log2 N⌉ target runs.
    """
    seen: dict[str, Comparison] = {}

    def diverged(position: int) -> bool:
        live = live_tensors(loaded, position)
        if not live:
            return False
        out = timed_run(target, prefix_model(loaded, position), feeds, "target", stats)
        found = False
        for t in live:
            c = compare_tensors(t, store.get(t), out.get(t), crit)
            seen[t] = c
            found = found or c.diverged
        log.info("cut search: position %d (%d live) %s", position, len(live), found)
        return found

    outcome = CutSearch(0, len(loaded.nodes)).run(diverged)
    return CutResult(outcome, loaded.nodes[outcome.transition - 1], seen)


def find_pattern(
    target: Backend,
    loaded: LoadedModel,
    feeds: Feeds,
    crit: Criterion,
    store: TensorStore,
    stats: RunStats,
    start: NodeInfo,
    max_size: int = MAX_WINDOW,
) -> Pattern | None:
    """Smallest window around ``start`` that diverges on the target when fed reference inputs.

    Windows of each size are tried backward (producers: a pattern ending at ``start``, such as
    Conv -> Sigmoid -> Mul), forward (consumers: a fused group starting there), and backward
    closed over fan-out (an ancestor with all its readers, so its output is unobserved).
    """
    for tried, window in enumerate(window_candidates(loaded, store, start, max_size), start=1):
        nodes = tuple(loaded.nodes[i] for i in window)
        exits = _run_window(target, loaded, feeds, crit, store, stats, nodes)
        if exits is not None and any(c.diverged for c in exits.values()):
            log.info("pattern: window %s reproduces", [n.name for n in nodes])
            return Pattern(nodes, exits, tried)
    return None


def window_candidates(
    loaded: LoadedModel, store: TensorStore, start: NodeInfo, max_size: int = MAX_WINDOW
) -> Iterator[tuple[int, ...]]:
    """Node-index windows around ``start``, smallest first, each family interleaved."""
    producers, consumers = _edges(loaded, store)
    back = backward_windows(start.index, producers, max_size)
    fwd = forward_windows(start.index, consumers, max_size)
    closed = closure_windows(start.index, producers, consumers, max_size)
    return _unique(_interleave(back, fwd, closed))


def _run_window(
    target: Backend,
    loaded: LoadedModel,
    feeds: Feeds,
    crit: Criterion,
    store: TensorStore,
    stats: RunStats,
    nodes: Sequence[NodeInfo],
) -> dict[str, Comparison] | None:
    metas, constants = reference_operands(loaded, store, [t for n in nodes for t in n.inputs])
    model, fed, exits = window_model(loaded, nodes, metas, constants)
    window_feeds = dict(feeds)
    window_feeds.update({name: loaded.as_fed(t, store.get(t)) for name, t in fed.items()})
    try:
        out = timed_run(target, model, window_feeds, "target", stats)
    except BackendError as exc:
        log.info("pattern: window %s failed: %s", [n.name for n in nodes], exc)
        return None
    return {t: compare_tensors(t, store.get(t), out.get(t), crit) for t in exits}


def _edges(
    loaded: LoadedModel, store: TensorStore
) -> tuple[dict[int, list[int]], dict[int, list[int]]]:
    """Producer and consumer lists between nodes, through activation values only: constants
    and shape arithmetic are embedded in every window, and Shape/Size read no values, so none
    of them needs a slot in one."""
    producer = loaded.producer
    producers: dict[int, list[int]] = {}
    consumers: dict[int, list[int]] = {}
    for n in loaded.nodes:
        if n.op_type in METADATA_OPS:
            continue
        for t in n.inputs:
            p = producer.get(t)
            if p is None or is_constant(t, loaded, store):
                continue
            producers.setdefault(n.index, []).append(p.index)
            consumers.setdefault(p.index, []).append(n.index)
    return producers, consumers


def _interleave(*iterators: Iterator[T]) -> Iterator[T]:
    """Windows of size 2 from each family, then size 3, and so on: smallest first."""
    its = list(iterators)
    while its:
        for it in list(its):
            try:
                yield next(it)
            except StopIteration:
                its.remove(it)


def _unique(windows: Iterator[tuple[int, ...]]) -> Iterator[tuple[int, ...]]:
    seen: set[tuple[int, ...]] = set()
    for w in windows:
        if w not in seen:
            seen.add(w)
            yield w
