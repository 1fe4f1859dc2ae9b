"""Loading a model and the graph surgery the search needs.

Every function here returns a new model and leaves its argument untouched: the caller's
``ModelProto`` is theirs, and a search that mutated it would corrupt later steps.
"""

from __future__ import annotations

import heapq
import logging
import os
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import onnx
from onnx import helper, numpy_helper

from onnx_bisect.errors import ModelLoadError

__all__ = [
    "METADATA_OPS",
    "LoadedModel",
    "NodeInfo",
    "NotProbed",
    "TensorMeta",
    "fix_input_shapes",
    "isolation_model",
    "live_tensors",
    "load_model",
    "prefix_model",
    "save_model",
    "tensor_nbytes",
    "window_exits",
    "window_model",
    "with_outputs",
]

log = logging.getLogger(__name__)

# Protobuf cannot serialize a message over 2 GiB; leave headroom for the graph itself.
_PROTO_LIMIT = 2**31 - 2**26
_SUBGRAPH_OPS = frozenset({"If", "Loop", "Scan"})


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
        want = self.dtypes.get(tensor)
        return value if want is None or value.dtype == want else value.astype(want)

    def fed_meta(self, tensor: str, meta: TensorMeta) -> TensorMeta:
        return TensorMeta(self.dtypes.get(tensor, meta.dtype), meta.shape)

    def node(self, name: str) -> NodeInfo:
        for n in self.nodes:
            if n.name == name:
                return n
        raise KeyError(name)


def load_model(model: str | os.PathLike[str] | onnx.ModelProto) -> LoadedModel:
    """Load, name, sort and shape-infer a model; raises ModelLoadError with the reason."""
    notes: list[str] = []
    path: Path | None = None
    if isinstance(model, onnx.ModelProto):
        proto = onnx.ModelProto()
        proto.CopyFrom(model)
        proto = _infer_shapes(proto, None, notes)
    else:
        path = Path(model)
        proto = _load_path(path, notes)
    graph = proto.graph
    if not graph.node:
        raise ModelLoadError(f"{path or 'model'}: the graph has no nodes")
    _name_nodes(graph, notes)
    _toposort(graph, notes)
    inits = frozenset(t.name for t in graph.initializer)
    nodes = tuple(
        NodeInfo(
            index=i,
            name=n.name,
            op_type=n.op_type,
            domain=n.domain,
            inputs=tuple(n.input),
            outputs=tuple(o for o in n.output if o),
            implicit_inputs=tuple(sorted(_implicit_inputs(n))),
        )
        for i, n in enumerate(graph.node)
    )
    return LoadedModel(
        model=proto,
        path=path,
        nodes=nodes,
        inputs=tuple(i.name for i in graph.input if i.name not in inits),
        outputs=tuple(o.name for o in graph.output),
        initializers=inits,
        not_probed=tuple(_subgraph_tensors(graph)),
        notes=tuple(notes),
    )


def _load_path(path: Path, notes: list[str]) -> onnx.ModelProto:
    if not path.exists():
        raise ModelLoadError(f"model file not found: {path}")
    if path.is_dir():
        raise ModelLoadError(f"{path} is a directory; pass the .onnx file")
    try:
        # Weights stay on disk until shape inference is done, so a >2 GB model never has to
        # pass through a single protobuf message.
        proto = onnx.load(str(path), load_external_data=False)
    except Exception as exc:  # protobuf raises several unrelated types for garbage input
        raise ModelLoadError(f"{path}: not a valid ONNX model ({_first_line(exc)})") from exc
    if not proto.graph.node and not proto.opset_import:
        raise ModelLoadError(f"{path}: not a valid ONNX model (empty or not a ModelProto)")
    proto = _infer_shapes(proto, path, notes)
    try:
        onnx.external_data_helper.load_external_data_for_model(proto, str(path.parent))
    except Exception as exc:
        raise ModelLoadError(f"{path}: cannot load external data ({_first_line(exc)})") from exc
    return proto


def _infer_shapes(proto: onnx.ModelProto, path: Path | None, notes: list[str]) -> onnx.ModelProto:
    try:
        if proto.ByteSize() < _PROTO_LIMIT:
            return onnx.shape_inference.infer_shapes(proto, data_prop=True)
        if path is None:
            notes.append("shape inference skipped: in-memory model over 2 GB")
            return proto
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "inferred.onnx"
            onnx.shape_inference.infer_shapes_path(str(path), str(out), data_prop=True)
            return onnx.load(str(out), load_external_data=False)
    except Exception as exc:
        # Custom domains and some contrib ops defeat inference; probes still work without it.
        notes.append(f"shape inference failed, continuing without it: {_first_line(exc)}")
        log.warning("shape inference failed: %s", exc)
        return proto


def _name_nodes(graph: onnx.GraphProto, notes: list[str]) -> None:
    seen: set[str] = set()
    renamed = 0
    for i, node in enumerate(graph.node):
        if not node.name or node.name in seen:
            base = node.name or f"{node.op_type}_{i}"
            name, k = base, 1
            while name in seen:
                name, k = f"{base}__{k}", k + 1
            node.name = name
            renamed += 1
        seen.add(node.name)
    if renamed:
        notes.append(f"{renamed} unnamed or duplicate node names were given synthetic names")


def _implicit_inputs(node: onnx.NodeProto) -> set[str]:
    """Outer-scope names that the node's subgraphs read."""
    used: set[str] = set()
    for attr in node.attribute:
        graphs = [attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs)
        for g in graphs:
            defined = {i.name for i in g.input} | {t.name for t in g.initializer}
            inner: set[str] = set()
            for n in g.node:
                inner |= set(n.input) | _implicit_inputs(n)
                defined |= set(n.output)
            used |= {x for x in inner if x and x not in defined}
    return used


def _toposort(graph: onnx.GraphProto, notes: list[str]) -> None:
    """Stable Kahn sort in place; a file that is already sorted keeps its order."""
    available = {i.name for i in graph.input} | {t.name for t in graph.initializer} | {""}
    nodes = list(graph.node)
    deps = [(set(n.input) | _implicit_inputs(n)) - available for n in nodes]
    producers = {o: i for i, n in enumerate(nodes) for o in n.output if o}
    missing = sorted({d for ds in deps for d in ds if d not in producers})
    if missing:
        raise ModelLoadError(
            f"graph reads tensors that nothing produces: {', '.join(missing[:5])}"
            + (" ..." if len(missing) > 5 else "")
        )
    waiting = [len({producers[d] for d in ds}) for ds in deps]
    users: dict[int, list[int]] = {}
    for i, ds in enumerate(deps):
        for p in {producers[d] for d in ds}:
            users.setdefault(p, []).append(i)
    ready = [i for i, w in enumerate(waiting) if w == 0]
    heapq.heapify(ready)
    order: list[int] = []
    while ready:
        i = heapq.heappop(ready)
        order.append(i)
        for u in users.get(i, []):
            waiting[u] -= 1
            if waiting[u] == 0:
                heapq.heappush(ready, u)
    if len(order) != len(nodes):
        stuck = [nodes[i].name for i in range(len(nodes)) if i not in set(order)]
        raise ModelLoadError(f"graph has a cycle through: {', '.join(stuck[:5])}")
    if order != sorted(order):
        notes.append("nodes were not in topological order; re-sorted")
        copies = [onnx.NodeProto() for _ in nodes]
        for c, i in zip(copies, order, strict=True):
            c.CopyFrom(nodes[i])
        del graph.node[:]
        graph.node.extend(copies)


def _subgraph_tensors(graph: onnx.GraphProto) -> Iterable[NotProbed]:
    for node in graph.node:
        if node.op_type not in _SUBGRAPH_OPS and not any(
            a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS)
            for a in node.attribute
        ):
            continue
        for attr in node.attribute:
            graphs = [attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs)
            for g in graphs:
                for inner in g.node:
                    for out in inner.output:
                        if out:
                            yield NotProbed(
                                out,
                                node.name,
                                f"inside the {attr.name!r} body of {node.op_type} {node.name!r}; "
                                "only top-level tensors can be marked as outputs",
                            )


def with_outputs(model: onnx.ModelProto, names: Sequence[str]) -> onnx.ModelProto:
    """A copy of ``model`` whose graph outputs are exactly ``names`` (in that order)."""
    import onnx_graphsurgeon as gs

    gs.logger.G_LOGGER.severity = gs.logger.G_LOGGER.ERROR
    graph = gs.import_onnx(model)
    tensors = graph.tensors()
    unknown = [n for n in names if n not in tensors]
    if unknown:
        raise KeyError(f"no such tensors: {unknown}")
    graph.outputs = [tensors[n] for n in names]
    # Tensors whose type inference could not determine are still valid outputs for ORT.
    out: onnx.ModelProto = gs.export_onnx(graph, do_type_check=False)
    return out


def isolation_model(
    loaded: LoadedModel,
    nodes: Sequence[NodeInfo],
    meta: Mapping[str, TensorMeta],
    constants: Mapping[str, npt.NDArray[Any]] | None = None,
) -> tuple[onnx.ModelProto, dict[str, str]]:
    """A model in which each of ``nodes`` reads its activations from fresh graph inputs.

    Fed with the reference's tensors, one run of it gives every node's *isolated* output: the
    node computed on the target from exactly the reference's inputs. Tensors in ``constants``
    are embedded as initializers instead: runtimes need shape and axes operands to be constant
    (OpenVINO's CPU plugin rejects an Unsqueeze whose axes are an input). Returns the model and
    a map from each new graph-input name to the original tensor it stands for.
    """
    outputs = [o for n in nodes for o in n.outputs]
    return _extract(loaded, nodes, meta, constants or {}, False, outputs, "isolated")


def window_model(
    loaded: LoadedModel,
    nodes: Sequence[NodeInfo],
    meta: Mapping[str, TensorMeta],
    constants: Mapping[str, npt.NDArray[Any]] | None = None,
    outputs: Sequence[str] | None = None,
    keep_names: bool = False,
) -> tuple[onnx.ModelProto, dict[str, str], list[str]]:
    """``nodes`` as one connected subgraph: edges between them stay inside, so the target may
    fuse them, and only the window's exits are outputs (marking more would break fusions).

    Inputs from outside the window become graph inputs as in ``isolation_model`` (under their
    own names with ``keep_names``, as a repro bundle wants). ``outputs`` narrows the exits.
    Returns the model, the feed map and the outputs.
    """
    exits = window_exits(loaded, nodes) if outputs is None else list(outputs)
    model, feeds = _extract(
        loaded, nodes, meta, constants or {}, True, exits, "window", keep_names=keep_names
    )
    return model, feeds, exits


def prefix_model(loaded: LoadedModel, position: int) -> onnx.ModelProto:
    """Nodes before ``position`` only, with the tensors live across that cut as outputs.

    The target keeps its fusions everywhere except across the cut, which is what lets a
    binary search over positions find a bug that hides whenever its tensors are observed.
    """
    nodes = loaded.nodes[:position]
    model, _ = _extract(loaded, nodes, {}, {}, True, live_tensors(loaded, position), "prefix")
    return model


def live_tensors(loaded: LoadedModel, position: int) -> list[str]:
    """Tensors produced before ``position`` and read at or after it (or graph outputs)."""
    produced = {o: n.index for n in loaded.nodes[:position] for o in n.outputs}
    later = {t for n in loaded.nodes[position:] for t in (*n.inputs, *n.implicit_inputs)}
    later |= set(loaded.outputs)
    return [t for t in produced if t in later]


# Ops that read only a tensor's metadata: a reader of this kind does not observe the values.
METADATA_OPS = frozenset({"Shape", "Size"})
# Ops whose output is not a function of their inputs: never treated as constants.
_NONDETERMINISTIC = frozenset(
    {"RandomNormal", "RandomNormalLike", "RandomUniform", "RandomUniformLike", "Multinomial"}
)


def window_exits(loaded: LoadedModel, nodes: Sequence[NodeInfo]) -> list[str]:
    """Outputs of ``nodes`` whose values are read outside them, or that are graph outputs."""
    inside = {n.name for n in nodes}
    outside_reads = {
        t
        for n in loaded.nodes
        if n.name not in inside and n.op_type not in METADATA_OPS
        for t in (*n.inputs, *n.implicit_inputs)
    }
    outside_reads |= set(loaded.outputs)
    return [o for n in nodes for o in n.outputs if o in outside_reads]


def _extract(
    loaded: LoadedModel,
    nodes: Sequence[NodeInfo],
    meta: Mapping[str, TensorMeta],
    constants: Mapping[str, npt.NDArray[Any]],
    keep_edges: bool,
    outputs: Sequence[str],
    suffix: str,
    keep_names: bool = False,
) -> tuple[onnx.ModelProto, dict[str, str]]:
    """Copy ``nodes`` into a new model; activations they read from elsewhere become graph
    inputs (``ref__<name>``) or, for ``constants``, initializers. With ``keep_edges`` a tensor
    produced by one of ``nodes`` stays an internal edge."""
    src = loaded.model.graph
    graph_inputs = {i.name: i for i in src.input}
    inits = {t.name: t for t in src.initializer}
    produced = {o for n in nodes for o in n.outputs}
    taken = set(produced) | set(graph_inputs) | set(inits)
    feed_for: dict[str, str] = {}
    feeds: dict[str, str] = {}
    used_inits: set[str] = set()
    used_inputs: set[str] = set()
    embedded: dict[str, str] = {}

    def fresh(base: str) -> str:
        name, k = base, 1
        while name in taken:
            name, k = f"{base}__{k}", k + 1
        taken.add(name)
        return name

    def feed_name(tensor: str) -> str:
        if tensor not in feed_for:
            if tensor in constants:
                feed_for[tensor] = fresh(tensor if keep_names else f"const__{tensor}")
                embedded[feed_for[tensor]] = tensor
            else:
                feed_for[tensor] = fresh(tensor if keep_names else f"ref__{tensor}")
                feeds[feed_for[tensor]] = tensor
        return feed_for[tensor]

    new_nodes: list[onnx.NodeProto] = []
    protos = {n.name: n for n in src.node}
    for info in nodes:
        node = onnx.NodeProto()
        node.CopyFrom(protos[info.name])
        for j, name in enumerate(node.input):
            if not name or (keep_edges and name in produced):
                continue
            if name in inits:
                used_inits.add(name)
            elif name in graph_inputs:
                used_inputs.add(name)
            else:
                node.input[j] = feed_name(name)
        for name in info.implicit_inputs:
            # Bodies read outer names directly, so they are fed under their own names.
            if name in inits:
                used_inits.add(name)
            elif name in graph_inputs:
                used_inputs.add(name)
            elif name not in produced:
                feeds[name] = name
        new_nodes.append(node)

    def vi(name: str, tensor: str) -> onnx.ValueInfoProto:
        m = meta[tensor]
        elem = helper.np_dtype_to_tensor_dtype(m.dtype)
        return helper.make_tensor_value_info(name, elem, list(m.shape))

    def out_vi(name: str) -> onnx.ValueInfoProto:
        # Typed where we know the type: runtimes behind exec: may insist on it.
        return vi(name, name) if name in meta else helper.make_value_info(name, onnx.TypeProto())

    inputs = [graph_inputs[n] for n in graph_inputs if n in used_inputs]
    inputs += [vi(f, t) for f, t in feeds.items()]
    graph = helper.make_graph(
        new_nodes,
        f"{src.name or 'graph'}_{suffix}",
        inputs,
        [out_vi(o) for o in outputs],
        initializer=[inits[n] for n in inits if n in used_inits]
        + [numpy_helper.from_array(np.asarray(constants[t]), name) for name, t in embedded.items()],
    )
    out = helper.make_model(graph, opset_imports=list(loaded.model.opset_import))
    out.ir_version = loaded.model.ir_version
    out.functions.extend(loaded.model.functions)
    return out, feeds


def fix_input_shapes(
    model: onnx.ModelProto, shapes: Mapping[str, Sequence[int]]
) -> onnx.ModelProto:
    """A copy with concrete input dims, re-inferred so that every probe's size is known."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    for inp in out.graph.input:
        if inp.name in shapes:
            dims = inp.type.tensor_type.shape.dim
            for d, v in zip(dims, shapes[inp.name], strict=False):
                d.Clear()
                d.dim_value = int(v)
    del out.graph.value_info[:]
    try:
        if out.ByteSize() < _PROTO_LIMIT:
            return onnx.shape_inference.infer_shapes(out, data_prop=True)
    except Exception as exc:
        log.debug("shape inference with fixed inputs failed: %s", exc)
    return out


def tensor_nbytes(model: onnx.ModelProto) -> dict[str, int | None]:
    """Bytes of every typed tensor with a fully known shape; None where unknown."""
    sizes: dict[str, int | None] = {}
    g = model.graph
    for v in list(g.value_info) + list(g.output) + list(g.input):
        t = v.type.tensor_type
        if not t.elem_type or not t.HasField("shape"):
            sizes[v.name] = None
            continue
        dims = [d.dim_value if d.HasField("dim_value") else -1 for d in t.shape.dim]
        if any(d < 0 for d in dims):
            sizes[v.name] = None
            continue
        itemsize = helper.tensor_dtype_to_np_dtype(t.elem_type).itemsize
        sizes[v.name] = int(np.prod(dims, dtype=np.int64)) * itemsize
    return sizes


def save_model(model: onnx.ModelProto, directory: Path, name: str = "model.onnx") -> Path:
    """Write a model for a runtime; weights go to ``<name>.data`` when one file can't hold it."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / name
    large = model.ByteSize() >= _PROTO_LIMIT
    if large:
        # save_model moves the weights out of the message it is given; keep the caller's intact.
        copy = onnx.ModelProto()
        copy.CopyFrom(model)
        model = copy
    onnx.save_model(
        model,
        str(path),
        save_as_external_data=large,
        all_tensors_to_one_file=True,
        location=f"{name}.data",
    )
    return path


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0][:300]
