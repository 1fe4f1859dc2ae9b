"""``exec:{python}``: the runtime's script runs with the interpreter running onnx-bisect, not the
first ``python`` on the shell's PATH; a wrong interpreter's failure says so, once."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import onnx
import pytest
from onnx import TensorProto, helper

import onnx_bisect
from tests.models import FAULTY_RUNTIME, YOLO, make

BIN = Path(sys.executable).parent
ROOT = Path(__file__).resolve().parents[1]
# What a shell's other Python says when it lacks the packages the runtime needs.
FAKE_PYTHON = """#!/bin/sh
echo "Traceback (most recent call last):" >&2
echo "ModuleNotFoundError: No module named 'onnx'" >&2
exit 1
"""


def shell(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``bisect ARGS`` from bash, whose PATH finds a fake ``python`` (exit 1) first."""
    fake = tmp_path / "fake-bin"
    fake.mkdir(exist_ok=True)
    (fake / "python").write_text(FAKE_PYTHON)
    (fake / "python").chmod(0o755)
    env = {**os.environ, "PATH": f"{fake}:{os.environ['PATH']}", "PYTHONPATH": str(ROOT)}
    env.pop("COLUMNS", None)
    assert subprocess.run(["bash", "-c", "python"], env=env, capture_output=True).returncode == 1
    cmd = shlex.join([str(BIN / "bisect"), *args])
    return subprocess.run(
        ["bash", "-c", cmd], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300
    )


def faulty(program: str) -> str:
    fault = "--fault /down1/conv/Conv=0.05"
    return f"exec:{program} {FAULTY_RUNTIME} {{model}} {{inputs}} {{outputs}} {fault}"


def test_python_placeholder_runs_the_tools_own_interpreter(tmp_path: Path) -> None:
    res = shell(tmp_path, str(YOLO), "--target", faulty("{python}"), "--no-repro", "-o", "r")
    assert res.returncode == 1, res.stdout + res.stderr
    report = json.loads((tmp_path / "r" / "report.json").read_text())
    assert report["root_cause"]["nodes"] == ["/down1/conv/Conv"]
    assert report["target"]["spec"] == faulty("{python}")  # as given: portable


@pytest.mark.slow
def test_the_bundles_repro_script_runs_its_own_interpreter(tmp_path: Path) -> None:
    res = shell(tmp_path, str(YOLO), "--target", faulty("{python}"), "-o", "r")
    assert res.returncode == 1, res.stdout + res.stderr
    assert "(divergence, verified)" in res.stdout, res.stdout
    # repro.py, run by hand from the same shell, substitutes its own interpreter too.
    repro = tmp_path / "r" / "repro"
    env = {**os.environ, "PATH": f"{tmp_path / 'fake-bin'}:{os.environ['PATH']}"}
    env["PYTHONPATH"] = str(ROOT)
    run = subprocess.run(
        [sys.executable, "repro.py"], cwd=repro, env=env, capture_output=True, text=True
    )
    assert run.returncode == 1, run.stdout + run.stderr


def test_a_missing_module_names_the_placeholder_once(tmp_path: Path) -> None:
    res = shell(tmp_path, str(YOLO), "--target", faulty("python"))
    assert res.returncode == 2, res.stdout + res.stderr
    [line] = res.stderr.strip().splitlines()
    assert line == (
        f"error: target failed: {faulty('python')}: exited with code 1: "
        "Traceback (most recent call last): | ModuleNotFoundError: No module named 'onnx' "
        "(hint: a command's `python` is the first on PATH, not necessarily the Python running "
        f"onnx-bisect; exec:{{python}} SCRIPT ... runs a Python script with {sys.executable}) "
        "(it also fails on a one-node Identity model, so no node is to blame)"
    )


def test_a_command_not_found_says_how_to_name_it(tmp_path: Path) -> None:
    res = shell(tmp_path, str(YOLO), "--target", faulty("no-such-runtime"))
    assert res.returncode == 2, res.stdout + res.stderr
    [line] = res.stderr.strip().splitlines()
    assert line.startswith(f"error: target failed: {faulty('no-such-runtime')}: command not ")
    assert line.count("command not found: no-such-runtime") == 1, line
    assert line.endswith(
        f"(hint: give the program's path; exec:{{python}} SCRIPT ... runs a Python script with "
        f"{sys.executable}) (it also fails on a one-node Identity model, so no node is to blame)"
    ), line


def test_the_template_runtime_writes_a_tensor_named_file(tmp_path: Path) -> None:
    # np.savez(path, **outputs) cannot: `file` is its own first parameter.
    node = helper.make_node("Relu", ["x"], ["file"], name="relu")
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])
    y = helper.make_tensor_value_info("file", TensorProto.FLOAT, [2, 3])
    path = tmp_path / "file.onnx"
    onnx.save(make([node], [x], [y]), path)
    target = f"exec:{{python}} {FAULTY_RUNTIME} {{model}} {{inputs}} {{outputs}}"
    result = onnx_bisect.bisect(path, target=target)
    assert result.verdict.value == "match", result.summary()
    assert [c.tensor for c in result.outputs] == ["file"]
