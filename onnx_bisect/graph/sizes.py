"""Sizes: concrete input shapes, bytes per tensor, and the 2 GB protobuf limit."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

import numpy as np
import onnx
from onnx import helper

from onnx_bisect.graph.view import LoadedModel

__all__ = ["fix_input_shapes", "tensor_nbytes"]

log = logging.getLogger(__name__)

log = logging.getLogger(__name__)


# Protobuf cannot serialize a message over 2 GiB; leave headroom for the graph itself.
PROTO_LIMIT = 2**31 - 2**26


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
        if out.ByteSize() < PROTO_LIMIT:
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
