"""Bundles that reproduce as found: a 0-d input stays 0-d, the ``env NAME=VALUE`` settings of an
``exec:env …`` target travel in the bundle and its "Found with", and issue.md's title names the
runtime and its version rather than the command line."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnx_bisect.entry import bisect_entry
from onnx_bisect.report.runtime import env_assignments, runtime_name
from tests.models import FAULTY_RUNTIME, ROOT


def _scaled_by_rate() -> onnx.ModelProto:
    """y = Relu(x * float(sr)), ``sr`` a 0-d int64 input as silero-vad's sample rate."""
    nodes = [
        helper.make_node("Cast", ["sr"], ["srf"], to=TensorProto.FLOAT, name="cast"),
        helper.make_node("Mul", ["x", "srf"], ["m"], name="mul"),
        helper.make_node("Relu", ["m"], ["y"], name="relu"),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4]),
            helper.make_tensor_value_info("sr", TensorProto.INT64, []),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])],
    )
    model = helper.make_model(graph, ir_version=8, opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(model, full_check=True)
    return model


def _bisect(model: Path, target: str, out: Path) -> int:
    with pytest.raises(SystemExit) as exit_:
        bisect_entry([str(model), "--target", target, "--out", str(out), "-q"])
    return int(exit_.value.code or 0)


@pytest.mark.slow  # a runtime process per run, and repro.py's own
def test_a_0d_input_stays_0d_in_a_verified_bundle(tmp_path: Path) -> None:
    model = tmp_path / "rate.onnx"
    onnx.save(_scaled_by_rate(), model)
    cmd = [sys.executable, str(FAULTY_RUNTIME), "{model}", "{inputs}", "{outputs}"]
    # The Cast of the 0-d input is wrong: the bundle is that node, fed ``sr`` alone.
    target = "exec:" + shlex.join([*cmd, "--fault", "cast=0.05"])
    assert _bisect(model, target, tmp_path / "out") == 1
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["root_cause"]["nodes"] == ["cast"]
    assert report["repro"]["reproduces"] is True, report["repro"]
    bundle = tmp_path / "out" / "repro"
    fed = onnx.load(bundle / "model.onnx").graph.input
    data = bundle / "test_data_set_0"
    arrays = {
        t.name: numpy_helper.to_array(t)
        for t in (onnx.load_tensor(str(p)) for p in sorted(data.glob("input_*.pb")))
    }
    assert [i.name for i in fed] == ["sr"] and arrays["sr"].shape == ()
    assert arrays["sr"].dtype == np.int64


_ENV_RUNTIME = """\
import os, subprocess, sys
# A runtime configured by the environment: MYRT_FAULT plants the fault.
args = [sys.executable, {runtime!r}, *sys.argv[1:]]
if os.environ.get("MYRT_FAULT"):
    args += ["--fault", os.environ["MYRT_FAULT"]]
sys.exit(subprocess.call(args))
"""


@pytest.mark.slow  # a runtime process per run, and repro.py's own twice
def test_exec_env_settings_travel_with_the_bundle(tmp_path: Path) -> None:
    runtime = tmp_path / "envrt.py"
    runtime.write_text(_ENV_RUNTIME.format(runtime=str(FAULTY_RUNTIME)))
    model = tmp_path / "rate.onnx"
    onnx.save(_scaled_by_rate(), model)
    command = shlex.join([sys.executable, str(runtime), "{model}", "{inputs}", "{outputs}"])
    target = f"exec:env MYRT_FAULT=mul=0.05 {command}"
    out = tmp_path / "out"
    assert "MYRT_FAULT" not in os.environ
    assert _bisect(model, target, out) == 1
    report = json.loads((out / "report.json").read_text())
    assert report["root_cause"]["nodes"] == ["mul"] and report["repro"]["reproduces"] is True
    readme = (out / "repro" / "README.md").read_text()
    found = readme.split("## Found with\n\n", 1)[1].split("\n", 1)[1].split("\n```", 1)[0]
    argv = shlex.split(found)
    assert argv[argv.index("--target") + 1] == target
    issue = (out / "repro" / "issue.md").read_text()
    version = report["versions"]["onnxruntime"]
    title = f"# `envrt.py` diverges from `ONNX Runtime {version} (cpu)` at `mul` (culprit)"
    assert issue.splitlines()[0] == title
    assert "- target environment (set by its spec): `MYRT_FAULT=mul=0.05`\n" in issue
    # The bundle's repro.py, in a fresh process whose environment lacks the setting.
    env = {k: v for k, v in os.environ.items() if k != "MYRT_FAULT"}
    env["PYTHONPATH"] = str(ROOT)
    proc = subprocess.run(
        [sys.executable, "repro.py"], cwd=out / "repro", env=env, capture_output=True, text=True
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "REPRODUCED" in proc.stdout


@pytest.mark.parametrize(
    ("spec", "name"),
    [
        ("cpu", "ONNX Runtime 1.2.3 (cpu)"),
        ("ort:cuda+fp16", "ONNX Runtime 1.2.3 (cuda) +fp16"),
        ("iree:cuda?flags=--iree-opt-level=O0", "IREE 3.13.0 (cuda)"),
        ("tvm", "TVM"),  # no version known: none claimed
        ("exec:env A=1 -u B C=x=y /usr/bin/python3 -u rt.py {model}", "python3"),
        ("exec:env A=1 /opt/py/bin/python3.11 tools/rt.py {model} {inputs}", "rt.py"),
        ("exec:python -m my.runtime {model}", "my.runtime"),
        ("exec:{python} tools/rt.py {model} {inputs}", "rt.py"),
        ("exec:'./my rt' {model}", "my rt"),
        ("pkg.module:Class", "pkg.module:Class"),
    ],
)
def test_runtime_names(spec: str, name: str) -> None:
    versions = {"onnxruntime": "1.2.3", "iree-base-compiler": "3.13.0"}
    assert runtime_name(spec, versions) == name


def test_env_assignments() -> None:
    assert env_assignments("exec:env A=1 -u B C=x=y rt {model}") == {"A": "1", "C": "x=y"}
    assert env_assignments("exec:/usr/bin/env A=1 rt") == {"A": "1"}
    assert env_assignments("exec:rt A=1") == {}
    assert env_assignments("cpu") == {}
