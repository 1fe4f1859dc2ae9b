"""upcast_model / upcast_feeds and ``ref?dtype=float64``, on real models and real runtimes."""

from __future__ import annotations

from collections.abc import Callable

import ml_dtypes
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnx_bisect.backends import create_backend
from onnx_bisect.compare.metrics import rel_l2
from onnx_bisect.errors import SpecError
from onnx_bisect.graph.extract import with_outputs
from onnx_bisect.transforms.upcast import upcast_feeds, upcast_model
from tests.models import (
    TRANSFORMER,
    YOLO,
    chain,
    int_output,
    make,
    residual,
    two_inputs,
    typed_inputs,
    with_if,
)

BUILDERS: dict[str, Callable[[], onnx.ModelProto]] = {
    "yolo_like": lambda: onnx.load(str(YOLO)),
    "transformer_block": lambda: onnx.load(str(TRANSFORMER)),
    "chain": chain,
    "residual": residual,
    "with_if": with_if,
    "int_output": int_output,
    "two_inputs": two_inputs,
    "typed_inputs": typed_inputs,
}

EXAMPLES = {
    "yolo_like": (YOLO, "images", (1, 3, 160, 160)),
    "transformer_block": (TRANSFORMER, "x", (1, 64, 16)),
}


def _random(shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).random(shape, dtype=np.float32)


def _node(model: onnx.ModelProto, name: str) -> onnx.NodeProto:
    found: onnx.NodeProto = next(n for n in model.graph.node if n.name == name)
    return found


def _attr(node: onnx.NodeProto, name: str) -> onnx.AttributeProto:
    found: onnx.AttributeProto = next(a for a in node.attribute if a.name == name)
    return found


def _elem(vi: onnx.ValueInfoProto) -> int:
    return vi.type.tensor_type.elem_type


# --- upcast_model: structure ----------------------------------------------------------------


@pytest.mark.parametrize("name", BUILDERS)
def test_upcast_never_mutates_its_input(name: str) -> None:
    model = BUILDERS[name]()
    before = model.SerializeToString()
    upcast = upcast_model(model)
    assert model.SerializeToString() == before
    assert upcast is not model


@pytest.mark.parametrize("name", BUILDERS)
def test_upcast_passes_the_full_checker(name: str) -> None:
    model = BUILDERS[name]()
    upcast = upcast_model(model)
    onnx.checker.check_model(upcast, full_check=True)
    # Names, opsets and node count are kept: none of these models needs an inserted Cast.
    assert [n.name for n in upcast.graph.node] == [n.name for n in model.graph.node]
    assert upcast.opset_import == model.opset_import
    floats = {TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16}
    for vi in [*upcast.graph.input, *upcast.graph.output]:
        assert _elem(vi) not in floats, vi.name


def test_initializers_become_double() -> None:
    model = onnx.load(str(YOLO))
    upcast = upcast_model(model)
    for old, new in zip(model.graph.initializer, upcast.graph.initializer, strict=True):
        assert new.name == old.name
        assert new.data_type == TensorProto.DOUBLE
        np.testing.assert_array_equal(numpy_helper.to_array(new), numpy_helper.to_array(old))


def test_resize_scales_stay_float() -> None:
    # Resize's scales input is tensor(float) in every opset: the Constant feeding it is kept.
    upcast = upcast_model(onnx.load(str(YOLO)))
    assert _attr(_node(upcast, "/up/Constant"), "value").t.data_type == TensorProto.FLOAT


def test_integer_tensors_stay_integers() -> None:
    upcast = upcast_model(int_output())
    assert _elem(upcast.graph.output[0]) == TensorProto.INT64
    out = create_backend("ref?dtype=float64").run(int_output(), {"x": _random((2, 5))})
    assert out["idx"].dtype == np.int64
    np.testing.assert_array_equal(out["idx"], _random((2, 5)).argmax(axis=1))

    typed = upcast_model(typed_inputs())
    elems = {vi.name: _elem(vi) for vi in typed.graph.input}
    assert elems == {
        "f": TensorProto.DOUBLE,
        "b": TensorProto.BOOL,
        "i": TensorProto.INT64,
        "u": TensorProto.UINT8,
        "s": TensorProto.INT8,
        "h": TensorProto.DOUBLE,
    }


def test_shape_chains_stay_int64_in_the_yolo_model() -> None:
    model = onnx.load(str(YOLO))
    upcast = upcast_model(model)
    int_constants = [
        n.name
        for n in model.graph.node
        if n.op_type == "Constant" and _attr(n, "value").t.data_type == TensorProto.INT64
    ]
    assert int_constants
    for name in int_constants:
        assert _attr(_node(upcast, name), "value").t.data_type == TensorProto.INT64
    inferred = onnx.shape_inference.infer_shapes(upcast, strict_mode=True)
    types = {vi.name: _elem(vi) for vi in inferred.graph.value_info}
    shape_ops = [n for n in model.graph.node if n.op_type in ("Shape", "Gather")]
    assert shape_ops
    for n in shape_ops:
        assert types[n.output[0]] == TensorProto.INT64, n.name
    # ...and at run time: the float64 reference returns them as int64, equal to fp32's.
    probes = [n.output[0] for n in shape_ops] + ["output0"]
    probed = with_outputs(model, probes)
    feeds = {"images": _random((1, 3, 160, 160))}
    ref64 = create_backend("ref?dtype=float64").run(probed, feeds)
    ref32 = create_backend("ref").run(probed, feeds)
    for name in probes[:-1]:
        assert ref64[name].dtype == np.int64, name
        np.testing.assert_array_equal(ref64[name], ref32[name])
    assert ref64["output0"].dtype == np.float64


def _constants_model() -> onnx.ModelProto:
    """Cast(to=FLOAT), Constant (value, value_float, value_floats), ConstantOfShape (with and
    without value), and a Cast to INT64 that must stay."""
    nodes = [
        helper.make_node("Cast", ["n"], ["nf"], name="cast_f", to=TensorProto.FLOAT),
        helper.make_node("Cast", ["x"], ["xi"], name="cast_i", to=TensorProto.INT64),
        helper.make_node("Cast", ["xi"], ["xif"], name="cast_back", to=TensorProto.FLOAT),
        helper.make_node(
            "Constant",
            [],
            ["k"],
            name="const_t",
            value=numpy_helper.from_array(np.array([0.1, 0.2, 0.3], np.float32), "k"),
        ),
        helper.make_node("Constant", [], ["kf"], name="const_f", value_float=0.1),
        helper.make_node("Constant", [], ["kfs"], name="const_fs", value_floats=[0.1, 0.2, 0.3]),
        helper.make_node("Shape", ["x"], ["shape"], name="shape"),
        helper.make_node(
            "ConstantOfShape",
            ["shape"],
            ["ones"],
            name="fill",
            value=numpy_helper.from_array(np.array([0.1], np.float32), "value"),
        ),
        helper.make_node("ConstantOfShape", ["shape"], ["zeros"], name="fill0"),
        helper.make_node("Sum", ["x", "nf", "k", "kf", "kfs", "ones", "zeros", "xif"], ["y"]),
    ]
    nodes[-1].name = "sum"
    return make(
        nodes,
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3]),
            helper.make_tensor_value_info("n", TensorProto.INT64, [3]),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])],
    )


def test_casts_and_constants_become_double() -> None:
    model = _constants_model()
    upcast = upcast_model(model)
    onnx.checker.check_model(upcast, full_check=True)
    assert _attr(_node(upcast, "cast_f"), "to").i == TensorProto.DOUBLE
    assert _attr(_node(upcast, "cast_back"), "to").i == TensorProto.DOUBLE
    assert _attr(_node(upcast, "cast_i"), "to").i == TensorProto.INT64
    for name in ("const_t", "const_f", "const_fs", "fill", "fill0"):
        (value,) = _node(upcast, name).attribute
        assert value.name == "value"
        assert value.t.data_type == TensorProto.DOUBLE, name
    # value_float 0.1 is stored as float32, so the double holds float32's 0.1, not 0.1 exactly.
    const_f = numpy_helper.to_array(_attr(_node(upcast, "const_f"), "value").t)
    assert const_f == np.float64(np.float32(0.1))
    fill0 = numpy_helper.to_array(_attr(_node(upcast, "fill0"), "value").t)
    np.testing.assert_array_equal(fill0, np.zeros(1))

    x = np.array([[1.5, -2.25, 3.0], [0.5, 7.75, -1.0]], np.float32)
    n = np.array([1, 2, 3], np.int64)
    out = create_backend("ref?dtype=float64").run(model, {"x": x, "n": n})["y"]
    assert out.dtype == np.float64
    tenth = np.float64(np.float32(0.1))
    k = np.array([0.1, 0.2, 0.3], np.float32).astype(np.float64)
    xi = x.astype(np.int64).astype(np.float64)
    expected = x.astype(np.float64) + n + k + tenth + k + tenth + 0.0 + xi
    np.testing.assert_allclose(out, expected, rtol=1e-15, atol=0)


def test_if_branches_are_upcast() -> None:
    model = with_if()
    upcast = upcast_model(model)
    branch = _node(upcast, "branch")
    for attr in ("then_branch", "else_branch"):
        assert _elem(_attr(branch, attr).g.output[0]) == TensorProto.DOUBLE
    assert upcast.graph.initializer[0].data_type == TensorProto.DOUBLE  # "zero", for Greater
    ref64 = create_backend("ref?dtype=float64")
    pos = np.array([1.0, -2.0, 3.0, 0.5], np.float32)
    out = ref64.run(model, {"x": pos})["y"]
    assert out.dtype == np.float64
    np.testing.assert_array_equal(out, -np.maximum(pos, 0).astype(np.float64))
    neg = -np.abs(pos)
    np.testing.assert_array_equal(ref64.run(model, {"x": neg})["y"], np.zeros(4))


def test_loop_body_reading_an_outer_constant_is_upcast() -> None:
    """acc *= k, 50 times, with k an outer-scope Constant(value_float=1.1) read by the body."""
    body = helper.make_graph(
        [
            helper.make_node("Identity", ["cond"], ["cond_out"], name="keep_going"),
            helper.make_node("Mul", ["acc", "k"], ["acc_out"], name="scale"),
        ],
        "body",
        [
            helper.make_tensor_value_info("i", TensorProto.INT64, []),
            helper.make_tensor_value_info("cond", TensorProto.BOOL, []),
            helper.make_tensor_value_info("acc", TensorProto.FLOAT, [2]),
        ],
        [
            helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
            helper.make_tensor_value_info("acc_out", TensorProto.FLOAT, [2]),
        ],
    )
    model = make(
        [
            helper.make_node("Constant", [], ["k"], name="k", value_float=1.1),
            helper.make_node("Loop", ["n", "true", "x"], ["y"], name="loop", body=body),
        ],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])],
        [
            numpy_helper.from_array(np.array(50, np.int64), "n"),
            numpy_helper.from_array(np.array(True), "true"),
        ],
    )
    upcast = upcast_model(model)
    onnx.checker.check_model(upcast, full_check=True)
    loop_body = _attr(_node(upcast, "loop"), "body").g
    assert [_elem(vi) for vi in loop_body.input] == [
        TensorProto.INT64,
        TensorProto.BOOL,
        TensorProto.DOUBLE,
    ]
    x = np.ones(2, np.float32)
    out = create_backend("ref?dtype=float64").run(model, {"x": x})["y"]
    expected = np.full(2, np.float64(np.float32(1.1)) ** 50)
    np.testing.assert_allclose(out, expected, rtol=1e-14)
    fp32 = create_backend("cpu").run(model, {"x": x})["y"]
    assert rel_l2(expected, fp32) > 1e-7


def _islands_model() -> onnx.ModelProto:
    """Ops with no float64 slot: Resize fed computed scales, LayerNormalization's Mean."""
    nodes = [
        helper.make_node("Mul", ["s", "two"], ["scales"], name="double_scales"),
        helper.make_node("Resize", ["x", "", "scales"], ["up"], name="resize", mode="nearest"),
        helper.make_node(
            "LayerNormalization", ["up", "gamma"], ["norm", "mean"], name="ln", axis=-1
        ),
        helper.make_node("Add", ["norm", "mean"], ["y"], name="add"),
    ]
    return make(
        nodes,
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 1, 2, 4]),
            helper.make_tensor_value_info("s", TensorProto.FLOAT, [4]),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 1, 4, 8])],
        [
            numpy_helper.from_array(np.array(2.0, np.float32), "two"),
            numpy_helper.from_array(np.linspace(0.5, 2.0, 8, dtype=np.float32), "gamma"),
        ],
    )


def test_ops_without_float64_slots_get_casts() -> None:
    model = _islands_model()
    upcast = upcast_model(model)
    onnx.checker.check_model(upcast, full_check=True)
    ops = [(n.op_type, n.name) for n in upcast.graph.node]
    assert ops == [
        ("Mul", "double_scales"),
        ("Cast", "scales__float/Cast"),
        ("Resize", "resize"),
        ("LayerNormalization", "ln"),
        ("Cast", "mean/Cast"),
        ("Add", "add"),
    ]
    assert _attr(upcast.graph.node[1], "to").i == TensorProto.FLOAT
    assert _attr(upcast.graph.node[4], "to").i == TensorProto.DOUBLE
    assert list(_node(upcast, "ln").output) == ["norm", "mean__narrow"]

    feeds = {"x": _random((1, 1, 2, 4)), "s": np.array([0.5, 0.5, 1.0, 1.0], np.float32)}
    out = create_backend("ref?dtype=float64").run(model, feeds)["y"]
    assert out.dtype == np.float64
    expected = create_backend("cpu").run(model, feeds)["y"]
    assert rel_l2(out, expected) < 1e-5


def test_functions_are_kept_and_upcast() -> None:
    body = [
        helper.make_node("Constant", [], ["c"], value_float=0.5),
        helper.make_node("Mul", ["a", "c"], ["b"]),
    ]
    func = helper.make_function("local", "Half", ["a"], ["b"], body, [helper.make_opsetid("", 18)])
    model = make(
        [helper.make_node("Half", ["x"], ["y"], name="half", domain="local")],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3])],
    )
    model.opset_import.append(helper.make_opsetid("local", 1))
    model.functions.append(func)
    upcast = upcast_model(model)
    onnx.checker.check_model(upcast, full_check=True)
    assert [f.name for f in upcast.functions] == ["Half"]
    assert _attr(upcast.functions[0].node[0], "value").t.data_type == TensorProto.DOUBLE
    x = np.array([1.0, 2.0, 3.0], np.float32)
    out = create_backend("ref?dtype=float64").run(model, {"x": x})["y"]
    assert out.dtype == np.float64
    np.testing.assert_array_equal(out, x / 2)


def test_upcast_to_float_only_widens_half_types() -> None:
    upcast = upcast_model(typed_inputs(), to=TensorProto.FLOAT)
    elems = {vi.name: _elem(vi) for vi in upcast.graph.input}
    assert (elems["f"], elems["h"]) == (TensorProto.FLOAT, TensorProto.FLOAT)
    with pytest.raises(ValueError, match="use onnx.TensorProto.DOUBLE or onnx.TensorProto.FLOAT"):
        upcast_model(chain(), to=TensorProto.INT64)


# --- feeds ----------------------------------------------------------------------------------


def test_upcast_feeds() -> None:
    feeds: dict[str, np.ndarray] = {
        "f": np.ones(2, np.float32),
        "h": np.ones(2, np.float16),
        "bf": np.ones(2, ml_dtypes.bfloat16),
        "d": np.ones(2, np.float64),
        "i": np.ones(2, np.int64),
        "b": np.ones(2, bool),
        "f8": np.ones(2, ml_dtypes.float8_e4m3fn),
    }
    up = upcast_feeds(feeds)
    assert {k: v.dtype.name for k, v in up.items()} == {
        "f": "float64",
        "h": "float64",
        "bf": "float64",
        "d": "float64",
        "i": "int64",
        "b": "bool",
        "f8": "float8_e4m3fn",
    }
    assert up["d"] is feeds["d"]
    assert feeds["f"].dtype == np.float32  # the caller's dict is not changed


# --- ref?dtype=float64 ----------------------------------------------------------------------


@pytest.mark.parametrize("name", EXAMPLES)
def test_float64_reference_agrees_with_ort_fp32(name: str) -> None:
    path, input_name, shape = EXAMPLES[name]
    model = onnx.load(str(path))
    feeds = {input_name: _random(shape)}
    ref64 = create_backend("ref?dtype=float64").run(model, feeds)
    cpu = create_backend("cpu").run(model, feeds)
    assert set(ref64) == set(cpu)
    for out, value in ref64.items():
        assert value.dtype == np.float64, out
        assert cpu[out].dtype == np.float32
        assert rel_l2(value, cpu[out]) < 1e-5, out
    assert feeds[input_name].dtype == np.float32


def _large_k() -> onnx.ModelProto:
    """x[1, K] @ W[K, 8], summed: long fp32 accumulations, where rounding shows."""
    k = 1 << 16
    w = np.random.default_rng(1).standard_normal((k, 8)).astype(np.float32)
    nodes = [
        helper.make_node("MatMul", ["x", "W"], ["m"], name="mm"),
        helper.make_node("ReduceSum", ["m", "axes"], ["y"], name="sum", keepdims=0),
    ]
    return make(
        nodes,
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])],
        [numpy_helper.from_array(w, "W"), numpy_helper.from_array(np.array([1], np.int64), "axes")],
    )


def _numpy64(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    """The model's computation in numpy float64, written out by hand."""
    w = {t.name: numpy_helper.to_array(t).astype(np.float64) for t in model.graph.initializer}
    h = x.astype(np.float64)
    if "axes" in w:
        summed: np.ndarray = (h @ w["W"]).sum(axis=1)
        return summed
    for i in range(len(w)):
        h = np.tanh(h @ w[f"W{i}"])
    return h


@pytest.mark.parametrize(
    ("model", "x"),
    [
        pytest.param(
            chain(30, width=64), np.random.default_rng(2).standard_normal((4, 64)), id="chain30"
        ),
        pytest.param(
            _large_k(), np.random.default_rng(3).standard_normal((1, 1 << 16)), id="large_k"
        ),
    ],
)
def test_float64_reference_is_more_accurate(model: onnx.ModelProto, x: np.ndarray) -> None:
    feeds = {"x": x.astype(np.float32)}
    out = model.graph.output[0].name
    ref64 = create_backend("ref?dtype=float64").run(model, feeds)[out]
    ort32 = create_backend("cpu").run(model, feeds)[out]
    ref32 = create_backend("ref").run(model, feeds)[out]
    np64 = _numpy64(model, feeds["x"])
    assert rel_l2(ref64, np64) < 1e-12
    assert rel_l2(ref64, ort32) > 1e-9  # fp32 rounding is visible...
    assert rel_l2(ref64, ort32) > 1000 * rel_l2(ref64, np64)  # ...and float64's is not
    assert rel_l2(ref64, ref32) > 1000 * rel_l2(ref64, np64)


# --- the spec option ------------------------------------------------------------------------


def test_dtype_option() -> None:
    assert "float64" in create_backend("ref?dtype=float64").describe()
    assert "float32" in create_backend("ref").describe()
    assert "float32" in create_backend("ref?dtype=float32").describe()
    with pytest.raises(SpecError) as err:
        create_backend("ref?dtype=float16")
    assert str(err.value) == (
        "backend 'ref?dtype=float16': dtype='float16' is not supported; use dtype=float32 "
        "(the model as written, the default) or dtype=float64 (an upcast copy)"
    )
    with pytest.raises(SpecError, match=r"unknown option\(s\) x; valid: dtype"):
        create_backend("ref?x=1")
