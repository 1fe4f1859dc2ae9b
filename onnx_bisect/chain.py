"""The amplification chain: how the root cause's error grows on its way to the outputs.

From the root-cause node, follow at each step the consumer carrying the largest accumulated
error, until a node with no consumer. The residual Adds that turned 1e-7 into 1e8 in the
YOLO11x report show up here as the links with large gains.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from onnx_bisect.result import NodeResult

__all__ = ["ChainLink", "amplification_chain"]

MAX_LINKS = 1024


@dataclass(frozen=True)
class ChainLink:
    node: str
    op_type: str
    index: int
    rel_l2: float
    gain: float | None  # this node's amplification (output error ÷ worst input error)


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
        links.append(ChainLink(node.name, node.op_type, node.index, err, node.amplification))
        nxt = [(e, c) for c in consumers.get(current, ()) if (e := by_index[c].rel_l2) is not None]
        current = max(nxt)[1] if nxt else None
    return tuple(links)
