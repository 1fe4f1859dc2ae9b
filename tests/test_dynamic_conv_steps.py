"""A dynamic-int8 convolution (Sigmoid -> Mul -> DynamicQuantizeLinear -> ConvInteger, the
bias quantized with the run-time scale) on two backends whose Sigmoids differ in the last
bits (zoo G12: ddddocr on torch:cpu): the integers a step apart and the ConvInteger's
accumulators they move are the int8 precision, in the scan and in the pattern windows alike,
not a divergence."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import onnx
from onnx import TensorProto, helper, numpy_helper

import onnx_bisect
from onnx_bisect.backends.protocol import BackendBase, Tensors
from onnx_bisect.backends.registry import create_backend
from onnx_bisect.backends.spec import BackendSpec
from onnx_bisect.report.serialize import to_dict
from tests.quant_models import quantized

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


class SigmoidUlp(BackendBase):
    """ONNX Runtime with Sigmoid ``sig``'s output times 1 ± 2^-19 per element (a seeded
    pattern): a few float32 ulps, as torch's Sigmoid differs from ONNX Runtime's."""

    def __init__(self) -> None:
        super().__init__(BackendSpec(text="sigmoid-ulp", name="sigmoid-ulp"))
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
