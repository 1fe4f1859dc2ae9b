"""Runs an ONNX graph node by node as torch operations, in topological order.

Eager by design: every tensor the search asks for exists as soon as its node has run, so
marking intermediates costs nothing and changes nothing (unlike a compiler, which fuses
across them). Values are dropped after their last consumer unless they were asked for, so
memory stays at what the live tensors need.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, cast

import numpy.typing as npt
import onnx
import torch
from onnx import numpy_helper

from onnx_bisect.backends.torch.context import (
    OpContext,
    TensorSequence,
    attributes,
    cpu_channels_last,
)
from onnx_bisect.backends.torch.ops import lookup
from onnx_bisect.backends.torch.ops.registry import OpFn, UnsupportedOperator
from onnx_bisect.backends.torch.rounding import Rounding
from onnx_bisect.backends.torch.stand_in import StandIn, stand_in
from onnx_bisect.errors import BackendError
from onnx_bisect.graph.weights import is_external, tensor_array

__all__ = ["Observer", "Program", "TranslationFailed", "WeightCache", "referenced_names"]


@dataclass(frozen=True)
class _Step:
    node: onnx.NodeProto
    fn: OpFn
    attrs: dict[str, Any]
    ctx: OpContext
    reads: frozenset[str]  # referenced_names(node), computed once
    # The floating dtype every floating operand is cast to first (a node kept in float32
    # under a float16 policy, and its readers back to the policy); None: as they come.
    cast: torch.dtype | None = None


# Sees a step's index, its operands and its results (``Program.run``'s ``observe``).
Observer = Callable[[int, Sequence["torch.Tensor | None"], Sequence["torch.Tensor | None"]], None]


class Program:
    """One graph, bound to a device and a floating-point policy, ready to run many times.

    ``outer`` is set for a subgraph: names it does not define are read from the caller's scope.
    """

    def __init__(
        self,
        graph: onnx.GraphProto,
        opsets: Mapping[str, int],
        device: torch.device,
        policy: torch.dtype | None,
        weights: WeightCache | None = None,
        rounding: Rounding | None = None,
        fallback: bool = False,
        float32_nodes: frozenset[str] = frozenset(),
    ) -> None:
        self.graph, self.opsets, self.device, self.policy = graph, dict(opsets), device, policy
        # Under a float16/bfloat16 policy, these nodes compute in float32 from operands cast
        # up, and every other node casts a float32 operand back down to the policy: what
        # autocast does for a module excluded from it (``FLOAT32_NODES``).
        low = policy in (torch.float16, torch.bfloat16)
        self.float32_nodes = float32_nodes if low else frozenset()
        self.rounding = rounding
        # ``fallback``: a node torch cannot compute is computed alone another way
        # (``stand_in.py``), recorded here by node name; without it, such a node fails the run.
        self.fallback = fallback
        self.stand_ins: dict[str, StandIn] = {}
        self._weights = weights if weights is not None else WeightCache()
        self._subprograms: dict[int, Program] = {}
        self._scope: dict[str, torch.Tensor | None] = {}
        self.inputs = [v.name for v in graph.input]
        self.outputs = [v.name for v in graph.output]
        self._declared = _declared_types(graph)
        base = OpContext(device, policy, 0, self._run_subgraph)
        lazy = _external_bytes(graph) > LAZY_EXTERNAL_BYTES
        self.constants: dict[str, torch.Tensor | _Lazy] = {
            t.name: _Lazy(t) if lazy and is_external(t) else self._weights.get(t, base)
            for t in graph.initializer
        }
        reads = [frozenset(referenced_names(node)) for node in graph.node]
        self.steps = [self._bind(graph.node[i], reads[i]) for i in _topological(graph, reads)]
        self._plans: dict[frozenset[str], dict[int, list[str]]] = {}  # last uses per `wanted`

    def _bind(self, node: onnx.NodeProto, reads: frozenset[str]) -> _Step:
        domain = "" if node.domain == "ai.onnx" else node.domain
        opset = self.opsets.get(domain)
        try:
            if opset is None:
                raise UnsupportedOperator(
                    f"node {node.name!r}: the torch backend does not support domain {domain!r}"
                )
            try:
                fn = lookup(node.op_type, opset, domain)
            except UnsupportedOperator as exc:
                raise UnsupportedOperator(f"node {node.name!r}: {exc}", node=node.name) from None
        except UnsupportedOperator as exc:
            if not self.fallback:
                raise
            why = str(exc).removeprefix(f"node {node.name!r}: ").split("; docs/")[0]
            fn = stand_in(node, self.opsets, why, self.stand_ins)
        types = tuple(self._declared.get(n, 0) for n in node.input)
        kept = node.name in self.float32_nodes
        policy = torch.float32 if kept else self.policy
        ctx = OpContext(
            self.device, policy, opset or 0, self._run_subgraph, len(node.output), types
        )
        cast = policy if self.float32_nodes else None
        return _Step(node, fn, attributes(node), ctx, reads, cast)

    def tensors(self, arrays: Mapping[str, npt.NDArray[Any]]) -> dict[str, torch.Tensor | None]:
        """Any of the graph's values as tensors on the device, under the policy (values to
        pin with ``run(known=)``)."""
        base = OpContext(self.device, self.policy, 0, self._run_subgraph)
        return {n: _value(base, a) for n, a in arrays.items()}

    def feed(self, arrays: Mapping[str, npt.NDArray[Any]]) -> dict[str, torch.Tensor]:
        """The graph's inputs as tensors on the device, under the policy. An input that is
        also an initializer (IR < 4) keeps its stored value when not fed."""
        base = OpContext(self.device, self.policy, 0, self._run_subgraph)
        missing = [n for n in self.inputs if n not in arrays and n not in self.constants]
        if missing:
            raise BackendError(f"no value fed for graph input(s) {', '.join(missing[:5])}")
        # An empty optional input is fed as None, which ops read as an absent value.
        return {n: cast(torch.Tensor, _value(base, arrays[n])) for n in self.inputs if n in arrays}

    def run(
        self,
        feeds: Mapping[str, torch.Tensor | None],
        wanted: Sequence[str] | None = None,
        outer: Mapping[str, torch.Tensor | None] | None = None,
        known: Mapping[str, torch.Tensor | None] | None = None,
        emit: Callable[[str, torch.Tensor | None], None] | None = None,
        observe: Observer | None = None,
    ) -> dict[str, torch.Tensor | None]:
        """The ``wanted`` tensors (default: the graph's outputs) computed from ``feeds``.

        ``known`` holds values computed before (a compiled run's folded constants): a node
        whose outputs are all known is not run. With ``emit``, each wanted tensor goes to it
        as soon as it is computed and is then freed like any other (nothing is returned): a
        run over every probe holds what is live, not what was asked for. ``observe`` sees each
        step's index, operands and results as they are computed (the oracle's isolated
        precision floors recompute each node from them)."""
        wanted = list(self.outputs if wanted is None else wanted)
        env: dict[str, Any] = dict(outer or {})
        env.update(self.constants)
        env.update(feeds)
        env.update(known or {})
        keep = frozenset(wanted) if emit is None else frozenset()
        emitting = frozenset(wanted) if emit is not None else frozenset()
        send = emit or _drop
        last = self._plans.get(keep)
        if last is None:
            last = self._plans[keep] = _last_uses(self.steps, keep)
        try:
            for i, step in enumerate(self.steps):
                if known and all(n in known for n in step.node.output if n):
                    for name in step.node.output:
                        if name in emitting:  # a pinned value is still a value computed
                            send(name, env[name])
                    continue
                self._scope = env
                operands = [self._operand(env[n], step.ctx) if n else None for n in step.node.input]
                if step.cast is not None:
                    operands = [_cast(o, step.cast) for o in operands]
                if self.rounding is not None:
                    operands = self.rounding.operands(step.node.op_type, operands)
                results = self._call(i, step, operands)
                if self.rounding is not None:
                    results = self.rounding.results(step.node.op_type, results)
                if observe is not None:
                    observe(i, operands, results)
                for name, value in zip(step.node.output, results, strict=False):
                    if name:
                        env[name] = value
                        if name in emitting:
                            send(name, value)
                for name in last.get(i, ()):
                    env.pop(name, None)
        finally:
            # The scope holds every value still alive; kept past the run, it would hold the
            # outputs through the caller's next run (the program is in a reference cycle
            # with its ops' contexts, so only the cyclic collector would free it).
            self._scope = {}
        if emit is not None:
            return {}
        missing = [n for n in wanted if n not in env]
        if missing:
            raise BackendError(f"the graph does not compute {', '.join(missing[:5])}")
        base = OpContext(self.device, self.policy, 0, self._run_subgraph)
        return {n: self._operand(env[n], base) for n in wanted}

    def _call(
        self, index: int, step: _Step, operands: list[torch.Tensor | None]
    ) -> Sequence[torch.Tensor | None]:
        try:
            return _call(step, operands)
        except TranslationFailed as exc:
            if not self.fallback:
                raise
            # This model's use of the op is beyond our translation: the stand-in from now on.
            fn = stand_in(step.node, self.opsets, exc.why, self.stand_ins)
            step = self.steps[index] = replace(step, fn=fn)
            return _call(step, operands)

    def _operand(self, value: Any, ctx: OpContext) -> torch.Tensor | None:
        # A lazy weight is read and converted for this one use, then dropped with the
        # operands: the run holds one such weight at a time, not all of them.
        return self._weights.get(value.proto, ctx) if isinstance(value, _Lazy) else value

    def values(self) -> list[str]:
        """Every value the graph computes, in order."""
        return [n for step in self.steps for n in step.node.output if n]

    def _run_subgraph(
        self, graph: onnx.GraphProto, inputs: Sequence[torch.Tensor | None]
    ) -> list[torch.Tensor | None]:
        program = self._subprograms.get(id(graph))
        if program is None:
            program = Program(
                graph,
                self.opsets,
                self.device,
                self.policy,
                self._weights,
                self.rounding,
                fallback=self.fallback,
            )
            program.stand_ins = self.stand_ins  # one record for the graph and its subgraphs
            self._subprograms[id(graph)] = program
        scope = self._scope
        feeds = dict(zip(program.inputs, inputs, strict=False))
        out = program.run(feeds, outer=scope)
        self._scope = scope  # the subgraph's run replaced it; the caller's node continues
        return [out[n] for n in program.outputs]


# Above this many bytes of external weights a program converts each external weight when a
# node reads it, not once up front: the float64 oracle on a model of several GB would
# otherwise hold every weight twice over (float64), and it runs each model only a few times.
LAZY_EXTERNAL_BYTES = 1 << 30


@dataclass(frozen=True)
class _Lazy:
    """An external weight not yet read (``LAZY_EXTERNAL_BYTES``)."""

    proto: onnx.TensorProto


def _external_bytes(graph: onnx.GraphProto) -> int:
    total = 0
    for t in graph.initializer:
        if is_external(t):
            length = next((int(e.value) for e in t.external_data if e.key == "length"), None)
            if length is None:
                count = 1
                for d in t.dims:
                    count *= d
                length = count * onnx.helper.tensor_dtype_to_np_dtype(t.data_type).itemsize
            total += length
    return total


class WeightCache:
    """Initializers already converted to tensors, reused by the next model that has the same
    bytes: the search runs many cuts of one model, and converting YOLOv8n's weights costs more
    than running it. The bytes are compared in full (a fault planted in one weight must not
    hit the cache); weights above ``limit`` bytes in all are not kept."""

    def __init__(self, limit: int = 256 << 20) -> None:
        self._kept: dict[tuple[Any, ...], tuple[bytes, torch.Tensor]] = {}
        self._bytes, self._limit = 0, limit

    def get(self, proto: onnx.TensorProto, ctx: OpContext) -> torch.Tensor:
        raw = proto.raw_data if proto.HasField("raw_data") else None
        if raw is None or is_external(proto):
            return cpu_channels_last(ctx.tensor(tensor_array(proto)))
        key = (proto.name, proto.data_type, tuple(proto.dims), ctx.device, ctx.policy)
        hit = self._kept.get(key)
        if hit is not None and hit[0] == raw:
            return hit[1]
        tensor = cpu_channels_last(ctx.tensor(numpy_helper.to_array(proto)))
        if self._bytes + len(raw) <= self._limit:
            self._kept[key] = (raw, tensor)
            self._bytes += len(raw)
        return tensor


def _value(ctx: OpContext, fed: Any) -> torch.Tensor | None:
    """A fed array as a tensor; a list (a sequence input) as a sequence, None (an empty
    optional) as None."""
    if fed is None:
        return None
    if isinstance(fed, list):
        return TensorSequence(ctx.tensor(a) for a in fed)  # type: ignore[return-value]
    return ctx.tensor(fed)


def _declared_types(graph: onnx.GraphProto) -> dict[str, int]:
    """The element types the graph states (inputs, initializers, value_info), by name."""
    out = {t.name: t.data_type for t in graph.initializer}
    for v in [*graph.input, *graph.value_info, *graph.output]:
        if v.type.HasField("tensor_type") and v.type.tensor_type.elem_type:
            out[v.name] = v.type.tensor_type.elem_type
    return out


def _cast(value: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """A floating tensor in ``dtype``; others (integers, sequences, absent) as they are."""
    if isinstance(value, torch.Tensor) and value.is_floating_point() and value.dtype != dtype:
        return value.to(dtype)
    return value


def _drop(name: str, value: torch.Tensor | None) -> None:
    pass


class TranslationFailed(BackendError):
    """Our translation of a node into torch calls raised: a limit of this backend's op, not of
    the model or of torch (``torch.stft`` itself may be fine where our STFT is not)."""

    def __init__(self, node: onnx.NodeProto, text: str) -> None:
        self.why = f"the torch backend's translation of {node.op_type} failed: {text}"
        super().__init__(f"node {node.name!r} ({node.op_type}): {self.why}", node=node.name)


def _call(step: _Step, inputs: list[torch.Tensor | None]) -> Sequence[torch.Tensor | None]:
    node = step.node
    try:
        result = step.fn(step.ctx, inputs, step.attrs)
    except BackendError:
        raise
    except Exception as exc:
        # The node's name is what the search and the user need; the exception says why.
        text = " ".join(str(exc).split())[:300] or type(exc).__name__
        raise TranslationFailed(node, text) from exc
    return (result,) if isinstance(result, torch.Tensor) else tuple(result)


def _last_uses(steps: Sequence[_Step], keep: frozenset[str]) -> dict[int, list[str]]:
    """For each step, the values no later step reads (and nobody asked for): free them there."""
    last: dict[str, int] = {}
    for i, step in enumerate(steps):
        for name in step.reads:
            last[name] = i
        for name in step.node.output:
            last.setdefault(name, i)  # an output nobody reads is freed where it is made
    out: dict[int, list[str]] = {}
    for name, i in last.items():
        if name and name not in keep:
            out.setdefault(i, []).append(name)
    return out


def referenced_names(node: onnx.NodeProto) -> set[str]:
    """Inputs of ``node`` plus the outer-scope names its subgraphs read."""
    names = {n for n in node.input if n}
    for attr in node.attribute:
        for graph in [attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs):
            defined = {v.name for v in graph.input} | {t.name for t in graph.initializer}
            for inner in graph.node:
                names |= referenced_names(inner) - defined
                defined |= set(inner.output)
    return names


def _topological(graph: onnx.GraphProto, reads: Sequence[frozenset[str]]) -> Iterator[int]:
    """Node indices in an order that runs (``reads[i]``: what node i reads); ONNX requires the
    stored order to be one, but not every exporter complies."""
    ready = {v.name for v in graph.input} | {t.name for t in graph.initializer} | {""}
    produced = {o for n in graph.node for o in n.output}
    pending = list(range(len(graph.node)))
    while pending:
        waiting = []
        for i in pending:
            # Names from an outer scope are never produced here: only wait for local producers.
            if all(n in ready or n not in produced for n in reads[i]):
                ready.update(graph.node[i].output)
                yield i
            else:
                waiting.append(i)
        if len(waiting) == len(pending):
            raise BackendError(f"graph {graph.name!r} has a cycle or reads an undefined value")
        pending = waiting
