"""The tinygrad recipe of docs/backends.md: examples/tinygrad_runtime.py as an exec: target,
run where tinygrad is installed (it is not a dependency of any extra: the recipe is a script).

tinygrad keeps compiled kernels in one cache database per user (``~/.cache/tinygrad``); each
test gives it a fresh one through ``exec:env CACHEDB=…``, as the docs advise, so a kernel
cached by another toolchain cannot decide the result.
"""

from __future__ import annotations

import json
import shlex
import shutil
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from typer.testing import CliRunner

from onnx_bisect.cli import bisect_app
from tests.models import ROOT, chain

pytest.importorskip("tinygrad", reason="tinygrad is not installed (pip install tinygrad)")
if shutil.which("clang") is None:  # DEV=CPU compiles each kernel with it
    pytest.skip("tinygrad's CPU device needs clang, which is not on PATH", allow_module_level=True)

RUNTIME = ROOT / "examples" / "tinygrad_runtime.py"


def _target(tmp_path: Path) -> str:
    argv = ["env", "DEV=CPU", f"CACHEDB={tmp_path / 'tinygrad-cache.db'}", sys.executable]
    return "exec:" + shlex.join([*argv, str(RUNTIME)]) + " {model} {inputs} {outputs}"


def _lstm() -> onnx.ModelProto:
    """Tanh -> LSTM -> Relu: tinygrad's ONNX runner has no LSTM."""
    rng = np.random.default_rng(0)
    hidden = 3
    weights = [
        numpy_helper.from_array(rng.standard_normal((1, 4 * hidden, n)).astype(np.float32), name)
        for name, n in (("W", 4), ("R", hidden))
    ]
    nodes = [
        helper.make_node("Tanh", ["x"], ["t"], name="pre"),
        helper.make_node("LSTM", ["t", "W", "R"], ["Y"], name="lstm", hidden_size=hidden),
        helper.make_node("Relu", ["Y"], ["y"], name="post"),
    ]
    graph = helper.make_graph(
        nodes, "lstm",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 1, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 1, 1, hidden])],
        weights,
    )  # fmt: skip
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def test_tinygrad_agrees_on_a_chain(tmp_path: Path) -> None:
    model = tmp_path / "chain.onnx"
    onnx.save(chain(3), model)
    res = CliRunner().invoke(bisect_app, [str(model), "--target", _target(tmp_path)])
    assert res.exit_code == 0, res.output
    assert "No divergence" in res.output


def test_tinygrad_lacks_lstm_and_declares_that_it_compiles(tmp_path: Path) -> None:
    model, out = tmp_path / "lstm.onnx", tmp_path / "out"
    onnx.save(_lstm(), model)
    args = [str(model), "--target", _target(tmp_path), "--out", str(out)]
    res = CliRunner().invoke(bisect_app, args)
    assert res.exit_code == 1, res.output
    report = json.loads((out / "report.json").read_text())
    cause = report["root_cause"]
    assert cause["nodes"] == ["lstm"] and cause["kind"] == "unsupported"
    assert "op='LSTM' is not supported" in cause["message"]
    assert "onnx-bisect-capability" not in cause["message"]  # a declaration, not its words
    assert report["target"]["compiles"]
    assert report["repro"]["reproduces"]
