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
from collections.abc import Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, TypeVar

import numpy.typing as npt

from onnx_bisect.compare.criterion import Comparison
from onnx_bisect.compare.tensors import compare_tensors
from onnx_bisect.engine.measure.operands import is_constant, reference_fed
from onnx_bisect.engine.measure.runs import timed_run
from onnx_bisect.engine.measure.store import TensorStore
from onnx_bisect.engine.search.state import (
    backward_windows,
    closure_windows,
    forward_windows,
)
from onnx_bisect.engine.session import Session
from onnx_bisect.errors import BackendError
from onnx_bisect.graph.extract import window_exits, window_model
from onnx_bisect.graph.view import METADATA_OPS, LoadedModel, NodeInfo
from onnx_bisect.result import NodeResult

__all__ = [
    "EXTREME_GAIN",
    "EXTREME_WINDOW",
    "MAX_WINDOW",
    "Pattern",
    "extreme_gains",
    "find_pattern",
    "window_candidates",
]

log = logging.getLogger(__name__)

Feeds = Mapping[str, npt.NDArray[Any]]

T = TypeVar("T")


MAX_WINDOW = 8
# With no single culprit, windows of up to EXTREME_WINDOW nodes are first tried around the
# EXTREME_SEEDS nodes of the largest gains of at least EXTREME_GAIN (a broken fused quantized
# Softmax on tract: x10,282 at one node, far from the first divergence).
EXTREME_GAIN = 1000.0
EXTREME_WINDOW = 6
EXTREME_SEEDS = 3


@dataclass(frozen=True)
class Pattern:
    nodes: tuple[NodeInfo, ...]
    comparisons: Mapping[str, Comparison]  # the window's exits
    tried: int  # windows run, this one included


def find_pattern(
    session: Session,
    store: TensorStore,
    start: NodeInfo,
    max_size: int = MAX_WINDOW,
    kept: Collection[str] = (),
    fold: bool = False,
) -> Pattern | None:
    """Smallest window around ``start`` that diverges on the target when fed reference inputs.

    Windows of each size are tried backward (producers: a pattern ending at ``start``, such as
    Conv -> Sigmoid -> Mul), forward (consumers: a fused group starting there), and backward
    closed over fan-out (an ancestor with all its readers, so its output is unobserved).
    ``kept``: tensors whose marking changes the target's result, never a window's exit.
    ``fold``: tensors the input shapes alone determine are embedded as constants, not fed,
    as a target folds them at static shapes (a T5 encoder's position bias, which OpenVINO
    folds into the attention mask's arithmetic), and are no edge of a window.
    """
    loaded = session.loaded
    folded = shape_determined(loaded) if fold else frozenset()
    windows = window_candidates(loaded, store, start, max_size, folded)
    for tried, window in enumerate(windows, start=1):
        nodes = tuple(loaded.nodes[i] for i in window)
        exits = _run_window(session, store, nodes, kept, folded)
        if exits is None or not any(c.diverged for c in exits.values()):
            continue
        if _flips_inside(session, store, nodes, kept, folded):
            continue
        log.debug("pattern: window %s reproduces", [n.name for n in nodes])
        return Pattern(nodes, exits, tried)
    return None


def _flips_inside(
    session: Session,
    store: TensorStore,
    nodes: Sequence[NodeInfo],
    kept: Collection[str],
    folded: Collection[str],
) -> list[str]:
    """The integer tensors inside a diverging window of one quantized model that come out a
    step apart from the reference's (within the int8 precision), the window run again with
    them marked: fp32-level differences rounded to the neighbouring step there, and what the
    window computes from them moves with them (zoo G12: a Sigmoid's last bit flipped a
    DynamicQuantizeLinear, and the window after it was named). Empty where there are none,
    so that the window is a finding."""
    crit = session.crit
    gridded = set(crit.quantized or ()) | set(crit.quant_bounds or ())
    inner = [o for n in nodes[:-1] for o in n.outputs if o in gridded and o in store]
    if not inner:
        return []
    exits = _run_window(session, store, nodes, kept, folded, also=inner)
    flipped = [t for t in inner if exits is not None and t in exits and exits[t].within_precision]
    if flipped:
        log.debug("pattern: window %s diverges from flips of %s", [n.name for n in nodes], flipped)
    return flipped


def extreme_gains(nodes: Sequence[NodeResult], skip: str = "") -> list[NodeResult]:
    """The nodes whose gain (output error ÷ worst input error) is at least ``EXTREME_GAIN``,
    largest first, at most ``EXTREME_SEEDS`` (``skip``: a node searched anyway)."""
    big = [
        n
        for n in nodes
        if n.amplification is not None and n.amplification >= EXTREME_GAIN and n.name != skip
    ]
    return sorted(big, key=lambda n: -(n.amplification or 0.0))[:EXTREME_SEEDS]


def window_candidates(
    loaded: LoadedModel,
    store: TensorStore,
    start: NodeInfo,
    max_size: int = MAX_WINDOW,
    folded: Collection[str] = frozenset(),
) -> Iterator[tuple[int, ...]]:
    """Node-index windows around ``start``, smallest first, each family interleaved.

    Edges through constants and shape arithmetic are left out: those are embedded in every
    window, so none of them needs a slot in one (nor do the ``folded`` tensors).
    """
    producers, consumers = loaded.value_edges(
        skip=lambda t: t in folded or is_constant(t, loaded, store)
    )
    back = backward_windows(start.index, producers, max_size)
    fwd = forward_windows(start.index, consumers, max_size)
    closed = closure_windows(start.index, producers, consumers, max_size)
    return _unique(_interleave(back, fwd, closed))


def shape_determined(loaded: LoadedModel) -> frozenset[str]:
    """Tensors computed from initializers and the graph inputs' shapes alone (Shape, Size, and
    arithmetic on those and on constants): at the fixed shapes of a run, constants a target
    may fold into what reads them."""
    found = set(loaded.initializers) | set(loaded.constants)
    for n in loaded.nodes:
        if n.implicit_inputs or n.op_type in _NONDETERMINISTIC:
            continue
        if n.op_type in METADATA_OPS or all(t == "" or t in found for t in n.inputs):
            found.update(o for o in n.outputs if o)
    return frozenset(found)


def _made_outside(loaded: LoadedModel, tensor: str, inside: Collection[str]) -> bool:
    producer = loaded.producer.get(tensor)
    return producer is not None and producer.name not in inside


_NONDETERMINISTIC = frozenset(
    {"RandomNormal", "RandomNormalLike", "RandomUniform", "RandomUniformLike", "Multinomial"}
)


def _run_window(
    session: Session,
    store: TensorStore,
    nodes: Sequence[NodeInfo],
    kept: Collection[str],
    folded: Collection[str],
    also: Sequence[str] = (),
) -> dict[str, Comparison] | None:
    """The window fed the reference's inputs on the target, its exits compared (``also``:
    inner tensors marked and compared too)."""
    loaded = session.loaded
    outs = [t for t in window_exits(loaded, nodes) if t not in kept]
    outs += [t for t in also if t not in outs]
    if not outs:
        return None
    inside = {n.name for n in nodes}
    fold = {
        t: loaded.as_fed(t, store.get(t))
        for n in nodes
        for t in n.inputs
        if t in folded and t in store and _made_outside(loaded, t, inside)
    }
    model, feeds = reference_fed(
        loaded, store, session.feeds, nodes,
        lambda metas, constants: window_model(
            loaded, nodes, metas, {**constants, **fold}, outs
        )[:2],
    )  # fmt: skip
    try:
        out = timed_run(session.target, model, feeds, "target", session.stats)
    except BackendError as exc:
        log.debug("pattern: window %s failed: %s", [n.name for n in nodes], exc)
        return None
    exits = [o.name for o in model.graph.output]
    crit = session.crit
    if crit.quantized:  # each integer kernel of the window may round a step apart
        crit = replace(crit, quant_steps=len(nodes))
    return {t: compare_tensors(t, store.get(t), out.get(t), crit) for t in exits}


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
