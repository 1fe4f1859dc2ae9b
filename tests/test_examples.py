"""The shipped examples: the committed models are what build_models.py makes, and the simulated
faulty runtime obeys the exec: protocol on its own."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import onnx
import onnxruntime as ort
import pytest
from onnx import numpy_helper

from tests.models import FAULTY_RUNTIME, ROOT, TRANSFORMER, YOLO, YOLO_FUSED

# Float payloads of a rebuilt model may differ from the committed ones in the last bits: torch
# draws the random weights with CPU-specific vectorized code (AVX2, AVX-512 or scalar Box-Muller
# and log), and folding BatchNorm into Conv weights is float32 arithmetic whose rounding follows
# the kernel too. Forcing torch's scalar kernels (ATEN_CPU_CAPABILITY=default) moves weights by
# up to 4.1 ulps of their tensor's largest value; 16 ulps leaves room for other CPUs. A wrong
# seed, layer or fold changes weights by whole percent, 1e4 times more. Everything else
# (graph, names, attributes, shapes, integer tensors) must match exactly.
WEIGHT_ULPS = 16
_FLOAT_TYPES = {
    onnx.TensorProto.FLOAT,
    onnx.TensorProto.DOUBLE,
    onnx.TensorProto.FLOAT16,
    onnx.TensorProto.BFLOAT16,
}


def _float_payloads(model: onnx.ModelProto) -> tuple[onnx.ModelProto, dict[str, npt.NDArray[Any]]]:
    """A copy of ``model`` with the data of its float tensors (initializers and tensor
    attributes, such as Constant values) cleared, and that data by where it was."""
    stripped = onnx.ModelProto()
    stripped.CopyFrom(model)
    payloads: dict[str, npt.NDArray[Any]] = {}

    def take(where: str, tensor: onnx.TensorProto) -> None:
        if tensor.data_type in _FLOAT_TYPES:
            payloads[where] = numpy_helper.to_array(tensor)
            for field in ("raw_data", "float_data", "double_data", "int32_data"):
                tensor.ClearField(field)

    for init in stripped.graph.initializer:
        take(f"initializer {init.name}", init)
    for node in stripped.graph.node:
        for attr in node.attribute:
            if attr.HasField("t"):
                take(f"{node.name}.{attr.name}", attr.t)
            for k, tensor in enumerate(attr.tensors):
                take(f"{node.name}.{attr.name}[{k}]", tensor)
    return stripped, payloads


def assert_same_model(built: onnx.ModelProto, committed: onnx.ModelProto, name: str) -> None:
    """Same graph exactly; float weights equal to ``WEIGHT_ULPS`` ulps of each tensor's scale."""
    a, a_data = _float_payloads(built)
    b, b_data = _float_payloads(committed)
    # The readable differences first, then everything else the protos hold.
    assert [(n.name, n.op_type, list(n.input), list(n.output)) for n in a.graph.node] == [
        (n.name, n.op_type, list(n.input), list(n.output)) for n in b.graph.node
    ], name
    for x, y in zip(a.graph.node, b.graph.node, strict=True):
        assert x == y, f"{name}: node {y.name} differs (attributes)"
    assert a.graph.input == b.graph.input and a.graph.output == b.graph.output, name
    assert a == b, f"{name}: the models differ outside the float weights"
    assert list(a_data) == list(b_data), name
    for where, want in b_data.items():
        got = a_data[where]
        assert got.dtype == want.dtype and got.shape == want.shape, f"{name}: {where}"
        if want.size == 0:
            continue
        wide = want.astype(np.float64)
        tol = WEIGHT_ULPS * float(np.finfo(want.dtype).eps) * float(np.abs(wide).max())
        np.testing.assert_allclose(
            got.astype(np.float64), wide, rtol=0, atol=tol, err_msg=f"{name}: {where}"
        )


def test_build_models_reproduces_committed_files(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "build_models.py"), "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    for committed in (YOLO, YOLO_FUSED, TRANSFORMER):
        built = onnx.load(str(tmp_path / committed.name))
        assert_same_model(built, onnx.load(str(committed)), committed.name)


def test_example_models_have_the_advertised_structure() -> None:
    yolo = onnx.load(str(YOLO))
    ops = [n.op_type for n in yolo.graph.node]
    for op in ("Conv", "BatchNormalization", "Sigmoid", "Mul", "Split", "Add", "MaxPool"):
        assert op in ops
    assert {"Resize", "Softmax", "Concat"} <= set(ops)
    dims = yolo.graph.input[0].type.tensor_type.shape.dim
    assert dims[0].dim_param == "batch"
    fused = onnx.load(str(YOLO_FUSED))
    producers = {o: n for n in fused.graph.node for o in n.output}
    assert "BatchNormalization" not in {n.op_type for n in fused.graph.node}
    silu = [
        n
        for n in fused.graph.node
        if n.op_type == "Mul"
        and {producers[i].op_type for i in n.input if i in producers} == {"Conv", "Sigmoid"}
    ]
    assert len(silu) >= 20  # Conv -> Sigmoid -> Mul, the SiLU pattern of the YOLO11x report
    tr = onnx.load(str(TRANSFORMER))
    producers = {o: n for n in tr.graph.node for o in n.output}
    ln = next(n for n in tr.graph.node if n.op_type == "LayerNormalization")
    assert producers[ln.input[0]].op_type == "Transpose"  # LayerNorm right after a dim swap


def test_faulty_runtime_plants_exactly_the_requested_error(tmp_path: Path) -> None:
    x = np.random.default_rng(0).random((1, 3, 160, 160), dtype=np.float32)
    np.savez(tmp_path / "in.npz", images=x)
    proc = subprocess.run(
        [
            sys.executable,
            str(FAULTY_RUNTIME),
            str(YOLO),
            str(tmp_path / "in.npz"),
            str(tmp_path / "out.npz"),
            "--fault",
            "/stem/conv/Conv=0.1",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    good = ort.InferenceSession(str(YOLO)).run(None, {"images": x})[0]
    with np.load(tmp_path / "out.npz") as z:
        bad = z["output0"]
    assert bad.shape == good.shape
    assert not np.allclose(bad, good, rtol=1e-3)


def _typed_outputs_model() -> onnx.ModelProto:
    """x -> Split (two outputs) -> TopK (float values, int64 indices); a float16 branch
    (Cast -> Mul) and an int32 one (Cast -> Add): one node of each kind a plant must reach."""
    from onnx import TensorProto, helper

    from tests.models import make

    f32, f16 = TensorProto.FLOAT, TensorProto.FLOAT16
    i32, i64 = TensorProto.INT32, TensorProto.INT64
    k = numpy_helper.from_array(np.array([3], np.int64), "k")
    half = numpy_helper.from_array(np.array(2.0, np.float16), "half")
    seven = numpy_helper.from_array(np.array(7, np.int32), "seven")
    nodes = [
        helper.make_node("Split", ["x"], ["a", "b"], name="split", axis=1, num_outputs=2),
        helper.make_node("TopK", ["a", "k"], ["vals", "idx"], name="topk", axis=1),
        helper.make_node("Cast", ["b"], ["b16"], name="to16", to=f16),
        helper.make_node("Mul", ["b16", "half"], ["h"], name="mul16"),
        helper.make_node("Cast", ["b"], ["bi"], name="toint", to=i32),
        helper.make_node("Add", ["bi", "seven"], ["n"], name="addint"),
    ]
    outs = [("vals", f32, [2, 3]), ("idx", i64, [2, 3]), ("h", f16, [2, 4]), ("n", i32, [2, 4])]
    return make(
        nodes,
        [helper.make_tensor_value_info("x", f32, [2, 8])],
        [helper.make_tensor_value_info(n, t, s) for n, t, s in outs],
        [k, half, seven],
    )


def _faulty_run(tmp_path: Path, model: onnx.ModelProto, x: npt.NDArray[Any], fault: str) -> Any:
    onnx.save(model, tmp_path / "m.onnx")
    np.savez(tmp_path / "in.npz", x=x)
    proc = subprocess.run(
        [sys.executable, str(FAULTY_RUNTIME), str(tmp_path / "m.onnx"), str(tmp_path / "in.npz"),
         str(tmp_path / "out.npz"), "--fault", fault],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    with np.load(tmp_path / "out.npz") as z:
        return {name: z[name] for name in z.files}


def test_faulty_runtime_plants_on_multi_output_integer_and_float16_nodes(tmp_path: Path) -> None:
    """Each output of a planted node is scaled in its own type (issue 33): before, every fault
    Mul of a multi-output node had one name and int32/float16 outputs were multiplied by a
    float32 scale, which ONNX Runtime refused, so such plants read as crashes."""
    model = _typed_outputs_model()
    x = np.array([[1, 5, 3, 2, 10, 20, 30, 40], [4, 2, 8, 6, 1, 2, 3, 4]], np.float32)
    good = dict(zip(["vals", "idx", "h", "n"], ort.InferenceSession(
        model.SerializeToString()).run(None, {"x": x}), strict=True))  # fmt: skip
    split = _faulty_run(tmp_path, model, x, "split=0.5")
    np.testing.assert_allclose(split["vals"], good["vals"] * 1.5)  # both of Split's outputs
    np.testing.assert_allclose(split["h"], (x[:, 4:] * 1.5 * 2).astype(np.float16))
    topk = _faulty_run(tmp_path, model, x, "topk=0.5")
    np.testing.assert_allclose(topk["vals"], good["vals"] * 1.5)
    # int64 indices: x 1.5, rounded away from zero (index 0 stays 0, 1 becomes 2)
    assert topk["idx"].dtype == np.int64
    np.testing.assert_array_equal(topk["idx"], np.ceil(good["idx"] * 1.5).astype(np.int64))
    half = _faulty_run(tmp_path, model, x, "mul16=0.5")
    assert half["h"].dtype == np.float16
    np.testing.assert_array_equal(half["h"], good["h"] * np.float16(1.5))
    ints = _faulty_run(tmp_path, model, x, "addint=0.05")
    assert ints["n"].dtype == np.int32
    np.testing.assert_array_equal(ints["n"], good["n"] + np.ceil(good["n"] * 0.05).astype(np.int32))


def test_faulty_runtime_plant_on_integer_output_is_named_a_culprit_not_a_crash() -> None:
    import onnx_bisect

    spec = f"exec:{sys.executable} {FAULTY_RUNTIME} {{model}} {{inputs}} {{outputs}}"
    spec += " --fault topk=0.5"
    result = onnx_bisect.bisect(_typed_outputs_model(), target=spec)
    assert result.root_cause is not None
    assert (result.root_cause.kind.value, result.root_cause.nodes) == ("culprit", ("topk",))
    assert result.root_cause.reason == (
        "TopK 'topk' diverges on its own when fed the reference's inputs "
        "(4 of 6 elements differ (exact comparison))"
    )
