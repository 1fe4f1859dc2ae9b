"""Unrolling a Loop whose iteration count is known, so that its body's nodes can be probed.

A tensor inside a Loop body cannot be marked as a graph output, so a fault there used to be
blamed on the Loop. For the inputs of one diagnosis the reference tells how many iterations
run; that many copies of the body then replace the Loop in the parent graph, iteration ``i``'s
nodes and tensors named ``{loop}/iteration_{i}/{name}`` (every iteration needs its own names,
and the name says which one went wrong). Each copy reads the previous one's loop-carried
values; ``iter_num`` becomes a constant; the Loop's outputs are the last iteration's carried
values and, for scan outputs, every iteration's value stacked on a new leading axis, as the
Loop stacks them. The body's initializers are added once, shared by all iterations.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx
from onnx import helper, numpy_helper

from onnx_bisect.graph.rename import fresh, rename_node, tensor_names

__all__ = ["UnrolledLoop", "loop_opset", "top_level_loops", "unroll_loops"]


@dataclass(frozen=True)
class UnrolledLoop:
    """One Loop replaced by ``iterations`` copies of its body."""

    node: str
    iterations: int
    nodes: int
    # Each iteration's condition output, in the unrolled graph (to count iterations with).
    conditions: tuple[str, ...]


def top_level_loops(model: onnx.ModelProto) -> dict[str, onnx.NodeProto]:
    """The Loop nodes of the main graph, by name."""
    return {n.name: n for n in model.graph.node if n.op_type == "Loop" and n.domain == ""}


def loop_opset(model: onnx.ModelProto) -> int:
    return next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)


def unroll_loops(
    model: onnx.ModelProto, iterations: Mapping[str, int]
) -> tuple[onnx.ModelProto, list[UnrolledLoop]]:
    """A copy of ``model`` with each Loop in ``iterations`` (name -> count) unrolled that many
    times. A Loop with scan outputs and no iteration is left whole: its empty outputs' shapes
    are not known. The caller's model is left alone."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    graph = out.graph
    names = _Names({n.name for n in graph.node}, tensor_names(graph))
    old_unsqueeze = loop_opset(model) < 13  # axes became an input in opset 13
    done: list[UnrolledLoop] = []
    new_nodes: list[onnx.NodeProto] = []
    for node in graph.node:
        count = iterations.get(node.name) if node.op_type == "Loop" and node.domain == "" else None
        body = next((a.g for a in node.attribute if a.name == "body"), None)
        scans = len(node.output) - (len(node.input) - 2)
        if count is None or body is None or (count == 0 and scans > 0):
            new_nodes.append(node)
            continue
        unrolled = _Unroller(node, body, names, old_unsqueeze).unroll(count)
        new_nodes += unrolled.nodes
        graph.initializer.extend(unrolled.initializers)
        done.append(UnrolledLoop(node.name, count, len(unrolled.nodes), unrolled.conditions))
    del graph.node[:]
    graph.node.extend(new_nodes)
    return out, done


@dataclass
class _Names:
    nodes: set[str]
    tensors: set[str]

    def node(self, name: str) -> str:
        name = fresh(name, self.nodes)
        self.nodes.add(name)
        return name

    def tensor(self, name: str) -> str:
        name = fresh(name, self.tensors)
        self.tensors.add(name)
        return name


@dataclass
class _Unrolled:
    nodes: list[onnx.NodeProto]
    initializers: list[onnx.TensorProto]
    conditions: tuple[str, ...]


class _Unroller:
    """The copies of one Loop's body, wired iteration to iteration."""

    def __init__(
        self, loop: onnx.NodeProto, body: onnx.GraphProto, names: _Names, old_unsqueeze: bool
    ) -> None:
        self.loop, self.body, self.names = loop, body, names
        self.old_unsqueeze = old_unsqueeze
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self.axes = ""

    def unroll(self, count: int) -> _Unrolled:
        loop, body = self.loop, self.body
        carried_n = len(loop.input) - 2
        shared = self._shared_initializers()
        cond = loop.input[1] if len(loop.input) > 1 and loop.input[1] else ""
        if not cond and body.input[1].name:
            cond = self._constant("cond_true", np.array(True))
        carried = list(loop.input[2:])
        scans: list[list[str]] = [[] for _ in range(len(body.output) - 1 - carried_n)]
        conditions = []
        for i in range(count):
            rename = dict(shared)
            prefix = f"{loop.name}/iteration_{i}/"
            rename[body.input[0].name] = self._constant(
                f"iteration_{i}/{body.input[0].name}", np.array(i, dtype=np.int64)
            )
            if cond:
                rename[body.input[1].name] = cond
            for vi, value in zip(body.input[2:], carried, strict=True):
                rename[vi.name] = value
            for n in body.node:
                for o in n.output:
                    if o:
                        rename[o] = self.names.tensor(prefix + o)
            for k, n in enumerate(body.node):
                copy = rename_node(n, rename)
                copy.name = self.names.node(prefix + (n.name or f"{n.op_type}_{k}"))
                self.nodes.append(copy)
            results = [rename.get(o.name, o.name) for o in body.output]
            cond = results[0]
            conditions.append(cond)
            carried = results[1 : 1 + carried_n]
            for j, value in enumerate(results[1 + carried_n :]):
                scans[j].append(value)
        outputs = list(loop.output)
        for value, name in zip(carried, outputs[:carried_n], strict=True):
            if name:
                self._add("Identity", [value], name)
        for values, name in zip(scans, outputs[carried_n:], strict=True):
            if name:
                self._stack(values, name)
        return _Unrolled(self.nodes, self.inits, tuple(conditions))

    def _shared_initializers(self) -> dict[str, str]:
        """The body's initializers, once for every iteration, renamed only on a clash."""
        rename = {}
        for t in self.body.initializer:
            copy = onnx.TensorProto()
            copy.CopyFrom(t)
            copy.name = self.names.tensor(
                t.name if t.name not in self.names.tensors else f"{self.loop.name}/{t.name}"
            )
            rename[t.name] = copy.name
            self.inits.append(copy)
        return rename

    def _constant(self, name: str, value: np.ndarray) -> str:
        tensor = numpy_helper.from_array(value, self.names.tensor(f"{self.loop.name}/{name}"))
        self.inits.append(tensor)
        return tensor.name

    def _add(self, op: str, inputs: list[str], output: str, **attrs: Any) -> None:
        name = self.names.node(f"{self.loop.name}/{op}_{output}")
        self.nodes.append(helper.make_node(op, inputs, [output], name=name, **attrs))

    def _stack(self, values: list[str], output: str) -> None:
        """``output`` = the values stacked on a new axis 0, as a Loop's scan output is."""
        lifted = []
        for value in values:
            one = self.names.tensor(f"{output}/{value}/unsqueezed")
            if self.old_unsqueeze:
                self._add("Unsqueeze", [value], one, axes=[0])
            else:
                self.axes = self.axes or self._constant("axes_0", np.array([0], dtype=np.int64))
                self._add("Unsqueeze", [value, self.axes], one)
            lifted.append(one)
        if len(lifted) == 1:
            self._add("Identity", lifted, output)
        else:
            self._add("Concat", lifted, output, axis=0)
