"""The amplification chain: how the root cause's error grows on its way to the outputs.

From the root-cause node, follow at each step the consumer carrying the largest accumulated
error, until a node with no consumer. The residual Adds that turned 1e-7 into 1e8 in the
YOLO11x report show up here as the links with large gains.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from onnx_bisect.graph.view import LoadedModel
from onnx_bisect.result import (
    ChainLink,
    NodeResult,
    RootCause,
)

__all__ = ["MAX_LINKS", "amplification_chain", "chain_from"]


MAX_LINKS = 1024


def amplification_chain(
    nodes: Sequence[NodeResult], consumers: Mapping[int, Sequence[int]], start: int
) -> tuple[ChainLink, ...]:
    by_index = {n.index: n for n in nodes}
    links: list[ChainLink] = []
    current: int | None = start
    seen: set[int] = set()
    while current is not None and current not in seen and len(links) < MAX_LINKS:
        seen.add(current)
        node = by_index[current]
        err = node.rel_l2
        if err is None:
            break
        nonfinite = node.accumulated.nonfinite if node.accumulated else ""
        links.append(
            ChainLink(node.name, node.op_type, node.index, err, node.amplification, nonfinite)
        )
        nxt = [
            (e, c) for c in consumers.get(current, ()) if (e := _carried(by_index[c])) is not None
        ]
        current = max(nxt)[1] if nxt else None
    return tuple(links)


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
    return amplification_chain(nodes, loaded.value_edges()[1], start)
