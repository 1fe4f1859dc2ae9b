"""Loading a model and the graph surgery the search needs.

Every function here returns a new model and leaves its argument untouched: the caller's
``ModelProto`` is theirs, and a search that mutated it would corrupt later steps.
"""

from __future__ import annotations

import heapq
import logging
import os
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path

import onnx

from onnx_bisect.errors import ModelLoadError
from onnx_bisect.graph.sizes import model_bytes
from onnx_bisect.graph.view import LoadedModel, NodeInfo, NotProbed
from onnx_bisect.graph.weights import resolve_locations

__all__ = ["load_model", "name_nodes"]

log = logging.getLogger(__name__)


_SUBGRAPH_OPS = frozenset({"If", "Loop", "Scan"})


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
    name_nodes(graph, notes)
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
        # External weights stay on disk (graph/weights.py): the message stays small whatever
        # the model's size, and nothing is read that no run needs.
        proto = onnx.load(str(path), load_external_data=False)
    except Exception as exc:  # protobuf raises several unrelated types for garbage input
        raise ModelLoadError(f"{path}: not a valid ONNX model ({_first_line(exc)})") from exc
    if not proto.graph.node and not proto.opset_import:
        raise ModelLoadError(f"{path}: not a valid ONNX model (empty or not a ModelProto)")
    odd = next(_undecodable_names(proto.graph), None)
    if odd is not None:
        raise ModelLoadError(f"{path}: not a valid ONNX model (a name is not UTF-8 text: {odd!r})")
    # Located first: a location without a length is sized from its file, which a relative
    # path finds only from the model's directory, not from wherever the command runs.
    resolve_locations(proto, path.parent, str(path))
    return _infer_shapes(proto, path, notes)


def _undecodable_names(graph: onnx.GraphProto) -> Iterator[bytes]:
    """Names that protobuf hands over as bytes: a string field of invalid UTF-8 (a corrupted
    file), which every later join and format would trip over."""
    values = (*graph.input, *graph.output, *graph.value_info)
    for name in (
        *(v.name for v in values),
        *(t.name for t in graph.initializer),
        *(x for n in graph.node for x in (n.name, n.op_type, n.domain, *n.input, *n.output)),
    ):
        if not isinstance(name, str):
            yield name
    for node in graph.node:
        for attr in node.attribute:
            for sub in (attr.g, *attr.graphs):
                yield from _undecodable_names(sub)


def _clear_unknown_dims(graph: onnx.GraphProto, notes: list[str]) -> None:
    """Exporters write an unknown dim as dim_value -1 or 0 too; runtimes hold a declared 0 to
    be 0 (onnxruntime rejects any other size), so both become plain dynamic dims."""
    cleared = 0
    for vi in (*graph.input, *graph.output):
        for d in vi.type.tensor_type.shape.dim:
            if d.HasField("dim_value") and d.dim_value <= 0:
                d.Clear()
                cleared += 1
    if cleared:
        notes.append(f"{cleared} input/output dim(s) declared as -1 or 0 were taken as dynamic")


def _infer_shapes(proto: onnx.ModelProto, path: Path | None, notes: list[str]) -> onnx.ModelProto:
    _clear_unknown_dims(proto.graph, notes)
    try:
        if model_bytes(proto).fits:
            return onnx.shape_inference.infer_shapes(proto, data_prop=True)
        if path is None:
            # Every run that needs a file then writes its weights again: a path avoids both.
            notes.append(
                "shape inference skipped: in-memory model over 2 GB (give its path, with the "
                "weights in external data, to keep them on disk)"
            )
            return proto
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "inferred.onnx"
            onnx.shape_inference.infer_shapes_path(str(path), str(out), data_prop=True)
            inferred = onnx.load(str(out), load_external_data=False)
        # The file's locations again, relative to the model's directory.
        resolve_locations(inferred, path.parent, str(path))
        return inferred
    except Exception as exc:
        # Custom domains and some contrib ops defeat inference; probes still work without it.
        notes.append(f"shape inference failed, continuing without it: {_first_line(exc)}")
        log.warning("shape inference failed: %s", exc)
        return proto


def name_nodes(graph: onnx.GraphProto, notes: list[str]) -> None:
    """Name, in place, each unnamed or duplicate node ``{op_type}_{i}`` (``__k`` where that
    clashes): the names every report, and Model Explorer's overlays, use."""
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


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0][:300]
