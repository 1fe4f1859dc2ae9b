"""The amplification chain: how the root cause's error grows on its way to the outputs.

From the root-cause node, follow at each step the consumer carrying the largest accumulated
error, until a node with no consumer. The residual Adds that turned 1e-7 into 1e8 in the
YOLO11x report show up here as the links with large gains.

The walk always goes to its end (a 64-layer Llama's chain is thousands of links long); what is
kept is at most ``MAX_LINKS`` links: the first and last ``KEEP_ENDS`` and the largest gains
between, each kept link counting the links folded just before it (``ChainLink.folded``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Collection, Mapping, Sequence

from onnx_bisect.graph.view import LoadedModel
from onnx_bisect.result import (
    ChainLink,
    NodeResult,
    RootCause,
)

__all__ = ["KEEP_ENDS", "MAX_LINKS", "amplification_chain", "chain_from", "fold"]


MAX_LINKS = 1024
KEEP_ENDS = 256


def amplification_chain(
    nodes: Sequence[NodeResult],
    consumers: Mapping[int, Sequence[int]],
    start: int,
    outputs: Collection[str] = (),
) -> tuple[ChainLink, ...]:
    """The chain from ``start``, folded to ``MAX_LINKS``; ``outputs`` (the graph's) tell a
    chain that reaches them from one that stops short, whose last link says why."""
    by_index = {n.index: n for n in nodes}
    links: list[ChainLink] = []
    current: int | None = start
    seen: set[int] = set()
    stop = ""
    while current is not None and current not in seen:
        seen.add(current)
        node = by_index[current]
        err = node.rel_l2
        if err is None:
            break
        nonfinite = node.accumulated.nonfinite if node.accumulated else ""
        links.append(
            ChainLink(node.name, node.op_type, node.index, err, node.amplification, nonfinite)
        )
        after = [by_index[c] for c in consumers.get(current, ()) if c in by_index]
        nxt = [(e, c.index) for c in after if (e := _carried(c)) is not None]
        current = max(nxt)[1] if nxt else None
        if current is None and after and not set(node.outputs) & set(outputs):
            names = ", ".join(f"{c.op_type} {c.name}" for c in after[:3])
            stop = f"no error measured at its consumers ({names})"
    if stop and links:
        links[-1] = dataclasses.replace(links[-1], stop=stop)
    return fold(links)


def fold(
    links: Sequence[ChainLink], keep: int = MAX_LINKS, ends: int = KEEP_ENDS
) -> tuple[ChainLink, ...]:
    """At most ``keep`` links: the first and last ``ends`` and the largest gains between."""
    if len(links) <= keep:
        return tuple(links)
    middle = range(ends, len(links) - ends)
    gains = sorted(middle, key=lambda i: -(links[i].gain or 0.0))[: keep - 2 * ends]
    kept = sorted({*range(ends), *gains, *range(len(links) - ends, len(links))})
    out, last = [], -1
    for i in kept:
        out.append(dataclasses.replace(links[i], folded=i - last - 1))
        last = i
    return tuple(out)


def _carried(node: NodeResult) -> float | None:
    """The error a consumer carries: NaN or Inf where the reference has none, or the other way
    round, is the largest (its rel_l2 covers only the values finite in both: 0 when all NaN)."""
    if node.accumulated is not None and node.accumulated.nonfinite:
        return math.inf
    return node.rel_l2


def chain_from(
    loaded: LoadedModel,
    nodes: Sequence[NodeResult],
    cause: RootCause | None,
    first: NodeResult | None,
) -> tuple[ChainLink, ...]:
    """The chain from the root cause (its last node), or else the first divergence."""
    names = {n.name: n.index for n in nodes}
    starts = [names[n] for n in cause.nodes if n in names] if cause else []
    start = max(starts) if starts else (first.index if first else None)
    if start is None:
        return ()
    return amplification_chain(nodes, loaded.value_edges()[1], start, loaded.outputs)
