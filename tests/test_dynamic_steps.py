"""One dynamic-int8 model on two backends: integers one step apart because the float values
they quantize differ at the fp32 level are the int8 precision, not a divergence, and
report.json's ``quantization`` says how the integers were compared."""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import onnx
from onnx import helper, numpy_helper

import onnx_bisect
from onnx_bisect import Verdict
from onnx_bisect.backends.protocol import BackendBase, Tensors
from onnx_bisect.backends.registry import create_backend
from onnx_bisect.backends.spec import BackendSpec
from onnx_bisect.report.serialize import to_dict
from tests.faulty import FaultyBackend
from tests.quant_models import ERF_SHAPE, erf_matmul, quantized


class Nudged(BackendBase):
    """ONNX Runtime, with node ``pre``'s output moved by a few float32 ulps, up or down per
    element (a seeded pattern): what another runtime's Erf does to the last bits."""

    def __init__(self, ulps: float = 32) -> None:
        super().__init__(BackendSpec(text=f"nudged({ulps:g} ulps)", name="nudged"))
        signs = np.random.default_rng(7).choice([-1.0, 1.0], size=ERF_SHAPE)
        self.factor = (1 + signs * ulps * 2.0**-24).astype(np.float32)
        self.inner = create_backend("cpu")

    def _run(self, model: onnx.ModelProto, feeds: Mapping[str, npt.NDArray[Any]]) -> Tensors:
        nudged = onnx.ModelProto()
        nudged.CopyFrom(model)
        node = next((n for n in nudged.graph.node if n.name == "pre"), None)
        if node is not None:
            out = node.output[0]
            node.output[0] = f"{out}_exact"
            nudged.graph.initializer.append(numpy_helper.from_array(self.factor, "nudge"))
            mul = helper.make_node("Mul", [f"{out}_exact", "nudge"], [out], name="nudge_mul")
            nudged.graph.node.insert(list(nudged.graph.node).index(node) + 1, mul)
        return self.inner.run(nudged, feeds)


def test_one_step_flips_from_fp32_differences_upstream_are_precision(tmp_path: Path) -> None:
    _, dynamic = quantized(erf_matmul(), tmp_path, "dynamic")
    result = onnx_bisect.bisect(dynamic, ref="cpu", target=Nudged())
    assert result.verdict == "match"
    assert result.summary().splitlines()[0].startswith("No divergence: nudged(32 ulps) vs cpu on ")
    assert (
        "agrees within the int8 precision: y within what its integer inputs one quantization "
        "step apart make (" in result.summary()
    )
    report = to_dict(result)["quantization"]
    assert report is not None
    assert report["paired_by_rule"] == {"run-time scale": 1, "bound of one-step input flips": 3}
    steps = report["integer_steps"]
    assert (steps["stepped"], steps["runtime_scales"], steps["bounded"]) == (1, 1, 3)
    assert [a["tensor"] for a in steps["apart"]] == ["y"]
    # The integers themselves: a few elements one step apart, no more.
    scanned = onnx_bisect.bisect(dynamic, ref="cpu", target=Nudged(), always_scan=True)
    row = next(n for n in scanned.nodes if n.op_type == "DynamicQuantizeLinear")
    assert row.verdict is Verdict.PRECISION
    assert row.accumulated is not None
    assert re.fullmatch(
        r"\d+ of 61440 elements differ by up to 1 quantization step: integer kernels rounding "
        r"apart",
        row.accumulated.reason,
    ), row.accumulated.reason


def test_a_kernel_off_after_the_integers_is_still_a_culprit(tmp_path: Path) -> None:
    """The flips' bound is for inputs that may differ: fed the reference's own integers, the
    Mul by the scales 5% off is a culprit, and its outputs diverge."""
    _, dynamic = quantized(erf_matmul(), tmp_path, "dynamic")
    result = onnx_bisect.bisect(
        dynamic, ref="cpu", target=FaultyBackend("mm_quant_output_scale_mul", 0.05)
    )
    assert result.verdict == "diverged"
    rc = result.root_cause
    assert rc is not None and rc.nodes == ("mm_quant_output_scale_mul",)


def test_the_float64_oracle_quantizes_as_a_float32_runtime_does() -> None:
    """DynamicQuantizeLinear's scale and zero point are float32 arithmetic: for a Tanh's
    output in [-1, 1], -min/scale is 127.5 exactly in float64 and a hair off it in float32,
    so an oracle computing it in float64 rounded the zero point to 128 where every runtime
    has 127, and each of its integers sat a step from theirs (measured on a real model)."""
    graph = helper.make_graph(
        [helper.make_node("DynamicQuantizeLinear", ["x"], ["q", "s", "z"], name="dql")],
        "dql",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [5])],
        [helper.make_tensor_value_info(n, t, None) for n, t in
         (("q", onnx.TensorProto.UINT8), ("s", onnx.TensorProto.FLOAT),
          ("z", onnx.TensorProto.UINT8))],
    )  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    x = {"x": np.array([-1.0, -0.5, 0.0, 0.75, 1.0], np.float32)}
    want = create_backend("cpu").run(model, x)
    got = create_backend("torch:cpu?dtype=float64").run(model, x)
    assert int(got["z"]) == int(want["z"]) == 127
    assert np.array_equal(got["q"], want["q"])
    assert float(got["s"]) == float(want["s"])  # the float32 scale, carried in float64
