"""The ML-compiler adapters ``iree`` and ``tvm`` on the real compilers from PyPI: values by
name, compiles cached, IREE's missing BatchNormalization (before opset 15) found as unsupported,
the CLI on the example models. Each test skips, saying why, where its extra is absent."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from typer.testing import CliRunner

from onnx_bisect.backends import create_backend
from onnx_bisect.backends.compiled import (
    COMPILED_DIR_ENV,
    CompileCache,
    OnDisk,
    compiles_here,
    pinned_model,
)
from onnx_bisect.backends.compiler_passes import TVM_OPTIONAL
from onnx_bisect.backends.iree import compiler_message
from onnx_bisect.backends.passes import supports_passes
from onnx_bisect.cli import bisect_app
from onnx_bisect.errors import BackendCrash, BackendError, BackendUnavailableError, SpecError
from onnx_bisect.graph.extract import with_outputs
from tests.models import ROOT, chain

runner = CliRunner()
X = np.linspace(-1, 1, 16, dtype=np.float32).reshape(2, 8)
EXAMPLES = ROOT / "examples" / "models"


def _need(package: str, extra: str) -> None:
    pytest.importorskip(package, reason=f"the [{extra}] extra is not installed")


def _conv_bn(opset: int) -> onnx.ModelProto:
    """x -> Conv ``conv`` -> BatchNormalization ``bn`` -> Relu ``act`` -> y (1x4x8x8)."""
    rng = np.random.default_rng(0)

    def init(name: str, shape: tuple[int, ...], low: float = -1.0) -> onnx.TensorProto:
        return numpy_helper.from_array(rng.uniform(low, 1, shape).astype(np.float32), name)

    inits = [init("w", (4, 3, 3, 3)), init("s", (4,)), init("b", (4,)), init("m", (4,))]
    inits.append(init("v", (4,), low=0.5))
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["c"], name="conv", pads=[1, 1, 1, 1]),
        helper.make_node("BatchNormalization", ["c", "s", "b", "m", "v"], ["n"], name="bn"),
        helper.make_node("Relu", ["n"], ["y"], name="act"),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 8, 8])],
        initializer=inits,
    )
    return helper.make_model(graph, ir_version=8, opset_imports=[helper.make_opsetid("", opset)])


def _bisect(model: Path, target: str, out: Path | None = None) -> tuple[int, str]:
    args = [str(model), "--target", target]
    args += ["--out", str(out)] if out is not None else []
    res = runner.invoke(bisect_app, args)
    return res.exit_code, res.output


@pytest.mark.parametrize(("spec", "extra"), [("iree", "iree"), ("tvm", "tvm")])
def test_runs_every_output_by_name_and_compiles_once(spec: str, extra: str) -> None:
    _need(spec, extra)
    backend = create_backend(spec)
    names = ["a0", "y", "h1", "x"]  # intermediates marked as outputs, out of graph order
    model = with_outputs(chain(3), names)
    before = model.SerializeToString()
    got = backend.run(model, {"x": X, "unused": np.zeros(3)})
    want = create_backend("cpu").run(model, {"x": X})
    assert list(got) == names
    for name in names:
        assert got[name].shape == (2, 8) and got[name].dtype == np.float32, name
        np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-6, err_msg=name)
    assert model.SerializeToString() == before  # the caller's model is left alone
    # The same model on other values is not compiled again.
    again = backend.run(model, {"x": X * 2})
    want = create_backend("cpu").run(model, {"x": X * 2})
    np.testing.assert_allclose(again["y"], want["y"], rtol=1e-5, atol=1e-6)
    notes = backend.notes()  # type: ignore[attr-defined]
    assert len(notes) == 1 and notes[0].startswith("compiled by "), notes  # once: no count
    # Nor by another backend of the same spec (pass bisection builds one per run).
    same = create_backend(spec)
    same.run(model, {"x": X})
    assert same.notes() == []  # type: ignore[attr-defined]
    assert spec.upper() in backend.describe().upper()
    versions = backend.versions()
    assert versions and all(v != "unknown" for v in versions.values()), versions


@pytest.mark.parametrize(
    ("spec", "extra", "suffix"), [("iree", "iree", ".vmfb"), ("tvm", "tvm", ".so")]
)
def test_a_sandboxed_compiler_compiles_a_model_once(spec: str, extra: str, suffix: str) -> None:
    """Under --isolate-crashes each run is a fresh child: the backend still declares that its
    runs compile, and what one child compiled the next reads back from the sandbox's folder
    instead of compiling again (a second compile would replace the file)."""
    _need(spec, extra)
    backend = create_backend(spec, in_child=True)
    assert backend.capabilities.compiles and backend.capabilities.child_process
    model = with_outputs(chain(2), ["a0", "y"])
    first = backend.run(model, {"x": X})
    folder = Path(backend.environment()[COMPILED_DIR_ENV])  # type: ignore[attr-defined]
    (artifact,) = folder.iterdir()
    assert artifact.suffix == suffix
    made = artifact.stat()
    again = backend.run(model, {"x": X * 2})  # other values, the same shapes: no compile
    assert [p.name for p in folder.iterdir()] == [artifact.name]
    assert (artifact.stat().st_ino, artifact.stat().st_mtime_ns) == (made.st_ino, made.st_mtime_ns)
    for out, x in ((first, X), (again, X * 2)):
        want = create_backend("cpu").run(model, {"x": x})
        np.testing.assert_allclose(out["y"], want["y"], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "spec",
    ["iree:npu", "iree?opt=3", "iree?flags='--x", "tvm:metal", "tvm?opt_level=9", "tvm?fp16=2"],
)
def test_bad_specs_are_usage_errors(spec: str) -> None:
    _need(spec[:4].strip(":?"), spec[:4].strip(":?"))
    with pytest.raises(SpecError):
        create_backend(spec)


def test_a_driver_without_a_device_is_unavailable() -> None:
    _need("iree.runtime", "iree")
    import iree.runtime as rt

    try:
        rt.get_driver("vulkan").query_available_devices()
        pytest.skip("this machine has a Vulkan loader")
    except Exception:
        pass
    with pytest.raises(BackendUnavailableError, match="IREE's vulkan driver does not start: "):
        create_backend("iree:vulkan")


def test_pinned_model_types_every_output_from_the_feeds() -> None:
    """A model whose outputs have no type (as derived models had) and a symbolic batch: the
    copy a compiler gets has every input pinned and every output typed, 0-d inputs kept 0-d."""
    model = with_outputs(chain(2), ["h0", "y"])
    for o in model.graph.output:
        o.ClearField("type")
    model.graph.input[0].type.tensor_type.shape.dim[0].dim_param = "batch"
    scalar = helper.make_tensor_value_info("k", TensorProto.INT64, [])
    model.graph.input.append(scalar)
    pinned = pinned_model(model, {"x": X, "k": np.asarray(3, np.int64)})
    dims = [[d.dim_value for d in i.type.tensor_type.shape.dim] for i in pinned.graph.input]
    assert dims == [[2, 8], []]
    assert pinned.graph.input[1].type.tensor_type.HasField("shape")
    for o in pinned.graph.output:
        tt = o.type.tensor_type
        assert tt.elem_type == TensorProto.FLOAT and [d.dim_value for d in tt.shape.dim] == [2, 8]
    assert not model.graph.output[0].HasField("type")  # the caller's model is left alone


def test_compile_cache_keys_on_graph_shapes_and_settings() -> None:
    cache: CompileCache[int] = CompileCache(size=2)
    small = pinned_model(chain(1), {"x": X})
    tall = pinned_model(chain(1), {"x": np.ones((3, 8), np.float32)})
    built: list[str] = []

    def get(model: onnx.ModelProto, setting: str) -> int:
        return cache.get(
            CompileCache.key(model, setting), lambda: len(built.append(setting) or built)
        )

    assert [get(small, "a"), get(small, "a"), get(tall, "a"), get(small, "b")] == [1, 1, 2, 3]
    assert (cache.compiles, cache.reused) == (3, 1)
    assert get(small, "a") == 4  # the least recently used went when a third came


_BYTES: OnDisk[bytes] = OnDisk(".bin", lambda b, path: path.write_bytes(b), Path.read_bytes)
_REFUSED = "iree: unsupported op onnx.BatchNormalization (iree-compile: failed to legalize)"


def _refuse(calls: list[int]) -> Callable[[], bytes]:
    """A build that fails as IREE's does on an op it cannot legalize, counting its calls."""

    def build() -> bytes:
        calls.append(1)
        raise BackendError(_REFUSED, detail=f"{_REFUSED}\nDiagnostics: <stdin>:10:10: error")

    return build


def _raised(cache: CompileCache[bytes], key: str, build: Callable[[], bytes]) -> BackendError:
    with pytest.raises(BackendError) as info:
        cache.get(key, build)
    return info.value


def test_a_failed_compile_is_raised_again_without_compiling() -> None:
    """Scope 5: a model the compiler refused is not compiled again to be refused again; each
    time a fresh error of the same class, message and detail (the search sets its role)."""
    cache: CompileCache[bytes] = CompileCache(disk=_BYTES)
    calls: list[int] = []
    first = _raised(cache, "k", _refuse(calls))
    first.role = "target"
    again = _raised(cache, "k", _refuse(calls))
    assert calls == [1] and (cache.compiles, cache.reused) == (1, 1)
    assert type(again) is BackendError and again is not first and again.role is None
    assert (str(again), again.detail) == (str(first), first.detail)
    assert cache.get("other", lambda: b"vmfb") == b"vmfb"  # another key still compiles


def test_a_failed_compile_is_read_back_by_another_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """With the folder named, the failure is kept as ``{key}.failed`` (JSON), which a fresh
    cache (another process's) reads back as the same error, saying so, without compiling; one
    that failed before the folder was named is written when asked for again (a bundle's
    check, ``repro/bundle.py``)."""
    monkeypatch.setenv(COMPILED_DIR_ENV, str(tmp_path))
    calls: list[int] = []
    first = _raised(CompileCache(disk=_BYTES), "k", _refuse(calls))
    assert [p.name for p in tmp_path.iterdir()] == ["k.failed"]
    kept = json.loads((tmp_path / "k.failed").read_text())
    assert kept == {"kind": "onnx_bisect.errors.BackendError", "message": _REFUSED,
                    "detail": first.detail}  # fmt: skip
    fresh: CompileCache[bytes] = CompileCache(disk=_BYTES)
    with caplog.at_level("INFO", logger="onnx_bisect.backends.compiled"):
        again = _raised(fresh, "k", _refuse(calls))
    assert calls == [1] and (fresh.compiles, fresh.reused) == (0, 1)
    assert type(again) is BackendError and (str(again), again.detail) == (_REFUSED, first.detail)
    assert "failed compile of model k read back" in caplog.text
    _raised(fresh, "k", _refuse(calls))  # and kept in memory: the file is not read again
    (tmp_path / "k.failed").unlink()
    _raised(fresh, "k", _refuse(calls))
    assert calls == [1] and (tmp_path / "k.failed").exists()


def test_a_failed_compile_is_read_back_in_another_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(COMPILED_DIR_ENV, str(tmp_path))
    first = _raised(CompileCache(disk=_BYTES), "k", _refuse([]))
    child = (
        "import sys, pathlib\n"
        "from onnx_bisect.backends.compiled import CompileCache, OnDisk\n"
        "from onnx_bisect.errors import BackendError\n"
        "disk = OnDisk('.bin', lambda b, p: p.write_bytes(b), pathlib.Path.read_bytes)\n"
        "def build(): sys.exit('compiled again')\n"
        "try:\n    CompileCache(disk=disk).get('k', build)\n"
        "except BackendError as exc:\n    print(type(exc).__name__, exc.detail, sep='|')\n"
    )
    done = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == f"BackendError|{first.detail}"


@pytest.mark.parametrize(
    "exc",
    [
        MemoryError(),
        RuntimeError("the compiler's own bug"),
        BackendCrash("iree: the compiler died (signal 9)"),
    ],
)
def test_only_a_compilers_refusal_is_kept(
    exc: BaseException, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A crash, a timeout or Python's own error may not happen again: the next run compiles."""
    monkeypatch.setenv(COMPILED_DIR_ENV, str(tmp_path))
    cache: CompileCache[bytes] = CompileCache(disk=_BYTES)
    calls: list[int] = []

    def build() -> bytes:
        calls.append(1)
        raise exc

    for _ in range(2):
        with pytest.raises(type(exc)):
            cache.get("k", build)
    assert calls == [1, 1] and not list(tmp_path.iterdir())


@pytest.mark.parametrize(
    "text",
    [
        '{"kind": "os.system", "message": "rm -rf", "detail": null}',
        '{"kind": "onnx_bisect.errors.BackendError", "message": 3}',
        "{not json",
    ],
)
def test_a_damaged_failure_file_costs_a_compile(
    text: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Only the allowed classes are raised from a file; anything else is compiled again."""
    monkeypatch.setenv(COMPILED_DIR_ENV, str(tmp_path))
    (tmp_path / "k.failed").write_text(text)
    cache: CompileCache[bytes] = CompileCache(disk=_BYTES)
    assert cache.get("k", lambda: b"vmfb") == b"vmfb" and cache.compiles == 1


def test_compiler_message_names_the_unsupported_op() -> None:
    text = (
        "Error invoking IREE compiler tool iree-compile\nError code: 1\nDiagnostics:\n"
        "<stdin>:10:10: error: failed to legalize operation 'torch.operator' that was "
        'explicitly marked illegal: %29 = "torch.operator"(%28, %3) <{name = '
        '"onnx.BatchNormalization"}> {torch.onnx.epsilon = 9.99999974E-6 : f32}\n'
        "Invoked with:\n iree-compile - --iree-input-type=auto\n"
    )
    assert compiler_message(text) == (
        "unsupported op onnx.BatchNormalization (iree-compile: failed to legalize operation "
        "'torch.operator' onnx.BatchNormalization)"
    )
    other = "Diagnostics:\n<stdin>:3:1: error: 'linalg.generic' op inferred input/output\n"
    assert compiler_message(other) == "iree-compile: 'linalg.generic' op inferred input/output"


@pytest.mark.slow  # 4 compiles of about 2 s each
@pytest.mark.parametrize("opset", [13, 15])
def test_iree_batchnorm_before_opset_15_is_unsupported(tmp_path: Path, opset: int) -> None:
    """IREE 3.13 has no conversion for BatchNormalization before opset 15 (FIELD-NOTES); at 15
    it compiles and agrees with onnxruntime."""
    _need("iree.compiler", "iree")
    path = tmp_path / "conv_bn.onnx"
    onnx.save(_conv_bn(opset), path)
    code, output = _bisect(path, "iree", tmp_path / "out")
    if opset == 15:
        assert code == 0, output
        return
    assert code == 1, output
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    cause = report["root_cause"]
    assert cause["kind"] == "unsupported" and cause["nodes"] == ["bn"], cause
    assert "failed to legalize operation 'torch.operator'" in cause["message"]
    assert "onnx.BatchNormalization" in cause["message"]
    issue = (tmp_path / "out" / "repro" / "issue.md").read_text()
    version = report["versions"]["iree-base-compiler"]
    assert issue.startswith(f"# `IREE {version}` cannot run `bn`\n"), issue[:200]
    # Every compile is counted: the bundle's model (its inputs named as in the model, so not
    # the failure search's check of `bn` alone) is compiled once, by the check's repro.py
    # (IREE runs in a worker, so the bundle is checked there only); the others are made in
    # the worker, whose notes come back to the report.
    by_stage = report["target_runs_by_stage"]
    assert by_stage.get("repro check") == 1 and "repro" not in by_stage, by_stage
    made_here = sum(by_stage.values()) - by_stage["repro check"]
    compiled = f"compiled by iree-compile for llvm-cpu ({made_here} times)"
    assert compiled in report["notes"], (by_stage, report["notes"])


def test_tvm_fp16_is_declared_and_diverges(tmp_path: Path) -> None:
    _need("tvm", "tvm")
    fp16 = create_backend("tvm?fp16=1")
    info = fp16.computes_in()  # type: ignore[attr-defined]
    assert info is not None and info.precision.value == "float16" and info.asked
    model = with_outputs(chain(3), ["y"])
    got = fp16.run(model, {"x": X})["y"]
    want = create_backend("cpu").run(model, {"x": X})["y"]
    rel = float(np.linalg.norm(got - want) / np.linalg.norm(want))
    assert 1e-5 < rel < 1e-2, rel  # float16 rounding: visible, and small


@pytest.mark.slow
def test_a_divergence_bundle_is_compiled_once(tmp_path: Path) -> None:
    """Scope 5: no model is compiled twice. In the tool's process (--no-isolate-crashes) the
    bundle's candidate is compiled here, and its repro.py, run in a fresh process, reads that
    back rather than compiling it again: the repro stage costs one compile and there is no
    "repro check" compile. In a worker (the default) the candidate is compiled only by the
    check: one compile all the same."""
    _need("tvm", "tvm")
    model, out = tmp_path / "chain.onnx", tmp_path / "out"
    onnx.save(chain(3), model)
    args = [str(model), "--target", "tvm?fp16=1", "--threshold", "1e-5", "--out", str(out)]
    for where, stage, never in (("--no-isolate-crashes", "repro", "repro check"),
                                (None, "repro check", "repro")):  # fmt: skip
        res = CliRunner().invoke(bisect_app, [*args, where] if where else args)
        assert res.exit_code == 1, res.output
        report = json.loads((out / "report.json").read_text())
        # fp16 rounds every MatMul past 1e-5; the one whose repair brings the outputs back is
        # the root cause (issue 33's ranking), and the bundle is cut there.
        cause = report["root_cause"]["nodes"]
        assert report["repro"]["reproduces"] and report["repro"]["nodes"] == cause
        assert len(cause) == 1 and cause[0].startswith("mm")
        by_stage = report["target_runs_by_stage"]
        assert by_stage[stage] == 1 and never not in by_stage, (where, by_stage)


def test_tvm_returns_a_shape_it_computed_at_compile_time() -> None:
    """A prefix of a detector can end at a Shape: TVM folds it and its VM returns a shape (a
    tuple of ints), not a tensor. It once failed every such prefix ("'int' object is not
    iterable"), so the failure search named YOLOv8n's /model.22/Shape for a later error."""
    _need("tvm", "tvm")
    model = with_outputs(chain(1), ["y"])
    model.graph.node.append(helper.make_node("Shape", ["y"], ["s"], name="shape"))
    model.graph.output.append(helper.make_tensor_value_info("s", TensorProto.INT64, [2]))
    got = create_backend("tvm").run(model, {"x": X})
    assert got["s"].dtype == np.int64 and got["s"].tolist() == [2, 8]
    np.testing.assert_allclose(got["y"], create_backend("cpu").run(model, {"x": X})["y"], 1e-5)


def test_tvm_unsupported_op_is_an_error_naming_it() -> None:
    _need("tvm", "tvm")
    model = with_outputs(chain(1), ["y"])
    model.graph.node.append(helper.make_node("Det", ["y"], ["d"], name="det"))
    del model.graph.output[:]
    model.graph.output.append(helper.make_tensor_value_info("d", TensorProto.FLOAT, []))
    with pytest.raises(BackendError, match="unsupported op.*not supported .*: Det$"):
        create_backend("tvm").run(model, {"x": np.ones((8, 8), np.float32)})


def test_tvm_refusing_a_model_is_kept_and_not_compiled_again() -> None:
    """TVM's importer refuses a Reshape to a data-dependent shape with a TypeError: raised as the
    backend's error inside the compile, so the compile cache keeps the failure and the same
    model asked again fails without a second compile (the failure search, the bundle check)."""
    _need("tvm", "tvm")
    model = with_outputs(chain(1), ["y"])
    # The new shape depends on the data (max(y) * 0 + [8, 8]): TVM cannot fold it.
    model.graph.initializer.extend(
        [
            numpy_helper.from_array(np.array(v, np.int64), n)
            for n, v in (("base", [8, 8]), ("zero", 0))
        ]
    )
    model.graph.node.extend(
        [
            helper.make_node("ReduceMax", ["y"], ["m"], name="max", keepdims=0),
            helper.make_node("Cast", ["m"], ["mi"], name="cast", to=TensorProto.INT64),
            helper.make_node("Mul", ["mi", "zero"], ["z"], name="mul"),
            helper.make_node("Add", ["base", "z"], ["s"], name="add"),
            helper.make_node("Reshape", ["y", "s"], ["r"], name="reshape"),
        ]
    )
    del model.graph.output[:]
    model.graph.output.append(helper.make_tensor_value_info("r", TensorProto.FLOAT, [8, 8]))
    feeds = {"x": np.ones((8, 8), np.float32)}
    try:
        create_backend("tvm").run(model, feeds)
    except BackendError as exc:
        first = str(exc)
    else:
        pytest.skip("this TVM imports a Reshape to a shape computed from the data")
    before = compiles_here()
    with pytest.raises(BackendError) as again:
        create_backend("tvm").run(model, feeds)
    assert str(again.value) == first and compiles_here() == before


# The example models, each a compile of seconds to a minute on two shared cores.
_EXAMPLE_CODES = {
    # IREE 3.13: BatchNormalization at opset 13 has no conversion; these two are opset 13.
    "iree": {"conv_bn": 1, "conv_bn_constant": 1},
    "tvm": {},
}


@pytest.mark.slow
@pytest.mark.parametrize("spec", ["iree", "tvm"])
@pytest.mark.parametrize(
    "name", ["conv_bn", "conv_bn_constant", "transformer_block", "yolo_fused", "yolo_like"]
)
def test_example_models(spec: str, name: str, tmp_path: Path) -> None:
    _need("iree.compiler" if spec == "iree" else "tvm", spec)
    code, output = _bisect(EXAMPLES / f"{name}.onnx", spec, tmp_path / "out")
    want = _EXAMPLE_CODES[spec].get(name, 0)
    assert code == want, output
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    if want == 1:
        assert report["root_cause"]["kind"] == "unsupported"
        assert "onnx.BatchNormalization" in report["root_cause"]["message"]


_BF16 = (
    "--iree-opt-strip-assertions --iree-global-opt-demote-contraction-inputs-type=bf16 "
    "--iree-global-opt-demote-contraction-inputs-operations=all"
)


@pytest.mark.slow  # about 15 compiles of the transformer block's pieces
def test_iree_bf16_demotion_names_the_first_matmul_and_its_flag(tmp_path: Path) -> None:
    """IREE's contraction demotion to bf16 (which takes effect only with ``operations=all``) on
    the transformer example: the root cause is its first MatMul, and pass bisection over the
    flags names the one that switches the demotion on, with a verified workaround."""
    _need("iree.compiler", "iree")
    target = f"iree?flags={_BF16}"
    code, output = _bisect(EXAMPLES / "transformer_block.onnx", target, tmp_path / "out")
    assert code == 1, output
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["root_cause"]["kind"] == "culprit"
    # Every MatMul is demoted; the root cause is the smallest set whose repair brings the
    # outputs back (issue 33's ranking), no longer the first MatMul in graph order.
    model = onnx.load(EXAMPLES / "transformer_block.onnx")
    matmuls = {n.name for n in model.graph.node if n.op_type == "MatMul"}
    assert set(report["root_cause"]["nodes"]) <= matmuls
    passes = report["pass_bisection"]
    assert passes["outcome"] == "guilty" and passes["passes"] == _BF16.split()
    assert passes["guilty"] == ["--iree-global-opt-demote-contraction-inputs-operations=all"]
    workaround = passes["workaround"]
    assert workaround["verified"] is True
    assert workaround["spec"] == f"iree?flags={' '.join(_BF16.split()[:2])}"


def test_iree_pass_control_is_its_flags() -> None:
    _need("iree.compiler", "iree")
    assert supports_passes(create_backend("iree"), ()) is None  # no flags: nothing to switch
    control = supports_passes(create_backend("iree?flags=--a=1 --b"), ())
    assert control is not None
    assert control.passes(chain(1), {}) == ["--a=1", "--b"]
    assert control.all_off() == "iree"
    assert control.only(["--b"], ["--a=1", "--b"]) == "iree?flags=--b"
    assert control.workaround(["--b"]).forms == (("iree-compile", "iree-compile model.mlir --a=1"),)


@pytest.mark.slow  # three compiles, one of them hashing the module around every pass
def test_tvm_passes_are_seen_in_a_compile_and_switch_off() -> None:
    """fp16=1's ToMixedPrecision is among the passes that change the model; with it off, the
    same spec computes in float32 again."""
    _need("tvm", "tvm")
    control = supports_passes(create_backend("tvm?fp16=1"), ())
    assert control is not None
    model = with_outputs(chain(3), ["y"])
    passes = control.passes(model, {"x": X})
    assert passes[0] == "ToMixedPrecision" and set(passes) <= set(TVM_OPTIONAL), passes
    spec = control.only([], ["ToMixedPrecision"])
    assert spec == "tvm?fp16=1&disable=ToMixedPrecision"
    got = create_backend(spec).run(model, {"x": X})["y"]
    want = create_backend("cpu").run(model, {"x": X})["y"]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    form = control.workaround(["ToMixedPrecision"]).forms
    assert form == (
        ("Python", "tvm.transform.PassContext(opt_level=3, disabled_pass=['ToMixedPrecision'])"),
    )
