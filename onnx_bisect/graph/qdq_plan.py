"""Which tensors onnxruntime's QDQ quantizer puts a Q/DQ pair on, given ``nodes_to_exclude``
(pure): its rules, read from onnxruntime 1.32's ``quantization/qdq_quantizer.py`` and
``operators/``, replayed on the float model.

The quantizer walks the nodes in graph order. Each node it quantizes (its op type is one it
knows, and it is not excluded) *marks* tensors: most mark every float input and output
(``QDQOperatorBase``); Conv, Gemm and the normalizations mark their activation, weight, bias
and output; the data-movement ops (Reshape, Transpose, MaxPool, Resize, Slice, ...) mark only
their output, and only when their input is marked already; a Relu or Clip after a marked
tensor read by nothing else is removed and its producer writes its output (the Q/DQ range
clamps instead). Every marked tensor gets one Q/DQ pair that *all* its readers read, the
excluded ones too: excluding a node takes a pair away only where no quantized neighbour
marks it. That is what keeping a node in float means here.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

import numpy as np

from onnx_bisect.graph.view import LoadedModel, NodeInfo

__all__ = ["OP_TYPES", "QDQPlan", "qdq_plan"]

# quantize_static's default op types: QLinearOpsRegistry's and QDQRegistry's (registry.py).
OP_TYPES = frozenset(
    {"ArgMax", "Conv", "ConvTranspose", "Gemm", "MatMul", "Add", "Mul", "Relu", "Clip",
     "LeakyRelu", "Sigmoid", "MaxPool", "GlobalAveragePool", "Split", "Pad", "Reshape",
     "Squeeze", "Unsqueeze", "Flatten", "Resize", "AveragePool", "Concat", "Softmax", "Where",
     "Gather", "GatherElements", "Transpose", "EmbedLayerNormalization", "Slice", "TopK",
     "InstanceNormalization", "LayerNormalization", "BatchNormalization", "CumSum"}
)  # fmt: skip
# QDQDirect8BitOp and its kin: the output shares the input's pair, if the input has one.
_DIRECT = frozenset(
    {"Reshape", "Transpose", "Squeeze", "Unsqueeze", "Flatten", "AveragePool", "Slice", "TopK",
     "Resize", "MaxPool"}
)  # fmt: skip
_WEIGHTED = frozenset({"Conv", "ConvTranspose", "Gemm"})
_NORMS = frozenset({"InstanceNormalization", "LayerNormalization", "BatchNormalization"})
_REMOVABLE = frozenset({"Relu", "Clip"})
_FLOAT = (np.dtype(np.float32), np.dtype(np.float16))


@dataclass(frozen=True)
class QDQPlan:
    """``tensors``: the float model's tensors given a Q/DQ pair (activations, weights,
    biases); ``removed``: each Relu/Clip the quantizer drops -> the tensor it read (its
    producer writes the Relu's output instead); ``markers``: tensor -> the nodes asking for
    its pair."""

    tensors: frozenset[str]
    removed: dict[str, str]
    markers: dict[str, frozenset[str]]

    @property
    def key(self) -> tuple[frozenset[str], frozenset[str]]:
        """Two exclusion sets with the same key give the same quantized model."""
        return self.tensors, frozenset(self.removed)


class _Walk:
    def __init__(self, model: LoadedModel) -> None:
        self.model = model
        self.dtypes = model.dtypes
        self.marked: dict[str, set[str]] = {}
        self.removed: dict[str, str] = {}

    def mark(self, tensor: str, node: str) -> None:
        if tensor and self.dtypes.get(tensor) in _FLOAT:
            self.marked.setdefault(tensor, set()).add(node)

    def has(self, tensor: str) -> bool:
        return tensor in self.marked


def qdq_plan(model: LoadedModel, exclude: Collection[str], *, removable: bool = True) -> QDQPlan:
    """The pairs ``quantize_static(model, nodes_to_exclude=exclude, quant_format=QDQ)`` writes
    (see module). ``removable``: whether it drops a Relu/Clip after a quantized tensor (not
    with symmetric activations or ``QDQKeepRemovableActivations``)."""
    walk = _Walk(model)
    for n in model.nodes:
        if n.op_type in OP_TYPES and n.name not in exclude and n.name not in model.constant_nodes:
            _quantize(walk, n, removable)
    return QDQPlan(
        frozenset(walk.marked),
        dict(walk.removed),
        {t: frozenset(ns) for t, ns in walk.marked.items()},
    )


def _quantize(walk: _Walk, n: NodeInfo, removable: bool) -> None:
    """One op quantizer's ``quantize()``: the tensors it marks."""
    op, name = n.op_type, n.name
    first = n.inputs[0] if n.inputs else ""
    if op in _WEIGHTED or op in _NORMS:
        bias_ok = op != "Gemm" or (len(n.inputs) > 2 and n.inputs[2] in walk.model.initializers)
        for t in (*n.inputs[:2], *(n.inputs[2:3] if bias_ok else ()), *n.outputs[:1]):
            walk.mark(t, name)
    elif op in _REMOVABLE:
        if not walk.has(first):
            return  # an unquantized input: the activation stays as it is, unmarked
        if removable and _replaceable(walk.model, first):
            # try_replacing_upstream_output: the producer writes the output, whose pair
            # the producer's markers (and this node) now ask for.
            markers = walk.marked.pop(first)
            walk.removed[name] = first
            walk.marked.setdefault(n.outputs[0], set()).update(markers | {name})
            return
        walk.mark(first, name)
        walk.mark(n.outputs[0], name)
    elif op in _DIRECT:
        if walk.has(first):
            walk.mark(n.outputs[0], name)
    elif op == "Split":
        walk.mark(first, name)
        for o in n.outputs:
            walk.mark(o, name)
    elif op in ("Gather", "GatherElements"):
        if first in walk.model.initializers:
            walk.mark(first, name)
        if walk.has(first):
            walk.mark(n.outputs[0], name)
    elif op == "Where":
        if len(n.inputs) > 2 and walk.has(n.inputs[1]) and walk.has(n.inputs[2]):
            for o in n.outputs:
                walk.mark(o, name)
    else:  # QDQOperatorBase: every input and output
        for t in (*n.inputs, *n.outputs):
            walk.mark(t, name)


def _replaceable(model: LoadedModel, tensor: str) -> bool:
    """Whether the quantizer can have ``tensor``'s producer write the activation's output:
    it has one reader and is no graph input or output."""
    return (
        len(model.readers.get(tensor, ())) == 1
        and tensor in model.producer
        and tensor not in model.outputs
        and tensor not in model.inputs
    )
