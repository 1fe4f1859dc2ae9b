"""Quantized tensors of a model: where their scale and zero point are, what float tensor each
stands for, and why one has no counterpart (pure graph reading).

Three forms exist. QDQ: ``X -> QuantizeLinear -> DequantizeLinear ->`` float ops, so a
QuantizeLinear's output stands for its input and a DequantizeLinear's output for what its
input stands for. QOperator: QLinearConv and its kin read and write integers, with the scales
among their inputs; onnxruntime names the integer tensor after the float one it replaces
(``X_quantized``). Dynamic: DynamicQuantizeLinear computes its scale at run time, and
MatMulInteger/ConvInteger accumulate in int32 under the product of two scales, which a
``Cast -> Mul`` by that product (``[-> Add]`` of the bias) turns back into the float tensor:
their scale and zero point are tensors of the model, read from its run.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from onnx_bisect.graph.refloat import weight_only_dequantized
from onnx_bisect.graph.view import LoadedModel, NodeInfo

__all__ = [
    "QDQ_OPS",
    "WEIGHT_ONLY",
    "QTensor",
    "QuantGraph",
    "is_quantized",
    "is_weight_only",
    "read_quantized",
]

QDQ_OPS = frozenset({"QuantizeLinear", "DequantizeLinear"})

# Where a producer's output scale and zero point are among its inputs.
_OUT_PARAMS: dict[str, tuple[int, int]] = {
    "QuantizeLinear": (1, 2),
    "QLinearConv": (6, 7),
    "QLinearMatMul": (6, 7),
    "QLinearAdd": (6, 7),
    "QLinearMul": (6, 7),
    "QGemm": (7, 8),
    "QLinearSigmoid": (3, 4),
    "QLinearLeakyRelu": (3, 4),
    "QLinearSoftmax": (3, 4),
    "QLinearAveragePool": (3, 4),
    "QLinearGlobalAveragePool": (3, 4),
    "QLinearReduceMean": (3, 4),
    "QLinearConcat": (0, 1),
}
# Ops that move integers without changing their meaning: output scale = input scale.
_PASS_THROUGH = frozenset(
    {"Reshape", "Transpose", "Split", "MaxPool", "Resize", "Squeeze", "Unsqueeze", "Flatten",
     "Slice", "Gather", "Identity", "DepthToSpace", "SpaceToDepth", "Tile", "Expand"}
)  # fmt: skip
_DYNAMIC = frozenset({"DynamicQuantizeLinear"})
# Weight-only kernels (onnxruntime's MatMulNBitsQuantizer): float activations in and out,
# blockwise int4/int8 weights inside.
WEIGHT_ONLY = frozenset({"MatMulNBits", "GatherBlockQuantized"})
_ACCUMULATORS = frozenset({"MatMulInteger", "ConvInteger"})
# onnxruntime's names for the integer tensor replacing X: X_quantized, and Xquantized for
# the outputs of a Split it moved to integers.
_SUFFIXES = ("_quantized", "quantized")


@dataclass(frozen=True)
class QTensor:
    """A quantized tensor of the model: its scale and zero point (initializer names), the
    axis of a per-channel scale, and the float tensor it stands for, by which rule."""

    name: str
    scale: str
    zero_point: str | None
    axis: int | None
    stands_for: str | None  # a tensor name of the same model, or of the float model
    rule: str
    integer: bool  # the value is integers (dequantize to compare); else already float
    # Dynamic quantization: ``scale`` and ``zero_point`` name tensors the model computes.
    runtime: bool = False


@dataclass(frozen=True)
class QuantGraph:
    tensors: dict[str, QTensor] = field(default_factory=dict)
    unpaired: dict[str, str] = field(default_factory=dict)  # tensor -> why no counterpart
    # Dynamic chains: an accumulator's scaled float result read by a bias Add -> that Add's
    # output and the bias (the float model has the biased tensor only).
    biased: dict[str, tuple[str, str]] = field(default_factory=dict)
    # Float results of dynamic chains (the Mul's, or its bias Add's, output): they stand
    # for the float tensor of the same name although another op makes them.
    results: set[str] = field(default_factory=set)

    def params_of(self, name: str) -> QTensor | None:
        return self.tensors.get(name)


def is_quantized(model: LoadedModel) -> bool:
    """Whether the model has quantized tensors computed at run time (not just weights)."""
    return any(_quant_op(n) for n in model.nodes if n.name not in model.constant_nodes)


def is_weight_only(model: LoadedModel) -> bool:
    """Whether the model has weight-only quantized kernels (MatMulNBits, GatherBlockQuantized)
    or their QDQ form (int4 or blockwise DequantizeLinear of a weight)."""
    return any(n.op_type in WEIGHT_ONLY for n in model.nodes) or bool(
        weight_only_dequantized(model.model)
    )


def _quant_op(n: NodeInfo) -> bool:
    return (
        n.op_type in QDQ_OPS
        or n.op_type in _OUT_PARAMS
        or n.op_type in _DYNAMIC
        or n.op_type in _ACCUMULATORS
        or n.op_type.startswith("QLinear")
    )


def read_quantized(model: LoadedModel) -> QuantGraph:
    """Every quantized tensor computed at run time, with its parameters and counterpart."""
    out = QuantGraph()
    constants = set(model.constant_nodes)
    quantized: set[str] = set()
    readers = model.readers
    for n in model.nodes:
        if n.name in constants:
            continue
        if n.op_type in _DYNAMIC:
            _dynamic(n, out)
            quantized.update(n.outputs)
        elif n.op_type in _ACCUMULATORS:
            _accumulated(model, readers, n, out)
            quantized.update(n.outputs)
        elif n.op_type == "DequantizeLinear":
            _dequantized(model, n, out, quantized)
        elif n.op_type in _OUT_PARAMS:
            _produced(model, n, out)
            quantized.update(n.outputs)
        elif n.op_type.startswith("QLinear") or n.op_type == "QGemm":
            for o in n.outputs:
                out.unpaired[o] = f"{n.op_type}: where its output scale is, is not known here"
            quantized.update(n.outputs)
        elif n.op_type in _PASS_THROUGH and n.inputs and n.inputs[0] in quantized:
            _passed(n, out, quantized)
    return out


def _dynamic(n: NodeInfo, out: QuantGraph) -> None:
    """DynamicQuantizeLinear: y stands for x under the scale and zero point it outputs."""
    y, scale, zp = (*n.outputs, "", "")[:3]
    out.tensors[y] = QTensor(y, scale, zp or None, None, n.inputs[0], "run-time scale", True, True)
    for p, what in ((scale, "scale"), (zp, "zero point")):
        if p:
            out.unpaired[p] = f"the run-time {what} of {y} (read from the run to dequantize it)"


def _accumulated(
    model: LoadedModel, readers: Mapping[str, Sequence[NodeInfo]], n: NodeInfo, out: QuantGraph
) -> None:
    """MatMulInteger/ConvInteger: the int32 accumulator and its Cast to float stand for what
    the ``Mul`` by the product of scales writes, which stands for the float op's output (or,
    with a bias Add after it, for that output less the bias)."""
    acc = n.outputs[0]
    chain = dynamic_chain(readers, acc)
    if chain is None:
        out.unpaired[acc] = (
            "an int32 accumulator not followed by Cast and Mul by its scales: no float value"
        )
        return
    cast, scales, result = chain
    for t in (acc, cast):
        out.tensors[t] = QTensor(t, scales, None, None, result, "accumulator × run-time scales",
                                 True, True)  # fmt: skip
    after = readers.get(result, ())
    add = after[0] if len(after) == 1 and after[0].op_type == "Add" else None
    fixed = set(model.initializers) | set(model.constants)  # a bias Reshape'd at run time
    bias = [i for i in add.inputs if i != result and i in fixed] if add else []
    if add is not None and bias:
        out.biased[result] = (add.outputs[0], bias[0])
        out.results.add(add.outputs[0])
    else:
        out.results.add(result)


def dynamic_chain(
    readers: Mapping[str, Sequence[NodeInfo]], acc: str
) -> tuple[str, str, str] | None:
    """An accumulator's ``Cast`` output, the product of scales the ``Mul`` after it reads,
    and that Mul's output: how onnxruntime's quantize_dynamic turns it back into floats."""
    casts = readers.get(acc, ())
    if len(casts) != 1 or casts[0].op_type != "Cast":
        return None
    cast = casts[0].outputs[0]
    muls = readers.get(cast, ())
    if len(muls) != 1 or muls[0].op_type != "Mul":
        return None
    scales = [i for i in muls[0].inputs if i != cast]
    return (cast, scales[0], muls[0].outputs[0]) if len(scales) == 1 else None


def _axis(model: LoadedModel, n: NodeInfo) -> int | None:
    attrs = {a.name: a for a in model.node_protos[n.name].attribute}
    return attrs["axis"].i if "axis" in attrs else None


def _dequantized(model: LoadedModel, n: NodeInfo, out: QuantGraph, quantized: set[str]) -> None:
    src = n.inputs[0]
    known = out.tensors.get(src)
    if src not in quantized or known is None:
        reason = out.unpaired.get(src)
        out.unpaired[n.outputs[0]] = f"dequantizes {src}, which has no counterpart" + (
            f" ({reason})" if reason else ""
        )
        return
    zp = n.inputs[2] if len(n.inputs) > 2 and n.inputs[2] else None
    out.tensors[n.outputs[0]] = QTensor(
        n.outputs[0], n.inputs[1], zp, _axis(model, n), known.stands_for, "dequantized", False
    )


def _produced(model: LoadedModel, n: NodeInfo, out: QuantGraph) -> None:
    s, z = _OUT_PARAMS[n.op_type]
    scale = n.inputs[s] if len(n.inputs) > s else ""
    if not scale or scale not in model.initializers:
        out.unpaired[n.outputs[0]] = f"{n.op_type} with a scale computed at run time"
        return
    zp = n.inputs[z] if len(n.inputs) > z and n.inputs[z] else None
    source: str | None
    if n.op_type == "QuantizeLinear":
        source, rule, axis = n.inputs[0], "quantized", _axis(model, n)
    else:
        source, rule, axis = _named_source(n.outputs[0]), "onnxruntime's name", None
    out.tensors[n.outputs[0]] = QTensor(n.outputs[0], scale, zp, axis, source, rule, True)


def _passed(n: NodeInfo, out: QuantGraph, quantized: set[str]) -> None:
    known = out.tensors.get(n.inputs[0])
    quantized.update(n.outputs)
    for o in n.outputs:
        if known is None or known.axis is not None:
            out.unpaired[o] = f"{n.op_type} of a tensor without known per-tensor parameters"
            continue
        out.tensors[o] = QTensor(
            o,
            known.scale,
            known.zero_point,
            None,
            _named_source(o),
            "onnxruntime's name",
            True,
            known.runtime,
        )


def _named_source(name: str) -> str | None:
    for suffix in _SUFFIXES:
        if name.endswith(suffix) and len(name) > len(suffix):
            return name[: -len(suffix)]
    return None
