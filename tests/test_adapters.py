"""Backend specs, the adapter registry, and each built-in adapter on real runtimes."""

from __future__ import annotations

import platform
import shlex
import sys
import textwrap
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
from onnx import numpy_helper

from onnx_bisect.backends import (
    ALIASES,
    Adapter,
    Backend,
    BackendSpec,
    adapters,
    create_backend,
    parse_spec,
)
from onnx_bisect.errors import BackendError, BackendUnavailableError, SpecError
from onnx_bisect.graph.extract import with_outputs
from tests.models import chain, int_output

X = np.linspace(-1, 1, 16, dtype=np.float32).reshape(2, 8)


def _numpy_chain(n: int = 4) -> dict[str, np.ndarray]:
    """Every tensor of chain(n) on X, computed with numpy in float64."""
    model = chain(n)
    weights = {t.name: numpy_helper.to_array(t).astype(np.float64) for t in model.graph.initializer}
    out: dict[str, np.ndarray] = {}
    prev = X.astype(np.float64)
    for i in range(n):
        out[f"h{i}"] = prev @ weights[f"W{i}"]
        prev = out["y" if i == n - 1 else f"a{i}"] = np.tanh(out[f"h{i}"])
    return out


# --- parse_spec -----------------------------------------------------------------------------


def test_parse_alias() -> None:
    spec = parse_spec("cpu")
    assert spec == BackendSpec(text="cpu", name="ort", device="cpu")
    assert dict(spec.options) == {}
    assert spec.transforms == ()


def test_parse_options() -> None:
    spec = parse_spec("cpu?opt=disable&disable=ConvActivationFusion")
    assert (spec.name, spec.device) == ("ort", "cpu")
    assert dict(spec.options) == {"opt": "disable", "disable": "ConvActivationFusion"}
    assert spec.option("opt") == "disable"
    assert spec.option("threads") is None
    assert spec.option("threads", "4") == "4"
    assert spec.text == "cpu?opt=disable&disable=ConvActivationFusion"


def test_parse_name_and_device() -> None:
    spec = parse_spec("ort:cuda")
    assert (spec.name, spec.device, dict(spec.options)) == ("ort", "cuda", {})
    assert parse_spec("ORT:CPU").name == "ort"
    assert parse_spec("ORT:CPU").device == "cpu"


def test_parse_openvino_device_and_precision() -> None:
    spec = parse_spec("openvino:GPU?precision=f16")
    assert spec.name == "openvino"
    assert spec.device == "gpu"  # the adapter upper-cases it again
    assert dict(spec.options) == {"precision": "f16"}
    assert spec.text == "openvino:GPU?precision=f16"


def test_parse_ref() -> None:
    assert parse_spec("ref") == BackendSpec(text="ref", name="ref")
    assert parse_spec("  ref  ").text == "ref"


def test_parse_transforms() -> None:
    spec = parse_spec("cpu?opt=basic+fp16+ +onnxslim")
    assert spec.transforms == ("fp16", "onnxslim")
    assert dict(spec.options) == {"opt": "basic"}


@pytest.mark.parametrize(
    "command",
    [
        "python x.py {model} {inputs} {outputs}",
        "python x.py --mode=a+b --q? {model} {inputs} {outputs} +x ?y=1&z",
        "'/opt/my rt/run' {model} {inputs} {outputs}",
    ],
)
def test_parse_exec_keeps_the_command_verbatim(command: str) -> None:
    spec = parse_spec(f"exec:{command}")
    assert spec.name == "exec"
    assert spec.device == command
    assert dict(spec.options) == {}
    assert spec.transforms == ()


def test_aliases() -> None:
    assert ALIASES["cpu"] == ("ort", "cpu")
    assert ALIASES["trt"] == ("ort", "tensorrt")
    assert ALIASES["mps"] == ("torch", "mps")
    assert parse_spec("trt").device == "tensorrt"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "empty backend spec; try 'cpu', 'ref' or 'openvino'"),
        ("   ", "empty backend spec; try 'cpu', 'ref' or 'openvino'"),
        ("1cpu", "cannot parse backend spec '1cpu'; expected NAME[:DEVICE][?key=value&...]"),
        ("ort cpu", "cannot parse backend spec 'ort cpu'; expected NAME[:DEVICE][?key=value&...]"),
        ("ort:cuda?opt", "backend 'ort:cuda?opt': option 'opt' must look like key=value"),
        ("ort?=x", "backend 'ort?=x': option '=x' must look like key=value"),
        ("cpu:cuda", "backend 'cpu:cuda': alias 'cpu' already names a device"),
    ],
)
def test_parse_errors(text: str, message: str) -> None:
    with pytest.raises(SpecError) as err:
        parse_spec(text)
    assert str(err.value) == message


# --- registry and create_backend ------------------------------------------------------------


def test_adapters_registry() -> None:
    table = adapters()
    assert {"ort", "ref", "openvino", "exec", "torch"} <= set(table)
    for adapter in table.values():
        reason = adapter.availability()
        assert reason is None or (isinstance(reason, str) and reason)
    assert table["ort"].availability() is None
    assert table["ref"].availability() is None
    assert table["exec"].availability() is None


def test_adapter_that_cannot_import() -> None:
    broken = Adapter("x", "no_such_module_xyz:Thing", "broken")
    assert broken.availability() == (
        "cannot import no_such_module_xyz:Thing: No module named 'no_such_module_xyz'"
    )


def test_unknown_backend_lists_known_names() -> None:
    with pytest.raises(SpecError) as err:
        create_backend("tflite")
    known = ", ".join(sorted(set(adapters()) | set(ALIASES)))
    assert str(err.value) == f"unknown backend 'tflite'; known: {known}"
    for name in ("cpu", "exec", "openvino", "ort", "ref", "torch"):
        assert name in known.split(", ")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("cpu?foo=1", "backend 'cpu?foo=1': unknown option(s) foo; valid: opt, disable, threads"),
        ("ref?x=1&a=2", "backend 'ref?x=1&a=2': unknown option(s) a, x; valid: dtype"),
        (
            "cpu?opt=bogus",
            "backend 'cpu?opt=bogus': opt must be one of disable, basic, extended, all",
        ),
        ("cpu?threads=x", "backend 'cpu?threads=x': threads must be an integer"),
        (
            "ort:npu",
            "backend 'ort:npu': unknown device 'npu'; "
            "choose from cpu, cuda, tensorrt, coreml, dml, rocm, openvino",
        ),
        (
            "cpu+fp16",
            "backend 'cpu+fp16': model transforms (+fp16) rewrite the model, not the runtime; "
            "pass the spec to bisect() or the CLI",
        ),
    ],
)
def test_create_backend_spec_errors(text: str, message: str) -> None:
    with pytest.raises(SpecError) as err:
        create_backend(text)
    assert str(err.value) == message


def test_missing_execution_provider_is_unavailable() -> None:
    available = ort.get_available_providers()
    if "CUDAExecutionProvider" in available:
        pytest.skip("this onnxruntime build has CUDAExecutionProvider, so ort:cuda is not missing")
    with pytest.raises(BackendUnavailableError) as err:
        create_backend("ort:cuda")
    assert str(err.value) == (
        f"backend 'ort:cuda': this onnxruntime {ort.__version__} build has no "
        f"CUDAExecutionProvider (available: {', '.join(available)}); "
        "install the onnxruntime-gpu package in place of onnxruntime (not beside it)"
    )
    assert "CPUExecutionProvider" in str(err.value)


@pytest.mark.skipif(
    sys.platform == "darwin", reason="MPS can exist on macOS: whether mps runs depends on the Mac"
)
def test_mps_is_unavailable_here() -> None:
    with pytest.raises(BackendUnavailableError) as err:
        create_backend("mps")
    message = str(err.value)
    assert message.startswith("backend 'mps' is not available here: MPS needs macOS")
    assert "exec:CMD" not in message  # the hint for mps is to dump tensors on the Mac
    assert "onnx-bisect dump MODEL --backend mps" in message and "dump:DIR" in message


def test_mps_without_torch_off_macos_says_both(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torch", None)  # ``import torch`` now fails
    monkeypatch.setattr(sys, "platform", "linux")
    monkeypatch.setattr(platform, "system", lambda: "Linux")
    with pytest.raises(BackendUnavailableError) as err:
        create_backend("mps")
    # Installing torch alone would only lead to the next refusal: both reasons at once.
    assert str(err.value) == (
        "backend 'mps' is not available here: MPS needs macOS on Apple silicon and this "
        "machine runs Linux, and torch is not installed; install it with: "
        "pip install 'onnx-bisect[torch]'; run `onnx-bisect dump MODEL --backend mps --out DIR` "
        "where that device is, then compare here with --target dump:DIR"
    )


def test_torch_cpu_without_torch_says_only_to_install_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torch", None)
    with pytest.raises(BackendUnavailableError) as err:
        create_backend("torch:cpu")
    assert str(err.value) == (
        "backend 'torch:cpu' is not available: torch is not installed; install it with: "
        "pip install 'onnx-bisect[torch]'"
    )


# --- ONNX Runtime ---------------------------------------------------------------------------


def test_ort_runs_and_satisfies_the_protocol() -> None:
    cpu = create_backend("cpu")
    assert isinstance(cpu, Backend)
    assert cpu.describe() == "onnxruntime CPUExecutionProvider opt=all"
    assert cpu.versions() == {"onnxruntime": ort.__version__}
    out = cpu.run(chain(), {"x": X})
    assert list(out) == ["y"]
    assert out["y"].dtype == np.float32
    np.testing.assert_allclose(out["y"], _numpy_chain()["y"], rtol=1e-5, atol=1e-6)


def test_ort_opt_levels_agree() -> None:
    plain = create_backend("cpu?opt=disable&disable=ConvActivationFusion&threads=1")
    assert plain.describe() == (
        "onnxruntime CPUExecutionProvider opt=disable disabled=ConvActivationFusion"
    )
    full = create_backend("ort:cpu?opt=all")
    model = with_outputs(chain(), ["a1", "y"])
    a = plain.run(model, {"x": X})
    b = full.run(model, {"x": X})
    assert list(a) == list(b) == ["a1", "y"]
    for name in ("a1", "y"):
        np.testing.assert_allclose(a[name], b[name], rtol=1e-6, atol=1e-7)


def test_ort_ignores_feeds_the_model_does_not_take() -> None:
    out = create_backend("cpu").run(chain(), {"x": X, "unused": np.zeros(1)})
    assert out["y"].shape == (2, 8)


def test_ort_failure_becomes_backend_error() -> None:
    with pytest.raises(BackendError) as err:
        create_backend("cpu").run(chain(), {"x": X.astype(np.float64)})
    message = str(err.value)
    assert message.startswith("cpu: ")
    assert "\n" not in message
    assert "double" in message or "float64" in message or "tensor(double)" in message


def test_int_outputs_stay_integers() -> None:
    x = np.array([[0, 5, 1, 2, 3], [9, 1, 2, 3, 4]], np.float32)
    out = create_backend("cpu").run(int_output(), {"x": x})
    assert out["idx"].dtype == np.int64
    assert out["idx"].tolist() == [1, 0]


# --- reference evaluator --------------------------------------------------------------------


def test_ref_runs_chain() -> None:
    ref = create_backend("ref")
    assert ref.describe().startswith("onnx.reference.ReferenceEvaluator (onnx ")
    expected = _numpy_chain()
    out = ref.run(with_outputs(chain(), ["h0", "y"]), {"x": X, "extra": X})
    assert list(out) == ["h0", "y"]
    np.testing.assert_allclose(out["h0"], expected["h0"], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(out["y"], expected["y"], rtol=1e-5, atol=1e-6)


# --- OpenVINO -------------------------------------------------------------------------------


def test_openvino_matches_cpu_and_names_intermediates() -> None:
    pytest.importorskip("openvino")
    ov = create_backend("openvino?precision=f32")
    assert ov.describe() == "OpenVINO CPU precision=f32"
    assert set(ov.versions()) == {"openvino"}
    names = ["a0", "h2", "y", "h1"]
    model = with_outputs(chain(), names)
    got = ov.run(model, {"x": X})
    want = create_backend("cpu").run(model, {"x": X})
    assert list(got) == names
    for name in names:
        assert got[name].shape == (2, 8), name
        np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-5, err_msg=name)
    # The names must not be shuffled: each value differs from every other one.
    assert not np.allclose(got["a0"], got["h1"])


def test_openvino_spec_errors() -> None:
    pytest.importorskip("openvino")
    with pytest.raises(SpecError) as err:
        create_backend("openvino?precision=int4")
    assert str(err.value) == "backend 'openvino?precision=int4': precision must be f32, bf16 or f16"
    with pytest.raises(SpecError, match=r"unknown option\(s\) threads; valid: precision"):
        create_backend("openvino?threads=2")
    with pytest.raises(BackendUnavailableError) as unavailable:
        create_backend("openvino:XPU")
    assert str(unavailable.value).startswith(
        "backend 'openvino:XPU': OpenVINO has no XPU device here (available: "
    )


# --- exec: ----------------------------------------------------------------------------------

RUNTIME = """
import sys

import numpy as np
import onnxruntime as ort

model, inputs, outputs = sys.argv[1:4]
sess = ort.InferenceSession(model, providers=["CPUExecutionProvider"])
with np.load(inputs) as z:
    feeds = {k: z[k] for k in z.files}
assert sorted(feeds) == sorted(i.name for i in sess.get_inputs()), sorted(feeds)
names = [o.name for o in sess.get_outputs()]
np.savez(outputs, **dict(zip(names, sess.run(names, feeds))))
"""


def _exec(py: str, script: Path, *extra: str) -> str:
    return "exec:" + shlex.join([py, str(script), *extra, "{model}", "{inputs}", "{outputs}"])


def _script(tmp_path: Path, body: str, name: str = "rt.py") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return path


def test_exec_runtime_that_works(py: str, tmp_path: Path) -> None:
    # A directory with a space checks that the command is split, not passed to a shell.
    folder = tmp_path / "my runtime"
    folder.mkdir()
    script = _script(folder, RUNTIME)
    backend = create_backend(_exec(py, script))
    quoted = shlex.quote(str(script))  # the path has a space
    assert backend.describe() == f"exec: {py} {quoted} {{model}} {{inputs}} {{outputs}}"
    model = with_outputs(chain(), ["a0", "y"])
    out = backend.run(model, {"x": X, "not_an_input": np.zeros(3)})
    want = create_backend("cpu").run(model, {"x": X})
    assert list(out) == ["a0", "y"]
    for name in ("a0", "y"):
        np.testing.assert_array_equal(out[name], want[name])


def test_exec_nonzero_exit_reports_code_and_stderr_tail(py: str, tmp_path: Path) -> None:
    script = _script(
        tmp_path,
        """
        import sys
        for i in range(7):
            print(f"line {i}", file=sys.stderr)
        sys.exit(3)
        """,
    )
    spec = _exec(py, script)
    with pytest.raises(BackendError) as err:
        create_backend(spec).run(chain(), {"x": X})
    assert str(err.value) == (
        f"{spec}: exited with code 3: line 2 | line 3 | line 4 | line 5 | line 6"
    )


def test_exec_exit_zero_without_outputs(py: str, tmp_path: Path) -> None:
    script = _script(tmp_path, "import sys\nprint('did nothing', file=sys.stderr)\n")
    spec = _exec(py, script)
    with pytest.raises(BackendError) as err:
        create_backend(spec).run(chain(), {"x": X})
    assert str(err.value) == f"{spec}: exited 0 but wrote no outputs.npz: did nothing"


def test_exec_missing_output_is_named(py: str, tmp_path: Path) -> None:
    script = _script(
        tmp_path,
        """
        import sys
        import numpy as np
        np.savez(sys.argv[3], a0=np.zeros((2, 8), np.float32))
        """,
    )
    spec = _exec(py, script)
    with pytest.raises(BackendError) as err:
        create_backend(spec).run(with_outputs(chain(), ["a0", "y"]), {"x": X})
    assert str(err.value) == f"{spec}: did not return output(s) y"


def test_exec_killed_by_a_signal(py: str, tmp_path: Path) -> None:
    script = _script(
        tmp_path,
        """
        import os, signal, sys
        print("about to crash", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGSEGV)
        """,
    )
    spec = _exec(py, script)
    with pytest.raises(BackendError) as err:
        create_backend(spec).run(chain(), {"x": X})
    assert str(err.value) == f"{spec}: exited with signal 11: about to crash"


def test_exec_command_must_have_all_placeholders() -> None:
    with pytest.raises(SpecError) as err:
        create_backend("exec:python x.py {model} {inputs}")
    assert str(err.value) == (
        "backend 'exec:python x.py {model} {inputs}': the command must contain "
        "{model}, {inputs}, {outputs} (missing {outputs})"
    )


def test_exec_empty_or_unsplittable_command() -> None:
    with pytest.raises(SpecError) as err:
        create_backend("exec:")
    assert str(err.value).startswith("exec: needs a command")
    with pytest.raises(SpecError) as err:
        create_backend("exec:python 'x.py {model} {inputs} {outputs}")
    assert str(err.value).startswith(
        'backend "exec:python \'x.py {model} {inputs} {outputs}": cannot split the command ('
    )


def test_exec_command_not_found(tmp_path: Path) -> None:
    prog = tmp_path / "no-such-runtime"
    spec = f"exec:{prog} {{model}} {{inputs}} {{outputs}}"
    with pytest.raises(BackendError) as err:
        create_backend(spec).run(chain(), {"x": X})
    hint = (
        "give the program's path; exec:{python} SCRIPT ... runs a Python script with "
        + sys.executable
    )
    assert str(err.value) == f"{spec}: command not found: {prog} (hint: {hint})"


NOT_UTF8 = """
import sys

import numpy as np

sys.stderr.buffer.write(b"warning: caf\\xe9 \\xff\\n")
sys.stderr.flush()
with np.load(sys.argv[2]) as z:
    x = z["x"]
np.savez(sys.argv[3], y=np.tanh(x))
sys.exit(int(sys.argv[4]))
"""


def test_exec_tolerates_non_utf8_stderr(py: str, tmp_path: Path) -> None:
    script = _script(tmp_path, NOT_UTF8)
    spec = "exec:" + shlex.join([py, str(script), "{model}", "{inputs}", "{outputs}", "0"])
    model = chain(1)
    model.graph.node[0].op_type = "Identity"  # y = tanh(x) must come out of the script
    del model.graph.node[0].input[1:]
    out = create_backend(spec).run(model, {"x": X})
    np.testing.assert_array_equal(out["y"], np.tanh(X))


def test_exec_failure_with_non_utf8_stderr_keeps_the_exit_code(py: str, tmp_path: Path) -> None:
    script = _script(tmp_path, NOT_UTF8)
    spec = "exec:" + shlex.join([py, str(script), "{model}", "{inputs}", "{outputs}", "4"])
    with pytest.raises(BackendError) as err:
        create_backend(spec).run(chain(), {"x": X})
    assert "exited with code 4: warning: caf" in str(err.value)


def test_plugin_from_a_file_path(tmp_path: Path) -> None:
    plugin = tmp_path / "my plugins" / "rt.py"
    plugin.parent.mkdir()
    plugin.write_text(
        textwrap.dedent(
            """
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
    )
    from onnx_bisect.backends.registry import create_backend
    from onnx_bisect.backends.spec import parse_spec

    spec = parse_spec(f"{plugin}:Scaled?factor=2")
    assert spec.name == "file" and spec.options["factor"] == "2"
    import onnx_bisect
    from tests.models import YOLO

    same = onnx_bisect.bisect(YOLO, target=f"{plugin}:Scaled?factor=1")
    assert same.verdict == "match"
    scaled = onnx_bisect.bisect(YOLO, target=f"{plugin}:Scaled?factor=1.01")
    assert scaled.verdict == "diverged"
    with pytest.raises(BackendUnavailableError, match="has no Nope"):
        create_backend(f"{plugin}:Nope")
    with pytest.raises(BackendUnavailableError, match="no such file"):
        create_backend(f"{tmp_path}/missing.py:Scaled")
