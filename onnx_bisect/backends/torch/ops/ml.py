"""``ai.onnx.ml`` operators: Binarizer and ArrayFeatureExtractor (the classical-ML
converters' glue around a model), and TreeEnsemble (opset 5), walked on the host one row and
one tree at a time: a tree is data-dependent branching, not tensor maths."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from onnx_bisect.backends.torch.context import OpContext
from onnx_bisect.backends.torch.ops.registry import register
from onnx_bisect.backends.torch.ops.shape import need

__all__: list[str] = []

Inputs = list[torch.Tensor | None]
_ML = "ai.onnx.ml"


@register("Binarizer", since=1, domain=_ML)
def binarizer(ctx: OpContext, x: Inputs, attrs: dict[str, Any]) -> torch.Tensor:
    data = need(x, 0)
    return (data > float(attrs.get("threshold", 0.0))).to(data.dtype)


@register("ArrayFeatureExtractor", since=1, domain=_ML)
def array_feature_extractor(ctx: OpContext, x: Inputs, attrs: dict[str, Any]) -> torch.Tensor:
    """The last axis's entries at ``indices`` (flattened); a vector gives one row, as ONNX
    Runtime does."""
    data, indices = need(x, 0), need(x, 1).reshape(-1).to(torch.int64)
    picked = data[..., indices]
    return picked.reshape(1, -1) if data.dim() == 1 else picked


def _member_sets(attrs: dict[str, Any], modes: list[int]) -> dict[int, set[float]]:
    """Each MEMBER node's set: ``membership_values`` holds them in node order, NaN-separated."""
    values = [float(v) for v in np.asarray(attrs.get("membership_values", [])).reshape(-1)]
    sets: list[set[float]] = [set()]
    for v in values:
        if math.isnan(v):
            sets.append(set())
        else:
            sets[-1].add(v)
    members = [i for i, m in enumerate(modes) if m == 6]
    return dict(zip(members, sets, strict=False))


def _goes_true(mode: int, x: float, split: float, members: set[float] | None) -> bool:
    tests = {0: x <= split, 1: x < split, 2: x >= split, 3: x > split, 4: x == split,
             5: x != split}  # fmt: skip
    return x in (members or set()) if mode == 6 else tests[mode]


def _leaf(row: list[float], root: int, t: dict[str, Any]) -> int:
    """The leaf index one tree (from ``root``) sends ``row`` to."""
    if t["true_leaf"][root] and t["false_leaf"][root] and t["true"][root] == t["false"][root]:
        return root
    node = root
    while True:
        x = row[t["feature"][node]]
        branch = (math.isnan(x) and t["missing"][node]) or _goes_true(
            t["mode"][node], x, t["split"][node], t["members"].get(node)
        )
        side = "true" if branch else "false"
        nxt, is_leaf = t[side][node], t[f"{side}_leaf"][node]
        if is_leaf:
            return int(nxt)
        node = int(nxt)


@register("TreeEnsemble", since=5, domain=_ML)
def tree_ensemble(ctx: OpContext, x: Inputs, attrs: dict[str, Any]) -> torch.Tensor:
    data = need(x, 0)

    def ints(name: str) -> list[int]:
        return [int(v) for v in attrs.get(name, [])]

    modes = [int(v) for v in np.asarray(attrs["nodes_modes"]).reshape(-1)]
    tables = {
        "feature": ints("nodes_featureids"), "mode": modes, "true": ints("nodes_truenodeids"),
        "false": ints("nodes_falsenodeids"), "true_leaf": ints("nodes_trueleafs"),
        "false_leaf": ints("nodes_falseleafs"), "members": _member_sets(attrs, modes),
        "split": [float(v) for v in np.asarray(attrs["nodes_splits"]).reshape(-1)],
        "missing": ints("nodes_missing_value_tracks_true") or [0] * len(modes),
    }  # fmt: skip
    weights = [float(v) for v in np.asarray(attrs["leaf_weights"]).reshape(-1)]
    targets, roots = ints("leaf_targetids"), ints("tree_roots")
    how = int(attrs.get("aggregate_function", 1))  # 0 average, 1 sum, 2 min, 3 max
    rows = data.reshape(data.shape[0], -1).to(torch.float64).cpu().tolist()
    start = {2: math.inf, 3: -math.inf}.get(how, 0.0)
    out = [[start] * int(attrs["n_targets"]) for _ in rows]
    for r, row in enumerate(rows):
        for root in roots:
            leaf = _leaf(row, root, tables)
            w, target = weights[leaf], targets[leaf]
            pick = {2: min, 3: max}.get(how)
            out[r][target] = pick(out[r][target], w) if pick else out[r][target] + w
    result = torch.tensor(out, dtype=torch.float64)
    if how == 0:
        result = result / len(roots)
    return result.to(data.dtype).to(data.device)
