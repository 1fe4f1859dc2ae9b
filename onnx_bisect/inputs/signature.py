"""A model's input signature as declared: names, dtypes, and which dims are fixed."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import helper

from onnx_bisect.errors import InputError

__all__ = ["Dim", "InputSpec", "declared_dim", "format_dims", "input_specs"]

# A fixed size (> 0), a dynamic dim's name, or None for a dynamic dim without a name.
Dim = int | str | None


@dataclass(frozen=True)
class InputSpec:
    name: str
    dtype: np.dtype[np.generic]
    dims: tuple[Dim, ...]


def declared_dim(dim: onnx.TensorShapeProto.Dimension) -> Dim:
    """One declared dim. Exporters write "unknown" three ways: a ``dim_param``, no value at
    all, or a ``dim_value`` of -1 or 0 (paddle2onnx: PP-OCR's cls batch is -1). All three are
    dynamic here: an input that must be empty is far rarer than an exporter's 0 for unknown."""
    if dim.HasField("dim_value"):
        return dim.dim_value if dim.dim_value > 0 else None
    return dim.dim_param or None


def input_specs(model: onnx.ModelProto) -> list[InputSpec]:
    """The graph inputs that are not initializers, in declaration order."""
    inits = {t.name for t in model.graph.initializer}
    specs = []
    for vi in model.graph.input:
        if vi.name in inits:
            continue
        if not vi.type.HasField("tensor_type"):
            raise InputError(f"input {vi.name!r} is not a tensor; only tensor inputs are supported")
        tt = vi.type.tensor_type
        dtype = np.dtype(helper.tensor_dtype_to_np_dtype(tt.elem_type))
        specs.append(InputSpec(vi.name, dtype, tuple(declared_dim(d) for d in tt.shape.dim)))
    return specs


def format_dims(dims: Sequence[Dim]) -> str:
    return "[" + ", ".join("?" if d is None else str(d) for d in dims) + "]"
