"""Which ONNX tensor stands for a module's output (pure): every node's module path from
``node_source`` (the dynamo exporter's scopes, or a TorchScript scoped name); a module M's
output is the last tensor, in topological order, produced by the nodes whose module path is M
or under M, with the same shape as the torch output."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy.typing as npt

from onnx_bisect.graph.source import node_source
from onnx_bisect.graph.view import LoadedModel, NodeInfo

__all__ = ["Mapped", "candidates", "map_modules", "module_paths", "scope_nodes", "scopes"]

# How many of a scope's last tensors are probed for one with the torch output's shape: the
# last is nearly always it; a trailing Reshape or Cast in the scope may push it back.
CANDIDATES = 3


@dataclass(frozen=True)
class Mapped:
    module: str
    tensor: str
    node: NodeInfo


def module_paths(loaded: LoadedModel) -> dict[str, str]:
    """Each node's module path, for the nodes whose model says one."""
    protos = loaded.node_protos
    found: dict[str, str] = {}
    for n in loaded.nodes:
        src = node_source(protos[n.name])
        if src is not None:
            found[n.name] = src.module
    return found


def scopes(loaded: LoadedModel, paths: Mapping[str, str]) -> dict[str, list[NodeInfo]]:
    """Per module path, the nodes whose module path is it or under it, in topological order:
    each node listed under every prefix of its path (one pass, not one per module)."""
    out: dict[str, list[NodeInfo]] = {}
    for n in loaded.nodes:
        path = paths.get(n.name)
        if path is None:
            continue
        parts = path.split(".") if path else []
        for k in range(len(parts) + 1):
            out.setdefault(".".join(parts[:k]), []).append(n)
    return out


def scope_nodes(loaded: LoadedModel, paths: Mapping[str, str], module: str) -> list[NodeInfo]:
    """The nodes whose module path is ``module`` or under it, in topological order; the top
    module's are every node (a node with no module path is the top module's own)."""
    return list(loaded.nodes) if not module else scopes(loaded, paths).get(module, [])


def candidates(
    loaded: LoadedModel, paths: Mapping[str, str], modules: Sequence[str]
) -> dict[str, list[str]]:
    """Per module, its scope's last tensors, last first: those to mark on the target."""
    by_scope = scopes(loaded, paths)
    out: dict[str, list[str]] = {}
    for m in modules:
        if not m:  # the top module: its first output is the model's
            out[m] = list(loaded.outputs[:1])
            continue
        nodes = by_scope.get(m, [])
        tensors = [t for n in reversed(nodes[-CANDIDATES:]) for t in n.outputs if t]
        if tensors:
            out[m] = tensors[:CANDIDATES]
    return out


def map_modules(
    loaded: LoadedModel,
    found: Mapping[str, list[str]],
    torch_outputs: Mapping[str, npt.NDArray[Any]],
    values: Mapping[str, npt.NDArray[Any]],
) -> list[Mapped]:
    """Each module's tensor: the first candidate (last in the graph) whose value on the
    target has the torch output's shape; in topological order of those tensors, a module
    before its parent where both map to one tensor (the innermost is named)."""
    producer = loaded.producer
    mapped: list[Mapped] = []
    for module, tensors in found.items():
        out = torch_outputs.get(module)
        if out is None:
            continue
        for t in tensors:
            v = values.get(t)
            if v is not None and tuple(v.shape) == tuple(out.shape):
                mapped.append(Mapped(module, t, producer[t]))
                break
    return sorted(mapped, key=lambda m: (m.node.index, -_depth(m.module), m.module))


def _depth(module: str) -> int:
    """How deep a module path is: the top module ("") above every named one."""
    return module.count(".") if module else -1
