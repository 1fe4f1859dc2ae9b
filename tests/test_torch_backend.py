"""The torch backend: its spec, its devices, its verdicts on real models and the float64 oracle.

Everything runs real torch on this machine's CPU; CUDA cases are marked ``gpu`` and skip where
torch sees no CUDA device. The operator coverage against ONNX's own node tests lives in
tests/test_torch_ops.py.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from typer.testing import CliRunner

import onnx_bisect
from onnx_bisect import Verdict
from onnx_bisect.backends.spec import parse_spec
from onnx_bisect.cli import bisect_app
from onnx_bisect.compare.metrics import rel_l2
from onnx_bisect.engine.measure.isolate import IsolationFailure
from onnx_bisect.errors import BackendError, BackendUnavailableError, SpecError
from onnx_bisect.graph.extract import with_outputs
from onnx_bisect.inputs.feeds import make_feeds
from tests.faulty import FaultyBackend
from tests.models import ROOT, TRANSFORMER, YOLO, chain, make

torch = pytest.importorskip("torch")

from onnx_bisect.backends.registry import create_backend  # noqa: E402
from onnx_bisect.backends.torch.options import TorchOptions  # noqa: E402

runner = CliRunner()
EXAMPLES = sorted((ROOT / "examples" / "models").glob("*.onnx"))
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="torch sees no CUDA device")


# --- the spec -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("torch", TorchOptions()),
        ("torch:cpu?dtype=float64", TorchOptions(dtype="float64")),
        ("mps", TorchOptions(device="mps")),
        ("torch:cuda:1?tf32=1", TorchOptions(device="cuda:1", tf32=True)),
        (
            "torch:cpu?compile=inductor&deterministic=1&dtype=bfloat16",
            TorchOptions(compile="inductor", deterministic=True, dtype="bfloat16"),
        ),
    ],
)
def test_spec_grammar(text: str, expected: TorchOptions) -> None:
    assert TorchOptions.parse(parse_spec(text)) == expected


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("torch:cpu?dtype=int8", "dtype must be one of float32, float16, bfloat16, float64"),
        ("torch:tpu", "unknown torch device 'tpu'"),
        ("torch:cpu?compile=tvm", "compile must be one of inductor, aot_eager, eager"),
        ("torch:cpu?tf32=maybe", "tf32 must be 0 or 1"),
        ("torch:cpu?fast=1", "unknown option(s) fast"),
        ("mps?dtype=float64", "MPS has no float64"),
    ],
)
def test_bad_spec_is_a_spec_error(text: str, message: str) -> None:
    with pytest.raises(SpecError, match=message.replace("(", r"\(").replace(")", r"\)")):
        create_backend(text)


# --- devices that are not here: one line, exit 2 ---------------------------------------------


@pytest.mark.skipif(sys.platform == "darwin", reason="a Mac may have MPS")
def test_mps_off_macos_is_one_line_exit_2() -> None:
    res = runner.invoke(bisect_app, [str(YOLO), "--ref", "cpu", "--target", "mps"])
    assert res.exit_code == 2
    (line,) = res.stderr.strip().splitlines()
    assert "MPS needs macOS on Apple silicon" in line
    assert "onnx-bisect dump MODEL --backend mps --out DIR" in line and "dump:DIR" in line


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_cuda_absent_is_one_line_exit_2() -> None:
    res = runner.invoke(bisect_app, [str(YOLO), "--target", "torch:cuda?tf32=1"])
    assert res.exit_code == 2
    (line,) = res.stderr.strip().splitlines()
    assert "sees no CUDA device" in line and "dump:DIR" in line


def test_without_torch_the_core_works_and_torch_specs_say_how_to_install(tmp_path: Path) -> None:
    script = tmp_path / "no_torch.py"
    script.write_text(
        "import sys\n"
        "sys.modules['torch'] = None  # as if torch were not installed\n"
        "import onnx_bisect\n"
        "r = onnx_bisect.bisect(sys.argv[1], ref='cpu', target='ref')\n"
        "assert r.verdict == 'match', r.verdict\n"
        "from onnx_bisect.cli import bisect_entry\n"
        "sys.argv = ['bisect', sys.argv[1], '--target', 'torch:cpu']\n"
        "bisect_entry()\n"
    )
    res = subprocess.run(
        [sys.executable, str(script), str(YOLO)], capture_output=True, text=True, cwd=ROOT
    )
    assert res.returncode == 2, res.stderr
    (line,) = res.stderr.strip().splitlines()
    assert "torch is not installed" in line
    assert "pip install 'onnx-bisect[torch]'" in line


def test_importing_the_package_does_not_import_torch() -> None:
    code = "import sys, onnx_bisect, onnx_bisect.cli; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.stdout.strip() == "False", out.stderr


def test_backends_lists_torch_devices_and_version() -> None:
    from onnx_bisect.cli import app

    res = runner.invoke(app, ["backends"], env={"COLUMNS": "200"})
    assert res.exit_code == 0
    row = next(line for line in res.stdout.splitlines() if line.startswith("│ torch"))
    assert f"torch {torch.__version__}" in row and "devices here: cpu" in row


# --- running models ---------------------------------------------------------------------------


@pytest.mark.parametrize("model", EXAMPLES, ids=lambda p: p.stem)
def test_example_models_match_onnxruntime(model: Path) -> None:
    result = onnx_bisect.bisect(model, ref="cpu", target="torch:cpu", threshold="auto")
    assert result.verdict == "match", [(o.name, o.score) for o in result.outputs]


def test_every_tensor_matches_onnxruntime_when_scanned() -> None:
    result = onnx_bisect.bisect(YOLO, ref="cpu", target="torch:cpu", always_scan=True)
    assert result.verdict == "match"
    assert result.nodes and all(n.verdict is Verdict.OK for n in result.nodes)


def test_planted_fault_in_the_torch_backend_is_named() -> None:
    node = "/down1/conv/Conv"
    target = FaultyBackend(node, 0.01, base="torch:cpu")
    result = onnx_bisect.bisect(YOLO, ref="cpu", target=target, threshold="auto")
    assert result.verdict == "diverged"
    assert result.root_cause is not None and result.root_cause.nodes == (node,)
    assert [n.name for n in result.culprits()] == [node]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision_is_found_and_called_a_precision_policy(dtype: str) -> None:
    # fp16's output error (4e-4) is over fp32 noise and within what fp16 predicts: with the
    # default floors it agrees; against a fixed 1e-4 every Conv is a culprit, with the note.
    target = f"torch:cpu?dtype={dtype}"
    result = onnx_bisect.bisect(YOLO, ref="cpu", target=target, threshold="auto")
    assert result.verdict == "match"
    assert f"agrees within {dtype} precision" in result.summary()
    fixed = onnx_bisect.bisect(YOLO, ref="cpu", target=target, threshold=1e-4)
    assert fixed.verdict == "diverged"
    assert len(fixed.culprits()) >= 5
    assert any(f"the target computes in {dtype}" in n for n in fixed.notes), fixed.notes


def test_dtype_policy_reaches_constants_and_casts() -> None:
    """float64 must reach a Constant, a Cast target and ConstantOfShape, not only inputs."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [3])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [3])
    third = numpy_helper.from_array(np.array(1 / 3, np.float32), "v")
    model = make(
        [
            helper.make_node("Constant", [], ["c"], value=third),
            helper.make_node("Cast", ["x"], ["xc"], to=TensorProto.FLOAT),
            helper.make_node("Div", ["xc", "c"], ["y"]),
        ],
        [x],
        [y],
    )
    feeds = {"x": np.array([1, 2, 3], np.float32)}
    out = create_backend("torch:cpu?dtype=float64").run(model, feeds)["y"]
    assert out.dtype == np.float64
    # 1/3 rounded to float32, then divided in float64: the constant's float32 value is kept.
    np.testing.assert_allclose(out, feeds["x"] / np.float64(np.float32(1 / 3)), rtol=1e-15)


def test_an_operator_it_lacks_is_named_with_its_version() -> None:
    """The error names the node, the operator and its version, and reads as "not supported"
    (which isolation turns into the verdict ``unsupported``). Bisecting a target that fails on
    the whole model to that node is issue 12; today that is a one-line exit 2."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])
    draws = helper.make_tensor_value_info("draws", TensorProto.FLOAT, [2, 3])
    model = make(
        [
            helper.make_node("Sigmoid", ["x"], ["p"], name="sig"),
            # Left out on purpose: its draws would be torch's, not the reference's.
            helper.make_node("Bernoulli", ["p"], ["draws"], name="coin"),
        ],
        [x],
        [draws],
    )
    with pytest.raises(BackendError) as info:
        create_backend("torch:cpu").run(model, {"x": np.zeros((2, 3), np.float32)})
    message = str(info.value)
    assert "node 'coin'" in message and "does not support Bernoulli version 15" in message
    assert IsolationFailure(message).unsupported


def test_compiled_run_matches_eager() -> None:
    model = chain(3)
    feeds = {"x": np.random.default_rng(0).standard_normal((2, 8)).astype(np.float32)}
    eager = create_backend("torch:cpu").run(model, feeds)["y"]
    compiled = create_backend("torch:cpu?compile=aot_eager").run(model, feeds)["y"]
    np.testing.assert_allclose(compiled, eager, rtol=1e-6, atol=1e-7)


@pytest.mark.slow
def test_compile_inductor_bisects_like_any_target() -> None:
    result = onnx_bisect.bisect(
        TRANSFORMER, ref="torch:cpu", target="torch:cpu?compile=inductor", threshold="auto"
    )
    assert result.verdict == "match", [(o.name, o.score) for o in result.outputs]


# --- the float64 oracle -----------------------------------------------------------------------


def test_threshold_auto_uses_the_torch_oracle_and_says_so() -> None:
    # --always-scan: agreeing outputs would not wait for the oracle (tests/test_settle.py).
    result = onnx_bisect.bisect(YOLO, ref="cpu", target="cpu", threshold="auto", always_scan=True)
    assert any("float64 values from torch" in n for n in result.notes), result.notes


@pytest.mark.parametrize("model", EXAMPLES, ids=lambda p: p.stem)
def test_torch_oracle_agrees_with_the_reference_evaluator(model: Path) -> None:
    """Where onnx.reference is right, the two float64 oracles differ far less than fp32 rounds
    (its Erf runs in float32: still well within). Where it is known wrong (BatchNormalization
    at opsets 9-13 in training mode), torch stays within fp32 rounding of ONNX Runtime."""
    loaded = onnx.load(str(model))
    feeds = make_feeds(loaded, seed=0)
    marked = with_outputs(loaded, _float_tensors(loaded))
    ours = create_backend("torch:cpu?dtype=float64").run(marked, feeds)
    theirs = create_backend("ref?dtype=float64").run(marked, feeds)
    fp32 = create_backend("cpu").run(marked, feeds)
    opset = next(i.version for i in loaded.opset_import if i.domain in ("", "ai.onnx"))
    after_bn = _after_batchnorm(loaded) if 9 <= opset <= 13 else set()
    for name, value in theirs.items():
        noise = rel_l2(value, fp32[name])
        if name in after_bn:
            assert rel_l2(ours[name], fp32[name]) < 1e-5, name
        else:
            assert rel_l2(value, ours[name]) <= max(0.25 * noise, 1e-12), name


def _after_batchnorm(model: onnx.ModelProto) -> set[str]:
    tainted: set[str] = set()
    for node in model.graph.node:
        if node.op_type == "BatchNormalization" or tainted & set(node.input):
            tainted |= set(node.output)
    return tainted


def _float_tensors(model: onnx.ModelProto) -> list[str]:
    inferred = onnx.shape_inference.infer_shapes(model)
    types = {v.name: v.type.tensor_type.elem_type for v in inferred.graph.value_info}
    types.update({v.name: v.type.tensor_type.elem_type for v in inferred.graph.output})
    return [
        o
        for n in model.graph.node
        for o in n.output
        if types.get(o) == TensorProto.FLOAT and n.op_type != "Constant"
    ]


# --- CUDA (skipped without a GPU) -------------------------------------------------------------


@pytest.mark.gpu
@CUDA
def test_cuda_matches_cpu() -> None:
    result = onnx_bisect.bisect(YOLO, ref="torch:cpu", target="torch:cuda", threshold="auto")
    assert result.verdict == "match"


@pytest.mark.gpu
@CUDA
def test_tf32_on_diverges_from_tf32_off() -> None:
    model = chain(4, width=256)
    feeds = {"x": np.random.default_rng(0).standard_normal((64, 256)).astype(np.float32)}
    result = onnx_bisect.bisect(
        model, ref="torch:cuda?tf32=0", target="torch:cuda?tf32=1", inputs=feeds, threshold=1e-5
    )
    assert result.verdict == "diverged"
    assert result.first_divergence is not None and result.first_divergence.op_type == "MatMul"


def test_runs_in_two_threads_each_see_their_own_numerics_flags() -> None:
    """The engine runs the reference and the target at once; torch's flags are process-wide."""
    import threading
    import time

    from onnx_bisect.backends.torch.numerics import numerics

    matmul = torch.backends.cuda.matmul
    if not hasattr(matmul, "fp32_precision"):
        pytest.skip("torch < 2.9 has no fp32_precision flags")
    seen: list[str] = []
    inside = threading.Event()

    def first() -> None:
        with numerics(tf32=True, deterministic=None):
            inside.set()
            time.sleep(0.3)  # the other thread tries to set its own flags meanwhile
            seen.append(matmul.fp32_precision)

    thread = threading.Thread(target=first)
    thread.start()
    inside.wait()
    with numerics(tf32=False, deterministic=None):
        seen.append(matmul.fp32_precision)
    thread.join()
    assert seen == ["tf32", "ieee"]


def test_unavailable_error_type() -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(BackendUnavailableError):
        create_backend("torch:cuda")
