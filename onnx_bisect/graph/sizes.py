"""Sizes: concrete input shapes, bytes per tensor, a model's bytes, and the 2 GB limit."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import helper

from onnx_bisect.graph.view import LoadedModel
from onnx_bisect.graph.weights import all_tensors, external_ref

__all__ = ["PROTO_LIMIT", "ModelBytes", "fix_input_shapes", "model_bytes", "tensor_nbytes"]

log = logging.getLogger(__name__)


# Protobuf cannot serialize a message over 2 GiB (upb raises "Failed to serialize proto" from
# ByteSize() itself); 64 MiB of headroom covers what the estimate below may miss.
PROTO_LIMIT = 2**31 - 2**26


@dataclass(frozen=True)
class ModelBytes:
    """A model's size, found without serializing it.

    ``message``: an upper bound of its serialized size (``ByteSize()``), within a byte or two
    per field; ``inline_data``: the tensor bytes held in the message; ``external``: the bytes
    its tensors keep in files.
    """

    message: int
    inline_data: int
    external: int

    @property
    def weights(self) -> int:
        """Every tensor's bytes, wherever they are: what a runtime holds to run the model."""
        return self.inline_data + self.external

    @property
    def fits(self) -> bool:
        """Whether the message can be serialized as one protobuf (its weights kept inline)."""
        return self.message < PROTO_LIMIT


def model_bytes(model: onnx.ModelProto) -> ModelBytes:
    """The model's sizes: tensor data summed (raw_data lengths, typed fields, external-data
    lengths), the rest from ``ByteSize()`` of parts that cannot reach 2 GB on their own.

    ``ByteSize()`` of the whole model raises past 2 GB, which is the very case this decides,
    and serializing costs a copy of the weights; this reads lengths only.
    """
    inline = external = 0
    for t in all_tensors(model):
        if t.data_location == onnx.TensorProto.EXTERNAL:
            external += external_ref(t).length
        else:
            inline += _data_bytes(t)
    return ModelBytes(_model_message(model), inline, external)


# Past this a single part is measured by hand: its own ByteSize() is safe, but a sum of two
# such parts in one message would not be, and a part over 2 GB cannot be measured at all.
_SAFE_PART = 1 << 30
# The most a length-delimited field adds to its payload: a 2-byte tag and a 5-byte length.
_FIELD = 7


def _field(n: int) -> int:
    return n + _FIELD


def _data_bytes(t: onnx.TensorProto) -> int:
    """Bytes of the data held in the message (varints counted at their widest)."""
    if t.HasField("raw_data"):
        return len(t.raw_data)
    fixed = 4 * len(t.float_data) + 8 * len(t.double_data)
    varint = 10 * (len(t.int32_data) + len(t.int64_data) + len(t.uint64_data))
    return fixed + varint + sum(_field(len(v)) for v in t.string_data)


def _tensor_message(t: onnx.TensorProto) -> int:
    data = _data_bytes(t)
    if data < _SAFE_PART:
        return _field(t.ByteSize())
    meta = len(t.name) + len(t.doc_string) + 11 * len(t.dims) + 16
    return _field(data + meta)


def _heavy(attr: onnx.AttributeProto) -> bool:
    return bool(
        attr.HasField("t")
        or attr.tensors
        or attr.HasField("g")
        or attr.graphs
        or attr.HasField("sparse_tensor")
    )


def _node_message(node: onnx.NodeProto) -> int:
    if not any(_heavy(a) for a in node.attribute):
        return _field(node.ByteSize())
    names = (*node.input, *node.output, node.name, node.op_type, node.domain, node.doc_string)
    attrs = sum(_attr_message(a) for a in node.attribute)
    return _field(sum(_field(len(x)) for x in names) + attrs)


def _attr_message(attr: onnx.AttributeProto) -> int:
    if not _heavy(attr):
        return _field(attr.ByteSize())
    size = _field(len(attr.name)) + 16
    tensors = [attr.t] if attr.HasField("t") else []
    size += sum(_tensor_message(t) for t in (*tensors, *attr.tensors))
    if attr.HasField("sparse_tensor"):
        sparse = attr.sparse_tensor
        size += _tensor_message(sparse.values) + _tensor_message(sparse.indices) + 16
    graphs = [attr.g] if attr.HasField("g") else []
    return _field(size + sum(_graph_message(g) for g in (*graphs, *attr.graphs)))


def _small(messages: Iterable[onnx.ValueInfoProto | onnx.StringStringEntryProto]) -> int:
    return sum(_field(m.ByteSize()) for m in messages)


def _graph_message(g: onnx.GraphProto) -> int:
    size = _field(len(g.name)) + _field(len(g.doc_string))
    size += sum(_node_message(n) for n in g.node)
    size += sum(_tensor_message(t) for t in g.initializer)
    for sparse in g.sparse_initializer:
        size += _field(_tensor_message(sparse.values) + _tensor_message(sparse.indices) + 16)
    size += _small((*g.input, *g.output, *g.value_info, *g.metadata_props))
    size += sum(_field(q.ByteSize()) for q in g.quantization_annotation)
    return _field(size)


# ModelProto fields measured part by part; every other field is small and measured whole.
_MODEL_PARTS = frozenset({"graph", "functions", "training_info"})


def _model_message(model: onnx.ModelProto) -> int:
    head = onnx.ModelProto()
    for field, value in model.ListFields():
        if field.name in _MODEL_PARTS:
            continue
        if field.is_repeated:
            getattr(head, field.name).extend(value)
        elif field.type == field.TYPE_MESSAGE:
            getattr(head, field.name).CopyFrom(value)
        else:
            setattr(head, field.name, value)
    size = int(head.ByteSize()) + _graph_message(model.graph)
    for fn in model.functions:
        size += _field(sum(_node_message(n) for n in fn.node) + _function_head(fn))
    for info in model.training_info:
        graphs = (info.initialization, info.algorithm)
        size += _field(sum(_graph_message(g) for g in graphs) + 1024)
    return size


def _function_head(fn: onnx.FunctionProto) -> int:
    head = onnx.FunctionProto()
    head.CopyFrom(fn)
    del head.node[:]
    return int(head.ByteSize())


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
        if model_bytes(out).fits:
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


def probe_bytes(loaded: LoadedModel, sizes: Mapping[str, int | None]) -> int:
    """Bytes of every probe; an unknown size counts as the largest known."""
    known = [s for s in sizes.values() if s is not None]
    return sum(sizes.get(p) or max(known, default=0) for p in loaded.probes)
