"""Reading a repro bundle back and re-running it, in a fresh process or in this one."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy.typing as npt
import onnx
from onnx import numpy_helper

from onnx_bisect.backends.protocol import Backend
from onnx_bisect.compare.criterion import Criterion
from onnx_bisect.compare.tensors import compare_tensors
from onnx_bisect.errors import BackendCrash, BackendError
from onnx_bisect.graph.weights import read_model
from onnx_bisect.process import run_child

__all__ = [
    "VERIFY_TIMEOUT_S",
    "diverged_outputs",
    "load_bundle",
    "output_tail",
    "rerun_in_process",
    "run_bundle",
]


VERIFY_TIMEOUT_S = 600


def diverged_outputs(
    expected: Mapping[str, npt.NDArray[Any]], got: Mapping[str, npt.NDArray[Any]], crit: Criterion
) -> list[str]:
    return [t for t, ref in expected.items() if compare_tensors(t, ref, got.get(t), crit).diverged]


def load_bundle(
    bundle: Path,
) -> tuple[onnx.ModelProto, dict[str, npt.NDArray[Any]], dict[str, npt.NDArray[Any]]]:
    """The model, inputs and expected outputs of a bundle, read back from its files."""
    model = read_model(bundle / "model.onnx")
    data = bundle / "test_data_set_0"

    def read(prefix: str) -> dict[str, npt.NDArray[Any]]:
        out = {}
        for f in sorted(data.glob(f"{prefix}_*.pb"), key=lambda p: int(p.stem.split("_")[-1])):
            t = onnx.TensorProto()
            t.ParseFromString(f.read_bytes())
            out[t.name] = numpy_helper.to_array(t)
        return out

    return model, read("input"), read("output")


def rerun_in_process(
    bundle: Path, target: Backend, crit: Criterion, symptom: str
) -> tuple[bool, str]:
    """For a target given as a Python object, which no fresh process can rebuild: the written
    files, read back and run here. ``symptom``: "divergence", "crash" or "error"."""
    model, inputs, expected = load_bundle(bundle)
    try:
        out = target.run(model, inputs)
    except BackendCrash as exc:
        return symptom == "crash", f"crashed: {exc}"
    except BackendError as exc:
        return symptom == "error", f"failed: {exc}"
    bad = diverged_outputs(expected, out, crit)
    shown = f"diverged: {', '.join(bad)}" if bad else "no divergence"
    return (bool(bad) and symptom == "divergence"), shown


def run_bundle(
    bundle: Path,
    flags: Mapping[str, str | float | None] | None = None,
    timeout: float = VERIFY_TIMEOUT_S,
) -> tuple[int, str]:
    """Run ``bundle/repro.py`` in a fresh interpreter: its exit code (1 reproduces, 0 does not,
    2 could not run) and everything it printed. ``flags``: repro.py's options to change
    (``{"--target": "cpu"}``), None for the bundle's own."""
    argv = [sys.executable, str(bundle / "repro.py"), "--dir", str(bundle)]
    for flag, value in (flags or {}).items():
        if value is not None:
            argv += [flag, str(value)]
    try:
        proc = run_child(argv, timeout=timeout)
    except subprocess.TimeoutExpired:
        return 2, f"repro.py did not finish in {timeout:g}s"
    output = proc.stdout.decode(errors="replace") + proc.stderr.decode(errors="replace")
    return proc.returncode, output.strip()


def output_tail(text: str) -> str:
    return " | ".join(text.splitlines()[-4:])
