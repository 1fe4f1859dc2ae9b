"""Precision-aware verdicts: a float16, bfloat16 or TF32 target is judged against the error its
precision predicts (measured by the float64 oracle's faithful twin), and what is worse than
that is named: a flushed Sigmoid, a MatMul that accumulates in float16, a runtime that lowered
the precision unasked.
"""

from __future__ import annotations

import importlib.util
import sys
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnx_bisect
from onnx_bisect import Verdict
from onnx_bisect.backends.protocol import BackendBase, Tensors
from onnx_bisect.backends.registry import create_backend
from onnx_bisect.backends.spec import BackendSpec
from onnx_bisect.compare.precision import (
    DATA_MOVEMENT,
    Precision,
    held_in_range,
    range_problem,
    round_to,
)
from onnx_bisect.report.markdown import render_markdown
from onnx_bisect.result import CauseKind, Outcome

pytest.importorskip("torch")  # the faithful twin that measures precision floors

LOWP = Path(__file__).resolve().parent / "lowp_runtime.py"
OPSET, IR = 18, 10


def _init(name: str, value: np.ndarray) -> onnx.TensorProto:
    return numpy_helper.from_array(value.astype(np.float32), name)


def conv_net(seed: int = 0) -> onnx.ModelProto:
    """Conv -> Sigmoid -> Mul (SiLU) -> Conv -> Add (residual) -> Reshape -> Transpose ->
    MatMul, the Sigmoid also an output (a detector's class scores). The first Conv's outputs
    reach -20: a Sigmoid below -11.1 gives values float16 holds only as subnormals, which a
    flushing runtime returns as 0."""
    rng = np.random.default_rng(seed)
    inits = [
        _init("w1", rng.standard_normal((8, 4, 3, 3)) * 2.4),
        _init("w2", rng.standard_normal((8, 8, 1, 1)) / np.sqrt(8)),
        _init("shape", np.zeros(0)),  # replaced below: int64
        _init("w3", rng.standard_normal((8, 4)) / np.sqrt(8)),
    ]
    inits[2] = numpy_helper.from_array(np.array([1, 8, 256], np.int64), "shape")
    nodes = [
        helper.make_node("Conv", ["x", "w1"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
        helper.make_node("Sigmoid", ["c1"], ["s1"], name="sigmoid1"),
        helper.make_node("Mul", ["c1", "s1"], ["m1"], name="silu1"),
        # An output of its own: onnxconverter-common mistypes a graph output read inside.
        helper.make_node("Identity", ["s1"], ["scores"], name="scores"),
        helper.make_node("Conv", ["m1", "w2"], ["c2"], name="conv2"),
        helper.make_node("Add", ["c2", "m1"], ["r1"], name="residual"),
        helper.make_node("Reshape", ["r1", "shape"], ["flat"], name="reshape"),
        helper.make_node("Transpose", ["flat"], ["rows"], name="transpose", perm=[0, 2, 1]),
        helper.make_node("MatMul", ["rows", "w3"], ["y"], name="head"),
    ]
    graph = helper.make_graph(
        nodes,
        "conv_net",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 16, 16])],
        [
            helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 256, 4]),
            helper.make_tensor_value_info("scores", TensorProto.FLOAT, [1, 8, 16, 16]),
        ],
        initializer=inits,
    )
    return helper.make_model(graph, ir_version=IR, opset_imports=[helper.make_opsetid("", OPSET)])


def long_matmul(k: int = 4096, seed: int = 0) -> onnx.ModelProto:
    """x [4, K] -> MatMul W [K, 16] -> Tanh -> MatMul V [16, 8]: one K=4096 reduction."""
    rng = np.random.default_rng(seed)
    inits = [
        _init("w", rng.standard_normal((k, 16)) / np.sqrt(k) * 4),
        _init("v", rng.standard_normal((16, 8)) / 4),
    ]
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["h"], name="long_mm"),
        helper.make_node("Tanh", ["h"], ["a"], name="act"),
        helper.make_node("MatMul", ["a", "v"], ["y"], name="out_mm"),
    ]
    graph = helper.make_graph(
        nodes,
        "long_matmul",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 8])],
        initializer=inits,
    )
    return helper.make_model(graph, ir_version=IR, opset_imports=[helper.make_opsetid("", OPSET)])


def detector_net(seed: int = 0) -> onnx.ModelProto:
    """YOLOv8n's head in small: class scores (a Sigmoid reaching -20) concatenated with boxes
    up to ~300 into one output, so that scores flushed below 1.6e-5 are 5e-8 of its peak."""
    rng = np.random.default_rng(seed)
    inits = [
        _init("w1", rng.standard_normal((8, 4, 3, 3)) * 2.4),
        _init("wb", rng.standard_normal((4, 4, 1, 1)) * 60),
    ]
    nodes = [
        helper.make_node("Conv", ["x", "w1"], ["c1"], name="cls_conv", pads=[1, 1, 1, 1]),
        helper.make_node("Sigmoid", ["c1"], ["scores"], name="cls_sigmoid"),
        helper.make_node("Conv", ["x", "wb"], ["boxes"], name="box_conv"),
        helper.make_node("Concat", ["boxes", "scores"], ["y"], name="head_concat", axis=1),
    ]
    graph = helper.make_graph(
        nodes,
        "detector_net",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 16, 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 12, 16, 16])],
        initializer=inits,
    )
    return helper.make_model(graph, ir_version=IR, opset_imports=[helper.make_opsetid("", OPSET)])


def masked_attention(seed: int = 0) -> onnx.ModelProto:
    """scores = q @ k^T -> Add a causal mask of float32's lowest (-3.4e38, as transformers
    writes it) -> Softmax -> @ v: float16 cannot hold the mask, which a conversion clips."""
    rng = np.random.default_rng(seed)
    mask = np.where(np.triu(np.ones((16, 16), bool), 1), np.finfo(np.float32).min, 0)
    inits = [
        _init("wk", rng.standard_normal((8, 8)) / np.sqrt(8)),
        _init("mask", mask),
        _init("wv", rng.standard_normal((8, 8)) / np.sqrt(8)),
    ]
    nodes = [
        helper.make_node("MatMul", ["x", "wk"], ["k"], name="key"),
        helper.make_node("Transpose", ["k"], ["kt"], name="key_t", perm=[0, 2, 1]),
        helper.make_node("MatMul", ["x", "kt"], ["s"], name="scores"),
        helper.make_node("Add", ["s", "mask"], ["masked"], name="mask_add"),
        helper.make_node("Softmax", ["masked"], ["p"], name="softmax", axis=-1),
        helper.make_node("MatMul", ["x", "wv"], ["v"], name="value"),
        helper.make_node("MatMul", ["p", "v"], ["y"], name="attend"),
    ]
    graph = helper.make_graph(
        nodes,
        "masked_attention",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 16, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 16, 8])],
        initializer=inits,
    )
    return helper.make_model(graph, ir_version=IR, opset_imports=[helper.make_opsetid("", OPSET)])


def cancelling_relu(seed: int = 0) -> onnx.ModelProto:
    """x @ W1 - x @ W2 with W2 within 1% of W1 -> Relu -> MatMul: the difference is small
    against each product's rounding, so a lower precision moves many values across the
    Relu's edge; fed the reference's inputs the Relu returns no wrong 0."""
    rng = np.random.default_rng(seed)
    w1 = rng.standard_normal((64, 64)) / 8
    inits = [
        _init("w1", w1),
        _init("w2", w1 * (1 + 0.01 * rng.standard_normal((64, 64)))),
        _init("w3", rng.standard_normal((64, 8)) / 8),
    ]
    nodes = [
        helper.make_node("MatMul", ["x", "w1"], ["a"], name="mm_a"),
        helper.make_node("MatMul", ["x", "w2"], ["b"], name="mm_b"),
        helper.make_node("Sub", ["a", "b"], ["h"], name="cancel"),
        helper.make_node("Relu", ["h"], ["r"], name="relu"),
        helper.make_node("MatMul", ["r", "w3"], ["y"], name="head"),
    ]
    graph = helper.make_graph(
        nodes,
        "cancelling_relu",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [32, 64])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [32, 8])],
        initializer=inits,
    )
    return helper.make_model(graph, ir_version=IR, opset_imports=[helper.make_opsetid("", OPSET)])


def squeeze_excite(seed: int = 0) -> onnx.ModelProto:
    """PP-OCRv4 det's squeeze-excite in small: GlobalAveragePool -> Conv to 6 channels -> Relu
    -> Conv back -> HardSigmoid -> Mul. The Relu holds one nonzero value, 64 (the first Conv's
    bias), which float16 holds exactly: the faithful twin's error there is 0."""
    rng = np.random.default_rng(seed)
    inits = [
        _init("w1", np.zeros((6, 4, 1, 1))),
        _init("b1", np.array([64.0, -40.0, -1.0, -33.0, -5.0, -4.0])),
        _init("w2", rng.standard_normal((4, 6, 1, 1)) / 64),
    ]
    nodes = [
        helper.make_node("GlobalAveragePool", ["x"], ["pool"], name="pool"),
        helper.make_node("Conv", ["pool", "w1", "b1"], ["squeeze"], name="squeeze"),
        helper.make_node("Relu", ["squeeze"], ["se"], name="se_relu"),
        helper.make_node("Conv", ["se", "w2"], ["excite"], name="excite"),
        helper.make_node("HardSigmoid", ["excite"], ["gate"], name="gate"),
        helper.make_node("Mul", ["x", "gate"], ["y"], name="scale"),
    ]
    graph = helper.make_graph(
        nodes,
        "squeeze_excite",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 8, 8])],
        initializer=inits,
    )
    return helper.make_model(graph, ir_version=IR, opset_imports=[helper.make_opsetid("", OPSET)])


@pytest.fixture(scope="module")
def net(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("lowered") / "conv_net.onnx"
    onnx.save(conv_net(), path)
    return path


def _lowp(*flags: str) -> str:
    return f"exec:{sys.executable} {LOWP} {{model}} {{inputs}} {{outputs}} {' '.join(flags)}"


def _no_data_movement_culprit(result: onnx_bisect.BisectResult) -> None:
    blamed = [
        n.name
        for n in result.nodes
        if n.op_type in DATA_MOVEMENT and n.verdict in (Verdict.CULPRIT, Verdict.RANGE)
    ]
    assert not blamed


def _agrees_within(result: onnx_bisect.BisectResult, precision: str) -> None:
    assert result.verdict is Outcome.MATCH, result.summary()
    assert not result.culprits()
    assert not [n for n in result.nodes if n.verdict in (Verdict.CULPRIT, Verdict.RANGE)]
    assert f"agrees within {precision} precision: " in result.summary()
    _no_data_movement_culprit(result)


@pytest.mark.parametrize(
    ("target", "precision"),
    [
        ("cpu+fp16", "float16"),
        ("torch:cpu?dtype=float16", "float16"),
        ("torch:cpu?dtype=bfloat16", "bfloat16"),
        ("torch:cpu?round=tf32", "tf32"),
    ],
)
def test_a_declared_lower_precision_agrees_within_its_floors(
    net: Path, target: str, precision: str
) -> None:
    result = onnx_bisect.bisect(net, ref="cpu", target=target, always_scan=True)
    _agrees_within(result, precision)
    assert result.target_precision.precision.value == precision
    assert result.target_precision.source == "declared"
    # Without floors the same run had many culprits: the floors are what explain them.
    assert any(n.verdict is Verdict.PRECISION for n in result.nodes)
    # The first Conv, fed by the graph input (through a converter's Cast), is isolated too.
    first = next(n for n in result.nodes if n.name == "conv1")
    assert first.isolated is not None


def test_the_reports_say_the_precision_and_every_nodes_floor(net: Path, tmp_path: Path) -> None:
    """Issue 25 scope 7: the terminal and report.md lead with the answer and what each side
    computes in; report.json has each node's precision floors; report.html's curve draws the
    precision floor beside the fp32 one."""
    import json

    result = onnx_bisect.bisect(net, ref="cpu", target="cpu+fp16", always_scan=True)
    onnx_bisect.write_reports(result, tmp_path, formats=("md", "json", "html"))
    precision = "the target computes in float16 (declared: the +fp16 transform)"
    for text in (result.summary(), (tmp_path / "report.md").read_text()):
        head = "\n".join(text.splitlines()[:6])
        assert "agrees within float16 precision: " in head and precision in head, head
        # The user's 9 nodes, not the Casts that onnxconverter-common put around them.
        casts = sum(1 for n in result.nodes if n.op_type == "Cast")
        assert casts > 0
        assert f"precision: 9 nodes (+{casts} Casts the conversion inserted)" in head, head
    data = json.loads((tmp_path / "report.json").read_text())
    assert data["target"]["precision"]["precision"] == "float16"
    assert data["target"]["precision"]["source"] == "declared"
    computed = [n for n in data["nodes"] if n["isolated"] and n["accumulated"]]
    assert len(computed) >= 9 and all(n["accumulated"]["precision_floor"] > 0 for n in computed)
    assert all(n["isolated"]["precision_floor"] is not None for n in computed)
    assert {n["verdict"] for n in data["nodes"]} <= {"ok", "precision", "not-probed"}
    if importlib.util.find_spec("matplotlib") is not None:
        html = (tmp_path / "report.html").read_text()
        figure = html[html.index('<div class="figure"><svg') :]
        figure = figure[: figure.index("</svg>")]
        assert "float16 precision floor" in figure and "fp32 noise floor" in figure


def test_a_faithful_exec_runtime_declared_with_target_precision_agrees(net: Path) -> None:
    result = onnx_bisect.bisect(
        net, ref="cpu", target=_lowp(), target_precision="float16", always_scan=True
    )
    _agrees_within(result, "float16")
    assert result.target_precision.how == "--target-precision"


def test_a_flushing_sigmoid_is_the_root_cause_and_its_zeros_are_named(net: Path) -> None:
    result = onnx_bisect.bisect(
        net, ref="cpu", target=_lowp("--flush Sigmoid=1.6e-5"), target_precision="float16"
    )
    assert result.verdict is Outcome.DIVERGED
    assert result.root_cause is not None
    assert result.root_cause.nodes == ("sigmoid1",)
    assert result.root_cause.kind is CauseKind.RANGE
    assert "are 0 where float16 holds values up to" in result.root_cause.reason
    verdicts = {n.name: n.verdict for n in result.nodes}
    assert verdicts["sigmoid1"] is Verdict.RANGE
    assert verdicts["conv1"] in (Verdict.OK, Verdict.PRECISION)
    _no_data_movement_culprit(result)


def test_a_flush_in_an_output_that_concatenates_boxes_is_found(tmp_path: Path) -> None:
    """tinygrad's float16 Sigmoid on YOLOv8n: the zeroed scores are 5e-8 of the output's peak
    (its boxes), yet most of its elements; they are found, and the Sigmoid named."""
    path = tmp_path / "detector.onnx"
    onnx.save(detector_net(), path)
    flushing = _lowp("--flush cls_sigmoid=1.6e-5")
    result = onnx_bisect.bisect(path, ref="cpu", target=flushing, target_precision="float16")
    assert result.verdict is Outcome.DIVERGED, result.summary()
    assert result.root_cause is not None
    assert result.root_cause.nodes == ("cls_sigmoid",)
    assert result.root_cause.kind is CauseKind.RANGE
    assert "are 0 where float16 holds values up to" in result.root_cause.reason
    assert "are 0 where float16 holds" in result.outputs[0].reason
    _no_data_movement_culprit(result)
    faithful = onnx_bisect.bisect(path, ref="cpu", target=_lowp(), target_precision="float16")
    _agrees_within(faithful, "float16")


def test_a_mask_beyond_float16_clipped_by_the_conversion_is_no_culprit(tmp_path: Path) -> None:
    """A GPT-2 export under cpu+fp16: onnxconverter-common clips the -3.4e38 causal mask to
    -1e4, and the masked scores then differ by 3.4e38 from the reference's; the Softmax after
    them gives the same 0s. Not a culprit: float16 cannot hold the mask."""
    path = tmp_path / "attention.onnx"
    onnx.save(masked_attention(), path)
    result = onnx_bisect.bisect(path, ref="cpu", target="cpu+fp16", always_scan=True)
    _agrees_within(result, "float16")
    assert result.first_divergence is None
    verdicts = {n.name: n.verdict for n in result.nodes}
    assert verdicts["mask_add"] in (Verdict.OK, Verdict.PRECISION)


def test_values_float16_cannot_hold_leave_no_numpy_warning_on_the_terminal(
    tmp_path: Path,
) -> None:
    """Isolation feeds the float16 model the reference's -3.4e38 mask, which becomes -Inf as
    the target's own run makes it: expected, and no "RuntimeWarning: overflow encountered in
    cast" for the user (PP-OCRv4 det, GPT-2 under +fp16 printed one)."""
    import subprocess

    path = tmp_path / "attention.onnx"
    onnx.save(masked_attention(), path)
    bisect = Path(sys.executable).parent / "bisect"
    args = [str(bisect), str(path), "--target", "cpu+fp16", "--always-scan", "--out"]
    proc = subprocess.run(
        [*args, str(tmp_path / "out")], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Warning" not in proc.stderr + proc.stdout, proc.stderr


def test_zeros_from_cancelling_and_a_clamp_are_precision(tmp_path: Path) -> None:
    """Zeros a faithful lower precision gives: a difference whose rounded operands cancel, a
    Relu whose input's rounding crossed its edge (PP-OCRv4 rec's HardSigmoid on OpenVINO's bf16
    returned 0 for 3.1% of its values). They are scattered among values of their size, not
    all of the small values as a flush's are: precision, not a range problem."""
    path = tmp_path / "cancel.onnx"
    onnx.save(cancelling_relu(), path)
    target = _lowp("--precision bfloat16")
    result = onnx_bisect.bisect(
        path, ref="cpu", target=target, target_precision="bfloat16", always_scan=True
    )
    verdicts = {n.name: n.verdict for n in result.nodes}
    assert verdicts["relu"] is Verdict.PRECISION
    assert verdicts["cancel"] is Verdict.PRECISION  # fed rounded operands, some cancel to 0
    assert result.first_divergence is None
    _agrees_within(result, "bfloat16")


def test_a_matmul_that_accumulates_in_float16_is_the_culprit(tmp_path: Path) -> None:
    path = tmp_path / "long.onnx"
    onnx.save(long_matmul(), path)
    result = onnx_bisect.bisect(
        path, ref="cpu", target=_lowp("--accumulate long_mm"), target_precision="float16"
    )
    assert result.root_cause is not None, result.summary()
    assert result.root_cause.nodes == ("long_mm",)
    assert result.root_cause.kind is CauseKind.CULPRIT
    others = {n.name: n.verdict for n in result.nodes if n.name != "long_mm"}
    assert set(others.values()) <= {Verdict.OK, Verdict.PRECISION, Verdict.PROPAGATED}


def test_the_same_matmul_accumulating_in_float32_agrees(tmp_path: Path) -> None:
    path = tmp_path / "long.onnx"
    onnx.save(long_matmul(), path)
    result = onnx_bisect.bisect(path, ref="cpu", target=_lowp(), target_precision="float16")
    assert result.verdict is Outcome.MATCH, result.summary()


def test_a_tensor_of_one_value_two_steps_off_is_precision(tmp_path: Path) -> None:
    """PP-OCRv4 det under cpu+fp16: a squeeze-excite Relu of one nonzero value, two float16
    steps from the twin's, was named the first divergence (rel_l2 1.8e-3 against 4 × a floor
    of 5.8e-5, the twin's lucky draw on that one value). A floor for few values allows it."""
    path = tmp_path / "se.onnx"
    onnx.save(squeeze_excite(), path)
    kernel = _lowp("--nudge se_relu=2")
    result = onnx_bisect.bisect(
        path, ref="cpu", target=kernel, target_precision="float16", always_scan=True
    )
    _agrees_within(result, "float16")
    assert result.first_divergence is None
    relu = next(n for n in result.nodes if n.name == "se_relu")
    assert relu.verdict is Verdict.PRECISION
    assert relu.accumulated is not None and relu.accumulated.metrics["rel_l2"] > 5e-4


def test_a_tensor_of_one_value_far_off_is_still_the_culprit(tmp_path: Path) -> None:
    """The floor for few values is a few steps of the precision, not a pass for any error: the
    same value 32 steps off (3%) is the culprit."""
    path = tmp_path / "se.onnx"
    onnx.save(squeeze_excite(), path)
    kernel = _lowp("--nudge se_relu=32")
    result = onnx_bisect.bisect(path, ref="cpu", target=kernel, target_precision="float16")
    assert result.verdict is Outcome.DIVERGED, result.summary()
    assert result.root_cause is not None
    assert result.root_cause.nodes == ("se_relu",)
    assert result.root_cause.kind is CauseKind.CULPRIT
    assert result.first_divergence is not None
    assert result.first_divergence.name == "se_relu"


def _openvino_lowers() -> str | None:
    if importlib.util.find_spec("openvino") is None:
        return "openvino is not installed"
    from onnx_bisect.backends.openvino import default_precision

    return None if default_precision() != "f32" else "OpenVINO runs f32 on this CPU"


def test_openvino_lowering_unasked_is_the_root_cause_with_a_verified_workaround(
    net: Path,
) -> None:
    why = _openvino_lowers()
    if why is not None:
        pytest.skip(why)
    result = onnx_bisect.bisect(net, ref="cpu", target="openvino")
    assert result.verdict is Outcome.DIVERGED
    assert result.root_cause is not None
    assert result.root_cause.kind is CauseKind.PRECISION
    reason = result.root_cause.reason
    assert "without being asked (OpenVINO's CPU default INFERENCE_PRECISION_HINT=" in reason
    assert "Workaround: --target 'openvino?precision=f32' (verified:" in reason
    first_lines = result.summary().splitlines()[:4]
    assert any(line.startswith("Root cause (precision): the target") for line in first_lines)
    _no_data_movement_culprit(result)
    # Words that agree with themselves: no red "Diverged" over "no divergence found".
    assert result.root_cause.workaround_verified
    name = result.target_precision.precision.value
    assert first_lines[0] == (
        f"Precision lowered by the runtime ({name}); no kernel bug; fp32 workaround verified: "
        f"openvino vs cpu on {net}"
    )
    assert f"First divergence: none beyond the error {name} predicts" in first_lines
    md = render_markdown(result).splitlines()
    said = f"Precision lowered by the runtime ({name}); no kernel bug; fp32 workaround verified"
    assert md[2] == f"**{said}.**"
    assert f"- **First divergence:** none beyond the error {name} predicts." in md
    # Each node judged by the precision's floor shows that bound as its threshold.
    crit = result.criterion
    judged = [n for n in result.nodes if n.accumulated and n.accumulated.within_precision]
    assert judged
    for n in judged:
        acc = n.accumulated
        if acc is not None:
            assert acc.threshold is not None and acc.precision_floor is not None
            assert acc.threshold >= crit.k * acc.precision_floor + crit.eps - 1e-12, n.name
            assert acc.metrics["rel_l2"] <= acc.threshold, n.name


def test_openvino_at_f32_agrees(net: Path) -> None:
    if importlib.util.find_spec("openvino") is None:
        pytest.skip("openvino is not installed")
    result = onnx_bisect.bisect(net, ref="cpu", target="openvino?precision=f32")
    assert result.verdict is Outcome.MATCH


class TailOffSigmoid(BackendBase):
    """ONNX Runtime, except that every output value under 1e-6 comes back ``off`` higher: a
    Sigmoid inaccurate in its tail, where its outputs are 1e-7."""

    def __init__(self, off: float) -> None:
        super().__init__(BackendSpec(text=f"tail-off({off:g})", name="tail-off"))
        self.off = off
        self.inner = create_backend("cpu")

    def _run(self, model: onnx.ModelProto, feeds: Mapping[str, Any]) -> Tensors:
        out = dict(self.inner.run(model, feeds))
        return {k: np.where(v < 1e-6, v + np.float32(self.off), v) for k, v in out.items()}


def sigmoid_map() -> onnx.ModelProto:
    """A probability map of 128x128 values at most 1.1e-7, but one near 1."""
    spike = np.zeros((1, 1, 128, 128), np.float32)
    spike[0, 0, 5, 5] = 40
    inits = [_init("scale", np.array(18.0)), _init("shift", np.array(-34.0)), _init("spike", spike)]
    nodes = [
        helper.make_node("Mul", ["x", "scale"], ["a"], name="scale"),
        helper.make_node("Add", ["a", "shift"], ["b"], name="shift"),
        helper.make_node("Add", ["b", "spike"], ["c"], name="spike"),
        helper.make_node("Sigmoid", ["c"], ["y"], name="sigmoid"),
    ]
    graph = helper.make_graph(
        nodes,
        "sigmoid_map",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 1, 128, 128])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 1, 128, 128])],
        initializer=inits,
    )
    return helper.make_model(graph, ir_version=IR, opset_imports=[helper.make_opsetid("", OPSET)])


def test_an_error_negligible_against_the_peak_is_a_note_with_both_figures() -> None:
    """Issue 25 scope 6: errors of 5e-7 on a probability map peaking at 1 are said, with both
    figures, and not counted; ten times more than 1e-6 of the peak is a divergence."""
    result = onnx_bisect.bisect(sigmoid_map(), ref="cpu", target=TailOffSigmoid(5e-7))
    assert result.verdict is Outcome.MATCH, result.summary()
    assert result.outputs[0].metrics["rel_l2"] > 2 * (result.outputs[0].threshold or 1)
    note = next(n for n in result.notes if n.startswith("output y: "))
    assert "but max_abs=5e-07 is at most 1e-06 × its peak |value| 1" in note
    assert "not counted as a divergence" in note
    loud = onnx_bisect.bisect(sigmoid_map(), ref="cpu", target=TailOffSigmoid(1e-5))
    assert loud.verdict is Outcome.DIVERGED


def test_round_to_matches_the_formats() -> None:
    x = np.array([1.0, 1 + 2**-11, 1 + 2**-9, 3.0e-6, 70000.0, np.inf], np.float32)
    with np.errstate(over="ignore"):  # 70000 overflows float16, as it should
        expected = x.astype(np.float16).astype(np.float32)
    assert np.array_equal(round_to(x, Precision.FLOAT16), expected)
    bf = round_to(np.array([1 + 2**-8, 1 + 3 * 2**-8], np.float32), Precision.BFLOAT16)
    assert bf.tolist() == [1.0, 1 + 2**-6]  # ties to even
    tf = round_to(np.array([1 + 2**-12], np.float32), Precision.TF32)
    assert tf.tolist() == [1.0]


def test_values_beyond_the_range_held_at_its_edge_are_taken_as_held() -> None:
    ref = np.array([np.finfo(np.float32).min, 3.0, 1e9], np.float32)  # sentinels (masks)
    clipped = np.array([-1e4, 3.0, np.inf], np.float32)
    assert held_in_range(ref, clipped, Precision.FLOAT16).tolist() == ref.tolist()
    wrong = np.array([1e4, 3.0, -np.inf], np.float32)  # the other sign is an error
    assert held_in_range(ref, wrong, Precision.FLOAT16) is wrong
    assert held_in_range(ref, clipped, Precision.TF32) is clipped  # float32's range
    with warnings.catch_warnings():  # bfloat16 from float32: no sentinel, no overflow
        warnings.simplefilter("error")
        assert held_in_range(ref, clipped, Precision.BFLOAT16) is clipped
    # A real value beyond the range (PP-OCRv4 det's BatchNormalization variance) is lost.
    variance = np.array([1.05e7, 3.0], np.float32)
    lost = np.array([1e4, 3.0], np.float32)
    assert held_in_range(variance, lost, Precision.FLOAT16) is lost


def test_a_flush_counts_against_the_typical_value_not_the_peak() -> None:
    # Boxes up to 320 beside scores, 55% of them flushed below 1.6e-5: a finding, though
    # the zeroed values are 5e-8 of the peak.
    rng = np.random.default_rng(0)
    scores = (10.0 ** rng.uniform(-8, 0, 800)).astype(np.float32)
    ref = np.concatenate([rng.uniform(0, 320, 40).astype(np.float32), scores])
    flushed = np.where(ref < 1.6e-5, 0, ref).astype(np.float32)
    assert "are 0 where float16 holds" in range_problem(ref, flushed, Precision.FLOAT16)
    # Float32 denormal weights (1e-38) beside values of 0.1, flushed by a bf16 runtime: no.
    weights = rng.standard_normal(200).astype(np.float32) * 0.1
    weights[:10] = 1e-38
    assert range_problem(weights, np.where(weights == 1e-38, 0, weights), Precision.BFLOAT16) == ""
    # Zeros scattered among values of their size (rounded operands cancelling): rounding.
    small = rng.uniform(1e-3, 1e-2, 1000).astype(np.float32)
    cancelled = np.where(rng.random(1000) < 0.3, 0, small).astype(np.float32)
    assert range_problem(small, cancelled, Precision.FLOAT16) == ""
    # One zero in a tensor of 48 (a squeeze-excite Relu whose input crossed 0) is not many.
    excite = np.linspace(0.005, 1, 48).astype(np.float32)
    assert range_problem(excite, np.where(excite < 0.006, 0, excite), Precision.BFLOAT16) == ""
    # Zeros two float16 steps from 0 (ONNX Runtime's float16 Sigmoid near 1e-7): rounding.
    tails = np.full(100, 1.2e-7, np.float32)
    assert range_problem(tails, np.zeros_like(tails), Precision.FLOAT16) == ""


def test_range_problems_are_told_from_rounding() -> None:
    ref = np.linspace(-1, 1, 1000).astype(np.float32) * 1e-4
    assert range_problem(ref, round_to(ref, Precision.FLOAT16), Precision.FLOAT16) == ""
    flushed = np.where(np.abs(ref) < 5e-5, 0, ref)
    assert "are 0 where float16 holds" in range_problem(ref, flushed, Precision.FLOAT16)
    # 3.5e4 fits float16; an overflowing kernel returned Inf for it.
    overflowed = np.full(100, np.inf, np.float32)
    assert "are ±Inf" in range_problem(np.full(100, 3.5e4), overflowed, Precision.FLOAT16)


def _bn_with_a_variance_beyond_float16(tmp_path: Path) -> Path:
    """Conv -> BatchNormalization whose variance (a Constant) holds 1e7: the fp16 converter
    clips it to 1e4, as it does PP-OCRv4 det's, so the model the target runs differs."""
    rng = np.random.default_rng(0)
    params = {"s": [1.0] * 4, "b": [0.1] * 4, "m": [0.0] * 4, "v": [1.0, 1.5, 1e7, 2.0]}
    nodes = [
        helper.make_node(
            "Constant", [], [k], name=f"const_{k}", value=_init(f"{k}_t", np.array(v, np.float32))
        )
        for k, v in params.items()
    ]
    nodes += [
        helper.make_node("Conv", ["x", "w"], ["c"], name="conv", pads=[1, 1, 1, 1]),
        helper.make_node("BatchNormalization", ["c", *params], ["bn"], name="bn"),
        helper.make_node("Relu", ["bn"], ["y"], name="relu"),
    ]
    w = _init("w", rng.standard_normal((4, 3, 3, 3)).astype(np.float32))
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 8, 8])
    graph = helper.make_graph(nodes, "bn_variance", [x], [y], [w])
    path = tmp_path / "bn_variance.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


def test_a_changed_constant_is_not_blamed_on_a_kernel_by_the_pass_bisection(
    tmp_path: Path,
) -> None:
    result = onnx_bisect.bisect(_bn_with_a_variance_beyond_float16(tmp_path), target="cpu+fp16")
    rc, pb = result.root_cause, result.pass_bisection
    assert rc is not None and rc.kind == CauseKind.PARAMETER and rc.nodes == ("const_v",)
    assert pb is not None and "the changed constant (const_v)" in pb.reason, pb
    assert "a kernel, not" not in pb.reason


def test_a_precision_floor_is_capped_so_that_a_wrong_tensor_cannot_pass() -> None:
    """An fp16 floor of 1.03 on a probability vector said "float16 predicts <= 4.1", a bound
    any value passes (issue 33): floors are capped at FLOOR_CAP (bound 4 x 0.125 + 1e-5)."""
    from onnx_bisect.compare.criterion import FLOOR_CAP, Criterion
    from onnx_bisect.compare.precision import PrecisionFloors
    from onnx_bisect.compare.tensors import compare_tensors

    probs = np.array([0.7, 0.2, 0.05, 0.05], np.float32)
    wrong = np.array([0.05, 0.05, 0.2, 0.7], np.float32)  # rel_l2 1.35: another answer
    floors = PrecisionFloors(Precision.FLOAT16, accumulated={"p": 1.03})
    crit = Criterion(floors=floors)
    assert FLOOR_CAP == 0.125
    assert crit.precision_limit("p") == (4 * 0.125 + 1e-5, 0.125)
    judged = compare_tensors("p", probs, wrong, crit)
    assert judged.diverged and not judged.within_precision
    assert judged.precision_floor == 0.125
    # An error the capped bound still holds (rel_l2 0.1) is within precision.
    near = (probs * np.float32(1.1)).astype(np.float32)
    assert compare_tensors("p", probs, near, crit).within_precision
