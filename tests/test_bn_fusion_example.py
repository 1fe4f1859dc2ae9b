"""examples/bn_fusion.py: the issue #178 models are valid and deterministic, and onnxoptimizer's
fuse_bn_into_conv does to them what the example's docstring says it does."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import numpy as np
import onnx
import pytest

from tests.models import ROOT

STAGES = ("stem", "stage1", "stage2", "stage3")


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bn_fusion", ROOT / "examples" / "bn_fusion.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules["bn_fusion"] = module  # dataclasses look their module up while being created
    spec.loader.exec_module(module)
    return module


bn = _load()


def _optimized(model: onnx.ModelProto) -> onnx.ModelProto:
    pytest.importorskip("onnxoptimizer")
    out: onnx.ModelProto = bn.fuse_bn(model)
    return out


def _producers(model: onnx.ModelProto) -> dict[str, onnx.NodeProto]:
    return {o: n for n in model.graph.node for o in n.output}


@pytest.mark.parametrize("weight", ["initializer", "constant"])
def test_builder_makes_a_valid_runnable_model(weight: str) -> None:
    model = bn.conv_bn_model(weight)
    onnx.checker.check_model(model, full_check=True)
    assert (model.ir_version, model.opset_import[0].version) == (8, 13)
    names = [n.name for n in model.graph.node]
    assert all(names) and len(set(names)) == len(names)
    producers = _producers(model)
    for s in STAGES:
        conv = producers[f"{s}/conv_out"]
        assert conv.name == f"{s}/conv" and conv.op_type == "Conv"
        assert len(conv.input) == (3 if s == "stage2" else 2)  # only stage2 has a Conv bias
        assert producers[f"{s}/bn_out"].input[0] == f"{s}/conv_out"
    inits = {i.name for i in model.graph.initializer}
    consts = [n.name for n in model.graph.node if n.op_type == "Constant"]
    if weight == "initializer":
        assert {f"{s}/conv.weight" for s in STAGES} <= inits and not consts
    else:
        assert not inits & {f"{s}/conv.weight" for s in STAGES}
        assert consts == [f"{s}/conv.weight_const" for s in STAGES]
    out = bn.run(model, bn.random_feed(0))
    assert out["logits"].shape == (1, 10) and out["features"].shape == (1, 32)
    assert np.isfinite(out["logits"]).all() and float(np.std(out["logits"])) > 0.01


@pytest.mark.parametrize("weight", ["initializer", "constant"])
def test_builder_is_deterministic(weight: str) -> None:
    first = bn.conv_bn_model(weight).SerializeToString()
    assert bn.conv_bn_model(weight).SerializeToString() == first
    assert bn.conv_bn_model(weight, seed=1).SerializeToString() != first


def test_variants_are_valid() -> None:
    model = bn.conv_bn_model(side_branch=True, extra_outputs=("stage2/bn_out",), opset=11)
    assert [o.name for o in model.graph.output] == [
        "logits",
        "features",
        "stage1_conv_mean",
        "stage2/bn_out",
    ]
    readers = [n.name for n in model.graph.node if "stage1/conv_out" in n.input]
    assert readers == ["stage1/bn", "stage1/side_gap"]
    out = bn.run(model, bn.random_feed(0))
    assert out["stage1_conv_mean"].shape == (1, 16) and out["stage2/bn_out"].shape == (
        1,
        16,
        16,
        16,
    )


def test_main_writes_the_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert bn.main([str(tmp_path)]) == 0
    written = {p.name for p in tmp_path.iterdir()}
    assert {"conv_bn.onnx", "conv_bn_constant.onnx"} <= written
    if importlib.util.find_spec("onnxoptimizer") is not None:
        assert {"conv_bn.optimized.onnx", "conv_bn_constant.optimized.onnx"} <= written
        assert (
            "kept name, new meaning: stem/conv_out now holds stem/bn_out" in capsys.readouterr().out
        )


# What onnxoptimizer 0.4.2's fuse_bn_into_conv was observed to do (see the example's docstring).


@pytest.mark.parametrize("weight", ["initializer", "constant"])
def test_fusion_writes_the_folding_into_the_graph(weight: str) -> None:
    model = bn.conv_bn_model(weight)
    fused = _optimized(model)
    onnx.checker.check_model(fused, full_check=True)
    added = bn.op_counts(fused) - bn.op_counts(model)
    assert bn.op_counts(fused)["BatchNormalization"] == 0  # the biased stage2 Conv too
    # ten nodes per BN compute the new weight and bias at run time
    per_bn = {"Cast": 2, "Add": 2, "Sqrt": 1, "Div": 1, "Unsqueeze": 1, "Mul": 2, "Sub": 1}
    assert added == {op: 4 * n for op, n in per_bn.items()}
    convs = [n for n in fused.graph.node if n.op_type == "Conv"]
    assert [c.output[0] for c in convs] == [f"{s}/conv_out" for s in STAGES]
    assert all(len(c.input) == 3 for c in convs)  # every Conv now has a bias
    tensors = {t for n in fused.graph.node for t in n.output}
    assert not any(t.endswith("/bn_out") for t in tensors)
    inits = {i.name for i in fused.graph.initializer}
    assert {i for i in inits if "/" in i} == {"head/fc.weight", "head/fc.bias"}


def test_constant_weights_leave_dead_constant_nodes() -> None:
    model = bn.conv_bn_model("constant")
    fused = _optimized(model)
    assert bn.dead_nodes(model) == []
    assert bn.dead_nodes(fused) == [f"{s}/conv.weight_const" for s in STAGES]
    assert fused.ByteSize() > 1.8 * model.ByteSize()  # weights stored twice
    assert bn.dead_nodes(_optimized(bn.conv_bn_model())) == []


@pytest.mark.parametrize("weight", ["initializer", "constant"])
def test_kept_names_hold_post_bn_values_and_logits_agree(weight: str) -> None:
    model = bn.conv_bn_model(weight)
    report = bn.compare(weight, model, _optimized(model))
    assert report.renamed == {f"{s}/conv_out": f"{s}/bn_out" for s in STAGES}
    for same_name, new_meaning in report.renamed_check.values():
        assert same_name > 0.3 and new_meaning < 1e-5
    assert report.logits_rel_l2 < 1e-5 and report.logits_max_abs < 1e-5
    assert report.logits_rel_l2_ort_opt < 1e-5


@pytest.mark.parametrize("opset", [11, 12, 13])
def test_fusion_at_older_opsets(opset: int) -> None:
    model = bn.conv_bn_model(opset=opset)
    fused = _optimized(model)
    assert bn.op_counts(fused)["BatchNormalization"] == 0
    unsqueeze = [n for n in fused.graph.node if n.op_type == "Unsqueeze"]
    assert all(len(n.input) == (2 if opset >= 13 else 1) for n in unsqueeze)  # axes input/attr
    feed = bn.random_feed(0)
    a = bn.run(model, feed, ort_optimizations=False)["logits"]
    b = bn.run(fused, feed, ort_optimizations=False)["logits"]
    assert bn.rel_l2(a, b) < 1e-5


def test_conv_output_with_a_second_reader_is_not_fused() -> None:
    model = bn.conv_bn_model(side_branch=True)
    fused = _optimized(model)
    assert [n.name for n in fused.graph.node if n.op_type == "BatchNormalization"] == ["stage1/bn"]
    feed = bn.random_feed(0)
    a, b = bn.run(model, feed), bn.run(fused, feed)
    assert bn.rel_l2(a["stage1_conv_mean"], b["stage1_conv_mean"]) < 1e-6
    assert bn.rel_l2(a["logits"], b["logits"]) < 1e-5


def test_conv_output_that_is_a_graph_output_is_not_fused() -> None:
    fused = _optimized(bn.conv_bn_model(extra_outputs=("stage2/conv_out",)))
    assert [n.name for n in fused.graph.node if n.op_type == "BatchNormalization"] == ["stage2/bn"]


def test_bn_output_that_is_a_graph_output_keeps_its_name() -> None:
    model = bn.conv_bn_model(extra_outputs=("stage2/bn_out",))
    fused = _optimized(model)
    assert bn.op_counts(fused)["BatchNormalization"] == 0
    assert _producers(fused)["stage2/bn_out"].name == "stage2/conv"
    assert "stage2/conv_out" not in _producers(fused)
    feed = bn.random_feed(0)
    a, b = bn.run(model, feed), bn.run(fused, feed)
    assert bn.rel_l2(a["stage2/bn_out"], b["stage2/bn_out"]) < 1e-5


def test_bias_that_is_not_a_constant_initializer_blocks_fusion() -> None:
    model = bn.conv_bn_model()
    bias = next(i for i in model.graph.initializer if i.name == "stage2/conv.bias")
    model.graph.input.append(onnx.helper.make_tensor_value_info(bias.name, bias.data_type, [16]))
    fused = _optimized(model)
    assert [n.name for n in fused.graph.node if n.op_type == "BatchNormalization"] == ["stage2/bn"]
