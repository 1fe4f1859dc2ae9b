"""The bundle's ``repro.py``: generated, then run as a runtime maintainer would, on real runtimes.

Most runs put a fake ``onnx_bisect`` that refuses to import first on PYTHONPATH, so they also
prove that the script stands alone for cpu, ref and exec: targets.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnx_bisect.backends import openvino as ov_backend
from onnx_bisect.backends import ort as ort_backend
from onnx_bisect.backends.exec import PLACEHOLDERS
from onnx_bisect.backends.spec import ALIASES
from onnx_bisect.compare.criterion import Criterion
from onnx_bisect.compare.metrics import METRICS
from onnx_bisect.repro import template
from onnx_bisect.repro.script import SCRIPT_METRICS, render_repro_script
from tests.models import make

ROOT = Path(__file__).resolve().parents[1]
X = np.linspace(-1, 1, 16, dtype=np.float32).reshape(2, 8)

# An exec: runtime: ONNX Runtime with its float outputs scaled; or a crash, a hang, an error.
RUNTIME = textwrap.dedent(
    """\
    import os
    import resource
    import sys
    import time
    import zipfile

    import numpy as np
    import onnxruntime as ort

    model, inputs, outputs, mode = sys.argv[1:5]
    if mode == "abort":
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # no core file
        os.abort()
    if mode == "hang":
        time.sleep(600)
    if mode == "fail":
        sys.exit("error: op Relu is not implemented")
    with np.load(inputs) as z:
        feeds = {k: z[k] for k in z.files}
    session = ort.InferenceSession(model, providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    with zipfile.ZipFile(outputs, "w") as zf:
        for name, value in zip(names, session.run(names, feeds)):
            if value.dtype.kind == "f":
                value = value * np.float32(mode)
            with zf.open(name + ".npy", "w") as f:
                np.lib.format.write_array(f, value)
    """
)

# Plugin backends (named by module path, so no entry point is needed): one whose runtime
# aborts, and one that reports an error.
CRASHY = textwrap.dedent(
    """\
    import os
    import resource

    from onnx_bisect import BackendBase


    class Crasher(BackendBase):
        def _run(self, model, feeds):
            resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
            os.abort()


    class Refuser(BackendBase):
        def _run(self, model, feeds):
            raise RuntimeError("op Relu is not implemented")
    """
)


def matmul_relu() -> onnx.ModelProto:
    """Two outputs, one named as exporters do; the input is named ``file`` (np.savez(**feeds)
    would choke on it), and the bias is a graph input with an initializer, not to be fed."""
    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.standard_normal((8, 4)).astype(np.float32), "W")
    b = numpy_helper.from_array(rng.standard_normal(4).astype(np.float32), "B")
    model = make(
        [
            helper.make_node("MatMul", ["file", "W"], ["/mm/MatMul:0"], name="mm"),
            helper.make_node("Add", ["/mm/MatMul:0", "B"], ["z"], name="add"),
            helper.make_node("Relu", ["z"], ["y"], name="relu"),
        ],
        [
            helper.make_tensor_value_info("file", TensorProto.FLOAT, [2, 8]),
            helper.make_tensor_value_info("B", TensorProto.FLOAT, [4]),
        ],
        [
            helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4]),
            helper.make_tensor_value_info("/mm/MatMul:0", TensorProto.FLOAT, [2, 4]),
        ],
        [w, b],
    )
    return onnx.shape_inference.infer_shapes(model)


def argmax() -> onnx.ModelProto:
    return make(
        [helper.make_node("ArgMax", ["x"], ["idx"], axis=1, keepdims=0, name="argmax")],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 8])],
        [helper.make_tensor_value_info("idx", TensorProto.INT64, [2])],
    )


def write_bundle(
    directory: Path,
    model: onnx.ModelProto,
    feeds: dict[str, np.ndarray[Any, Any]],
    *,
    tamper: float = 1.0,
    named: bool = True,
    **script: Any,
) -> Path:
    """A bundle as onnx-bisect writes one; ``tamper`` scales the float expected outputs, and
    ``named=False`` leaves the TensorProtos unnamed, to be matched by position."""
    data = directory / "test_data_set_0"
    data.mkdir(parents=True)
    onnx.save(model, directory / "model.onnx")
    options = ort.SessionOptions()
    options.log_severity_level = 3  # B, an input with an initializer, is meant
    session = ort.InferenceSession(
        model.SerializeToString(), options, providers=["CPUExecutionProvider"]
    )
    names = [o.name for o in session.get_outputs()]
    for i, (name, value) in enumerate(feeds.items()):
        proto = numpy_helper.from_array(value, name if named else None)
        (data / f"input_{i}.pb").write_bytes(proto.SerializeToString())
    for i, (name, value) in enumerate(zip(names, session.run(names, feeds), strict=True)):
        if value.dtype.kind == "f":
            value = (value * tamper).astype(value.dtype)
        proto = numpy_helper.from_array(value, name if named else None)
        (data / f"output_{i}.pb").write_bytes(proto.SerializeToString())
    script.setdefault("ref", "cpu")
    script.setdefault("target", "cpu?opt=disable")
    (directory / "repro.py").write_text(render_repro_script(**script))
    return directory


def write_crashy(directory: Path) -> None:
    (directory / "crashy").mkdir()
    (directory / "crashy" / "__init__.py").write_text("")
    (directory / "crashy" / "backend.py").write_text(CRASHY)


def exec_spec(tmp_path: Path, mode: str) -> str:
    runtime = tmp_path / "runtime.py"
    runtime.write_text(RUNTIME)
    return f"exec:{sys.executable} {runtime} {{model}} {{inputs}} {{outputs}} {mode}"


@pytest.fixture(scope="module")
def no_bisect(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """An environment in which ``import onnx_bisect`` fails."""
    fake = tmp_path_factory.mktemp("fake") / "onnx_bisect"
    fake.mkdir()
    (fake / "__init__.py").write_text("raise ImportError('onnx_bisect is hidden from repro.py')\n")
    return {**os.environ, "PYTHONPATH": str(fake.parent)}


def run(
    bundle: Path, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(bundle / "repro.py"), *args],
        capture_output=True,
        text=True,
        cwd=bundle.parent,
        env=env,
        timeout=120,
    )


def load_script(path: Path, monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    spec = importlib.util.spec_from_file_location("generated_repro", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


# ---------------------------------------------------------------------------------------------
# The text


def test_script_is_standalone_and_clean(tmp_path: Path) -> None:
    text = render_repro_script(
        ref="cpu",
        target="exec:./rt {model} {inputs} {outputs} " + "--flag " * 30,
        title='Conv /down1/conv/Conv (#4) "diverges" on C:\\runtime; __REF__ ' + "x" * 150,
        workdir="/work/" + "dir/" * 30,
    )
    tree = ast.parse(text)
    doc = ast.get_docstring(tree)
    assert doc is not None and "Usage:" in doc and "Exit codes" in doc
    assert 'Conv /down1/conv/Conv (#4) "diverges" on C:\\runtime; __REF__' in doc
    top: list[ast.stmt] = [n for n in tree.body if isinstance(n, ast.Import | ast.ImportFrom)]
    top += [n for s in tree.body if isinstance(s, ast.Try) for n in s.body]
    modules = {a.name for n in top if isinstance(n, ast.Import) for a in n.names}
    modules |= {n.module or "" for n in top if isinstance(n, ast.ImportFrom)}
    assert {m.split(".")[0] for m in modules} <= set(sys.stdlib_module_names) | {"numpy", "onnx"}
    assert "onnx_bisect" not in {m.split(".")[0] for m in modules}
    scope: dict[str, Any] = {}
    exec(compile(ast.Module([s for s in tree.body if _is_setting(s)], []), "s", "exec"), scope)
    assert scope["REF"] == "cpu"
    assert scope["TARGET"] == ("exec:./rt {model} {inputs} {outputs} " + "--flag " * 30).strip()

    path = tmp_path / "repro.py"
    path.write_text(text)
    config = ["--config", str(ROOT / "pyproject.toml")]
    for command in (["check"], ["format", "--check"]):
        proc = subprocess.run(
            [sys.executable, "-m", "ruff", *command, *config, str(path)],
            capture_output=True,
            text=True,
        )
        if "No module named ruff" in proc.stderr:
            pytest.skip("ruff is not installed")
        assert proc.returncode == 0, proc.stdout + proc.stderr


def _is_setting(stmt: ast.stmt) -> bool:
    return isinstance(stmt, ast.Assign) and any(
        isinstance(t, ast.Name) and t.id in ("REF", "TARGET") for t in stmt.targets
    )


# What render_repro_script substitutes in template.py's text.
TEMPLATE_PLACEHOLDERS = (
    "__TITLE__\n",
    *(f'"__{name}__"' for name in ("REF", "TARGET", "METRIC", "THRESHOLD", "ATOL", "RTOL")),
    '"__WORKDIR__"',
    '"__SYMPTOM__"',
    '"__PRECISION__"',
)


def test_template_placeholders_each_filled_once() -> None:
    source = Path(template.__file__).read_text()
    assert {p: source.count(p) for p in TEMPLATE_PLACEHOLDERS} == dict.fromkeys(
        TEMPLATE_PLACEHOLDERS, 1
    )
    text = render_repro_script(ref="ref", target="cpu", atol=1e-4, rtol=0.0, metric="cosine")
    assert not re.search(r"__[A-Z]+__", text)
    assert "\nATOL = 0.0001\nRTOL = 0.0\n" in text
    assert '\nMETRIC = "cosine"\nTHRESHOLD = 0.001\n' in text


def test_every_onnx_bisect_metric_is_supported() -> None:
    assert set(METRICS) <= set(SCRIPT_METRICS)


# ---------------------------------------------------------------------------------------------
# Drift: the template restates onnx-bisect's tables and metrics, so that repro.py stands alone


def test_template_tables_match_the_package() -> None:
    assert dict(ALIASES) == template.ALIASES
    assert dict(ort_backend.PROVIDERS) == template.PROVIDERS
    assert template.PLACEHOLDERS == PLACEHOLDERS
    assert template.OPT_LEVELS == ort_backend._OPT_LEVELS
    assert template.PRECISIONS == ov_backend._PRECISIONS


def test_script_metrics_are_what_the_template_computes() -> None:
    computed = template.metrics(np.ones(3), np.zeros(3))
    assert tuple(computed) == SCRIPT_METRICS
    assert tuple(template._HIGHER_IS_WORSE) == SCRIPT_METRICS
    for name in SCRIPT_METRICS:
        if name in METRICS:
            assert template._HIGHER_IS_WORSE[name] == METRICS[name].higher_is_worse, name


_RNG = np.random.default_rng(1)
_REF = _RNG.standard_normal((3, 5)).astype(np.float32)


@pytest.mark.parametrize(
    ("ref", "target"),
    [
        (_REF, _REF + np.float32(1e-3) * _RNG.standard_normal((3, 5)).astype(np.float32)),
        (_REF, -_REF),
        (_REF, _REF.copy()),
        (np.zeros(4, np.float32), np.ones(4, np.float32)),
        (np.zeros(4, np.float32), np.zeros(4, np.float32)),
        (np.ones(4, np.float16), np.full(4, 1.001, np.float16)),
        (np.arange(6, dtype=np.int64), np.arange(6, dtype=np.int64)[::-1].copy()),
        (np.zeros(0, np.float32), np.zeros(0, np.float32)),
    ],
)
def test_template_metrics_match_the_package(
    ref: np.ndarray[Any, Any], target: np.ndarray[Any, Any]
) -> None:
    computed = template.metrics(ref, target)
    expected = {name: METRICS[name].fn(ref, target) for name in METRICS}
    assert computed == pytest.approx(expected, rel=1e-9, abs=1e-12)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"metric": "rel_l2", "threshold": 1e-3},
        {"metric": "cosine", "threshold": 0.999},
        {"metric": "sqnr_db", "threshold": 40.0},
        {"atol": 1e-4},
        {"rtol": 0.0},
    ],
)
def test_template_criterion_matches_the_package(kwargs: dict[str, Any]) -> None:
    """Same defaults for the tolerance not given, same description in the verdict line."""
    package = Criterion(**kwargs)
    script = template.Criterion(
        kwargs.get("metric", "rel_l2"),
        kwargs.get("threshold", 1e-3),
        kwargs.get("atol"),
        kwargs.get("rtol"),
    )
    assert script.describe() == package.describe()
    if package.allclose:
        assert script.tolerances == (package.atol_value, package.rtol_value)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"metric": "l1"}, "unknown metric 'l1'"),
        ({"threshold": float("nan")}, "must be a finite number"),
        ({"atol": float("inf")}, "must be a finite number"),
        ({"target": " "}, "target spec is empty"),
    ],
)
def test_render_rejects_bad_arguments(kwargs: dict[str, Any], message: str) -> None:
    args: dict[str, Any] = {"ref": "cpu", "target": "cpu", **kwargs}
    with pytest.raises(ValueError, match=message):
        render_repro_script(**args)


def test_comparison_rules(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The generated comparison, imported: zeros, NaN placement, shapes, integers, cosine."""
    path = tmp_path / "repro.py"
    path.write_text(render_repro_script(ref="cpu", target="cpu"))
    m = load_script(path, monkeypatch)
    crit = m.Criterion("rel_l2", 1e-3, None, None)
    zeros, ones = np.zeros(4, np.float32), np.ones(4, np.float32)
    assert m.metrics(zeros, zeros)["rel_l2"] == 0.0
    assert m.metrics(zeros, ones)["rel_l2"] == pytest.approx(2.0)  # ‖t−r‖ when ‖r‖ = 0
    assert m.metrics(ones, 2 * ones)["cosine"] == pytest.approx(1.0)
    nan = np.array([1.0, np.nan], np.float32)
    assert not m.compare("t", nan, nan.copy(), crit).diverged
    row = m.compare("t", nan, np.array([np.nan, 1.0], np.float32), crit)
    assert row.diverged and "NaN/Inf" in row.reason
    assert m.compare("t", -np.inf * ones, np.inf * ones, crit).diverged
    row = m.compare("t", ones, np.ones(5, np.float32), crit)
    assert row.diverged and "shape (5,) != expected (4,)" in row.reason
    assert m.compare("t", ones, ones.astype(np.int64), crit).diverged
    big = np.array([2**53, 1], np.int64)
    assert m.compare("t", big, big + np.array([1, 0]), crit).diverged  # exact, not float64
    assert not m.compare("t", ones, ones * 1.05, m.Criterion("cosine", 0.999, None, None)).diverged
    row = m.compare("t", ones, ones + 1e-2, m.Criterion("rel_l2", 1.0, 1e-5, None))
    assert row.diverged and row.reason == "4 of 4 outside allclose(atol=1e-05, rtol=0.001)"


# ---------------------------------------------------------------------------------------------
# Running it


def test_matching_target_is_not_reproduced(tmp_path: Path, no_bisect: dict[str, str]) -> None:
    bundle = write_bundle(tmp_path / "b", matmul_relu(), {"file": X}, target="cpu?opt=disable")
    proc = run(bundle, env=no_bisect)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("reference  cpu: matches expected outputs (rel_l2 ")
    assert lines[1] == "target     cpu?opt=disable"
    assert re.fullmatch(r"  y {13}rel_l2=0  max_abs=0  cosine=1  ok", lines[2])
    assert re.fullmatch(r"  /mm/MatMul:0  rel_l2=0  max_abs=0  cosine=1  ok", lines[3])
    assert lines[4].startswith("NOT REPRODUCED: the target matches the expected outputs")


@pytest.mark.parametrize(("scale", "code"), [("1.05", 1), ("1.0", 0)])
def test_exec_target(tmp_path: Path, no_bisect: dict[str, str], scale: str, code: int) -> None:
    target = exec_spec(tmp_path, scale)
    bundle = write_bundle(tmp_path / "b", matmul_relu(), {"file": X}, target=target)
    proc = run(bundle, env=no_bisect)
    assert proc.returncode == code, proc.stdout + proc.stderr
    if code:
        line = r"\n  y +rel_l2=0\.05  max_abs=0\.\d+  cosine=1  DIVERGED \(rel_l2 > 0\.001\)\n"
        assert re.search(line, proc.stdout)
        assert "REPRODUCED: the target diverges from the reference on this subgraph" in proc.stdout
    else:
        assert "NOT REPRODUCED" in proc.stdout


def test_criterion_overrides(tmp_path: Path, no_bisect: dict[str, str]) -> None:
    target = exec_spec(tmp_path, "1.05")
    bundle = write_bundle(tmp_path / "b", matmul_relu(), {"file": X}, target=target)
    # A uniform 5% scale leaves the direction alone: cosine does not see it.
    proc = run(bundle, "--metric", "cosine", "--threshold", "0.999", env=no_bisect)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "reference  cpu: matches expected outputs (cosine 1)" in proc.stdout


def test_wrong_expected_outputs_say_so(tmp_path: Path, no_bisect: dict[str, str]) -> None:
    bundle = write_bundle(tmp_path / "b", matmul_relu(), {"file": X}, tamper=1.05)
    proc = run(bundle, env=no_bisect)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "reference  cpu: DIFFERS from the expected outputs (y: rel_l2 > 0.001)" in proc.stdout
    assert "diverges from the recorded reference outputs" in proc.stdout
    assert "the reference cpu also disagrees with the expected outputs" in proc.stdout


def test_target_and_ref_overrides(tmp_path: Path, no_bisect: dict[str, str]) -> None:
    target = exec_spec(tmp_path, "1.05")
    bundle = write_bundle(tmp_path / "b", matmul_relu(), {"file": X}, target=target)
    proc = run(bundle, "--target", "cpu", "--ref", "ref", env=no_bisect)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.startswith("reference  ref: matches expected outputs (rel_l2 ")
    assert "\ntarget     cpu\n" in proc.stdout


@pytest.mark.parametrize(
    ("mode", "verdict"),
    [
        ("abort", f"the target crashed: killed by signal {signal.SIGABRT.value} (SIGABRT)"),
        ("fail", "the target failed: exited with code 1: error: op Relu is not implemented"),
    ],
)
def test_exec_crash_or_failure(
    tmp_path: Path, no_bisect: dict[str, str], mode: str, verdict: str
) -> None:
    # A crash reproduces (exit 1); an error the runtime reports is not the symptom (exit 2).
    bundle = write_bundle(tmp_path / "b", matmul_relu(), {"file": X})
    proc = run(bundle, "--target", exec_spec(tmp_path, mode), env=no_bisect)
    code, word = (1, "REPRODUCED") if mode == "abort" else (2, "COULD NOT RUN")
    assert proc.returncode == code, proc.stdout + proc.stderr
    assert proc.stdout.startswith("reference  cpu: matches")
    assert proc.stdout.endswith(f"\n{word}: {verdict}\n")


def test_runtime_error_in_the_child_is_a_failure(tmp_path: Path) -> None:
    write_crashy(tmp_path)
    target = "crashy.backend:Refuser"
    bundle = write_bundle(tmp_path / "b", matmul_relu(), {"file": X}, target=target)
    proc = run(bundle, env={**os.environ, "PYTHONPATH": str(tmp_path)})
    assert proc.returncode == 2, proc.stdout + proc.stderr
    verdict = f"COULD NOT RUN: the target failed: {target}: op Relu is not implemented\n"
    assert proc.stdout.endswith(verdict)


@pytest.mark.parametrize(
    ("tensor", "message"),
    [
        (X.astype(np.float64), "input 'file' is float64 but the model takes float32"),
        (X[:1], "input 'file' has shape (1, 8) but the model takes [2, 8]"),
    ],
)
def test_inputs_that_do_not_fit_are_usage_errors(
    tmp_path: Path, no_bisect: dict[str, str], tensor: np.ndarray[Any, Any], message: str
) -> None:
    bundle = write_bundle(tmp_path / "b", matmul_relu(), {"file": X})
    proto = numpy_helper.from_array(tensor, "file")
    (bundle / "test_data_set_0" / "input_0.pb").write_bytes(proto.SerializeToString())
    proc = run(bundle, env=no_bisect)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr == f"error: {message}\n"


def test_exec_hang_is_a_crash(tmp_path: Path, no_bisect: dict[str, str]) -> None:
    bundle = write_bundle(tmp_path / "b", matmul_relu(), {"file": X})
    target = exec_spec(tmp_path, "hang")
    proc = run(bundle, "--target", target, "--timeout", "3", env=no_bisect)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "REPRODUCED: the target crashed: timed out after 3 s and was killed" in proc.stdout


def test_in_process_runtime_crash_is_contained(tmp_path: Path) -> None:
    """A runtime that aborts inside Python (here a plugin, through onnx-bisect) kills only the
    child process the script runs the target in."""
    write_crashy(tmp_path)
    bundle = write_bundle(
        tmp_path / "b", matmul_relu(), {"file": X}, target="crashy.backend:Crasher"
    )
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    proc = run(bundle, env=env)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert f"crashed: killed by signal {signal.SIGABRT.value} (SIGABRT)" in proc.stdout
    # faulthandler's report, innermost frame first, names where the runtime died.
    assert "  stderr: Fatal Python error: Aborted | Current thread" in proc.stdout
    assert 'crashy/backend.py", line 10 in _run' in proc.stdout


def test_without_expected_outputs_the_reference_run_stands_in(
    tmp_path: Path, no_bisect: dict[str, str]
) -> None:
    target = exec_spec(tmp_path, "1.05")
    bundle = write_bundle(tmp_path / "b", matmul_relu(), {"file": X}, target=target)
    for path in (bundle / "test_data_set_0").glob("output_*.pb"):
        path.unlink()
    proc = run(bundle, env=no_bisect)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "the bundle records no expected outputs, so the target is compared" in proc.stdout
    assert "REPRODUCED: the target diverges from the reference" in proc.stdout


def test_openvino_fp32_matches(tmp_path: Path) -> None:
    pytest.importorskip("openvino")
    bundle = write_bundle(
        tmp_path / "b", matmul_relu(), {"file": X}, target="openvino?precision=f32"
    )
    proc = run(bundle)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "target     openvino?precision=f32\n" in proc.stdout


def test_integer_outputs_compare_exactly(tmp_path: Path, no_bisect: dict[str, str]) -> None:
    bundle = write_bundle(tmp_path / "b", argmax(), {"x": X}, named=False)
    assert run(bundle, env=no_bisect).returncode == 0
    data = bundle / "test_data_set_0" / "output_0.pb"
    idx = numpy_helper.to_array(onnx.load_tensor(str(data)))
    idx = idx.copy()
    idx[0] = (idx[0] + 1) % 8
    data.write_bytes(numpy_helper.from_array(idx).SerializeToString())
    proc = run(bundle, "--threshold", "1e9", env=no_bisect)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "DIVERGED (1 of 2 int64 elements differ)" in proc.stdout


@pytest.mark.parametrize(
    ("args", "hidden", "message"),
    [
        (["--target", "nosuch"], True, "it needs onnx-bisect and the plugin"),
        (["--target", "nosuch"], False, "unknown backend 'nosuch'; known:"),
        (["--target", "ort:npu"], True, "unknown device 'npu'; choose from cpu, cuda"),
        (["--ref", "ref?dtype=float64"], True, "needs onnx-bisect (pip install onnx-bisect)"),
        (["--target", "exec:./rt {model}"], True, "the command must contain {model}"),
        (["--dir", "nowhere"], True, "no model.onnx in nowhere; run the repro.py of a bundle"),
    ],
)
def test_usage_errors_are_one_line(
    tmp_path: Path, no_bisect: dict[str, str], args: list[str], hidden: bool, message: str
) -> None:
    bundle = write_bundle(tmp_path / "b", matmul_relu(), {"file": X})
    proc = run(bundle, *args, env=no_bisect if hidden else None)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("error: ")
    assert message in proc.stderr
    assert proc.stdout == ""


def test_float64_reference_through_onnx_bisect(tmp_path: Path) -> None:
    bundle = write_bundle(tmp_path / "b", matmul_relu(), {"file": X}, ref="ref?dtype=float64")
    proc = run(bundle)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.startswith("reference  ref?dtype=float64: matches expected outputs")


def test_a_model_at_a_newer_ir_version_runs_lowered(
    tmp_path: Path, no_bisect: dict[str, str]
) -> None:
    # onnxruntime refuses IR versions above the one it reads (1.32 reads 14): a copy lowered
    # to that runs when the model's opsets need no more.
    bundle = write_bundle(tmp_path / "b", matmul_relu(), {"file": X}, tamper=1.05)
    model = onnx.load(str(bundle / "model.onnx"))
    model.ir_version = 99
    onnx.save(model, bundle / "model.onnx")
    proc = run(bundle, env=no_bisect)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "REPRODUCED" in proc.stdout
    assert "ran a copy of model.onnx lowered from IR 99" in proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr and "[W:onnxruntime" not in proc.stderr


SCALED_PLUGIN = textwrap.dedent(
    """\
    from onnx_bisect import BackendBase, create_backend


    class Scaled(BackendBase):
        def __init__(self, spec):
            super().__init__(spec)
            spec.check_options(["factor"])
            self.factor = float(spec.option("factor", "1"))
            self.inner = create_backend("cpu")

        def _run(self, model, feeds):
            return {k: v * self.factor for k, v in self.inner.run(model, feeds).items()}
    """
)


@pytest.mark.slow
def test_a_plugin_file_spec_with_options_is_verified(tmp_path: Path) -> None:
    """``file.py:Class?key=value``: the bundle's repro.py builds it through onnx-bisect, so
    bisect's bundle is verified; a relative path is found from where onnx-bisect ran."""
    import json

    from typer.testing import CliRunner

    from onnx_bisect.cli import bisect_app
    from tests.models import chain

    plugin = tmp_path / "plugins" / "scaled.py"
    plugin.parent.mkdir()
    plugin.write_text(SCALED_PLUGIN)
    spec = template.parse_spec(f"{plugin}:Scaled?factor=1.05")
    assert (spec.name, spec.device) == ("file", f"{plugin}:Scaled")
    model = tmp_path / "chain.onnx"
    onnx.save(chain(4), model)
    out = tmp_path / "out"
    target = f"{plugin}:Scaled?factor=1.05"
    res = CliRunner().invoke(bisect_app, [str(model), "--target", target, "--out", str(out)])
    assert res.exit_code == 1, res.output
    repro = json.loads((out / "report.json").read_text())["repro"]
    assert repro["reproduces"], repro["message"]
    relative = "plugins/scaled.py:Scaled?factor=1.05"
    bundle = write_bundle(
        tmp_path / "elsewhere" / "b", matmul_relu(), {"file": X}, target=relative,
        workdir=str(tmp_path),
    )  # fmt: skip
    proc = run(bundle)  # from tmp_path/elsewhere, where plugins/ is not
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "REPRODUCED" in proc.stdout
