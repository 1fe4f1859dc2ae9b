"""Operator implementations, one module per family; importing a module registers its ops."""

from __future__ import annotations

from onnx_bisect.backends.torch.ops import (  # noqa: F401  (registration by import)
    activation,
    attention,
    cast,
    contrib,
    control,
    elementwise,
    generate,
    indexing,
    linear,
    ml,
    normalization,
    pool,
    quant,
    recurrent,
    reduce,
    resize,
    rnn,
    sequence,
    shape,
    signal,
    text,
    training,
    vision,
)
from onnx_bisect.backends.torch.ops.registry import lookup, register, table

__all__ = ["lookup", "register", "table"]
