"""--target-model: the original against a transformed copy, tensors matched by name."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper
from typer.testing import CliRunner

import onnx_bisect
from onnx_bisect.cli import bisect_app
from tests.models import YOLO, make

FAULT = "/down1/conv/Conv"


def _one_weight_changed(tmp_path: Path) -> Path:
    model = onnx.load(str(YOLO))
    conv = next(n for n in model.graph.node if n.name == FAULT)
    init = next(t for t in model.graph.initializer if t.name == conv.input[1])
    w = numpy_helper.to_array(init).copy()
    w.flat[0] += 20 * np.abs(w).max()  # one weight, far off
    init.CopyFrom(numpy_helper.from_array(w, init.name))
    path = tmp_path / "changed.onnx"
    onnx.save(model, str(path))
    return path


def test_a_changed_weight_in_a_copy_is_found_at_that_node(tmp_path: Path) -> None:
    result = onnx_bisect.bisect(YOLO, target="cpu", target_model=_one_weight_changed(tmp_path))
    assert result.verdict == "diverged"
    assert result.first_divergence is not None and result.first_divergence.name == FAULT
    assert result.root_cause is not None
    assert result.root_cause.kind == "culprit" and result.root_cause.nodes == (FAULT,)
    assert result.matching is not None and not result.matching.excluded


def _conv_bn(fused: bool) -> onnx.ModelProto:
    """Conv without bias -> BatchNormalization -> Relu, or the same with BN folded into the
    Conv, keeping the name conv_out for the post-BN value (what fuse_bn_into_conv does)."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal((4, 3, 3, 3)).astype(np.float32)
    scale, bias = rng.random(4).astype(np.float32) + 0.5, rng.standard_normal(4).astype(np.float32)
    mean, var = rng.standard_normal(4).astype(np.float32), rng.random(4).astype(np.float32) + 0.5
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 8, 8])
    if not fused:
        nodes = [
            helper.make_node("Conv", ["x", "W"], ["conv_out"], name="conv", pads=[1, 1, 1, 1]),
            helper.make_node(
                "BatchNormalization", ["conv_out", "s", "b", "m", "v"], ["bn_out"], name="bn"
            ),
            helper.make_node("Relu", ["bn_out"], ["y"], name="relu"),
        ]
        inits = [numpy_helper.from_array(a, n) for a, n in
                 ((w, "W"), (scale, "s"), (bias, "b"), (mean, "m"), (var, "v"))]  # fmt: skip
        return make(nodes, [x], [y], inits)
    k = scale / np.sqrt(var + 1e-5)
    wf = (w * k[:, None, None, None]).astype(np.float32)
    bf = (bias - mean * k).astype(np.float32)
    nodes = [
        helper.make_node("Conv", ["x", "W_f", "B_f"], ["conv_out"], name="conv", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["conv_out"], ["y"], name="relu"),
    ]
    inits = [numpy_helper.from_array(wf, "W_f"), numpy_helper.from_array(bf, "B_f")]
    return make(nodes, [x], [y], inits)


def test_a_name_that_changed_meaning_is_excluded_not_flagged() -> None:
    original, fused = _conv_bn(False), _conv_bn(True)
    result = onnx_bisect.bisect(original, target="cpu", target_model=fused, always_scan=True)
    assert result.verdict == "match"
    assert result.first_divergence is None  # conv_out differs by design, and is left out
    assert result.matching is not None
    assert set(result.matching.excluded) == {"conv_out"}
    assert "holds bn_out's value" in result.matching.excluded["conv_out"]
    assert result.matching.matched == ("y",)
    # ...and still compared, with the reference tensor it now holds.
    assert result.matching.pairs == {"conv_out": "bn_out", "y": "y"}
    conv = next(n for n in result.nodes if n.name == "conv")
    assert conv.accumulated is not None and not conv.diverged
    report = onnx_bisect.to_dict(result)["tensor_matching"]
    assert report["excluded"][0]["tensor"] == "conv_out"
    assert any("excluded conv_out" in n for n in result.notes)


def test_cli_target_model(tmp_path: Path) -> None:
    res = CliRunner().invoke(
        bisect_app,
        [str(YOLO), "-t", "cpu", "--target-model", str(_one_weight_changed(tmp_path))],
    )
    assert res.exit_code == 1, res.output
    assert f"Root cause (culprit): {FAULT}" in res.stdout


def test_bn_folded_detector_against_the_original_has_no_false_divergence() -> None:
    from tests.models import YOLO_FUSED

    result = onnx_bisect.bisect(YOLO, target="cpu", target_model=YOLO_FUSED, always_scan=True)
    assert result.verdict == "match" and result.first_divergence is None
    m = result.matching
    assert m is not None
    # Every Conv output now holds its BatchNorm's value: all 30 are recognised and left out.
    assert len(m.excluded) == 30
    assert all("BatchNormalization_output_0's value" in r for r in m.excluded.values())
    assert len(m.matched) > 100


def test_a_transform_that_changes_results_is_still_reported() -> None:
    broken = _conv_bn(True)
    for t in broken.graph.initializer:
        if t.name == "B_f":
            t.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(t) + 0.5, "B_f"))
    result = onnx_bisect.bisect(_conv_bn(False), target="cpu", target_model=broken)
    assert result.verdict == "diverged"
    # conv_out is compared with bn_out, the value it now holds: the fused Conv itself is named.
    assert result.matching is not None and result.matching.paired == {"conv_out": "bn_out"}
    assert result.first_divergence is not None and result.first_divergence.name == "conv"
    assert result.root_cause is not None and result.root_cause.nodes == ("conv",)
    assert result.root_cause.kind == "culprit"


def test_a_transformed_copy_under_a_small_memory_budget(tmp_path: Path) -> None:
    """Reference tensors on disk, the target model's own weight arithmetic added to the view
    in memory: the planted Conv is still named."""
    result = onnx_bisect.bisect(
        YOLO,
        target="cpu+onnxoptimizer=fuse_bn_into_conv",
        target_model=_one_weight_changed(tmp_path),
        max_memory=4 << 20,
    )
    assert result.root_cause is not None and result.root_cause.nodes == (FAULT,)
