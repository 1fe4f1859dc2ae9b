"""The CLI: every command, every bad input as one line with exit 2, and real subprocesses."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from typer.testing import CliRunner

from onnx_bisect.backends import adapters
from onnx_bisect.cli import app, bisect_app, commands
from onnx_bisect.report.manifest import MANIFEST
from tests.models import FAULTY_RUNTIME, ROOT, YOLO, two_inputs

runner = CliRunner()
FAULT = "/down1/conv/Conv"
BIN = Path(sys.executable).parent


def faulty(*extra: str) -> str:
    args = [sys.executable, str(FAULTY_RUNTIME), "{model}", "{inputs}", "{outputs}", *extra]
    return "exec:" + shlex.join(args)


def test_bisect_finds_planted_fault_and_writes_reports(tmp_path: Path) -> None:
    out = tmp_path / "report"
    res = runner.invoke(
        bisect_app, [str(YOLO), "--target", faulty("--fault", f"{FAULT}=0.05"), "--out", str(out)]
    )
    assert res.exit_code == 1, res.output
    assert "First divergence" in res.stdout and FAULT in res.stdout
    assert "Root cause" in res.stdout and "culprit" in res.stdout
    assert {p.name for p in out.iterdir()} == {
        MANIFEST,
        "report.md",
        "report.json",
        "nodes.csv",
        "report.html",
        "error_curve.png",
        "inputs.npz",
        "repro",
        "explorer",
    }
    report = json.loads((out / "report.json").read_text())
    assert report["first_divergence"]["node"] == FAULT
    assert report["repro"]["reproduces"] is True and report["repro"]["nodes"] == [FAULT]
    assert report["command"].startswith("bisect ")
    with np.load(out / "inputs.npz") as z:
        assert z["images"].shape == (1, 3, 160, 160)


def test_onnx_bisect_run_is_the_same_command(tmp_path: Path) -> None:
    res = runner.invoke(app, ["run", str(YOLO), "--target", faulty("--fault", f"{FAULT}=0.05")])
    assert res.exit_code == 1, res.output
    assert FAULT in res.stdout


def test_match_exits_zero_with_one_line_summary(tmp_path: Path) -> None:
    out = tmp_path / "r"
    res = runner.invoke(bisect_app, [str(YOLO), "--ref", "cpu", "--target", "ref", "-o", str(out)])
    assert res.exit_code == 0, res.output
    assert res.stdout.strip().startswith("No divergence")
    assert len(res.stdout.strip().splitlines()) <= 2
    assert json.loads((out / "report.json").read_text())["verdict"] == "match"


def test_quiet_and_formats(tmp_path: Path) -> None:
    res = runner.invoke(
        bisect_app, [str(YOLO), "-t", "cpu?opt=disable", "-q", "-o", str(tmp_path), "-f", "json"]
    )
    assert res.exit_code == 0 and res.stdout == ""
    assert sorted(p.name for p in tmp_path.iterdir()) == [MANIFEST, "inputs.npz", "report.json"]


def test_backends_lists_availability() -> None:
    res = runner.invoke(app, ["backends"])
    assert res.exit_code == 0, res.output
    for name in ("ort", "ref", "openvino", "exec", "torch"):
        assert name in res.stdout
    # Each row says what the registry says on this host: yes, or no with the reason.
    rows = [[c.strip() for c in line.split("│")[1:-1]] for line in res.stdout.splitlines()]
    available = {row[0]: row[1] for row in rows if len(row) == 3 and row[0]}
    for name, adapter in adapters().items():
        if adapter.availability() is None:
            assert available[name] == "yes", name
        else:
            assert available[name].startswith("no: "), name
    assert "cpu = ort:cpu" in res.stdout


def test_backends_install_hints_name_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    for package in ("openvino", "torch", "tract", "iree.compiler", "tvm"):
        monkeypatch.setitem(sys.modules, package, None)  # ``import PACKAGE`` now fails
    res = runner.invoke(app, ["backends"])
    assert res.exit_code == 0, res.output
    rows = [[c.strip() for c in line.split("│")[1:-1]] for line in res.stdout.splitlines()]
    available = {row[0]: row[1] for row in rows if len(row) == 3 and row[0]}
    # Read as rich markup, "[torch]" was a style tag and the hint said pip install 'onnx-bisect'.
    assert available["openvino"] == (
        "no: the openvino package is not installed (pip install 'onnx-bisect[openvino]')"
    )
    assert available["torch"] == (
        "no: torch is not installed; install it with: pip install 'onnx-bisect[torch]'"
    )
    assert available["tract"] == (
        "no: the tract package is not installed (pip install 'onnx-bisect[tract]')"
    )
    assert available["iree"] == (
        "no: iree-base-compiler and iree-base-runtime are not installed "
        "(pip install 'onnx-bisect[iree]')"
    )
    assert available["tvm"] == (
        "no: the apache-tvm package is not installed (pip install 'onnx-bisect[tvm]')"
    )


def _npz(path: Path, **arrays: np.ndarray) -> Path:
    np.savez(path, **arrays)  # type: ignore[arg-type]
    return path


def _bad_cases(tmp: Path) -> dict[str, tuple[list[str], str]]:
    garbage = tmp / "garbage.onnx"
    garbage.write_bytes(b"\x00not an onnx model at all\xff" * 10)
    dyn = tmp / "dyn.onnx"
    onnx.save(two_inputs(), str(dyn))
    img = np.zeros((1, 3, 160, 160), np.float32)
    crash = "exec:" + shlex.join(
        [sys.executable, "-c", "import os; os.abort()", "{model}", "{inputs}", "{outputs}"]
    )
    y = str(YOLO)
    return {
        "missing model": ([str(tmp / "nope.onnx"), "-t", "ref"], "model file not found"),
        "corrupt model": ([str(garbage), "-t", "ref"], "not a valid ONNX model"),
        "unknown backend": ([y, "-t", "warpdrive"], "unknown backend 'warpdrive'"),
        "mps off macOS": ([y, "-t", "mps"], "not available here"),
        "missing EP": ([y, "-t", "ort:cuda"], "CUDAExecutionProvider"),
        "bad option": ([y, "-t", "cpu?fast=yes"], "unknown option(s) fast"),
        "wrong input name": (
            [y, "-t", "ref", "-i", str(_npz(tmp / "n.npz", image=img))],
            "unknown input(s) image",
        ),
        "wrong shape": (
            [y, "-t", "ref", "-i", str(_npz(tmp / "s.npz", images=img[:, :2]))],
            "dim 1 must be 3",
        ),
        "wrong dtype": (
            [y, "-t", "ref", "-i", str(_npz(tmp / "d.npz", images=img.astype(np.float64)))],
            "dtype float64",
        ),
        "bad --shape": ([y, "-t", "ref", "--shape", "images=1x3x160"], "rank 3"),
        "unset dynamic dim": ([str(dyn), "-t", "ref"], "--shape: input 'a' "),
        "target crashes": ([y, "-t", crash], "signal"),
        "bad max-memory": ([y, "-t", "ref", "--max-memory", "lots"], "not a size"),
    }


# Cases whose backend may exist on some hosts: there the CLI must not call it unavailable.
HOST_HAS_MPS = pytest.mark.skipif(
    sys.platform == "darwin", reason="MPS can exist on macOS: whether mps runs depends on the Mac"
)
HOST_HAS_CUDA_EP = pytest.mark.skipif(
    "CUDAExecutionProvider" in ort.get_available_providers(),
    reason="this onnxruntime build has CUDAExecutionProvider, so ort:cuda is not missing",
)


@pytest.mark.parametrize(
    "case",
    [
        "missing model",
        "corrupt model",
        "unknown backend",
        pytest.param("mps off macOS", marks=HOST_HAS_MPS),
        pytest.param("missing EP", marks=HOST_HAS_CUDA_EP),
        "bad option",
        "wrong input name",
        "wrong shape",
        "wrong dtype",
        "bad --shape",
        "unset dynamic dim",
        "target crashes",
        "bad max-memory",
    ],
)
def test_bad_input_is_one_line_exit_2(case: str, tmp_path: Path) -> None:
    args, expected = _bad_cases(tmp_path)[case]
    res = runner.invoke(bisect_app, args)
    assert res.exit_code == 2, res.output
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, res.stderr
    assert lines[0].startswith("error: ")
    assert expected in lines[0]
    assert "Traceback" not in res.output


def test_internal_error_exit_3_and_debug_traceback(monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(*_a: object, **_k: object) -> None:
        raise RuntimeError("kaboom")

    monkeypatch.setattr(commands, "run_bisect", boom)
    res = runner.invoke(bisect_app, [str(YOLO), "-t", "ref"])
    assert res.exit_code == 3
    assert res.stderr.strip().splitlines() == [
        "error: internal error: RuntimeError: kaboom (rerun with --debug)"
    ]
    # --debug adds the traceback and never changes the code (Python's own exit 1 for an
    # uncaught exception would read "divergence found").
    res = runner.invoke(bisect_app, [str(YOLO), "-t", "ref", "--debug"])
    assert res.exit_code == 3
    assert "Traceback" in res.stderr and "RuntimeError: kaboom" in res.stderr
    assert res.stderr.strip().splitlines()[-1] == "error: internal error: RuntimeError: kaboom"


# Real subprocesses through the installed console scripts.


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, capture_output=True, text=True, cwd=ROOT, timeout=300)


def test_subprocess_bisect_console_script(tmp_path: Path) -> None:
    proc = _run(
        str(BIN / "bisect"),
        "examples/models/yolo_like.onnx",
        "--target",
        faulty("--fault", f"{FAULT}=0.05"),
        "--out",
        str(tmp_path),
    )
    assert proc.returncode == 1, proc.stderr
    assert FAULT in proc.stdout
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["root_cause"]["nodes"] == [FAULT]
    assert report["command"].startswith("bisect examples/models/yolo_like.onnx --target")


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["examples/models/yolo_like.onnx"], "--target: missing; "),  # from the parser
        (["examples/models/yolo_like.onnx", "-t", "cpu", "--metric", "l7"], "l7"),
        (["missing.onnx", "-t", "cpu"], "model file not found"),
    ],
)
def test_subprocess_usage_errors_one_line(args: list[str], expected: str) -> None:
    proc = _run(str(BIN / "bisect"), *args)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and expected in lines[0], proc.stderr


def test_subprocess_onnx_bisect_backends() -> None:
    proc = _run(str(BIN / "onnx-bisect"), "backends")
    assert proc.returncode == 0 and "openvino" in proc.stdout


def test_unknown_format_is_a_usage_error_before_any_run(tmp_path: Path) -> None:
    res = runner.invoke(bisect_app, [str(YOLO), "-t", "ref", "-f", "md,pdf", "-o", str(tmp_path)])
    assert res.exit_code == 2
    assert res.stderr.strip() == (
        "error: unknown report format(s) pdf; choose from md, json, csv, html, png, explorer"
    )
    assert not list(tmp_path.iterdir())


def test_shape_with_input_is_rejected(tmp_path: Path) -> None:
    npz = _npz(tmp_path / "i.npz", images=np.zeros((1, 3, 160, 160), np.float32))
    res = runner.invoke(
        bisect_app, [str(YOLO), "-t", "ref", "-i", str(npz), "-s", "images=1x3x8x8"]
    )
    assert res.exit_code == 2
    assert res.stderr.startswith("error: --shape: for generated inputs only, and the inputs are")


def test_unknown_metric_from_the_api_is_an_input_error() -> None:
    import onnx_bisect

    with pytest.raises(onnx_bisect.InputError, match="metric: 'l7' is not one of rel_l2, "):
        onnx_bisect.bisect(YOLO, target="ref", metric="l7")
