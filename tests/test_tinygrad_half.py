"""tinygrad in float16 through examples/tinygrad_runtime.py: ``DEFAULT_FLOAT=HALF`` (issue 33
item 7, the real run on YOLOv8n-320). tinygrad's ONNX runner keeps a model's float32 tensors
float32 whatever its default float says, so the script casts them; ``DEV=PYTHON`` needs no
compiler, and a one-node model runs in a few seconds."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from tests.models import ROOT, make

pytest.importorskip("tinygrad", reason="tinygrad is not installed (pip install tinygrad)")

RUNTIME = ROOT / "examples" / "tinygrad_runtime.py"
X = np.array([-20, -15, -12, -11, -8, 0, 3, 10], np.float32)


def _sigmoid(tmp_path: Path, *settings: str) -> np.ndarray:
    model = make(
        [helper.make_node("Sigmoid", ["x"], ["y"], name="sig")],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [8])],
    )
    onnx.save(model, tmp_path / "sig.onnx")
    np.savez(tmp_path / "in.npz", x=X)
    args = [str(tmp_path / n) for n in ("sig.onnx", "in.npz", "out.npz")]
    env = ["env", "DEV=PYTHON", f"CACHEDB={tmp_path / 'cache.db'}", *settings]
    done = subprocess.run(
        [*env, sys.executable, str(RUNTIME), *args], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    assert "mismatch on dtype" not in done.stderr  # the runner's warning per input, silenced
    with np.load(tmp_path / "out.npz") as z:
        return np.asarray(z["y"])


def test_default_float_half_runs_the_model_in_half(tmp_path: Path) -> None:
    """In half, tinygrad's Sigmoid returns exactly 0 at -11 and below (exp2 overflows
    float16), which flushes YOLOv8n-320's scores; in float32 it does not. The output comes
    back float32, as the model declares it."""
    half = _sigmoid(tmp_path, "DEFAULT_FLOAT=HALF")
    assert half.dtype == np.float32
    assert half[:4].tolist() == [0.0] * 4
    np.testing.assert_allclose(half[4:], 1 / (1 + np.exp(-X[4:].astype(np.float64))), rtol=2e-3)
    full = _sigmoid(tmp_path)
    assert full.dtype == np.float32 and (full > 0).all()
    np.testing.assert_allclose(full, 1 / (1 + np.exp(-X.astype(np.float64))), rtol=1e-5)
