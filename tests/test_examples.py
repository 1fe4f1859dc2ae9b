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
