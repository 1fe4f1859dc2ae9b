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


HEAD_SHAPE = (1, 3, 16, 16)
HEAD_CLASSES = 8


def yolo_head(seed: int = 0) -> onnx.ModelProto:
    """YOLOv8's head in small: boxes (Sigmoid × 320, values in [0, 320]) and class scores
    (the Sigmoid of logits around -8, most scores below 0.005, plus a peak where an input
    channel is above 0.95, as an object makes: scores near 1 there) joined by one Concat
    into ``y`` (1, 4 + HEAD_CLASSES, 16, 16). The Sigmoid's own Q/DQ pair, its scale set by
    the peaks, rounds most scores to 0; the Concat's, set by the boxes, rounds them all."""
    rng = np.random.default_rng(seed)
    classes = numpy_helper.from_array(
        (rng.standard_normal((HEAD_CLASSES, 8, 1, 1)) * 1.2).astype(np.float32), "Wc"
    )
    peaks = np.zeros((HEAD_CLASSES, 3, 1, 1), np.float32)
    peaks[np.arange(HEAD_CLASSES), np.arange(HEAD_CLASSES) % 3] = 200.0
    inits = [_w(rng, (8, 3, 3, 3), "W1"), _w(rng, (8, 8, 3, 3), "W2"), classes,
             numpy_helper.from_array(np.full(HEAD_CLASSES, -8.0, np.float32), "Bc"),
             numpy_helper.from_array(peaks, "Wp"),
             numpy_helper.from_array(np.full(HEAD_CLASSES, -190.0, np.float32), "Bp"),
             _w(rng, (4, 8, 1, 1), "Wb"),
             numpy_helper.from_array(np.array(320.0, np.float32), "k320")]  # fmt: skip
    nodes = [
        helper.make_node("Conv", ["x", "W1"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c1"], ["r1"], name="relu1"),
        helper.make_node("Conv", ["r1", "W2"], ["c2"], name="conv2", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c2"], ["r2"], name="relu2"),
        helper.make_node("Conv", ["r2", "Wc", "Bc"], ["cls_base"], name="cls_conv"),
        helper.make_node("Conv", ["x", "Wp", "Bp"], ["p_logits"], name="peak_conv"),
        helper.make_node("Relu", ["p_logits"], ["peak"], name="peak_relu"),
        helper.make_node("Add", ["cls_base", "peak"], ["cls_logits"], name="cls_add"),
        helper.make_node("Sigmoid", ["cls_logits"], ["scores"], name="cls_sigmoid"),
        helper.make_node("Conv", ["r2", "Wb"], ["b_logits"], name="box_conv"),
        helper.make_node("Sigmoid", ["b_logits"], ["b_unit"], name="box_sigmoid"),
        helper.make_node("Mul", ["b_unit", "k320"], ["boxes"], name="box_scale"),
        helper.make_node("Concat", ["boxes", "scores"], ["y"], name="head_concat", axis=1),
    ]
    return make(
        nodes,
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(HEAD_SHAPE))],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4 + HEAD_CLASSES, 16, 16])],
        inits,
    )


def convnet(seed: int = 0, layers: int = 2) -> onnx.ModelProto:
    """``layers`` × (Conv -> Relu), then a 1x1 Conv: nothing but rounding to lose."""
    rng = np.random.default_rng(seed)
    inits = [_w(rng, (8, 3, 3, 3), "W1"), _w(rng, (4, 8, 1, 1), f"W{layers + 1}")]
    inits += [_w(rng, (8, 8, 3, 3), f"W{k}") for k in range(2, layers + 1)]
    nodes: list[onnx.NodeProto] = []
    x = "x"
    for k in range(1, layers + 1):
        nodes += [
            helper.make_node("Conv", [x, f"W{k}"], [f"c{k}"], name=f"conv{k}", pads=[1, 1, 1, 1]),
            helper.make_node("Relu", [f"c{k}"], [f"r{k}"], name=f"relu{k}"),
        ]
        x = f"r{k}"
    nodes.append(helper.make_node("Conv", [x, f"W{layers + 1}"], ["y"], name=f"conv{layers + 1}"))
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


MLP_SHAPE = (1, 32, 64)


def outlier_mlp(seed: int = 0, d: int = 64, hidden: int = 128, vocab: int = 50) -> onnx.ModelProto:
    """A decoder MLP and its LM head: ``x * S -> up -> Relu -> down -> + x -> lm_head``, with
    one outlier input channel of ``up``'s weight (row 7 × 30) that the norm's ``S`` (1/30
    there) cancels, as an LLM's folded norm leaves one: in float nothing stands out, but int4
    blocks holding that row get its scale, and their other 31 rows round to 0."""
    rng = np.random.default_rng(seed)
    up = (rng.standard_normal((d, hidden)) / np.sqrt(d)).astype(np.float32)
    up[7, :] *= 30.0
    norm = np.ones(d, np.float32)
    norm[7] = 1 / 30.0
    inits = [numpy_helper.from_array(norm, "S"), numpy_helper.from_array(up, "W_up"),
             _w(rng, (hidden, d), "W_down"), _w(rng, (d, vocab), "W_head")]  # fmt: skip
    nodes = [
        helper.make_node("Mul", ["x", "S"], ["xs"], name="norm"),
        helper.make_node("MatMul", ["xs", "W_up"], ["h"], name="up"),
        helper.make_node("Relu", ["h"], ["r"], name="act"),
        helper.make_node("MatMul", ["r", "W_down"], ["m"], name="down"),
        helper.make_node("Add", ["x", "m"], ["s"], name="residual"),
        helper.make_node("MatMul", ["s", "W_head"], ["logits"], name="lm_head"),
    ]
    return make(
        nodes,
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(MLP_SHAPE))],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, MLP_SHAPE[1], vocab])],
        inits,
    )


def int4(model: onnx.ModelProto, tmp: Path, exclude: tuple[str, ...] = ()) -> tuple[Path, Path]:
    """The float model and its weight-only int4 copy (MatMulNBitsQuantizer, block 32,
    symmetric, RTN), ``exclude`` left in float."""
    import copy

    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    src, dst = tmp / "float.onnx", tmp / "int4.onnx"
    onnx.save(model, str(src))
    q = MatMulNBitsQuantizer(copy.deepcopy(model), block_size=32, is_symmetric=True,
                             nodes_to_exclude=list(exclude))  # fmt: skip
    q.process()
    q.model.save_model_to_file(str(dst))
    return src, dst
