"""`+transform` suffixes: the model is rewritten, then compared with the original by name."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper
from typer.testing import CliRunner

import onnx_bisect
from onnx_bisect.backends.registry import create_backend
from onnx_bisect.backends.spec import parse_spec
from onnx_bisect.cli import bisect_app
from onnx_bisect.errors import SpecError
from onnx_bisect.report.curve import error_curve
from onnx_bisect.transforms.apply import apply_transforms
from onnx_bisect.transforms.registry import parse_transform
from tests.models import YOLO, make

pytest.importorskip("onnxconverter_common")
pytest.importorskip("onnxoptimizer")
pytest.importorskip("onnxslim")


def _shape_arithmetic() -> onnx.ModelProto:
    """x * float(x.shape[1]): a Cast(to=FLOAT) of shape arithmetic, as in YOLOv8n's anchors."""
    nodes = [
        helper.make_node("Shape", ["x"], ["s"], name="shape"),
        helper.make_node("Gather", ["s", "idx"], ["g"], name="gather", axis=0),
        helper.make_node("Cast", ["g"], ["c"], name="cast", to=TensorProto.FLOAT),
        helper.make_node("Mul", ["x", "c"], ["y"], name="mul"),
        helper.make_node("Relu", ["y"], ["out"], name="relu"),
    ]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])
    out = helper.make_tensor_value_info("out", TensorProto.FLOAT, [2, 3])
    idx = numpy_helper.from_array(np.array(1, dtype=np.int64), "idx")
    return onnx.shape_inference.infer_shapes(make(nodes, [x], [out], [idx]))


def _ort(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return np.asarray(sess.run(None, {"x": x})[0])


def test_spec_grammar_and_errors() -> None:
    spec = parse_spec("cpu?opt=basic+onnxoptimizer=fuse_bn_into_conv,eliminate_identity+fp16")
    assert spec.transforms == ("onnxoptimizer=fuse_bn_into_conv,eliminate_identity", "fp16")
    assert spec.without_transforms().text == "cpu?opt=basic"
    assert parse_transform("opset=18").arg == "18"
    for bad in ("cpu+bogus", "cpu+opset", "cpu+onnxsim=1", "cpu+fp16=x"):
        with pytest.raises(SpecError):
            parse_spec(bad)
    with pytest.raises(SpecError, match="rewrite the model"):
        create_backend("cpu+fp16")


def test_the_converter_mislabels_a_kept_cast_and_the_block_list_keeps_it_float32() -> None:
    from onnxconverter_common import float16

    model = _shape_arithmetic()
    x = np.random.default_rng(0).standard_normal((2, 3)).astype(np.float32)
    raw = float16.convert_float_to_float16(model, keep_io_types=True)
    # The failure being repaired: ORT refuses the converter's own output.
    with pytest.raises(Exception, match="float16|Type"):
        _ort(raw, x)
    fixed, records = apply_transforms(model, ["fp16"], "target")
    assert records[0].notes == (
        "kept in float32: 1 Cast(to=FLOAT) node(s) of the model's own (the converter keeps "
        "their float32 output but labels it float16)",
        "converted as float16.convert_float_to_float16(model, keep_io_types=True, "
        "node_block_list=['cast'])",
    )
    np.testing.assert_allclose(_ort(fixed, x), _ort(model, x), rtol=2e-3, atol=1e-3)
    assert len(model.graph.node) == 5  # the caller's model is left alone


def test_fp16_on_the_detector_reports_the_error_curve(tmp_path: Path) -> None:
    # fp16 rounding stays under 1e-3 at the output (the default noise-floor threshold calls
    # it a divergence), but the scan still runs: the curve is what a transform comparison is for.
    result = onnx_bisect.bisect(YOLO, target="cpu+fp16", threshold=1e-3)
    assert result.verdict == "match"
    assert result.target.spec == "cpu+fp16"
    assert [t.text for t in result.transforms] == ["fp16"]
    assert result.matching is not None and not result.matching.excluded
    curve = error_curve(result.nodes)
    assert sum(p.error > 0 for p in curve) > 10
    assert max(p.error for p in curve) < 0.05  # fp16-sized, not a broken kernel
    assert not result.culprits()
    onnx_bisect.write_reports(result, tmp_path)
    report = (tmp_path / "report.md").read_text()
    assert "**Error curve**" in report and "+fp16: onnxconverter-common" in report
    data = json.loads((tmp_path / "report.json").read_text())
    assert data["transforms"][0]["tool"].startswith("onnxconverter-common")
    assert len(data["error_curve"]) == len(curve)


@pytest.mark.parametrize(
    "transform", ["onnxoptimizer=fuse_bn_into_conv", "onnxoptimizer", "onnxslim", "opset=18"]
)
def test_an_optimized_copy_of_the_detector_shows_no_false_divergence(transform: str) -> None:
    result = onnx_bisect.bisect(YOLO, target=f"cpu+{transform}")
    assert result.verdict == "match", result.notes
    assert result.nodes, "the scan runs after a transform"
    assert not [n.name for n in result.nodes if n.diverged]
    assert result.matching is not None and len(result.matching.pairs) > 90


def test_onnxsim_copy_of_the_detector() -> None:
    pytest.importorskip("onnxsim")
    result = onnx_bisect.bisect(YOLO, target="cpu+onnxsim")
    assert result.verdict == "match"
    assert not [n.name for n in result.nodes if n.diverged]


def _one_weight_changed(tmp_path: Path, node: str = "/down1/conv/Conv") -> Path:
    model = onnx.load(str(YOLO))
    conv = next(n for n in model.graph.node if n.name == node)
    init = next(t for t in model.graph.initializer if t.name == conv.input[1])
    w = numpy_helper.to_array(init).copy()
    w.flat[0] += 20 * np.abs(w).max()
    init.CopyFrom(numpy_helper.from_array(w, init.name))
    path = tmp_path / "changed.onnx"
    onnx.save(model, str(path))
    return path


@pytest.mark.parametrize("transform", ["onnxoptimizer=fuse_bn_into_conv", "onnxslim", "fp16"])
def test_a_planted_fault_survives_the_transform_and_is_named(
    tmp_path: Path, transform: str
) -> None:
    """A changed weight in the target copy, then the transform: the fused Conv that now
    computes Conv+BN is compared with the BatchNorm's output it stands for, and named."""
    changed = _one_weight_changed(tmp_path)
    # A fixed threshold: against fp32 noise, every fp16 node would be a culprit.
    result = onnx_bisect.bisect(
        YOLO, target=f"cpu+{transform}", target_model=changed, threshold=1e-3
    )
    assert result.verdict == "diverged"
    assert result.root_cause is not None and result.root_cause.kind == "culprit"
    culprit = next(n for n in result.nodes if n.name == result.root_cause.nodes[0])
    assert culprit.op_type == "Conv"
    # The culprit reads the input of the planted Conv: it is that Conv, however renamed.
    stage_input = "/stem/Mul_output_0"
    assert stage_input in culprit.inputs


def test_a_transform_on_the_reference_side() -> None:
    result = onnx_bisect.bisect(YOLO, ref="cpu+onnxslim", target="cpu")
    assert result.verdict == "match"
    assert result.transforms[0].role == "ref"
    assert result.ref.spec == "cpu+onnxslim"


def test_cli_transform_and_its_errors(tmp_path: Path) -> None:
    runner = CliRunner()
    ok = runner.invoke(
        bisect_app, [str(YOLO), "-t", "cpu+onnxslim", "--no-repro", "-o", str(tmp_path / "r")]
    )
    assert ok.exit_code == 0, ok.output
    assert "+onnxslim" in ok.stdout
    bad = runner.invoke(bisect_app, [str(YOLO), "-t", "cpu+bogus"])
    assert bad.exit_code == 2
    assert "unknown transform +bogus" in bad.output and "Traceback" not in bad.output
    wrong = runner.invoke(bisect_app, [str(YOLO), "-t", "cpu+onnxoptimizer=no_such_pass"])
    assert wrong.exit_code == 2 and "no_such_pass" in wrong.output


def test_a_missing_transform_package_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    from importlib.metadata import PackageNotFoundError

    import onnx_bisect.transforms.apply as transforms

    def missing(name: str) -> str:
        raise PackageNotFoundError(name)

    monkeypatch.setattr(transforms, "version", missing)
    res = CliRunner().invoke(bisect_app, [str(YOLO), "-t", "cpu+onnxslim"])
    assert res.exit_code == 2
    assert "needs the onnxslim package" in res.output


def _bn_params_as_constant_floats() -> onnx.ModelProto:
    """Conv -> BatchNormalization whose parameters are Constant(value_floats=...) nodes:
    onnxoptimizer 0.4.2's fuse_bn_into_conv dereferences a null tensor there and segfaults."""
    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.standard_normal((2, 3, 1, 1)).astype(np.float32), "w")
    params = {"s": [1.0, 2.0], "b": [0.1, 0.2], "m": [0.0, 0.5], "v": [1.0, 1.5]}
    nodes = [
        helper.make_node("Constant", [], [k], name=f"const_{k}", value_floats=v)
        for k, v in params.items()
    ]
    nodes += [
        helper.make_node("Conv", ["x", "w"], ["conv_out"], name="conv"),
        helper.make_node("BatchNormalization", ["conv_out", *params], ["y"], name="bn"),
    ]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 4, 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 2, 4, 4])
    return make(nodes, [x], [y], [w])


def test_a_crashing_optimizer_is_one_clear_line(tmp_path: Path) -> None:
    path = tmp_path / "bn_constant_floats.onnx"
    onnx.save(_bn_params_as_constant_floats(), str(path))
    plain = CliRunner().invoke(bisect_app, [str(path), "-t", "cpu", "--no-repro"])
    assert plain.exit_code == 0, plain.output  # the model itself is fine
    res = CliRunner().invoke(
        bisect_app, [str(path), "-t", "cpu+onnxoptimizer=fuse_bn_into_conv", "--no-repro"]
    )
    if res.exit_code == 0:
        pytest.skip("this onnxoptimizer no longer crashes here (0.4.2 did)")
    assert res.exit_code == 2, res.output
    assert "transform +onnxoptimizer=fuse_bn_into_conv crashed (SIGSEGV)" in res.output
    assert "a bug in onnxoptimizer" in res.output
    assert "Traceback" not in res.output


CONV_BN = YOLO.parent / "conv_bn.onnx"
CONV_BN_CONSTANT = YOLO.parent / "conv_bn_constant.onnx"


@pytest.mark.parametrize("model", [CONV_BN, CONV_BN_CONSTANT], ids=["initializer", "constant"])
def test_the_onnxoptimizer_seed_pattern_shows_no_false_divergence(model: Path) -> None:
    """Conv with a weight and no bias -> BatchNorm, weights as initializers or Constant nodes:
    fuse_bn_into_conv keeps each Conv's output name for the post-BN value and recomputes the
    weights at run time; every renamed tensor is compared with its true counterpart."""
    result = onnx_bisect.bisect(
        model,
        ref="cpu?opt=disable",
        target="cpu?opt=disable+onnxoptimizer=fuse_bn_into_conv",
        topk=["1:logits"],
    )
    assert result.verdict == "match"
    assert not [n.name for n in result.nodes if n.diverged]
    m = result.matching
    assert m is not None
    assert {f"{s}/conv_out" for s in ("stem", "stage1", "stage2", "stage3")} == set(m.paired)
    assert all(m.paired[t] == t.replace("conv_out", "bn_out") for t in m.paired)
    assert result.task_checks[0].top1_agreement == 1.0


def test_a_wrong_constant_weight_after_fusion_is_named(tmp_path: Path) -> None:
    model = onnx.load(str(CONV_BN_CONSTANT))
    const = next(n for n in model.graph.node if n.name == "stage1/conv.weight_const")
    w = numpy_helper.to_array(const.attribute[0].t).copy()
    w.flat[3] += 10 * np.abs(w).max()
    const.attribute[0].t.CopyFrom(numpy_helper.from_array(w, const.attribute[0].t.name))
    changed = tmp_path / "changed.onnx"
    onnx.save(model, str(changed))
    result = onnx_bisect.bisect(
        CONV_BN_CONSTANT, target="cpu+onnxoptimizer=fuse_bn_into_conv", target_model=changed
    )
    assert result.verdict == "diverged"
    # The optimizer moved the changed weight into an initializer the fused Conv reads: the
    # Conv is named, with the changed Constant (never a culprit itself) pointed out.
    rc = result.root_cause
    assert rc is not None and rc.kind == "culprit" and rc.nodes == ("stage1/conv",)
    assert "changed constants (stage1/conv.weight_const)" in rc.reason
    const = next(n for n in result.nodes if n.name == "stage1/conv.weight_const")
    assert const.verdict == "parameter"
    conv = next(n for n in result.nodes if n.name == "stage1/conv")
    assert conv.diverged


def test_a_repro_bundle_is_cut_from_the_transformed_model(tmp_path: Path) -> None:
    """The bundle holds the fused Conv from the optimized copy and the reference model's
    value of the BatchNorm output it replaced; repro.py reproduces in a fresh process."""
    changed = _one_weight_changed(tmp_path)
    result = onnx_bisect.bisect(
        YOLO,
        target="cpu+onnxoptimizer=fuse_bn_into_conv",
        target_model=changed,
        repro=tmp_path / "bundle",
    )
    assert result.repro is not None and result.repro.reproduces
    assert result.repro.nodes == ("/down1/conv/Conv",)
    bundle = onnx.load(str(tmp_path / "bundle" / "model.onnx"))
    assert [n.op_type for n in bundle.graph.node] == ["Conv"]
    assert len(bundle.graph.node[0].input) == 3  # the fused Conv, with the folded bias
    readme = (tmp_path / "bundle" / "README.md").read_text()
    assert "cut from the target model" in readme


def _gemm_output_read_inside() -> onnx.ModelProto:
    """Gemm -> h, a graph output that Relu reads too (BERT's pooler as exported): with
    keep_io_types, onnxconverter-common 1.16 casts h back to float32 and still labels Relu's
    output float16, a model no runtime loads."""
    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.standard_normal((4, 4)).astype(np.float32), "w")
    b = numpy_helper.from_array(rng.standard_normal(4).astype(np.float32), "b")
    nodes = [
        helper.make_node("Gemm", ["x", "w", "b"], ["h"], name="gemm"),
        helper.make_node("Relu", ["h"], ["y"], name="relu"),
    ]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])
    outs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [2, 4]) for n in ("h", "y")]
    return make(nodes, [x], outs, [w, b])


def test_a_node_the_converter_breaks_is_kept_in_float32_and_the_run_answers(
    tmp_path: Path,
) -> None:
    """Not exit 2 on a valid model: onnx names the node the converter's float16 model fails
    at (relu), the transform keeps it in float32, says so, and the diagnosis goes on."""
    path = tmp_path / "gemm_output_read_inside.onnx"
    onnx.save(_gemm_output_read_inside(), str(path))
    res = CliRunner().invoke(bisect_app, [str(path), "-t", "cpu+fp16", "--no-repro"])
    assert res.exit_code == 0, res.output
    text = " ".join(res.output.split())
    assert (
        "kept in float32: relu (the converter's float16 model fails onnx type inference at "
        "relu: [TypeInferenceError] Inferred elem type differs from existing elem type: (1) "
        "vs (10))" in text
    )
    assert "node_block_list=['relu']" in text and "Traceback" not in res.output


def test_a_model_onnx_rejects_already_is_not_blamed_on_the_transform() -> None:
    from onnxconverter_common import float16

    from onnx_bisect.transforms.validity import broken_by

    good = _gemm_output_read_inside()
    bad = float16.convert_float_to_float16(good, keep_io_types=True)
    assert "node name: relu" in broken_by(good, bad)
    assert broken_by(bad, bad) == ""  # invalid before: not the transform's doing
    assert broken_by(good, good) == ""


def test_the_validity_skeleton_leaves_out_weights_only() -> None:
    from onnx_bisect.transforms.validity import skeleton

    model = _gemm_output_read_inside()
    big = numpy_helper.from_array(np.zeros((256, 256), np.float32), "big")
    model.graph.initializer.append(big)
    bones = skeleton(model)
    kept = {t.name: t for t in bones.graph.initializer}
    assert kept["w"] == model.graph.initializer[0]  # small: whole
    assert not kept["big"].raw_data and list(kept["big"].dims) == [256, 256]
    assert bones.graph.node == model.graph.node and bones.opset_import == model.opset_import


def test_opset_conversion_keeps_external_weights_on_disk(tmp_path: Path) -> None:
    """+opset reads no weight: the child converts the message with its weights located, not
    read (a model over 2 GB stays small), and the result still carries them."""
    from tests.models import write_external_mlp

    path = tmp_path / "mlp.onnx"
    write_external_mlp(path, blocks=2)
    loaded = onnx_bisect.graph.load.load_model(path)
    converted, (record,) = apply_transforms(loaded.model, ["opset=19"], "target")
    assert next(o.version for o in converted.opset_import if o.domain == "") == 19
    weights = {t.name: numpy_helper.to_array(t) for t in converted.graph.initializer}
    original = onnx.load(str(path))
    for t in original.graph.initializer:
        np.testing.assert_array_equal(weights[t.name], numpy_helper.to_array(t))
    assert record.nodes_after == record.nodes_before


def test_onnxoptimizer_through_files_as_past_2gb(tmp_path: Path) -> None:
    """Past 2 GB onnxoptimizer is handed files (protobuf raises EncodeError, which its own
    fallback does not catch); on a small model that path gives what optimize() gives."""
    import onnxoptimizer

    from onnx_bisect.transforms.registry import _optimize_from_files
    from tests.models import write_external_mlp

    path = tmp_path / "mlp.onnx"
    write_external_mlp(path, blocks=2)
    model = onnx.load(str(path))
    model.graph.node.insert(0, helper.make_node("Identity", ["x"], ["x_id"], name="id"))
    model.graph.node[1].input[0] = "x_id"
    passes = list(onnxoptimizer.get_fuse_and_elimination_passes())
    direct = onnxoptimizer.optimize(model, passes)
    via_files = _optimize_from_files(model, passes)
    assert "Identity" not in {n.op_type for n in via_files.graph.node}  # it did optimize
    assert [n.op_type for n in via_files.graph.node] == [n.op_type for n in direct.graph.node]
    for a, b in zip(direct.graph.initializer, via_files.graph.initializer, strict=True):
        np.testing.assert_array_equal(numpy_helper.to_array(a), numpy_helper.to_array(b))
