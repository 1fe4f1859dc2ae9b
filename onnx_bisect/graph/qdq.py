"""Quantized tensors of a model: where their scale and zero point are, what float tensor each
stands for, and why one has no counterpart (pure graph reading).

Three forms exist. QDQ: ``X -> QuantizeLinear -> DequantizeLinear ->`` float ops, so a
QuantizeLinear's output stands for its input and a DequantizeLinear's output for what its
input stands for. QOperator: QLinearConv and its kin read and write integers, with the scales
among their inputs; onnxruntime names the integer tensor after the float one it replaces
(``X_quantized``). Dynamic: DynamicQuantizeLinear computes its scale at run time, and
MatMulInteger/ConvInteger accumulate in int32 under the product of two such scales.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from onnx_bisect.graph.view import LoadedModel, NodeInfo

__all__ = ["QDQ_OPS", "QTensor", "QuantGraph", "is_quantized", "read_quantized"]

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


@dataclass(frozen=True)
class QuantGraph:
    tensors: dict[str, QTensor] = field(default_factory=dict)
    unpaired: dict[str, str] = field(default_factory=dict)  # tensor -> why no counterpart

    def params_of(self, name: str) -> QTensor | None:
        return self.tensors.get(name)


def is_quantized(model: LoadedModel) -> bool:
    """Whether the model has quantized tensors computed at run time (not just weights)."""
    return any(_quant_op(n) for n in model.nodes if n.name not in model.constant_nodes)


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
    for n in model.nodes:
        if n.name in constants:
            continue
        if n.op_type in _DYNAMIC:
            for o in n.outputs:
                out.unpaired[o] = "dynamic quantization: its scale is computed at run time"
            quantized.update(n.outputs)
        elif n.op_type in _ACCUMULATORS:
            for o in n.outputs:
                out.unpaired[o] = "an int32 accumulator, under the product of two run-time scales"
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
            o, known.scale, known.zero_point, None, _named_source(o), "onnxruntime's name", True
        )


def _named_source(name: str) -> str | None:
    for suffix in _SUFFIXES:
        if name.endswith(suffix) and len(name) > len(suffix):
            return name[: -len(suffix)]
    return None
