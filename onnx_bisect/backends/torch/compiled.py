"""``compile=``: the model as one fx graph, run through ``torch.compile``.

The interpreter is traced with ``make_fx`` into a single graph of aten operations, which
``torch.compile`` then compiles with the chosen backend. Tracing cannot read tensor values,
and ONNX graphs read many (Shape -> Gather -> Concat -> Reshape chains, Resize scales), so
first everything that does not depend on the inputs' *values* at these input shapes is folded:
one eager run computes it, and the traced graph starts from those constants. That is what a
compiler with static shapes folds anyway. What remains data-dependent (NonZero feeding a
Reshape, an If on a computed condition) cannot be one graph: that node fails with the reason.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch

from onnx_bisect.backends.torch.interpreter import Program, referenced_names
from onnx_bisect.errors import BackendError

__all__ = ["compiled_run"]

# Outputs that depend on their input's shape only, which is fixed for one compiled run.
_SHAPE_ONLY = frozenset({"Shape", "Size"})


def compiled_run(
    program: Program, inputs: Mapping[str, torch.Tensor], backend: str
) -> dict[str, torch.Tensor | None]:
    from torch.fx.experimental.proxy_tensor import make_fx

    every = program.run(inputs, wanted=program.values())
    dynamic = _value_dependent(program, set(inputs))
    folded = {n: v for n, v in every.items() if n not in dynamic}
    del every
    names = list(inputs)

    def forward(*values: torch.Tensor) -> tuple[Any, ...]:
        out = program.run(dict(zip(names, values, strict=True)), known=folded)
        return tuple(out[n] for n in program.outputs)

    try:
        with _constants_readable():
            graph = make_fx(forward, tracing_mode="real")(*inputs.values())
        with warnings.catch_warnings():
            # inductor advises turning TF32 on; the spec's tf32= decides that, not a warning.
            warnings.filterwarnings("ignore", message="TensorFloat32 tensor cores")
            results = torch.compile(graph, backend=backend, dynamic=False)(*inputs.values())
    except BackendError as exc:
        raise BackendError(
            f"compile={backend} cannot make one graph of the model: {exc}", node=exc.node
        ) from exc
    return dict(zip(program.outputs, results, strict=True))


@contextmanager
def _constants_readable() -> Iterator[None]:
    """Let ops read tensors they built from constants (Resize's index tables, Range): make_fx
    tracks constants only up to one element unless told otherwise (a module-level limit)."""
    from torch.fx.experimental import proxy_tensor

    saved = proxy_tensor.CONSTANT_NUMEL_LIMIT
    proxy_tensor.CONSTANT_NUMEL_LIMIT = 1 << 24
    try:
        yield
    finally:
        proxy_tensor.CONSTANT_NUMEL_LIMIT = saved


def _value_dependent(program: Program, inputs: set[str]) -> set[str]:
    """The values that change when the inputs' values change (shapes held fixed)."""
    dynamic = set(inputs)
    for step in program.steps:
        if step.node.op_type in _SHAPE_ONLY:
            continue
        if referenced_names(step.node) & dynamic:
            dynamic.update(n for n in step.node.output if n)
    return dynamic
