"""Names for nodes and tensors moved out of a subgraph into its parent graph.

Shared by If inlining and Loop unrolling: a fresh name where one clashes, the names a graph
already uses, and the renaming of outer-scope references inside nested subgraphs (a body node's
own If or Loop may read a tensor of the body by name, which moving the body renames).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import onnx

__all__ = ["fresh", "rename_node", "tensor_names"]


def fresh(name: str, taken: set[str]) -> str:
    """``name``, or ``name_1``, ``name_2``… whichever ``taken`` does not hold yet."""
    if name not in taken:
        return name
    i = 1
    while f"{name}_{i}" in taken:
        i += 1
    return f"{name}_{i}"


def tensor_names(graph: onnx.GraphProto) -> set[str]:
    """Every tensor name the graph defines at its top level."""
    names = {i.name for i in graph.input} | {t.name for t in graph.initializer}
    names |= {o for n in graph.node for o in n.output}
    return names


def rename_node(node: onnx.NodeProto, rename: Mapping[str, str]) -> onnx.NodeProto:
    """A copy of ``node`` reading and writing the renamed tensors, its subgraphs' references
    to outer tensors included."""
    copy = onnx.NodeProto()
    copy.CopyFrom(node)
    for i, t in enumerate(copy.input):
        copy.input[i] = rename.get(t, t)
    for i, t in enumerate(copy.output):
        copy.output[i] = rename.get(t, t)
    for attr in copy.attribute:
        for sub in _subgraphs(attr):
            _rename_outer(sub, rename)
    return copy


def _subgraphs(attr: onnx.AttributeProto) -> Iterable[onnx.GraphProto]:
    if attr.type == onnx.AttributeProto.GRAPH:
        yield attr.g
    yield from attr.graphs


def _rename_outer(graph: onnx.GraphProto, rename: Mapping[str, str]) -> None:
    """Rename, in place, the references of ``graph`` to tensors it does not define itself."""
    local = tensor_names(graph)
    # A name the subgraph defines shadows the outer one from there on.
    inner = {k: v for k, v in rename.items() if k not in local}
    if not inner:
        return
    for node in graph.node:
        for i, t in enumerate(node.input):
            node.input[i] = inner.get(t, t)
        for attr in node.attribute:
            for sub in _subgraphs(attr):
                _rename_outer(sub, inner)
    for out in graph.output:
        out.name = inner.get(out.name, out.name)
