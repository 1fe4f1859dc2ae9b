"""The settings an int8 model was quantized with, read from the model (pure): what to pass
``quantize_static``/``quantize_dynamic`` to quantize the float model the same way again, and
the call a user pastes."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx
from onnx import numpy_helper

from onnx_bisect.graph.refloat import weight_only_dequantized

__all__ = ["QuantSettings", "read_settings"]

# Integer dtype of the zero point -> onnxruntime's QuantType name.
_TYPES: dict[int, str] = {
    onnx.TensorProto.UINT8: "QUInt8",
    onnx.TensorProto.INT8: "QInt8",
    onnx.TensorProto.UINT16: "QUInt16",
    onnx.TensorProto.INT16: "QInt16",
    onnx.TensorProto.UINT4: "QUInt4",
    onnx.TensorProto.INT4: "QInt4",
}
_QOPERATOR_WEIGHT = {"QLinearConv": 3, "QLinearMatMul": 3, "QGemm": 3}
_DYNAMIC_KERNELS = frozenset({"MatMulInteger", "ConvInteger"})
_WEIGHT_READERS = frozenset({"Conv", "ConvTranspose", "Gemm", "MatMul"})


@dataclass(frozen=True)
class QuantSettings:
    """``form``: ``QDQ``, ``QOperator``, ``dynamic`` or ``nbits`` (weight-only, onnxruntime's
    MatMulNBitsQuantizer: ``bits``, ``block_size``, ``weight_symmetric``,
    ``accuracy_level``); types as ``QuantType`` names."""

    form: str
    activation_type: str
    weight_type: str
    per_channel: bool
    activation_symmetric: bool
    reduce_range: bool
    bits: int = 0
    block_size: int = 0
    weight_symmetric: bool = False
    accuracy_level: int | None = None
    # The weight-only quantizer's ``quant_format`` (QOperator: MatMulNBits; QDQ: blockwise
    # DequantizeLinear) and ``op_types_to_quantize`` (Gather too: GatherBlockQuantized).
    nbits_format: str = "QOperator"
    op_types: tuple[str, ...] = ("MatMul",)

    @property
    def dynamic(self) -> bool:
        return self.form == "dynamic"

    @property
    def calibrated(self) -> bool:
        """Whether quantizing again needs calibration inputs (static quantization)."""
        return self.form in ("QDQ", "QOperator")

    def kwargs(self) -> dict[str, Any]:
        """Keyword arguments by name (values as text: ``QuantType.QInt8``), nodes apart."""
        out: dict[str, Any] = {}
        if not self.dynamic:
            out["quant_format"] = f"QuantFormat.{self.form}"
            out["activation_type"] = f"QuantType.{self.activation_type}"
        out["weight_type"] = f"QuantType.{self.weight_type}"
        out["per_channel"] = self.per_channel
        out["reduce_range"] = self.reduce_range
        if self.activation_symmetric and not self.dynamic:
            out["extra_options"] = {"ActivationSymmetric": True}
        return out

    def call(self, nodes: Sequence[str]) -> str:
        """The call to paste: the float model quantized again with ``nodes`` excluded."""
        if self.form == "nbits":
            extra = ""
            if self.nbits_format != "QOperator":
                extra += f"quant_format=QuantFormat.{self.nbits_format}, "
            if self.op_types != ("MatMul",):
                extra += f"op_types_to_quantize={self.op_types!r}, "
            return (
                f"MatMulNBitsQuantizer(model, bits={self.bits}, block_size={self.block_size}, "
                f"is_symmetric={self.weight_symmetric}, accuracy_level={self.accuracy_level}, "
                f"{extra}nodes_to_exclude={list(nodes)!r}).process()"
            )
        head = (
            "quantize_dynamic(model_input, model_output"
            if self.dynamic
            else "quantize_static(model_input, model_output, calibration_data_reader"
        )
        args = [f"nodes_to_exclude={list(nodes)!r}"]
        for k, v in self.kwargs().items():
            args.append(f"{k}={v}" if isinstance(v, str) else f"{k}={v!r}")
        return f"{head}, {', '.join(args)})"

    def to_dict(self) -> dict[str, Any]:
        if self.form == "nbits":
            return {
                "format": self.form,
                "bits": self.bits,
                "block_size": self.block_size,
                "is_symmetric": self.weight_symmetric,
                "accuracy_level": self.accuracy_level,
                "quant_format": self.nbits_format,
                "op_types_to_quantize": list(self.op_types),
            }
        return {
            "format": self.form,
            "activation_type": None if self.dynamic else self.activation_type,
            "weight_type": self.weight_type,
            "per_channel": self.per_channel,
            "activation_symmetric": self.activation_symmetric,
            "reduce_range": self.reduce_range,
        }


def read_settings(model: onnx.ModelProto) -> QuantSettings:
    """The quantizer's settings as the model shows them: the format by its ops, each type by
    its zero points' dtype, per-channel by a weight scale of more than one value, symmetric
    activations by zero points at the middle of their range, reduce_range by int8 weights
    that never leave [-64, 64]."""
    g = model.graph
    inits = {t.name: t for t in g.initializer}
    ops = {n.op_type for n in g.node}
    activations: list[onnx.TensorProto] = []
    weights: list[tuple[onnx.TensorProto | None, onnx.TensorProto | None, onnx.TensorProto]] = []
    if ops & {"MatMulNBits", "GatherBlockQuantized"}:
        return _nbits(model)
    blockwise = weight_only_dequantized(model)
    if blockwise and "QuantizeLinear" not in ops:
        return _nbits_qdq(next(iter(blockwise.values())), inits)
    if "DynamicQuantizeLinear" in ops or ops & _DYNAMIC_KERNELS:
        form = "dynamic"
        for n in g.node:
            if n.op_type in _DYNAMIC_KERNELS and n.input[1] in inits:
                zp = inits.get(n.input[3]) if len(n.input) > 3 else None
                weights.append((None, zp, inits[n.input[1]]))
    elif any(o.startswith("QLinear") or o == "QGemm" for o in ops):
        form = "QOperator"
        for n in g.node:
            at = _QOPERATOR_WEIGHT.get(n.op_type)
            if at is not None and n.input[at] in inits:
                w, s, z = (inits.get(i) for i in n.input[at : at + 3])
                if w is not None:
                    weights.append((s, z, w))
            if n.op_type == "QuantizeLinear" and len(n.input) > 2 and n.input[2] in inits:
                activations.append(inits[n.input[2]])
    else:
        form = "QDQ"
        # A weight is what a Conv, Gemm or MatMul reads past its first input: the quantizer
        # gives another op's constant (a Mul's factor) the activation type.
        weighted = {i for n in g.node if n.op_type in _WEIGHT_READERS for i in n.input[1:2]}
        for n in g.node:
            if len(n.input) < 3 or n.input[2] not in inits:
                continue
            if n.op_type == "QuantizeLinear" and n.input[0] not in inits:
                activations.append(inits[n.input[2]])
            elif n.op_type == "DequantizeLinear" and n.output[0] in weighted:
                q = inits.get(n.input[0])
                if q is not None and q.data_type != onnx.TensorProto.INT32:  # not a bias
                    weights.append((inits.get(n.input[1]), inits[n.input[2]], q))
    return _settings(form, activations, weights)


def _settings(
    form: str,
    activations: Sequence[onnx.TensorProto],
    weights: Sequence[tuple[onnx.TensorProto | None, onnx.TensorProto | None, onnx.TensorProto]],
) -> QuantSettings:
    act = _TYPES.get(activations[0].data_type, "QUInt8") if activations else "QUInt8"
    wt = _TYPES.get(weights[0][2].data_type, "QInt8") if weights else "QInt8"
    per_channel = any(s is not None and int(np.prod(s.dims)) > 1 for s, _, _ in weights)
    symmetric = bool(activations) and all(_middle(z) for z in activations)
    reduce_range = (
        wt == "QInt8"
        and bool(weights)
        and all(int(np.abs(numpy_helper.to_array(w).astype(np.int32)).max(initial=0)) <= 64
                for _, _, w in weights)
    )  # fmt: skip
    return QuantSettings(form, act, wt, per_channel, symmetric, reduce_range)


def _nbits(model: onnx.ModelProto) -> QuantSettings:
    """A weight-only model's settings, from its first MatMulNBits (else GatherBlockQuantized):
    an asymmetric one has zero points (MatMulNBits' fourth input, GatherBlockQuantized's)."""
    g = model.graph
    kernels = [n for n in g.node if n.op_type in ("MatMulNBits", "GatherBlockQuantized")]
    node = next((n for n in kernels if n.op_type == "MatMulNBits"), kernels[0])
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    symmetric = not (len(node.input) > 3 and node.input[3])  # the zero point, in both
    bits = int(attrs.get("bits", 4))
    level = attrs.get("accuracy_level")
    gather = any(n.op_type == "GatherBlockQuantized" for n in kernels)
    return QuantSettings(
        "nbits", "", f"QInt{bits}", False, False, False, bits, int(attrs.get("block_size", 128)),
        symmetric, int(level) if level is not None else None,
        op_types=("MatMul", "Gather") if gather else ("MatMul",),
    )  # fmt: skip


def _nbits_qdq(dq: onnx.NodeProto, inits: dict[str, onnx.TensorProto]) -> QuantSettings:
    """MatMulNBitsQuantizer's QDQ form: bits by the weight's type, symmetric without a zero
    point, the DequantizeLinear's block size."""
    t = inits[dq.input[0]]
    narrow = (onnx.TensorProto.INT4, onnx.TensorProto.UINT4)
    bits = 4 if t.data_type in narrow else 8
    symmetric = not (len(dq.input) > 2 and dq.input[2])
    block = next((a.i for a in dq.attribute if a.name == "block_size"), 0)
    return QuantSettings(
        "nbits", "", f"QInt{bits}", False, False, False, bits, int(block), symmetric, None,
        nbits_format="QDQ",
    )  # fmt: skip


def _middle(zp: onnx.TensorProto) -> bool:
    """A symmetric zero point: 0 for a signed type, the middle for an unsigned one."""
    values = numpy_helper.to_array(zp).astype(np.int64)
    signed = zp.data_type in (onnx.TensorProto.INT8, onnx.TensorProto.INT16, onnx.TensorProto.INT4)
    if signed:
        return bool(np.all(values == 0))
    widths: dict[int, int] = {onnx.TensorProto.UINT8: 8, onnx.TensorProto.UINT16: 16}
    bits = widths.get(zp.data_type, 4)
    mid = 1 << (bits - 1)
    return bool(np.all((values == mid) | (values == mid - 1)))
