"""The shipped examples: the committed models are what build_models.py makes, and the simulated
faulty runtime obeys the exec: protocol on its own."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from tests.models import FAULTY_RUNTIME, ROOT, TRANSFORMER, YOLO, YOLO_FUSED


@pytest.mark.slow
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
        assert (tmp_path / committed.name).read_bytes() == committed.read_bytes(), committed.name


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
