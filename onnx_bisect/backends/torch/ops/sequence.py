"""Sequences and optionals: SequenceEmpty/Construct/Insert/At/Erase/Length,
ConcatFromSequence, SplitToSequence, SequenceMap, and Optional, OptionalHasElement,
OptionalGetElement.

A sequence is a ``TensorSequence`` (context.py), returned wrapped in a one-element list so
that it stays one output; an empty optional is None. Positions may be negative (from the
end), as ONNX allows.
"""

from __future__ import annotations

from typing import Any

import onnx
import torch

from onnx_bisect.backends.torch.context import OpContext, TensorSequence
from onnx_bisect.backends.torch.ops.registry import register
from onnx_bisect.backends.torch.ops.shape import axis_of, ints, need, opt
from onnx_bisect.errors import BackendError

__all__: list[str] = []

Inputs = list[torch.Tensor | None]


def _seq(x: Inputs, i: int) -> TensorSequence:
    value: Any = x[i] if i < len(x) else None
    if not isinstance(value, TensorSequence):
        raise BackendError(f"input {i} must be a sequence, not {type(value).__name__}")
    return value


def _position(t: torch.Tensor | None, size: int, default: int, *, insert: bool) -> int:
    if t is None:
        return default
    p = ints(t)[0]
    p = p + size if p < 0 else p
    if not 0 <= p <= (size if insert else size - 1):
        raise BackendError(f"sequence position {ints(t)[0]} is out of range for {size} tensors")
    return p


@register("SequenceEmpty", since=11)
def sequence_empty(ctx: OpContext, x: Inputs, attrs: dict[str, Any]) -> list[Any]:
    return [TensorSequence()]


@register("SequenceConstruct", since=11)
def sequence_construct(ctx: OpContext, x: Inputs, attrs: dict[str, Any]) -> list[Any]:
    return [TensorSequence(need(x, i) for i in range(len(x)))]


@register("SequenceInsert", since=11)
def sequence_insert(ctx: OpContext, x: Inputs, attrs: dict[str, Any]) -> list[Any]:
    seq = TensorSequence(_seq(x, 0))
    seq.insert(_position(opt(x, 2), len(seq), len(seq), insert=True), need(x, 1))
    return [seq]


@register("SequenceAt", since=11)
def sequence_at(ctx: OpContext, x: Inputs, attrs: dict[str, Any]) -> torch.Tensor:
    seq = _seq(x, 0)
    return seq[_position(need(x, 1), len(seq), 0, insert=False)]


@register("SequenceErase", since=11)
def sequence_erase(ctx: OpContext, x: Inputs, attrs: dict[str, Any]) -> list[Any]:
    seq = TensorSequence(_seq(x, 0))
    del seq[_position(opt(x, 1), len(seq), len(seq) - 1, insert=False)]
    return [seq]


@register("SequenceLength", since=11)
def sequence_length(ctx: OpContext, x: Inputs, attrs: dict[str, Any]) -> torch.Tensor:
    return torch.tensor(len(_seq(x, 0)), dtype=torch.int64, device=ctx.device)


@register("ConcatFromSequence", since=11)
def concat_from_sequence(ctx: OpContext, x: Inputs, attrs: dict[str, Any]) -> torch.Tensor:
    seq = _seq(x, 0)
    if not seq:
        raise BackendError("ConcatFromSequence of an empty sequence has no shape")
    rank = seq[0].dim() + int(attrs.get("new_axis", 0))
    axis = axis_of(int(attrs["axis"]), rank)
    return torch.stack(list(seq), axis) if attrs.get("new_axis", 0) else torch.cat(list(seq), axis)


@register("SplitToSequence", since=11)
def split_to_sequence(ctx: OpContext, x: Inputs, attrs: dict[str, Any]) -> list[Any]:
    data, sizes = need(x, 0), opt(x, 1)
    axis = axis_of(int(attrs.get("axis", 0)), data.dim())
    if sizes is None:  # pieces of 1, squeezed unless keepdims
        parts = torch.split(data, 1, dim=axis)
        if not int(attrs.get("keepdims", 1)):
            parts = tuple(p.squeeze(axis) for p in parts)
    elif sizes.dim() == 0:  # pieces of that size, the last one shorter
        parts = torch.split(data, ints(sizes)[0], dim=axis)
    else:
        parts = torch.split(data, ints(sizes), dim=axis)
    return [TensorSequence(parts)]


@register("SequenceMap", since=17)
def sequence_map(ctx: OpContext, x: Inputs, attrs: dict[str, Any]) -> list[Any]:
    """The body once per position of the sequences, tensors (the other inputs) fed whole."""
    body: onnx.GraphProto = attrs["body"]
    count = len(_seq(x, 0))
    outputs: list[TensorSequence] = [TensorSequence() for _ in body.output]
    for i in range(count):
        feeds = [v[i] if isinstance(v, TensorSequence) else v for v in x]
        for out, value in zip(outputs, ctx.run_graph(body, feeds), strict=True):
            if value is None:
                raise BackendError("a SequenceMap body output is empty")
            out.append(value)
    return outputs


@register("Optional", since=15)
def optional(ctx: OpContext, x: Inputs, attrs: dict[str, Any]) -> list[Any]:
    return [x[0] if x else None]


@register("OptionalHasElement", since=15)
def optional_has_element(ctx: OpContext, x: Inputs, attrs: dict[str, Any]) -> torch.Tensor:
    present = bool(x) and x[0] is not None
    return torch.tensor(present, dtype=torch.bool, device=ctx.device)


@register("OptionalGetElement", since=15)
def optional_get_element(ctx: OpContext, x: Inputs, attrs: dict[str, Any]) -> list[Any]:
    if not x or x[0] is None:
        raise BackendError("OptionalGetElement of an empty optional")
    return [x[0]]
