"""A dynamic-int8 convolution (Sigmoid -> Mul -> DynamicQuantizeLinear -> ConvInteger, the
bias quantized with the run-time scale) on two backends whose Sigmoids differ in the last
bits (zoo G12: ddddocr on torch:cpu): the integers a step apart and the ConvInteger's
accumulators they move are the int8 precision, in the scan and in the pattern windows alike,
not a divergence."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import onnx
from onnx import TensorProto, helper, numpy_helper
from typer.testing import CliRunner

import onnx_bisect
from onnx_bisect.backends.protocol import BackendBase, Tensors
from onnx_bisect.backends.registry import create_backend
from onnx_bisect.backends.spec import BackendSpec
from onnx_bisect.cli import bisect_app
from onnx_bisect.report.serialize import to_dict
from tests.quant_models import quantized

runner = CliRunner()

SHAPE = (1, 8, 48, 48)


def silu_conv(seed: int = 0) -> onnx.ModelProto:
    """x -> Sigmoid ('sig') -> Mul ('silu') -> Conv 3x3 with a bias ('conv') -> y."""
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((16, SHAPE[1], 3, 3)) / 8).astype(np.float32)
    b = rng.standard_normal(16).astype(np.float32)
    nodes = [
        helper.make_node("Sigmoid", ["x"], ["s"], name="sig"),
        helper.make_node("Mul", ["x", "s"], ["a"], name="silu"),
        helper.make_node("Conv", ["a", "W", "B"], ["y"], name="conv", pads=[1, 1, 1, 1]),
    ]
    graph = helper.make_graph(
        nodes,
        "silu_conv",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(SHAPE))],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 16, *SHAPE[2:]])],
        [numpy_helper.from_array(w, "W"), numpy_helper.from_array(b, "B")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def silu_convs(layers: int = 3, seed: int = 0) -> onnx.ModelProto:
    """x -> Sigmoid ('sig') -> Mul, then ``layers`` times Conv 3x3 ('conv{i}') -> Sigmoid
    ('sig{i}') -> Mul: each Conv quantized dynamically reads the flips the one before made."""
    rng = np.random.default_rng(seed)
    c = SHAPE[1]
    nodes = [
        helper.make_node("Sigmoid", ["x"], ["s"], name="sig"),
        helper.make_node("Mul", ["x", "s"], ["a0"], name="silu"),
    ]
    inits = []
    for i in range(layers):
        w = (rng.standard_normal((c, c, 3, 3)) / np.sqrt(9 * c)).astype(np.float32)
        inits.append(numpy_helper.from_array(w, f"W{i}"))
        out = f"a{i + 1}" if i < layers - 1 else "y"
        nodes += [
            helper.make_node("Conv", [f"a{i}", f"W{i}"], [f"c{i}"], name=f"conv{i}", pads=[1] * 4),
            helper.make_node("Sigmoid", [f"c{i}"], [f"g{i}"], name=f"sig{i}"),
            helper.make_node("Mul", [f"c{i}", f"g{i}"], [out], name=f"silu{i}"),
        ]
    io = [helper.make_tensor_value_info(n, TensorProto.FLOAT, list(SHAPE)) for n in ("x", "y")]
    graph = helper.make_graph(nodes, "silu_convs", io[:1], io[1:], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


class SigmoidUlp(BackendBase):
    """ONNX Runtime with Sigmoid ``sig``'s output times 1 ± 2^-19 per element (a seeded
    pattern): a few float32 ulps, as torch's Sigmoid differs from ONNX Runtime's."""

    def __init__(self, spec: BackendSpec | None = None) -> None:
        super().__init__(spec or BackendSpec(text="sigmoid-ulp", name="sigmoid-ulp"))
        signs = np.random.default_rng(7).choice([-1.0, 1.0], size=SHAPE)
        self.factor = (1 + signs * 2.0**-19).astype(np.float32)
        self.inner = create_backend("cpu")

    def _run(self, model: onnx.ModelProto, feeds: Mapping[str, npt.NDArray[Any]]) -> Tensors:
        nudged = onnx.ModelProto()
        nudged.CopyFrom(model)
        node = next((n for n in nudged.graph.node if n.name == "sig"), None)
        if node is not None:
            out = node.output[0]
            node.output[0] = f"{out}_exact"
            nudged.graph.initializer.append(numpy_helper.from_array(self.factor, "ulp"))
            mul = helper.make_node("Mul", [f"{out}_exact", "ulp"], [out], name="ulp_mul")
            nudged.graph.node.insert(list(nudged.graph.node).index(node) + 1, mul)
        return self.inner.run(nudged, feeds)


def test_conv_integer_flips_from_a_sigmoid_ulps_apart_are_precision(tmp_path: Path) -> None:
    _, dynamic = quantized(silu_conv(), tmp_path, "dynamic")
    result = onnx_bisect.bisect(dynamic, ref="cpu", target=SigmoidUlp(), repro=None)
    assert result.verdict == "match", result.summary()
    assert result.summary().splitlines()[0].startswith("No divergence: sigmoid-ulp vs cpu on "), (
        result.summary()
    )
    assert (
        "agrees within the int8 precision: y within what its integer inputs one quantization "
        "step apart make (" in result.summary()
    )
    report = to_dict(result)["quantization"]
    assert report is not None
    # The ConvInteger's accumulator, its Cast, the Mul by the scales and the bias Add.
    assert report["paired_by_rule"] == {"run-time scale": 1, "bound of one-step input flips": 4}
    # Scanned, the integers and the accumulators are within the precision too: no node is
    # named, no pattern window.
    scanned = onnx_bisect.bisect(
        dynamic, ref="cpu", target=SigmoidUlp(), always_scan=True, repro=None
    )
    assert scanned.verdict == "match" and scanned.root_cause is None, scanned.summary()
    conv = next(n for n in scanned.nodes if n.op_type == "ConvInteger")
    assert conv.accumulated is not None and conv.accumulated.within_precision, conv


AMPLIFIED = (
    "agrees within the int8 precision: no node diverges fed the reference's inputs, and the "
    "first divergent tensor (Sigmoid 'sig0') reads integers only one quantization step apart "
    "(DynamicQuantizeLinear 'a0_QuantizeLinear', ConvInteger 'conv0_quant', Cast "
    "'c0_output_quantized_cast' and 1 more: fp32-level differences upstream round a few "
    "elements or the run-time scale to the neighbouring step); the layers after them amplify "
    "those flips to the outputs (largest rel_l2 0.001309): the int8 precision, not a "
    "divergence"
)


def test_flips_amplified_past_the_threshold_are_the_int8_precision(tmp_path: Path) -> None:
    """Three dynamic-int8 Convs: the flips of each move the next one's integers, and the
    output ends 1.3e-3 from the reference's (fp32 noise: 1e-5). No node diverges fed the
    reference's inputs; the window Sigmoid -> ... -> ConvInteger -> ... -> Sigmoid diverges
    only through its DynamicQuantizeLinear's flips, so it is no pattern (G12 named one)."""
    _, dynamic = quantized(silu_convs(), tmp_path, "dynamic")
    out = tmp_path / "r"
    res = runner.invoke(
        bisect_app, [str(dynamic), "--target", f"{__file__}:SigmoidUlp", "-o", str(out)]
    )
    assert res.exit_code == 0, res.output
    report = json.loads((out / "report.json").read_text())
    assert report["verdict"] == "match"
    cause = report["root_cause"]
    assert (cause["kind"], cause["nodes"]) == ("precision", [])
    assert f"agrees within the int8 precision: {cause['reason']}" == AMPLIFIED
    assert res.output.startswith("No divergence: ")
    assert f": {AMPLIFIED} (" in " ".join(res.output.split())
    assert "\nRoot cause (precision): no node diverges fed the reference's inputs" in res.output
    assert not any(n["verdict"] == "pattern" for n in report["nodes"])
