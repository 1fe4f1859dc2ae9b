"""Number and label formatting shared by the text reports."""

from __future__ import annotations

import math

from onnx_bisect.result import BisectResult, NodeResult

__all__ = ["fmt", "fmt_amp", "node_label", "search_line"]


def fmt(x: float | None) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "—"
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    if x == 0:
        return "0"
    if 1e-3 <= abs(x) < 1e4:
        return f"{x:.4g}"
    return f"{x:.3e}"


def fmt_amp(x: float | None) -> str:
    return "—" if x is None else f"×{fmt(x)}"


def node_label(n: NodeResult) -> str:
    return f"{n.op_type} `{n.name}` (#{n.index})"


def search_line(result: BisectResult) -> str:
    s = result.search
    if s is None:
        return ""
    shape = "monotone" if s.monotone else "not monotone, refined linearly"
    extra = f", {s.pattern_windows_tried} pattern windows" if s.pattern_windows_tried else ""
    return (
        f"cut search: {s.runs} target runs over {len(result.nodes)} nodes ({shape}), "
        f"transition after {s.transition_node}{extra}"
    )
