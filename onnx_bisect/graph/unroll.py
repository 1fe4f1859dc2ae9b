"""Unrolling a Loop or a Scan whose iteration count is known, so that its body's nodes can be
probed.

A tensor inside a Loop body cannot be marked as a graph output, so a fault there used to be
blamed on the Loop. For the inputs of one diagnosis the reference tells how many iterations
run; that many copies of the body then replace the Loop in the parent graph, iteration ``i``'s
nodes and tensors named ``{loop}/iteration_{i}/{name}`` (every iteration needs its own names,
and the name says which one went wrong). Each copy reads the previous one's loop-carried
values; ``iter_num`` becomes a constant; the Loop's outputs are the last iteration's carried
values and, for scan outputs, every iteration's value stacked on a new leading axis, as the
Loop stacks them. A Scan's copies read their slice of each scan input through a Gather at
the iteration's index (counted from the end for a reversed input), and its scan outputs are
stacked on their axes, in their directions. The body's initializers are added once, shared by
all iterations.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx
from onnx import helper, numpy_helper

from onnx_bisect.graph.rename import fresh, rename_node, tensor_names

__all__ = [
    "ScanPlan",
    "UnrolledLoop",
    "loop_opset",
    "scan_plan",
    "top_level_loops",
    "top_level_scans",
    "unroll_loops",
    "unroll_scans",
]


@dataclass(frozen=True)
class UnrolledLoop:
    """One Loop replaced by ``iterations`` copies of its body."""

    node: str
    iterations: int
    nodes: int
    # Each iteration's condition output, in the unrolled graph (to count iterations with).
    conditions: tuple[str, ...]


@dataclass(frozen=True)
class ScanPlan:
    """How one Scan runs for these inputs: its iteration count and its axes, made
    non-negative against the ranks of the actual tensors."""

    iterations: int
    inputs: int  # num_scan_inputs
    input_axes: tuple[int, ...]
    input_reversed: tuple[bool, ...]
    output_axes: tuple[int, ...]
    output_reversed: tuple[bool, ...]


def top_level_loops(model: onnx.ModelProto) -> dict[str, onnx.NodeProto]:
    """The Loop nodes of the main graph, by name."""
    return {n.name: n for n in model.graph.node if n.op_type == "Loop" and n.domain == ""}


def top_level_scans(model: onnx.ModelProto) -> dict[str, onnx.NodeProto]:
    """The Scan nodes of the main graph (opset 9 on: Scan 8 has batch semantics), by name."""
    if loop_opset(model) < 9:
        return {}
    return {n.name: n for n in model.graph.node if n.op_type == "Scan" and n.domain == ""}


def scan_plan(
    scan: onnx.NodeProto, input_ranks: Sequence[int], output_ranks: Sequence[int], length: int
) -> ScanPlan:
    """``scan``'s plan, given the ranks of its scan inputs and scan outputs and the length of
    its sequence axis."""
    attrs = {a.name: helper.get_attribute_value(a) for a in scan.attribute}
    m = int(attrs["num_scan_inputs"])
    k = len(output_ranks)

    def listed(name: str, count: int) -> list[int]:
        return [int(v) for v in attrs.get(name, [0] * count)]

    in_axes = [a % r for a, r in zip(listed("scan_input_axes", m), input_ranks, strict=True)]
    out_axes = [a % r for a, r in zip(listed("scan_output_axes", k), output_ranks, strict=True)]
    return ScanPlan(
        iterations=length,
        inputs=m,
        input_axes=tuple(in_axes),
        input_reversed=tuple(bool(d) for d in listed("scan_input_directions", m)),
        output_axes=tuple(out_axes),
        output_reversed=tuple(bool(d) for d in listed("scan_output_directions", k)),
    )


def loop_opset(model: onnx.ModelProto) -> int:
    return next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)


def unroll_loops(
    model: onnx.ModelProto, iterations: Mapping[str, int]
) -> tuple[onnx.ModelProto, list[UnrolledLoop]]:
    """A copy of ``model`` with each Loop in ``iterations`` (name -> count) unrolled that many
    times. A Loop with scan outputs and no iteration is left whole: its empty outputs' shapes
    are not known. The caller's model is left alone."""

    def unroll(node: onnx.NodeProto, body: onnx.GraphProto, names: _Names, old: bool) -> _Done:
        count = iterations.get(node.name)
        scans = len(node.output) - (len(node.input) - 2)
        if count is None or (count == 0 and scans > 0):
            return None
        return count, _LoopUnroller(node, body, names, old).unroll(count)

    return _unrolled(model, "Loop", unroll)


def unroll_scans(
    model: onnx.ModelProto, plans: Mapping[str, ScanPlan]
) -> tuple[onnx.ModelProto, list[UnrolledLoop]]:
    """A copy of ``model`` with each Scan in ``plans`` unrolled as its plan says; a Scan of
    no iteration is left whole."""

    def unroll(node: onnx.NodeProto, body: onnx.GraphProto, names: _Names, old: bool) -> _Done:
        plan = plans.get(node.name)
        if plan is None or plan.iterations == 0:
            return None
        return plan.iterations, _ScanUnroller(node, body, names, old).unroll(plan)

    return _unrolled(model, "Scan", unroll)


def _unrolled(
    model: onnx.ModelProto,
    op: str,
    unroll: Callable[[onnx.NodeProto, onnx.GraphProto, _Names, bool], _Done],
) -> tuple[onnx.ModelProto, list[UnrolledLoop]]:
    """A copy of ``model`` with each ``op`` node that ``unroll`` unrolls replaced by the copies
    of its body it returns (with the iteration count); the others are kept."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    graph = out.graph
    names = _Names({n.name for n in graph.node}, tensor_names(graph))
    old_unsqueeze = loop_opset(model) < 13  # axes became an input in opset 13
    done: list[UnrolledLoop] = []
    new_nodes: list[onnx.NodeProto] = []
    for node in graph.node:
        body = next((a.g for a in node.attribute if a.name == "body"), None)
        mine = node.op_type == op and node.domain == ""
        result = unroll(node, body, names, old_unsqueeze) if mine and body is not None else None
        if result is None:
            new_nodes.append(node)
            continue
        count, unrolled = result
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


# An unrolled node's iteration count and body copies, or None to keep the node whole.
_Done = tuple[int, _Unrolled] | None


class _Unroller:
    """What unrolling a Loop and a Scan share: the body's initializers once, constants, added
    nodes, one iteration's copy of the body, and the stacking of scan outputs."""

    def __init__(
        self, node: onnx.NodeProto, body: onnx.GraphProto, names: _Names, old_unsqueeze: bool
    ) -> None:
        self.node, self.body, self.names = node, body, names
        self.old_unsqueeze = old_unsqueeze
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self.shared = self._shared_initializers()
        self.axes: dict[int, str] = {}

    def _iteration(self, i: int, inputs: Mapping[str, str]) -> list[str]:
        """Iteration ``i``'s copy of the body, its inputs bound to ``inputs`` (body input name
        -> tensor); the tensors its outputs end up in."""
        rename = {**self.shared, **inputs}
        prefix = f"{self.node.name}/iteration_{i}/"
        for n in self.body.node:
            for o in n.output:
                if o:
                    rename[o] = self.names.tensor(prefix + o)
        for k, n in enumerate(self.body.node):
            copy = rename_node(n, rename)
            copy.name = self.names.node(prefix + (n.name or f"{n.op_type}_{k}"))
            self.nodes.append(copy)
        return [rename.get(o.name, o.name) for o in self.body.output]

    def _shared_initializers(self) -> dict[str, str]:
        """The body's initializers, once for every iteration, renamed only on a clash."""
        rename = {}
        for t in self.body.initializer:
            copy = onnx.TensorProto()
            copy.CopyFrom(t)
            copy.name = self.names.tensor(
                t.name if t.name not in self.names.tensors else f"{self.node.name}/{t.name}"
            )
            rename[t.name] = copy.name
            self.inits.append(copy)
        return rename

    def _constant(self, name: str, value: np.ndarray) -> str:
        tensor = numpy_helper.from_array(value, self.names.tensor(f"{self.node.name}/{name}"))
        self.inits.append(tensor)
        return tensor.name

    def _add(self, op: str, inputs: list[str], output: str, **attrs: Any) -> None:
        name = self.names.node(f"{self.node.name}/{op}_{output}")
        self.nodes.append(helper.make_node(op, inputs, [output], name=name, **attrs))

    def _passed_out(self, values: Sequence[str], outputs: Sequence[str]) -> None:
        for value, name in zip(values, outputs, strict=True):
            if name:
                self._add("Identity", [value], name)

    def _stack(self, values: list[str], output: str, axis: int = 0) -> None:
        """``output`` = the values stacked on a new ``axis``, as scan outputs are."""
        lifted = []
        for value in values:
            one = self.names.tensor(f"{output}/{value}/unsqueezed")
            if self.old_unsqueeze:
                self._add("Unsqueeze", [value], one, axes=[axis])
            else:
                if axis not in self.axes:
                    self.axes[axis] = self._constant(
                        f"axes_{axis}", np.array([axis], dtype=np.int64)
                    )
                self._add("Unsqueeze", [value, self.axes[axis]], one)
            lifted.append(one)
        if len(lifted) == 1:
            self._add("Identity", lifted, output)
        else:
            self._add("Concat", lifted, output, axis=axis)


class _LoopUnroller(_Unroller):
    """A Loop's body copies: each reads the previous one's condition and carried values;
    ``iter_num`` is a constant."""

    def unroll(self, count: int) -> _Unrolled:
        loop, body = self.node, self.body
        carried_n = len(loop.input) - 2
        cond = loop.input[1] if len(loop.input) > 1 and loop.input[1] else ""
        if not cond:
            cond = self._constant("cond_true", np.array(True))
        carried = list(loop.input[2:])
        scans: list[list[str]] = [[] for _ in range(len(body.output) - 1 - carried_n)]
        conditions = []
        for i in range(count):
            iter_num = body.input[0].name
            bound = {
                iter_num: self._constant(f"iteration_{i}/{iter_num}", np.array(i, np.int64)),
                body.input[1].name: cond,
            }
            bound.update(zip((v.name for v in body.input[2:]), carried, strict=True))
            results = self._iteration(i, bound)
            cond = results[0]
            conditions.append(cond)
            carried = results[1 : 1 + carried_n]
            for j, value in enumerate(results[1 + carried_n :]):
                scans[j].append(value)
        self._passed_out(carried, list(loop.output[:carried_n]))
        for values, name in zip(scans, loop.output[carried_n:], strict=True):
            if name:
                self._stack(values, name)
        return _Unrolled(self.nodes, self.inits, tuple(conditions))


class _ScanUnroller(_Unroller):
    """A Scan's body copies: each reads the previous one's state and its slice of every scan
    input (a Gather at its index, in the input's direction)."""

    def unroll(self, plan: ScanPlan) -> _Unrolled:
        scan, body = self.node, self.body
        m = plan.inputs
        n = len(scan.input) - m
        state = list(scan.input[:n])
        outs: list[list[str]] = [[] for _ in range(len(body.output) - n)]
        for i in range(plan.iterations):
            bound = dict(zip((v.name for v in body.input[:n]), state, strict=True))
            for j, (source, vi) in enumerate(zip(scan.input[n:], body.input[n:], strict=True)):
                at = plan.iterations - 1 - i if plan.input_reversed[j] else i
                index = self._constant(f"iteration_{i}/index_{j}", np.array(at, np.int64))
                piece = self.names.tensor(f"{scan.name}/iteration_{i}/{vi.name}")
                self._add("Gather", [source, index], piece, axis=plan.input_axes[j])
                bound[vi.name] = piece
            results = self._iteration(i, bound)
            state = results[:n]
            for j, value in enumerate(results[n:]):
                outs[j].append(value)
        self._passed_out(state, list(scan.output[:n]))
        for j, (values, name) in enumerate(zip(outs, scan.output[n:], strict=True)):
            if name:
                ordered = values[::-1] if plan.output_reversed[j] else values
                self._stack(ordered, name, plan.output_axes[j])
        return _Unrolled(self.nodes, self.inits, ())
