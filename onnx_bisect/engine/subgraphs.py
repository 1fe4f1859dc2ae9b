"""Subgraphs around a root cause, smallest first: what a repro bundle and a pass bisection cut.

Candidates: the root cause itself (one culprit, a pattern window, a crash node), then windows
grown around it, then doubling ranges of its ancestors (16, 32, ... nodes back), then the whole
prefix of the graph up to it (the context in which the divergence was seen, fed the model's
own inputs). Every candidate but the prefix is fed the reference's tensors at its cut
(``reference_window``), under the original tensor names.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import onnx

from onnx_bisect.engine.measure.operands import reference_fed
from onnx_bisect.engine.measure.store import TensorStore
from onnx_bisect.engine.search.pattern import window_candidates
from onnx_bisect.graph.extract import window_model
from onnx_bisect.graph.view import LoadedModel, NodeInfo

__all__ = ["Candidate", "Fed", "candidates", "reference_window"]


@dataclass(frozen=True)
class Candidate:
    nodes: tuple[NodeInfo, ...]
    prefix: bool  # the whole graph before the cut, fed the model's own inputs


@dataclass(frozen=True)
class Fed:
    """A cut subgraph with its feeds and the reference's values at its outputs."""

    model: onnx.ModelProto
    inputs: dict[str, npt.NDArray[Any]]
    outputs: dict[str, npt.NDArray[Any]]


def candidates(
    loaded: LoadedModel, store: TensorStore, start: Sequence[str]
) -> Iterator[Candidate]:
    """Subgraphs around the nodes ``start``, smallest first (see module), each one the
    reference's values can feed (see ``_fed_by_reference``)."""
    for cand in _candidates(loaded, store, start):
        if cand.prefix or _fed_by_reference(loaded, store, cand.nodes):
            yield cand


def _fed_by_reference(loaded: LoadedModel, store: TensorStore, nodes: Sequence[NodeInfo]) -> bool:
    """Whether the reference holds every tensor ``nodes`` read from outside them. A second
    target model has tensors of its own the reference never computed (a quantized model's
    QuantizeLinear outputs): a window that reads one cannot be fed."""
    produced = {o for n in nodes for o in n.outputs}
    known = loaded.initializers | set(loaded.inputs)
    return all(
        t in produced or t in known or t in store
        for n in nodes
        for t in (*n.inputs, *n.implicit_inputs)
        if t
    )


def _candidates(
    loaded: LoadedModel, store: TensorStore, start: Sequence[str]
) -> Iterator[Candidate]:
    index = {n.name: n.index for n in loaded.nodes}
    first = sorted(index[s] for s in start if s in index)
    if not first:
        return
    yield Candidate(tuple(loaded.nodes[i] for i in first), False)
    seen = {tuple(first)}
    for window in window_candidates(loaded, store, loaded.nodes[first[-1]]):
        merged = tuple(sorted(set(window) | set(first)))
        if merged not in seen:
            seen.add(merged)
            yield Candidate(tuple(loaded.nodes[i] for i in merged), False)
    yield from _ranges(loaded, first[-1])
    yield Candidate(tuple(loaded.nodes[: first[-1] + 1]), True)


def _ranges(loaded: LoadedModel, end: int) -> Iterator[Candidate]:
    """Ancestors of ``end`` among the 16, 32, 64, ... nodes before it, fed at the cut.

    For a divergence that needs a region of the graph rather than a window: the first range
    that reproduces is within twice the smallest one that would, at one target run per
    doubling, before the whole prefix is the last resort.
    """
    ancestors = loaded.ancestors(end)
    step = 16
    while step < end:
        start = end - step
        nodes = tuple(n for n in loaded.nodes[start : end + 1] if n.index in ancestors)
        yield Candidate(nodes, False)
        step *= 2


def reference_window(
    loaded: LoadedModel,
    store: TensorStore,
    feeds: Mapping[str, npt.NDArray[Any]],
    nodes: Sequence[NodeInfo],
    outputs: Sequence[str] | None = None,
) -> Fed:
    """``nodes`` as one window under their own names, fed the reference's operands, with the
    reference's values at its exits (or at ``outputs``)."""
    model, inputs = reference_fed(
        loaded, store, feeds, nodes,
        lambda metas, constants: window_model(
            loaded, nodes, metas, constants, outputs=outputs, keep_names=True
        )[:2],
    )  # fmt: skip
    refs = {o.name: np.asarray(store.get(o.name)) for o in model.graph.output if o.name in store}
    return Fed(model, {k: np.asarray(v) for k, v in inputs.items()}, refs)
