"""Small float models and their int8 copies, quantized by onnxruntime.quantization on a few
seeded calibration inputs (QDQ, QOperator, dynamic)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from tests.models import make

DETECTOR_SHAPE = (1, 3, 16, 16)
BLOCK_SHAPE = (1, 8, 16)


def _w(rng: np.random.Generator, shape: tuple[int, ...], name: str) -> onnx.TensorProto:
    fan_in = int(np.prod(shape[1:])) if len(shape) > 2 else shape[0]
    return numpy_helper.from_array(
        (rng.standard_normal(shape) / np.sqrt(fan_in)).astype(np.float32), name
    )


def detector(seed: int = 0) -> onnx.ModelProto:
    """Conv -> Relu -> Conv -> Relu, then a score head (Sigmoid, values in [0, 1]) and a box
    head (Sigmoid × 300, values in [0, 300]) joined by one Concat, as a YOLO head is: a
    quantizer gives the Concat's inputs its output's scale, which the boxes set."""
    rng = np.random.default_rng(seed)
    inits = [_w(rng, (8, 3, 3, 3), "W1"), _w(rng, (8, 8, 3, 3), "W2"),
             _w(rng, (4, 8, 1, 1), "Ws"), _w(rng, (4, 8, 1, 1), "Wb"),
             numpy_helper.from_array(np.array(300.0, np.float32), "k300")]  # fmt: skip
    nodes = [
        helper.make_node("Conv", ["x", "W1"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c1"], ["r1"], name="relu1"),
        helper.make_node("Conv", ["r1", "W2"], ["c2"], name="conv2", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c2"], ["r2"], name="relu2"),
        helper.make_node("Conv", ["r2", "Ws"], ["s_logits"], name="score_conv"),
        helper.make_node("Sigmoid", ["s_logits"], ["scores"], name="score_sigmoid"),
        helper.make_node("Conv", ["r2", "Wb"], ["b_logits"], name="box_conv"),
        helper.make_node("Sigmoid", ["b_logits"], ["b_unit"], name="box_sigmoid"),
        helper.make_node("Mul", ["b_unit", "k300"], ["boxes"], name="box_scale"),
        helper.make_node("Concat", ["boxes", "scores"], ["y"], name="head_concat", axis=1),
    ]
    return make(
        nodes,
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(DETECTOR_SHAPE))],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8, 16, 16])],
        inits,
    )


def convnet(seed: int = 0) -> onnx.ModelProto:
    """Conv -> Relu -> Conv -> Relu -> Conv: nothing but rounding to lose."""
    rng = np.random.default_rng(seed)
    inits = [_w(rng, (8, 3, 3, 3), "W1"), _w(rng, (8, 8, 3, 3), "W2"), _w(rng, (4, 8, 1, 1), "W3")]
    nodes = [
        helper.make_node("Conv", ["x", "W1"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c1"], ["r1"], name="relu1"),
        helper.make_node("Conv", ["r1", "W2"], ["c2"], name="conv2", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c2"], ["r2"], name="relu2"),
        helper.make_node("Conv", ["r2", "W3"], ["y"], name="conv3"),
    ]
    return make(
        nodes,
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(DETECTOR_SHAPE))],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 16, 16])],
        inits,
    )


def block(seed: int = 0, d: int = 16) -> onnx.ModelProto:
    """One attention block: LayerNorm, Q/K/V projections, softmax(QKᵀ/√d)V, output
    projection, residual Add."""
    rng = np.random.default_rng(seed)
    inits = [_w(rng, (d, d), n) for n in ("Wq", "Wk", "Wv", "Wo")]
    inits += [
        numpy_helper.from_array(np.ones(d, np.float32), "gamma"),
        numpy_helper.from_array(np.zeros(d, np.float32), "beta"),
        numpy_helper.from_array(np.array(1 / np.sqrt(d), np.float32), "inv_sqrt_d"),
    ]
    nodes = [
        helper.make_node("LayerNormalization", ["x", "gamma", "beta"], ["h"], name="ln", axis=-1),
        helper.make_node("MatMul", ["h", "Wq"], ["q"], name="q_proj"),
        helper.make_node("MatMul", ["h", "Wk"], ["k"], name="k_proj"),
        helper.make_node("MatMul", ["h", "Wv"], ["v"], name="v_proj"),
        helper.make_node("Transpose", ["k"], ["kt"], name="k_t", perm=[0, 2, 1]),
        helper.make_node("MatMul", ["q", "kt"], ["qk"], name="scores"),
        helper.make_node("Mul", ["qk", "inv_sqrt_d"], ["qk_s"], name="scale"),
        helper.make_node("Softmax", ["qk_s"], ["p"], name="softmax", axis=-1),
        helper.make_node("MatMul", ["p", "v"], ["a"], name="attend"),
        helper.make_node("MatMul", ["a", "Wo"], ["o"], name="o_proj"),
        helper.make_node("Add", ["x", "o"], ["y"], name="residual"),
    ]
    return make(
        nodes,
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(BLOCK_SHAPE))],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, list(BLOCK_SHAPE))],
        inits,
    )


ERF_SHAPE = (1, 960, 64)


def erf_matmul(seed: int = 0) -> onnx.ModelProto:
    """x -> Erf ('pre') -> MatMul ('mm') -> y: for ``quantized(..., "dynamic")``, whose
    DynamicQuantizeLinear reads the Erf, a function runtimes compute to different last bits."""
    rng = np.random.default_rng(seed)
    width = ERF_SHAPE[-1]
    weight = (rng.standard_normal((width, width)) / np.sqrt(width)).astype(np.float32)
    nodes = [
        helper.make_node("Erf", ["x"], ["p"], name="pre"),
        helper.make_node("MatMul", ["p", "W"], ["y"], name="mm"),
    ]
    graph = helper.make_graph(
        nodes,
        "erf_matmul",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(ERF_SHAPE))],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, list(ERF_SHAPE))],
        [numpy_helper.from_array(weight, "W")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


LSTM_SHAPE = (16, 2, 32)


def lstm(seed: int = 0, hidden: int = 64) -> onnx.ModelProto:
    """One LSTM layer (its output squeezed), for ``quantized(..., "dynamic",
    op_types_to_quantize=["LSTM"])``: a com.microsoft DynamicQuantizeLSTM, whose ONNX Runtime
    kernel quantizes the activations to uint8 as well as the weights."""
    rng = np.random.default_rng(seed)
    seq, batch, width = LSTM_SHAPE
    w = rng.standard_normal((1, 4 * hidden, width)) * 0.2
    r = rng.standard_normal((1, 4 * hidden, hidden)) * 0.2
    b = rng.standard_normal((1, 8 * hidden)) * 0.1
    inits = [
        numpy_helper.from_array(v.astype(np.float32), n) for n, v in (("W", w), ("R", r), ("B", b))
    ]
    inits.append(numpy_helper.from_array(np.array([1], np.int64), "axis"))
    nodes = [
        helper.make_node("LSTM", ["x", "W", "R", "B"], ["Y"], hidden_size=hidden, name="lstm"),
        helper.make_node("Squeeze", ["Y", "axis"], ["y"], name="squeeze"),
    ]
    graph = helper.make_graph(
        nodes,
        "lstm",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(LSTM_SHAPE))],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [seq, batch, hidden])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def calibration(name: str, shape: tuple[int, ...], n: int = 4) -> list[dict[str, np.ndarray]]:
    """Seeded calibration inputs in [0, 1), as the tool's own seeded feeds for float inputs."""
    return [
        {name: np.random.default_rng(100 + i).random(shape).astype(np.float32)} for i in range(n)
    ]


def quantized(
    model: onnx.ModelProto,
    tmp: Path,
    form: str,
    activation: str = "QUInt8",
    weight: str = "QInt8",
    **kwargs: object,
) -> tuple[Path, Path]:
    """The float model and its ``form`` copy (``qdq``, ``qdq-per-channel``, ``qoperator``,
    ``dynamic``) written to ``tmp``, static forms with ``activation`` and ``weight`` types
    (names of onnxruntime's ``QuantType``)."""
    from onnxruntime.quantization import (
        CalibrationDataReader,
        QuantFormat,
        QuantType,
        quantize_dynamic,
        quantize_static,
    )

    src = tmp / "float.onnx"
    onnx.save(model, str(src))
    dst = tmp / f"{form}.onnx"
    if form == "dynamic":
        quantize_dynamic(str(src), str(dst), weight_type=QuantType.QInt8, **kwargs)  # type: ignore[arg-type]
        return src, dst
    first = model.graph.input[0]
    shape = tuple(d.dim_value for d in first.type.tensor_type.shape.dim)

    class Reader(CalibrationDataReader):  # type: ignore[misc]
        def __init__(self) -> None:
            self.items = iter(calibration(first.name, shape))

        def get_next(self) -> dict[str, np.ndarray] | None:
            return next(self.items, None)

    quantize_static(
        str(src),
        str(dst),
        Reader(),
        quant_format=QuantFormat.QOperator if form == "qoperator" else QuantFormat.QDQ,
        per_channel=form == "qdq-per-channel",
        activation_type=QuantType[activation],
        weight_type=QuantType[weight],
        **kwargs,  # type: ignore[arg-type]
    )
    return src, dst
