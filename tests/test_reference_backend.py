"""``ref``'s corrections to onnx.reference (``backends/reference_ops``), checked against ORT."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

import onnx_bisect
from onnx_bisect.backends.registry import create_backend
from onnx_bisect.compare.metrics import rel_l2
from onnx_bisect.errors import BackendError

SPECS = ("ref", "ref?dtype=float64")
C = 3


def _feeds(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"x": rng.normal(size=(2, C, 4, 5)).astype(np.float32)}


def _bn_model(
    opset: int, outputs: tuple[str, ...] = ("y",), per_activation: bool = False, **attrs: Any
) -> onnx.ModelProto:
    """X -> BatchNormalization with non-trivial statistics, so training mode (batch statistics)
    and inference mode (input_mean/input_var) give clearly different values."""
    rng = np.random.default_rng(1)
    shape = (C, 4, 5) if per_activation else (C,)
    params = {
        "scale": rng.normal(size=shape),
        "B": rng.normal(size=shape),
        "mean": rng.normal(size=shape),
        "var": rng.uniform(0.5, 2.0, size=shape),
    }
    node = helper.make_node("BatchNormalization", ["x", *params], list(outputs), **attrs)
    graph = helper.make_graph(
        [node],
        "bn",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, C, 4, 5])],
        [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in outputs],
        [numpy_helper.from_array(v.astype(np.float32), k) for k, v in params.items()],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=8)


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("opset", [7, 9, 12, 13, 14, 15])
def test_batchnorm_inference_matches_onnxruntime(opset: int, spec: str) -> None:
    model, feeds = _bn_model(opset, epsilon=1e-3), _feeds()
    expected = create_backend("cpu").run(model, feeds)["y"]
    got = create_backend(spec).run(model, feeds)["y"]
    assert got.dtype == (np.float64 if "float64" in spec else np.float32)
    assert rel_l2(expected, got) < 1e-5


@pytest.mark.parametrize("spec", SPECS)
def test_batchnorm_spatial_0_uses_per_activation_parameters(spec: str) -> None:
    model, feeds = _bn_model(7, per_activation=True, spatial=0), _feeds()
    expected = create_backend("cpu").run(model, feeds)["y"]
    assert rel_l2(expected, create_backend(spec).run(model, feeds)["y"]) < 1e-5


def test_batchnorm_opset_6_inference() -> None:
    """ONNX Runtime has no opset-6 kernel: check the formula directly."""
    model, feeds = _bn_model(6, is_test=1), _feeds()
    p = {t.name: numpy_helper.to_array(t).reshape(1, C, 1, 1) for t in model.graph.initializer}
    expected = (feeds["x"] - p["mean"]) / np.sqrt(p["var"] + 1e-5) * p["scale"] + p["B"]
    assert rel_l2(expected, create_backend("ref").run(model, feeds)["y"]) < 1e-6


@pytest.mark.parametrize(
    "model",
    [_bn_model(6), _bn_model(13, outputs=("y", "running_mean", "running_var"))],
    ids=["opset6-is_test=0", "opset13-statistics-outputs"],
)
def test_batchnorm_training_before_opset_14_is_refused(model: onnx.ModelProto) -> None:
    with pytest.raises(BackendError, match="training-mode BatchNormalization"):
        create_backend("ref").run(model, _feeds())


def test_batchnorm_training_mode_at_opset_15_keeps_upstream() -> None:
    outputs = ("y", "running_mean", "running_var")
    model, feeds = _bn_model(15, outputs, training_mode=1), _feeds()
    got = create_backend("ref").run(model, feeds)
    upstream = ReferenceEvaluator(model).run(None, feeds)
    expected = create_backend("cpu").run(model, feeds)
    for name, value in zip(outputs, upstream, strict=True):
        np.testing.assert_array_equal(got[name], value)
        assert rel_l2(expected[name], got[name]) < 1e-5


def test_batchnorm_is_corrected_inside_subgraphs() -> None:
    """new_ops reaches If branches, which run with the parent's opset."""
    bn = _bn_model(13)
    branch = helper.make_graph(list(bn.graph.node), "branch", [], list(bn.graph.output))
    cond = numpy_helper.from_array(np.array(True), "cond")
    node = helper.make_node("If", ["cond"], ["y"], then_branch=branch, else_branch=branch)
    graph = helper.make_graph(
        [node],
        "if",
        list(bn.graph.input),
        list(bn.graph.output),
        [*bn.graph.initializer, cond],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8)
    feeds = _feeds()
    expected = create_backend("cpu").run(bn, feeds)["y"]
    assert rel_l2(expected, create_backend("ref").run(model, feeds)["y"]) < 1e-5


def test_bisect_finds_no_divergence_between_onnxruntime_and_ref() -> None:
    result = onnx_bisect.bisect(
        _bn_model(13), ref="cpu", target="ref", inputs=_feeds(), threshold=1e-4
    )
    assert result.verdict == "match"


def test_describe_names_the_corrections() -> None:
    text = create_backend("ref").describe()
    assert "BatchNormalization 9-13 inference formula (onnx PR #8442)" in text
    assert "\n" not in text


def _erf_model() -> onnx.ModelProto:
    node = helper.make_node("Erf", ["x"], ["y"])
    graph = helper.make_graph(
        [node],
        "erf",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [64])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [64])],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8)


def test_erf_in_float64_is_not_rounded_to_float32() -> None:
    x = np.linspace(-3, 3, 64, dtype=np.float32)
    got = create_backend("ref?dtype=float64").run(_erf_model(), {"x": x})["y"]
    expected = np.array([math.erf(v) for v in x.astype(np.float64)])
    assert got.dtype == np.float64
    assert np.max(np.abs(got - expected)) < 1e-15


def test_erf_in_float32_is_erf_correctly_rounded() -> None:
    x = np.linspace(-3, 3, 64, dtype=np.float32)
    got = create_backend("ref").run(_erf_model(), {"x": x})["y"]
    expected = np.array([math.erf(v) for v in x.astype(np.float64)]).astype(np.float32)
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, expected)


@pytest.mark.parametrize("spec", SPECS)
def test_repro_script_ref_runs_the_same_corrections(spec: str) -> None:
    """A bundle's repro.py must compare against the reference the report used."""
    from onnx_bisect.repro import template

    model, feeds = _bn_model(12, epsilon=1e-3), _feeds()
    expected = create_backend("cpu").run(model, feeds)["y"]
    run = template.make_runner(template.parse_spec(spec), None)
    got = run(Path("unused.onnx"), model, feeds)["y"]
    assert rel_l2(expected, got) < 1e-5
