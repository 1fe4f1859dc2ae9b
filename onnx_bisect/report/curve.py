"""The error curve: accumulated error along the topological order, worst per segment.

A precision change (fp16, bf16) shows as a curve that rises slowly everywhere; a bad kernel as
a step at one node that the rest of the graph carries. Pure: it sees node results, not ONNX.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from onnx_bisect.result import NodeResult

__all__ = ["CurvePoint", "error_curve"]


@dataclass(frozen=True)
class CurvePoint:
    """Nodes ``first``..``last`` (topological indices); ``node`` has the worst error there."""

    first: int
    last: int
    node: str
    op_type: str
    error: float  # inf where NaN/Inf sit in different places: the worst there is
    diverged: bool
    nonfinite: str = ""  # then "NaN" or "inf", as shown

    def to_dict(self) -> dict[str, Any]:
        error = "nan" if self.nonfinite == "NaN" else str(self.error)
        return {
            "first": self.first,
            "last": self.last,
            "node": self.node,
            "op_type": self.op_type,
            "error": self.error if math.isfinite(self.error) else error,
            "diverged": self.diverged,
        }


def error_curve(nodes: Sequence[NodeResult], segments: int = 24) -> tuple[CurvePoint, ...]:
    """Up to ``segments`` points over the nodes with a measured accumulated error."""
    scored = [(n, e) for n in nodes if (e := _error(n)) is not None]
    if not scored or segments < 1:
        return ()
    size = math.ceil(len(scored) / segments)
    points = []
    for start in range(0, len(scored), size):
        chunk = scored[start : start + size]
        worst, error = max(chunk, key=lambda pair: pair[1])
        points.append(
            CurvePoint(
                first=chunk[0][0].index,
                last=chunk[-1][0].index,
                node=worst.name,
                op_type=worst.op_type,
                error=error,
                diverged=any(n.diverged for n, _ in chunk),
                nonfinite=worst.accumulated.nonfinite if worst.accumulated else "",
            )
        )
    return tuple(points)


def _error(n: NodeResult) -> float | None:
    """rel_l2, or inf where NaN/Inf sit in different places (rel_l2 covers only the values
    finite in both, 0 for an all-NaN tensor)."""
    if n.accumulated is not None and n.accumulated.nonfinite:
        return math.inf
    return n.rel_l2
