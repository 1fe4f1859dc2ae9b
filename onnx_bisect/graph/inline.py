"""Inlining the branch an If takes, so that its nodes can be probed, isolated and blamed.

A tensor inside an If branch cannot be marked as a graph output, so a fault there used to be
blamed on the If. For the inputs of one diagnosis the reference tells which branch runs; that
branch's nodes then replace the If in the parent graph. Node names stay as they are, unless
one clashes with a name already in the graph: then it gets ``{if}/{then_branch|else_branch}/``
in front, as Model Explorer's ONNX adapter names branch nodes. Tensors produced inside the
branch are renamed the same way on a clash; the branch's outputs take the If's output names,
so everything downstream reads the same tensors as before.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import onnx
from onnx import helper

from onnx_bisect.graph.rename import fresh, rename_node, tensor_names

__all__ = ["InlinedIf", "inline_branches", "top_level_ifs"]


@dataclass(frozen=True)
class InlinedIf:
    """One If replaced by its taken branch: which branch, and how many nodes it brought."""

    node: str
    branch: str  # "then_branch" or "else_branch"
    nodes: int


def top_level_ifs(model: onnx.ModelProto) -> dict[str, str]:
    """The If nodes of the main graph, by name, with their condition tensor."""
    return {n.name: n.input[0] for n in model.graph.node if n.op_type == "If" and n.domain == ""}


def inline_branches(
    model: onnx.ModelProto, taken: Mapping[str, bool]
) -> tuple[onnx.ModelProto, list[InlinedIf]]:
    """A copy of ``model`` with each If in ``taken`` (name -> condition value) replaced by the
    branch that condition selects. The caller's model is left alone."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    graph = out.graph
    node_names = {n.name for n in graph.node}
    tensors = tensor_names(graph)
    inlined: list[InlinedIf] = []
    new_nodes: list[onnx.NodeProto] = []
    for node in graph.node:
        if node.op_type != "If" or node.domain != "" or node.name not in taken:
            new_nodes.append(node)
            continue
        branch = "then_branch" if taken[node.name] else "else_branch"
        body = next(a.g for a in node.attribute if a.name == branch)
        nodes, inits = _inline(node, branch, body, node_names, tensors)
        new_nodes += nodes
        graph.initializer.extend(inits)
        inlined.append(InlinedIf(node.name, branch, len(nodes)))
    del graph.node[:]
    graph.node.extend(new_nodes)
    return out, inlined


def _inline(
    if_node: onnx.NodeProto,
    branch: str,
    body: onnx.GraphProto,
    node_names: set[str],
    tensors: set[str],
) -> tuple[list[onnx.NodeProto], list[onnx.TensorProto]]:
    """The branch's nodes and initializers, renamed to fit the parent graph."""
    prefix = f"{if_node.name}/{branch}/"
    rename: dict[str, str] = {}
    produced = [t.name for t in body.initializer] + [o for n in body.node for o in n.output if o]
    outputs = dict(zip((o.name for o in body.output), if_node.output, strict=True))
    for name in produced:
        if name in outputs and outputs[name]:
            rename[name] = outputs[name]  # downstream reads the If's output names
        elif name in tensors:
            rename[name] = fresh(prefix + name, tensors)
        tensors.add(rename.get(name, name))
    nodes: list[onnx.NodeProto] = []
    for n in body.node:
        copy = rename_node(n, rename)
        base = copy.name or f"{copy.op_type}_{len(nodes)}"
        copy.name = base if base not in node_names else fresh(prefix + base, node_names)
        node_names.add(copy.name)
        nodes.append(copy)
    inits = []
    for t in body.initializer:
        copy = onnx.TensorProto()
        copy.CopyFrom(t)
        copy.name = rename.get(t.name, t.name)
        inits.append(copy)
    # A branch output that is not computed in the branch (an outer tensor, or an input passed
    # through) still has to appear under the If's output name.
    for body_out, if_out in outputs.items():
        if if_out and body_out not in rename:
            name = fresh(f"{prefix}Identity_{if_out}", node_names)
            node_names.add(name)
            nodes.append(helper.make_node("Identity", [body_out], [if_out], name=name))
    return nodes, inits
