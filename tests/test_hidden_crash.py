"""A crash that needs a tensor unobserved (ONNX Runtime's Transpose -> MatMul fusion on a
float16 LSTM output, zoo G14): every prefix marks the tensors read later, so the crash first
shows at the tensor's last reader, a node that plays no part. The failure search then tries
the prefixes with that tensor unmarked and names its producer and the reader that crashes."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper
from typer.testing import CliRunner

from onnx_bisect.cli import bisect_app
from tests.models import make

runner = CliRunner()
PLUGIN = Path(__file__).with_name("crashing_runtime.py")


def skip_chain(blocks: int = 6, width: int = 8) -> onnx.ModelProto:
    """x -> (MatMul ``mm{i}`` -> Tanh ``act{i}``) * blocks, then ``skip`` adds ``a0`` (read
    by ``mm1`` too) to the last block's output: ``skip`` is ``a0``'s last reader."""
    rng = np.random.default_rng(0)
    nodes, inits, prev = [], [], "x"
    for i in range(blocks):
        w = (rng.standard_normal((width, width)) / np.sqrt(width)).astype(np.float32)
        inits.append(numpy_helper.from_array(w, f"W{i}"))
        nodes.append(helper.make_node("MatMul", [prev, f"W{i}"], [f"h{i}"], name=f"mm{i}"))
        nodes.append(helper.make_node("Tanh", [f"h{i}"], [f"a{i}"], name=f"act{i}"))
        prev = f"a{i}"
    nodes.append(helper.make_node("Add", [prev, "a0"], ["y"], name="skip"))
    io = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [2, width]) for n in ("x", "y")]
    return make(nodes, io[:1], io[1:], inits)


def test_a_crash_that_marking_hides_is_named_at_its_reader(tmp_path: Path) -> None:
    model = tmp_path / "skip.onnx"
    onnx.save(skip_chain(), model)
    spec = f"{PLUGIN}:Crashing?node=mm1&how=segv&unseen=a0"
    out = tmp_path / "r"
    res = runner.invoke(bisect_app, [str(model), "--target", spec, "-o", str(out)])
    assert res.exit_code == 1, res.output
    report = json.loads((out / "report.json").read_text())
    cause = report["root_cause"]
    assert (cause["kind"], cause["nodes"]) == ("crash", ["act0", "mm1"])
    assert cause["reason"] == (
        "the target crashes whenever MatMul 'mm1' is in the model and reads 'a0', the output "
        "of Tanh 'act0', unobserved, and runs that prefix with 'a0' marked as an output (a "
        "fusion from Tanh to MatMul that marking undoes); the prefixes that mark every tensor read "
        "later ran until the last reader, Add 'skip', which plays no part (found in 4 more "
        "target runs)"
    )
    assert cause["message"] == f"{spec}: exited with signal 11:\ndying on mm1"
    assert report["first_divergence"]["node"] == "mm1"
    # The bundle leaves a0 unobserved: marked, it would run.
    repro = report["repro"]
    assert (repro["kind"], repro["nodes"], repro["reproduces"]) == (
        "crash",
        ["act0", "mm1"],
        True,
    ), repro["message"]
    bundle = onnx.load(out / "repro" / "model.onnx")
    assert [o.name for o in bundle.graph.output] == ["h1"]
