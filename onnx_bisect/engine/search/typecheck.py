"""Whether a prefix the target ran gave its outputs the model's dtypes and shapes.

A runtime may run a node and still get its type wrong: tract gives a ConstantOfShape without
a ``value`` attribute a float64 output (ONNX says float32), and only a later Gemm refuses it
("Impossible to unify F64 with F32"). The failure search counts such a prefix as failing, so
that it names the node whose output changed, not the node that refused it.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper

from onnx_bisect.backends.protocol import Tensors
from onnx_bisect.errors import BackendError
from onnx_bisect.graph.view import LoadedModel

__all__ = ["TypeChange", "type_change"]


class TypeChange(BackendError):
    """A prefix the target ran whose output ``tensor`` came back with another dtype or shape
    than the model's (never raised out of the failure search)."""

    def __init__(self, message: str, tensor: str) -> None:
        super().__init__(message)
        self.tensor = tensor


def type_change(loaded: LoadedModel, prefix: onnx.ModelProto, out: Tensors) -> TypeChange | None:
    """The first output of ``prefix`` whose dtype or shape differs from what ``prefix``
    declares of it (the model's types, or the reference's where the model says nothing);
    None where each is as declared. Integer widths are not counted (a runtime may hand an
    int64 back as int32 and still compute right); a float of another width, or a float
    where the model says integer or the other way round, is."""
    for v in prefix.graph.output:
        value = out.get(v.name)
        t = v.type.tensor_type
        if value is None or v.type.WhichOneof("value") != "tensor_type" or not t.elem_type:
            continue
        want = np.dtype(helper.tensor_dtype_to_np_dtype(t.elem_type))
        got = np.asarray(value)
        dims = [d.dim_value if d.HasField("dim_value") else None for d in t.shape.dim]
        if got.dtype != want and "f" in (got.dtype.kind, want.kind):
            said = f"as {got.dtype} where the model says {want}"
        elif t.HasField("shape") and not _fits(got.shape, dims):
            said = f"of shape {_shape(got.shape)} where the model says {_shape(dims)}"
        else:
            continue
        producer = loaded.producer.get(v.name)
        who = f"{producer.op_type} {producer.name!r}" if producer else "the graph"
        return TypeChange(f"the target gives {who} output {v.name!r} {said}", v.name)
    return None


def _fits(got: tuple[int, ...], dims: list[int | None]) -> bool:
    """Whether ``got`` fits the declared ``dims`` (None: any size). One element given as a
    scalar, or a scalar as one element, is not counted: runtimes differ there harmlessly."""
    if len(got) == len(dims):
        return all(d is None or d == g for g, d in zip(got, dims, strict=True))
    return None not in dims and int(np.prod(got)) == int(np.prod([d or 0 for d in dims])) == 1


def _shape(dims: tuple[int, ...] | list[int | None]) -> str:
    return "(" + ", ".join("?" if d is None else str(d) for d in dims) + ")"
