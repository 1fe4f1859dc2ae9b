"""Signatures as exporters write them: -1 and 0 for a dynamic dim (paddle2onnx's PP-OCR cls
declares its batch as -1), and inputs whose values the user must choose (silero-vad's sample
rate), through the API and the CLI with real onnxruntime."""

from __future__ import annotations

import shlex
import sys
import time
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from typer.testing import CliRunner

import onnx_bisect
from onnx_bisect.cli import app, bisect_app
from onnx_bisect.engine import diagnose as diagnose_module
from onnx_bisect.engine.session import Session
from onnx_bisect.errors import BackendError
from onnx_bisect.inputs.feeds import make_feeds
from tests.models import FAULTY_RUNTIME, make

runner = CliRunner()

BATCH_DIMS = [-1, 0]


def batch_model(batch: int) -> onnx.ModelProto:
    """x[batch, 3, 8, 8] -> Relu -> Add(bias) -> Tanh -> y, the batch declared as a dim_value."""
    bias = np.linspace(-1, 1, 3, dtype=np.float32).reshape(1, 3, 1, 1)
    nodes = [
        helper.make_node("Relu", ["x"], ["r"], name="relu"),
        helper.make_node("Add", ["r", "bias"], ["a"], name="add"),
        helper.make_node("Tanh", ["a"], ["y"], name="tanh"),
    ]
    model = make(
        nodes,
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, 3, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [batch, 3, 8, 8])],
        [numpy_helper.from_array(bias, "bias")],
    )
    assert model.graph.input[0].type.tensor_type.shape.dim[0].dim_value == batch
    return model


def rate_model() -> onnx.ModelProto:
    """silero-vad's sample-rate check in small: x[1, 4] float and sr, an int64 scalar. Where
    sr is 16000 or 8000 the If yields Relu(x), [1, 4]; otherwise Concat(x, x), [1, 8], and
    the Add after it cannot broadcast, so onnxruntime fails."""
    good = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["good"], name="relu")],
        "good",
        [],
        [helper.make_tensor_value_info("good", TensorProto.FLOAT, [1, 4])],
    )
    bad = helper.make_graph(
        [helper.make_node("Concat", ["x", "x"], ["bad"], name="concat", axis=1)],
        "bad",
        [],
        [helper.make_tensor_value_info("bad", TensorProto.FLOAT, [1, 8])],
    )
    nodes = [
        helper.make_node("Equal", ["sr", "r16k"], ["is16k"], name="is16k"),
        helper.make_node("Equal", ["sr", "r8k"], ["is8k"], name="is8k"),
        helper.make_node("Or", ["is16k", "is8k"], ["known"], name="known"),
        helper.make_node("If", ["known"], ["h"], name="rate", then_branch=good, else_branch=bad),
        helper.make_node("Add", ["x", "h"], ["y"], name="add"),
    ]
    return make(
        nodes,
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4]),
            helper.make_tensor_value_info("sr", TensorProto.INT64, []),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])],
        [
            numpy_helper.from_array(np.array(16000, np.int64), "r16k"),
            numpy_helper.from_array(np.array(8000, np.int64), "r8k"),
        ],
    )


def _save(model: onnx.ModelProto, path: Path) -> Path:
    onnx.save(model, str(path))
    return path


# --- -1 and 0 batch dims through bisect() -----------------------------------------------------


@pytest.mark.parametrize("batch", BATCH_DIMS)
def test_unknown_batch_defaults_to_one(batch: int, tmp_path: Path) -> None:
    path = _save(batch_model(batch), tmp_path / "m.onnx")
    result = onnx_bisect.bisect(path, ref="cpu", target="cpu")
    assert not result.diverged
    assert result.inputs["x"].shape == (1, 3, 8, 8)


@pytest.mark.parametrize("batch", BATCH_DIMS)
def test_unknown_batch_takes_a_shape(batch: int, tmp_path: Path) -> None:
    path = _save(batch_model(batch), tmp_path / "m.onnx")
    result = onnx_bisect.bisect(path, ref="cpu", target="cpu", shapes={"x": (3, 3, 8, 8)})
    assert not result.diverged
    assert result.inputs["x"].shape == (3, 3, 8, 8)


@pytest.mark.parametrize("batch", BATCH_DIMS)
def test_unknown_batch_takes_an_npz_of_any_batch(batch: int, tmp_path: Path) -> None:
    path = _save(batch_model(batch), tmp_path / "m.onnx")
    x = np.random.default_rng(1).standard_normal((2, 3, 8, 8)).astype(np.float32)
    np.savez(tmp_path / "in.npz", x=x)
    result = onnx_bisect.bisect(path, ref="cpu", target="cpu", inputs=tmp_path / "in.npz")
    assert not result.diverged
    np.testing.assert_array_equal(result.inputs["x"], x)


def test_a_repro_bundle_of_an_unknown_batch_model_verifies(tmp_path: Path) -> None:
    # The culprit reads the model's own input, so the bundle keeps that input's declaration.
    path = _save(batch_model(-1), tmp_path / "m.onnx")
    run = [sys.executable, str(FAULTY_RUNTIME), "{model}", "{inputs}", "{outputs}"]
    target = "exec:" + shlex.join([*run, "--fault", "relu=0.05"])
    result = onnx_bisect.bisect(path, ref="cpu", target=target, repro=tmp_path / "repro")
    assert result.repro is not None and result.repro.nodes == ("relu",)
    assert result.repro.reproduces, result.repro.message


def test_fixed_dims_beside_an_unknown_batch_are_still_checked(tmp_path: Path) -> None:
    path = _save(batch_model(-1), tmp_path / "m.onnx")
    with pytest.raises(onnx_bisect.InputError) as err:
        onnx_bisect.bisect(path, ref="cpu", target="cpu", shapes={"x": (2, 4, 8, 8)})
    assert str(err.value) == "shapes x: dim 1 is 4 but the model fixes it to 3"


# --- an input whose values matter ------------------------------------------------------------


def test_generated_sample_rate_makes_the_model_fail(tmp_path: Path) -> None:
    path = _save(rate_model(), tmp_path / "vad.onnx")
    with pytest.raises(BackendError, match="reference failed"):
        onnx_bisect.bisect(path, ref="cpu", target="cpu")


def test_a_failed_reference_waits_for_the_oracle_before_the_scratch_folder_goes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The float64 oracle runs in a thread beside the screen and writes into the session's
    scratch folder; when the reference fails on the plain model the session ends with an
    error, and the folder must outlive the oracle's writes (CI once saw 'Directory not
    empty' from the folder's removal)."""
    seen: list[bool] = []

    def slow_oracle(session: Session, *args: object, **kwargs: object) -> object:
        time.sleep(0.5)  # long after the reference has failed
        seen.append(session.scratch.exists())
        (session.scratch / "late.bin").write_bytes(b"x")
        raise BackendError("no float64 here")

    monkeypatch.setattr(diagnose_module, "measure_float64", slow_oracle)
    path = _save(rate_model(), tmp_path / "vad.onnx")
    with pytest.raises(BackendError, match="reference failed"):
        onnx_bisect.bisect(path, ref="cpu", target="cpu")
    assert seen == [True]


@pytest.mark.parametrize("rate", [16000, 8000])
def test_feeds_with_a_chosen_sample_rate_run(rate: int, tmp_path: Path) -> None:
    feeds = make_feeds(rate_model(), values={"sr": rate}, ranges={"x": (-1.0, 1.0)})
    assert feeds["sr"].dtype == np.int64 and feeds["sr"].shape == () and int(feeds["sr"]) == rate
    assert feeds["x"].min() < 0 <= feeds["x"].max() < 1
    path = _save(rate_model(), tmp_path / "vad.onnx")
    result = onnx_bisect.bisect(path, ref="cpu", target="cpu", inputs=feeds)
    assert not result.diverged


def test_bisect_takes_values(tmp_path: Path) -> None:
    path = _save(rate_model(), tmp_path / "vad.onnx")
    result = onnx_bisect.bisect(path, ref="cpu", target="cpu", values={"sr": 16000})
    assert not result.diverged
    assert int(result.inputs["sr"]) == 16000


def test_bad_values_fail_before_any_work() -> None:
    with pytest.raises(onnx_bisect.InputError) as err:
        onnx_bisect.bisect("no-such-model.onnx", target="cpu", ranges={"x": (1.0, 0.0)})
    assert str(err.value) == "range for input 'x': low 1.0 is above high 0.0"


# --- the CLI ---------------------------------------------------------------------------------


def _one_line_error(args: list[str], *, cli: object = bisect_app) -> str:
    res = runner.invoke(cli, args)  # type: ignore[arg-type]
    assert res.exit_code == 2, res.output
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), res.stderr
    return lines[0]


@pytest.mark.parametrize("shape", ["x:[2,3,8,8]", "x=2x3x8x8", "x=2,3,8,8"])
def test_cli_shape_forms(shape: str, tmp_path: Path) -> None:
    path = _save(batch_model(-1), tmp_path / "m.onnx")
    out = tmp_path / "r"
    res = runner.invoke(bisect_app, [str(path), "-t", "cpu", "--shape", shape, "-o", str(out)])
    assert res.exit_code == 0, res.output
    with np.load(out / "inputs.npz") as z:
        assert z["x"].shape == (2, 3, 8, 8)


def test_cli_repeated_shape_is_an_error(tmp_path: Path) -> None:
    path = str(_save(batch_model(-1), tmp_path / "m.onnx"))
    twice = ["--shape", "x=1x3x8x8", "--shape", "x:[2,3,8,8]"]
    expected = (
        "error: --shape names input 'x' twice (x=1x3x8x8 and x:[2,3,8,8]); give each input once"
    )
    assert _one_line_error([path, "-t", "cpu", *twice]) == expected
    out = str(tmp_path / "dump")
    assert _one_line_error(["dump", path, "-b", "cpu", "-o", out, *twice], cli=app) == expected


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--value", "sr"], "error: --value 'sr': expected NAME=NUMBER, e.g. sr=16000"),
        (["--value", "sr=16k"], "error: --value 'sr=16k': expected NAME=NUMBER, e.g. sr=16000"),
        (
            ["--range", "x=1"],
            "error: --range 'x=1': expected NAME=LOW,HIGH or NAME:[LOW,HIGH], e.g. x=-1,1",
        ),
        (["--range", "x:[1,0]"], "error: range for input 'x': low 1 is above high 0"),
        (["--range", "x=0,inf"], "error: range for input 'x' must be finite, not 0,inf"),
        (
            ["--value", "sr=8000", "--range", "sr=0,1"],
            "error: input(s) sr given both a constant value and a range; give one",
        ),
        (
            ["--value", "sr=8000", "--value", "sr=16000"],
            "error: --value names input 'sr' twice (sr=8000 and sr=16000); give each input once",
        ),
    ],
)
def test_cli_bad_values_and_ranges(args: list[str], expected: str, tmp_path: Path) -> None:
    path = str(_save(rate_model(), tmp_path / "vad.onnx"))
    assert _one_line_error([path, "-t", "cpu", *args]) == expected


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (
            ["--value", "sr=0.5"],
            "error: input 'sr' is int64; the constant value 0.5 is not an integer",
        ),
        (
            ["--range", "sr=0,1e30"],
            "error: input 'sr' is int64; the range 0,1e+30 is outside "
            "[-9223372036854775808, 9223372036854775807]",
        ),
        (
            ["--value", "rate=16000"],
            "error: constant value or range for unknown input(s) rate; model inputs are x, sr",
        ),
        (
            ["--value", "sr=16000", "--input", "IN"],
            "error: a constant value or range (for sr) applies to generated inputs only, and "
            "these inputs are given; put the values in the given inputs instead",
        ),
    ],
)
def test_cli_values_that_do_not_fit_the_model(
    args: list[str], expected: str, tmp_path: Path
) -> None:
    path = str(_save(rate_model(), tmp_path / "vad.onnx"))
    np.savez(tmp_path / "in.npz", x=np.zeros((1, 4), np.float32), sr=np.array(16000))
    args = [str(tmp_path / "in.npz") if a == "IN" else a for a in args]
    assert _one_line_error([path, "-t", "cpu", *args]) == expected


def test_cli_value_and_range_run(tmp_path: Path) -> None:
    path = str(_save(rate_model(), tmp_path / "vad.onnx"))
    out = tmp_path / "r"
    args = [path, "-t", "cpu", "--value", "sr=8000", "--range", "x:[-2,2]", "-o", str(out)]
    res = runner.invoke(bisect_app, args)
    assert res.exit_code == 0, res.output
    with np.load(out / "inputs.npz") as z:
        assert int(z["sr"]) == 8000
        assert -2 <= z["x"].min() < 0 <= z["x"].max() < 2
