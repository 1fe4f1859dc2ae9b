"""The loaded model as the search sees it: nodes in topological order, tensors, adjacency.

All derived facts (producers, consumers, constants, dtypes) are cached on ``LoadedModel``: the
search asks for them once per tensor, and rebuilding them each time made planning quadratic.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt
import onnx
from onnx import helper

__all__ = [
    "LoadedModel",
    "METADATA_OPS",
    "NodeInfo",
    "NotProbed",
    "TensorMeta",
    "Units",
    "complete_type",
    "declared_types",
    "has_type",
]


class Units(Protocol):
    """How a model's tensors read in real units: a quantized model's integers stand for
    ``(q - zero_point) * scale`` (``engine/quant/pairing.py``)."""

    def real(
        self, tensor: str, value: npt.NDArray[Any] | None, like: np.dtype[Any]
    ) -> npt.NDArray[Any] | None: ...

    def fed(self, tensor: str, value: npt.NDArray[Any]) -> npt.NDArray[Any]: ...

    def dtype(self, tensor: str) -> np.dtype[Any] | None: ...


@dataclass(frozen=True)
class NodeInfo:
    index: int
    name: str
    op_type: str
    domain: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    # Outer-scope tensors read from inside If/Loop/Scan bodies.
    implicit_inputs: tuple[str, ...] = ()


@dataclass(frozen=True)
class NotProbed:
    tensor: str
    node: str
    reason: str


@dataclass(frozen=True)
class TensorMeta:
    dtype: np.dtype[np.generic]
    shape: tuple[int, ...]


@dataclass(frozen=True)
class LoadedModel:
    """A private, topologically sorted, shape-inferred copy of the user's model."""

    model: onnx.ModelProto
    path: Path | None
    nodes: tuple[NodeInfo, ...]
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    initializers: frozenset[str]
    not_probed: tuple[NotProbed, ...]
    notes: tuple[str, ...]
    # Where the model's integers stand for real values (a quantized target model).
    units: Units | None = None

    @cached_property
    def probes(self) -> tuple[str, ...]:
        """Every top-level node output, in topological order."""
        return tuple(o for n in self.nodes for o in n.outputs)

    @cached_property
    def producer(self) -> dict[str, NodeInfo]:
        # Cached: the search asks it once per tensor, and rebuilding it each time made
        # isolation and window planning quadratic in the node count.
        return {o: n for n in self.nodes for o in n.outputs}

    @cached_property
    def readers(self) -> dict[str, tuple[NodeInfo, ...]]:
        """Tensor -> the nodes reading it, in graph order, each once (a ``Mul(x, x)`` is one
        reader of ``x``)."""
        out: dict[str, list[NodeInfo]] = {}
        for n in self.nodes:
            for i in dict.fromkeys(n.inputs):
                out.setdefault(i, []).append(n)
        return {t: tuple(ns) for t, ns in out.items()}

    @cached_property
    def constants(self) -> tuple[str, ...]:
        """Tensors computed from initializers alone (an optimizer that folds BatchNorm into a
        Conv at run time leaves such arithmetic): they are the same on every input."""
        known = set(self.initializers)
        found: list[str] = []
        for n in self.nodes:
            if n.op_type in _NONDETERMINISTIC or n.implicit_inputs:
                continue
            if all(t == "" or t in known for t in n.inputs):
                known.update(n.outputs)
                found += [o for o in n.outputs if o]
        return tuple(found)

    @cached_property
    def constant_nodes(self) -> frozenset[str]:
        """Names of the nodes every output of which is in ``constants``: they compute nothing
        from the inputs, so the search compares them but never isolates or blames them."""
        known = set(self.constants)
        return frozenset(
            n.name for n in self.nodes if n.outputs and all(t in known for t in n.outputs if t)
        )

    @cached_property
    def node_protos(self) -> dict[str, onnx.NodeProto]:
        """Each node's proto by name: every cut copies its nodes from here, and indexing the
        graph per cut made isolation batches cost the whole graph each."""
        return {n.name: n for n in self.model.graph.node}

    @cached_property
    def declared(self) -> dict[str, onnx.ValueInfoProto]:
        """Each tensor's type as the model declares it (see ``declared_types``): every cut
        model declares its outputs from here, and collecting it per cut cost the whole graph."""
        return declared_types(self.model.graph)

    @cached_property
    def dtypes(self) -> dict[str, np.dtype[np.generic]]:
        """Element type of every tensor shape inference typed: what a runtime expects to be
        fed, whatever precision the reference computed it in."""
        g = self.model.graph
        out: dict[str, np.dtype[np.generic]] = {
            t.name: np.dtype(helper.tensor_dtype_to_np_dtype(t.data_type)) for t in g.initializer
        }
        for v in (*g.input, *g.output, *g.value_info):
            elem = v.type.tensor_type.elem_type
            if elem:
                out[v.name] = np.dtype(helper.tensor_dtype_to_np_dtype(elem))
        return out

    def as_fed(self, tensor: str, value: npt.NDArray[Any]) -> npt.NDArray[Any]:
        """``value`` in the model's own dtype for ``tensor`` (a float64 reference feeds fp32)."""
        if self.units is not None:
            value = self.units.fed(tensor, value)
        want = self.dtypes.get(tensor)
        if want is None or value.dtype == want:
            return value
        # A float16 model fed the reference's float32 values: those beyond 65504 become ±Inf,
        # as the target's own run makes them, and the comparison says so; not a warning.
        with np.errstate(over="ignore"):
            return value.astype(want)

    def fed_meta(self, tensor: str, meta: TensorMeta) -> TensorMeta:
        own = self.units.dtype(tensor) if self.units is not None else None
        return TensorMeta(own or self.dtypes.get(tensor, meta.dtype), meta.shape)

    def as_real(
        self, tensor: str, value: npt.NDArray[Any] | None, like: np.dtype[Any]
    ) -> npt.NDArray[Any] | None:
        """The model's value of ``tensor`` in real units, comparable with a float one's."""
        return value if self.units is None else self.units.real(tensor, value, like)

    def value_edges(
        self, skip: Callable[[str], bool] | None = None
    ) -> tuple[dict[int, list[int]], dict[int, list[int]]]:
        """Producer and consumer lists (node indices) along the values nodes read: a reader
        of metadata only (Shape, Size) observes no value, and tensors ``skip`` names are no
        edge either. The one adjacency of the graph: windows, chains and bundles walk it."""
        producers: dict[int, list[int]] = {}
        consumers: dict[int, list[int]] = {}
        for n in self.nodes:
            if n.op_type in METADATA_OPS:
                continue
            for t in n.inputs:
                p = self.producer.get(t)
                if p is None or (skip is not None and skip(t)):
                    continue
                producers.setdefault(n.index, []).append(p.index)
                consumers.setdefault(p.index, []).append(n.index)
        return producers, consumers

    def ancestors(self, end: int) -> set[int]:
        """Indices of every node ``end`` depends on, through inputs and subgraph reads."""
        seen = {end}
        todo = [end]
        while todo:
            n = self.nodes[todo.pop()]
            for t in (*n.inputs, *n.implicit_inputs):
                p = self.producer.get(t)
                if p is not None and p.index not in seen:
                    seen.add(p.index)
                    todo.append(p.index)
        return seen


def declared_types(graph: onnx.GraphProto) -> dict[str, onnx.ValueInfoProto]:
    """A typed ValueInfoProto per tensor of ``graph`` whose element type the graph declares."""
    found: dict[str, onnx.ValueInfoProto] = {
        t.name: helper.make_tensor_value_info(t.name, t.data_type, list(t.dims))
        for t in graph.initializer
    }
    for v in (*graph.value_info, *graph.output, *graph.input):  # the input's type wins
        if has_type(v):
            found[v.name] = v
    return found


def has_type(v: onnx.ValueInfoProto) -> bool:
    """Whether ``v`` declares a type (for a tensor, at least its element type)."""
    kind = v.type.WhichOneof("value")
    return kind is not None and (kind != "tensor_type" or bool(v.type.tensor_type.elem_type))


def complete_type(v: onnx.ValueInfoProto) -> bool:
    """An element type and a shape whose every dim is sized or named: IREE's importer
    requires the shape, tinygrad's parser a value for each dim."""
    if v.type.WhichOneof("value") != "tensor_type":
        return has_type(v)
    t = v.type.tensor_type
    if not t.elem_type or not t.HasField("shape"):
        return False
    return all(d.HasField("dim_value") or d.HasField("dim_param") for d in t.shape.dim)


# Ops that read only a tensor's metadata: a reader of this kind does not observe the values.
METADATA_OPS = frozenset({"Shape", "Size"})


# Ops whose output is not a function of their inputs: never treated as constants.
_NONDETERMINISTIC = frozenset(
    {"RandomNormal", "RandomNormalLike", "RandomUniform", "RandomUniformLike", "Multinomial"}
)
