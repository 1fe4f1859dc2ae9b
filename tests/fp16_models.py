"""Small float models onnxconverter-common 1.16's ``convert_float_to_float16(keep_io_types=True)``
writes invalid float16 copies of (each reproduces one breakage seen on real exports), and a
model whose float16 copy overflows."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from tests.models import make


def _vi(name: str, shape: list[int], elem: int = TensorProto.FLOAT) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, elem, shape)


def shared_initializer() -> onnx.ModelProto:
    """One constant read by a Max (in the converter's default op block list, so its operands
    stay float32) and by an Add it lowers: the Add gets float16 and float32."""
    c = numpy_helper.from_array(np.array(0.5, np.float32), "c")
    nodes = [
        helper.make_node("Max", ["x", "c"], ["m"], name="max"),
        helper.make_node("Add", ["m", "c"], ["y"], name="add"),
    ]
    return make(nodes, [_vi("x", [2, 3])], [_vi("y", [2, 3])], [c])


def constant_of_shape() -> onnx.ModelProto:
    """A ConstantOfShape without ``value`` (float32 zeros by the spec), labelled float16."""
    nodes = [
        helper.make_node("Shape", ["x"], ["s"], name="shape"),
        helper.make_node("ConstantOfShape", ["s"], ["z"], name="zeros"),
        helper.make_node("Add", ["x", "z"], ["y"], name="add"),
    ]
    return make(nodes, [_vi("x", [2, 3])], [_vi("y", [2, 3])])


def output_read_inside() -> onnx.ModelProto:
    """A Softmax whose output is a graph output that a Mul also reads (BERT's pooler as
    exported): the converter casts it back to float32 and still labels the Mul float16."""
    nodes = [
        helper.make_node("Softmax", ["x"], ["p"], name="softmax"),
        helper.make_node("Mul", ["p", "p"], ["y"], name="mul"),
    ]
    return make(nodes, [_vi("x", [2, 3])], [_vi("p", [2, 3]), _vi("y", [2, 3])])


def cast_in_loop() -> onnx.ModelProto:
    """A Loop whose body adds float(x's element count) via a Cast(to=FLOAT): the converter
    keeps the Cast's ``to`` and labels its output float16."""
    shape = [1, 2, 3, 3]
    body = helper.make_graph(
        [
            helper.make_node("Shape", ["acc_in"], ["s"], name="body_shape"),
            helper.make_node("Cast", ["s"], ["sf"], name="body_cast", to=TensorProto.FLOAT),
            helper.make_node("ReduceSum", ["sf"], ["n"], name="body_sum", keepdims=0),
            helper.make_node("Add", ["acc_in", "n"], ["acc_out"], name="body_add"),
            helper.make_node("Identity", ["cond_in"], ["cond_out"], name="body_cond"),
        ],
        "body",
        [
            _vi("i", [], TensorProto.INT64),
            _vi("cond_in", [], TensorProto.BOOL),
            _vi("acc_in", shape),
        ],
        [_vi("cond_out", [], TensorProto.BOOL), _vi("acc_out", shape)],
    )
    trip = numpy_helper.from_array(np.array(2, np.int64), "trip")
    cond = numpy_helper.from_array(np.array(True), "cond")
    loop = helper.make_node("Loop", ["trip", "cond", "x"], ["y"], name="loop", body=body)
    return make([loop], [_vi("x", shape)], [_vi("y", shape)], [trip, cond])


BROKEN = {
    "shared_initializer": (shared_initializer, "add"),
    "constant_of_shape": (constant_of_shape, "zeros"),
    "output_read_inside": (output_read_inside, "mul"),
    "cast_in_loop": (cast_in_loop, "body_cast"),
}


OVERFLOW_SHAPE = (1, 4, 64)


def matmul_overflow(scale: float = 3000.0) -> onnx.ModelProto:
    """x (in [0, 1)) -> MatMul by weights near ``scale`` and its bias Add (a Linear as
    exported; each output near 0.5 x 64 x 3000 ~ 1e5, beyond float16's 65504) ->
    LayerNormalization -> MatMul -> Relu -> y. In float32 the LayerNorm brings the values back
    to unit size; in float16 the first MatMul overflows to Inf and the LayerNorm gives NaN.
    (Without the Add, ONNX Runtime's CPU provider, which has no float16 MatMul or LayerNorm
    kernel, keeps the MatMul's output in float32 between the two.) ``scale=1`` is a model
    float16 runs fine."""
    rng = np.random.default_rng(0)
    d = OVERFLOW_SHAPE[-1]
    w1 = scale * (1.0 + 0.1 * rng.standard_normal((d, d)))
    w2 = rng.standard_normal((d, 16)) / np.sqrt(d)
    inits = [
        numpy_helper.from_array(w1.astype(np.float32), "w1"),
        numpy_helper.from_array(np.zeros(d, np.float32), "b1"),
        numpy_helper.from_array(np.ones(d, np.float32), "gamma"),
        numpy_helper.from_array(np.zeros(d, np.float32), "beta"),
        numpy_helper.from_array(w2.astype(np.float32), "w2"),
    ]
    nodes = [
        helper.make_node("MatMul", ["x", "w1"], ["h"], name="up"),
        helper.make_node("Add", ["h", "b1"], ["hb"], name=UP_BIAS),
        helper.make_node("LayerNormalization", ["hb", "gamma", "beta"], ["n"], name=NORM, axis=-1),
        helper.make_node("MatMul", ["n", "w2"], ["p"], name="down"),
        helper.make_node("Relu", ["p"], ["y"], name="act"),
    ]
    return make(
        nodes, [_vi("x", list(OVERFLOW_SHAPE))], [_vi("y", [*OVERFLOW_SHAPE[:2], 16])], inits
    )


def batchnorm_variance(variance: float = 1e7) -> onnx.ModelProto:
    """Conv -> BatchNormalization whose variance comes from a Constant of ``variance`` (PP-OCRv4
    det's first BatchNorm holds 1.0e7 to 9.8e7) -> Relu. onnxconverter-common clamps it to
    1e4, so the float16 copy's BatchNorm divides by 100 instead of 3162."""
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((4, 3, 3, 3)) * 300).astype(np.float32)
    params = {
        "scale": np.ones(4, np.float32),
        "bias": np.zeros(4, np.float32),
        "mean": np.zeros(4, np.float32),
        "var": np.full(4, variance, np.float32),
    }
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["c"], name="conv", pads=[1, 1, 1, 1]),
        *(
            helper.make_node("Constant", [], [k], name=f"bn_{k}", value=numpy_helper.from_array(v))
            for k, v in params.items()
        ),
        helper.make_node("BatchNormalization", ["c", *params], ["b"], name="bn"),
        helper.make_node("Relu", ["b"], ["y"], name="relu"),
    ]
    inits = [numpy_helper.from_array(w, "w")]
    return make(nodes, [_vi("x", [1, 3, 8, 8])], [_vi("y", [1, 4, 8, 8])], inits)


# A tiny decoder's prompt: input_ids [1, PROMPT] -> logits [1, PROMPT, VOCAB].
PROMPT, VOCAB, HIDDEN = 6, 32, 64
# Its nodes, named as the torch exporter names them (module path, then the op).
UP, UP_BIAS, NORM = "/model/up_proj/MatMul", "/model/up_proj/Add", "/model/norm/LayerNormalization"


def token_overflow(scale: float = 3000.0, seed: int = 0) -> onnx.ModelProto:
    """An LLM's shape in five nodes: input_ids -> the token embedding (Gather) -> an up
    projection by weights near ``scale`` and its bias Add (each value near 0.5 x 64 x 3000 ~
    1e5, beyond float16's 65504) -> LayerNormalization -> lm_head (MatMul) -> logits. In
    float32 the LayerNorm brings the values back; in float16 ``UP`` overflows to Inf and every
    logit is NaN. ``scale=1``: float16 runs it fine."""
    rng = np.random.default_rng(seed)
    embed = rng.random((VOCAB, HIDDEN))  # in [0, 1), as matmul_overflow's x
    w1 = scale * (1.0 + 0.1 * rng.standard_normal((HIDDEN, HIDDEN)))
    head = rng.standard_normal((HIDDEN, VOCAB)) / np.sqrt(HIDDEN)
    inits = [
        numpy_helper.from_array(embed.astype(np.float32), "embed"),
        numpy_helper.from_array(w1.astype(np.float32), "w1"),
        numpy_helper.from_array(np.zeros(HIDDEN, np.float32), "b1"),
        numpy_helper.from_array(np.ones(HIDDEN, np.float32), "gamma"),
        numpy_helper.from_array(np.zeros(HIDDEN, np.float32), "beta"),
        numpy_helper.from_array(head.astype(np.float32), "lm_head.weight"),
    ]
    nodes = [
        helper.make_node(
            "Gather", ["embed", "input_ids"], ["e"], name="/model/embed_tokens/Gather"
        ),
        helper.make_node("MatMul", ["e", "w1"], ["h"], name=UP),
        helper.make_node("Add", ["h", "b1"], ["hb"], name=UP_BIAS),
        helper.make_node("LayerNormalization", ["hb", "gamma", "beta"], ["n"], name=NORM, axis=-1),
        helper.make_node("MatMul", ["n", "lm_head.weight"], ["logits"], name="/lm_head/MatMul"),
    ]
    ids = helper.make_tensor_value_info("input_ids", TensorProto.INT64, [1, PROMPT])
    return make(nodes, [ids], [_vi("logits", [1, PROMPT, VOCAB])], inits)


def prompts(folder: Path, count: int = 8, seed: int = 0) -> Path:
    """``count`` prompts (random token ids), one .npz each: a --dataset folder."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    for i in range(count):
        ids = rng.integers(0, VOCAB, (1, PROMPT)).astype(np.int64)
        np.savez(folder / f"prompt{i}.npz", input_ids=ids)
    return folder
