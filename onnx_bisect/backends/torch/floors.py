"""Isolated precision floors: each node computed faithfully in a lower precision from the
exact (float64) values of its operands, against its exact result.

One float64 run of the model; as each node finishes, the same node runs again in float32 on
its operands rounded to the precision, and its results are rounded (``rounding.Rounding``).
The rel_l2 of that against the float64 results is what the precision alone makes of the node
when it is fed exact values: what a target's node, fed the reference's values, is held to.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy.typing as npt
import onnx
import torch

from onnx_bisect.backends.torch.interpreter import Program
from onnx_bisect.backends.torch.rounding import Rounding

__all__ = ["isolated_floors"]


def isolated_floors(
    model: onnx.ModelProto, feeds: Mapping[str, npt.NDArray[Any]], precision: str
) -> dict[str, float]:
    """Per tensor a node computes: rel_l2 of its faithful ``precision`` value against float64,
    the node fed its operands' float64 values. Nodes that cannot run alone in float32 (a
    subgraph reading its caller's scope) are left out."""
    opsets = {("" if i.domain == "ai.onnx" else i.domain): i.version for i in model.opset_import}
    device = torch.device("cpu")
    exact = Program(model.graph, opsets, device, torch.float64, fallback=True)
    rounding = Rounding(precision)
    low = Program(model.graph, opsets, device, torch.float32, rounding=rounding, fallback=True)
    floors: dict[str, float] = {}

    def observe(
        index: int,
        operands: Sequence[torch.Tensor | None],
        results: Sequence[torch.Tensor | None],
    ) -> None:
        step = low.steps[index]
        op = step.node.op_type
        # A node the float64 run computed by a stand-in (its translation failed on these
        # operands) is computed so here too.
        fn = exact.steps[index].fn if step.node.name in exact.stand_ins else step.fn
        cast = [_float32(v) for v in operands]
        try:
            low_results = fn(step.ctx, rounding.operands(op, cast), step.attrs)
        except Exception:  # noqa: BLE001 - a node that cannot run alone has no floor
            return
        if isinstance(low_results, torch.Tensor):
            low_results = (low_results,)
        rounded = rounding.results(op, list(low_results))
        for name, want, got in zip(step.node.output, results, rounded, strict=False):
            error = _rel_l2(want, got)
            if name and error is not None:
                floors[name] = error

    with torch.inference_mode():
        exact.run(exact.feed(feeds), observe=observe, emit=lambda name, value: None)
    return floors


def _float32(value: torch.Tensor | None) -> torch.Tensor | None:
    if value is None or not value.dtype.is_floating_point:
        return value
    return value.to(torch.float32)


def _rel_l2(exact: torch.Tensor | None, value: torch.Tensor | None) -> float | None:
    """rel_l2 over the elements finite in both; None for non-float or mismatched tensors."""
    if exact is None or value is None or not exact.dtype.is_floating_point:
        return None
    if exact.shape != value.shape:
        return None
    e, v = exact.to(torch.float64).reshape(-1), value.to(torch.float64).reshape(-1)
    finite = torch.isfinite(e) & torch.isfinite(v)
    e, v = e[finite], v[finite]
    d2, r2 = float(torch.dot(v - e, v - e)), float(torch.dot(e, e))
    if r2 == 0.0:
        return math.sqrt(d2)
    return math.sqrt(d2 / r2)
