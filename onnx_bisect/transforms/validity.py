"""Whether a transform broke the model: the types and shapes onnx infers, strictly, before and
after it. A converter that mistypes a tensor (onnxconverter-common labels float16 the output of
a node that reads a float32 graph output) writes a model no runtime loads; without this check
that surfaced as "the target fails on Gemm", a finding about the target rather than the tool.

Weights do not matter to the check, so it runs on a skeleton: the message with every large
initializer's data left out, which stays far below protobuf's 2 GB whatever the model's size.
"""

from __future__ import annotations

import onnx

__all__ = ["broken_by", "resort", "skeleton", "unchecked"]

# Initializers up to this size keep their data: shape inference reads small constant
# operands (a Reshape's shape, a Slice's starts), never a weight matrix.
_KEEP_DATA = 1 << 16


def skeleton(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of ``model`` without the data of its initializers over 64 KiB (dims and types
    kept). Subgraphs and attribute tensors are kept whole: they are small in the models that
    reach 2 GB (their weights are initializers)."""
    out = onnx.ModelProto()
    graph = model.graph
    kept = onnx.GraphProto()
    for field in ("node", "input", "output", "value_info", "sparse_initializer"):
        getattr(kept, field).extend(getattr(graph, field))
    kept.name, kept.doc_string = graph.name, graph.doc_string
    for t in graph.initializer:
        if len(t.raw_data) <= _KEEP_DATA and t.ByteSize() <= _KEEP_DATA:
            kept.initializer.append(t)
        else:
            kept.initializer.add(name=t.name, data_type=t.data_type, dims=t.dims)
    for field in ("ir_version", "producer_name", "producer_version", "domain", "model_version"):
        setattr(out, field, getattr(model, field))
    out.opset_import.extend(model.opset_import)
    out.functions.extend(model.functions)
    out.graph.CopyFrom(kept)
    return out


def _checkable(model: onnx.ModelProto) -> onnx.ModelProto:
    """The skeleton as onnx's checker takes it: an initializer left without its data becomes
    a graph input of its type and shape (the checker rejects a tensor without values)."""
    out = skeleton(model)
    graph = out.graph
    empty = [t for t in graph.initializer if not _has_data(t)]
    if not empty:
        return out
    kept = [t for t in graph.initializer if _has_data(t)]
    del graph.initializer[:]
    graph.initializer.extend(kept)
    named = {i.name for i in graph.input}
    for t in empty:
        if t.name not in named:
            graph.input.append(onnx.helper.make_tensor_value_info(t.name, t.data_type, t.dims))
    return out


def _has_data(t: onnx.TensorProto) -> bool:
    return (
        bool(t.raw_data)
        or t.data_location == onnx.TensorProto.EXTERNAL
        or any(len(getattr(t, f)) for f in _DATA_FIELDS)
    )


_DATA_FIELDS = (
    "float_data", "int32_data", "string_data", "int64_data", "double_data", "uint64_data"
)  # fmt: skip


def _strict_error(model: onnx.ModelProto) -> str:
    try:
        onnx.shape_inference.infer_shapes(model, check_type=True, strict_mode=True)
    except Exception as exc:  # onnx raises InferenceError, and ValueError for some inputs
        return " ".join(str(exc).split())
    return ""


def _checker_error(model: onnx.ModelProto) -> str:
    try:
        onnx.checker.check_model(_checkable(model), full_check=True)
    except Exception as exc:  # onnx raises ValidationError, InferenceError
        return " ".join(str(exc).split())
    return ""


def unchecked(before: onnx.ModelProto, after: onnx.ModelProto) -> str:
    """Why onnx's full checker rejects ``after`` where it accepted ``before``, or "". It sees
    what type inference does not: nodes out of order (a node whose subgraph reads a name its
    graph computes only later)."""
    problem = _checker_error(after)
    if not problem or _checker_error(before):
        return ""
    return problem


def resort(graph: onnx.GraphProto) -> None:
    """Order ``graph``'s nodes, and every subgraph's, topologically in place, counting the
    names a node's subgraphs read from the outer scope: onnxconverter-common's own sort
    misses those, and writes an If before the node whose output its branch reads (zoo G1,
    silero-vad's nested Ifs). A graph already in order keeps its order."""
    for node in graph.node:
        for sub in _subgraphs(node):
            resort(sub)
    producer = {o: i for i, n in enumerate(graph.node) for o in n.output if o}
    needs = [
        sorted({producer[t] for t in (*n.input, *_outer_reads(n)) if t in producer} - {i})
        for i, n in enumerate(graph.node)
    ]
    order: list[int] = []
    state = [0] * len(needs)  # 0 unseen, 1 on the stack, 2 placed
    for start in range(len(needs)):
        stack = [start]
        while stack:
            i = stack[-1]
            if state[i] == 2:
                stack.pop()
                continue
            state[i] = 1
            todo = [d for d in needs[i] if state[d] == 0]
            if todo:
                stack.append(todo[0])
                continue
            state[i] = 2  # a cycle (state 1 among needs) is left where it is: onnx says so
            order.append(i)
            stack.pop()
    if order != list(range(len(needs))):
        nodes = [graph.node[i] for i in order]
        del graph.node[:]
        graph.node.extend(nodes)


def _outer_reads(node: onnx.NodeProto) -> set[str]:
    """The names ``node``'s subgraphs (at any depth) read from outside themselves."""
    names: set[str] = set()
    for sub in _subgraphs(node):
        local = {i.name for i in sub.input} | {t.name for t in sub.initializer}
        local |= {o for n in sub.node for o in n.output}
        for n in sub.node:
            names |= {t for t in (*n.input, *_outer_reads(n)) if t and t not in local}
        names |= {o.name for o in sub.output if o.name not in local}
    return names


def _subgraphs(node: onnx.NodeProto) -> list[onnx.GraphProto]:
    return [g for a in node.attribute for g in ([a.g] if a.HasField("g") else a.graphs)]


def broken_by(before: onnx.ModelProto, after: onnx.ModelProto) -> str:
    """Why ``after`` is invalid where ``before`` was valid (onnx's strict type and shape
    inference), or "". A model onnx already rejects before the transform says nothing."""
    problem = _strict_error(skeleton(after))
    if not problem or _strict_error(skeleton(before)):
        return ""
    return problem
