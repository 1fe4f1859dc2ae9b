"""Options checked before any backend runs, one line naming the flag (or, from the API, the
parameter); the conventions of a command-line tool (--version, -h, help without type
placeholders); the subcommands taking the main command's options; and bisect() needing a
target.

The CLI runs in-process through its console-script entry points (``bisect_entry``,
``main_entry``), so typer's own usage errors take the same path as in a shell."""

from __future__ import annotations

import importlib.metadata
import math
import re
import shlex
import sys
import time
from pathlib import Path

import onnxruntime as ort
import pytest
import typer

import onnx_bisect
from onnx_bisect import BisectOptions, InputError
from onnx_bisect.cli import bisect_entry, main_entry
from onnx_bisect.cli.app import app, bisect_app
from onnx_bisect.cli.params import FLAGS
from tests.faulty import FaultyBackend
from tests.models import FAULTY_RUNTIME, YOLO

FAULT = "/down1/conv/Conv"


def cli(capsys: pytest.CaptureFixture[str], *args: str, main: bool = False) -> tuple[int, str, str]:
    """Run ``bisect ARGS`` (``onnx-bisect ARGS`` with ``main``): exit code, stdout, stderr."""
    with pytest.raises(SystemExit) as exit_:
        (main_entry if main else bisect_entry)(list(args))
    out, err = capsys.readouterr()
    code = exit_.value.code
    return (code if isinstance(code, int) else 0), out, err


def marker_backend(path: Path) -> str:
    """An exec: backend that leaves ``path`` behind if it ever runs, and then fails."""
    script = f"open({str(path)!r}, 'w').close(); raise SystemExit(3)"
    return "exec:" + shlex.join([sys.executable, "-c", script, "{model}", "{inputs}", "{outputs}"])


def faulty(*extra: str) -> str:
    args = [sys.executable, str(FAULTY_RUNTIME), "{model}", "{inputs}", "{outputs}", *extra]
    return "exec:" + shlex.join(args)


# --- bad values: exit 2, one line naming the flag, nothing run -------------------------------

# flags -> the error line's start. Every value is checked before either backend runs.
BAD = {
    "threshold nan": (
        "--threshold nan",
        "--threshold must be a finite number >= 0 or 'auto', got nan",
    ),
    "threshold -1": ("--threshold -1", "--threshold must be a finite number >= 0"),
    "threshold word": ("--threshold high", "--threshold 'high': a number, or 'auto'"),
    "cosine above 1": (
        "--metric cosine --threshold 2",
        "--threshold for metric cosine must be a finite number in [-1, 1]",
    ),
    "cosine auto": ("--metric cosine", "--metric cosine needs a threshold"),
    "metric l2": (
        "--metric l2",
        "--metric: 'l2' is not one of rel_l2, max_abs, mean_abs, cosine, sqnr_db",
    ),
    "strategy": ("--strategy fast", "--strategy: 'fast' is not one of auto, scan, bisect"),
    "atol -1": ("--atol -1", "--atol must be a finite number >= 0"),
    "rtol inf": ("--rtol inf", "--rtol must be a finite number >= 0"),
    "atol word": ("--atol tiny", "--atol: 'tiny' is not a number"),
    "noise-k -1": ("--noise-k -1", "--noise-k must be a finite number >= 0"),
    "noise-eps nan": ("--noise-eps nan", "--noise-eps must be a finite number >= 0"),
    "noise-k with fixed threshold": (
        "--noise-k 2 --threshold 1e-3",
        "--noise-k applies to threshold 'auto'",
    ),
    "threshold with atol": (
        "--threshold 0.5 --atol 1e-3",
        "--threshold 0.5 has no effect with atol/rtol",
    ),
    "metric with rtol": (
        "--metric max_abs --rtol 1e-3",
        "--metric max_abs has no effect with atol/rtol",
    ),
    "timeout -5": ("--timeout -5", "--timeout must be a finite number > 0"),
    "timeout 0": ("--timeout 0", "--timeout must be a finite number > 0"),
    "top -3": ("--top -3", "--top: must be an integer >= 0, got -3"),
    "seed -1": ("--seed -1", "--seed must be an integer >= 0, got -1"),
    "seed word": ("--seed one", "--seed: 'one' is not an integer"),
    "max-memory 0": ("--max-memory 0", "--max-memory must be a whole number of bytes >= 1"),
    "max-memory lots": ("--max-memory lots", "--max-memory 'lots' is not a size"),
    "max-memory inf": ("--max-memory 1e999", "--max-memory '1e999' is not a size"),
    "max-memory 1": (
        "--max-memory 1",
        "--max-memory 1 cannot hold the generated inputs (the largest, 'images': 1x3x160x160 "
        "float32), 307200 bytes (300 KiB); give smaller shapes (--shape), or more memory",
    ),
    "max-memory 1000000": (
        "--max-memory 1000000",
        "--max-memory 1000000 cannot hold the largest tensor, '/stem/conv/Conv_output_0' "
        "(204800 bytes), beside a runtime's working set (921600 bytes) and what the diagnosis "
        "keeps (993600 bytes) in float64; give at least 3246400 (3.1MB), or 1710400 with a "
        "fixed threshold (no float64 oracle)",
    ),
    "zero dim": ("--shape images=1x3x0x320", "--shape 'images=1x3x0x320': dims must be >= 1"),
    "negative dim": ("--shape images:[1,3,-1,160]", "--shape 'images:[1,3,-1,160]': dims must"),
    "topk grammar": ("--topk 0:output0", "--topk '0:output0': expected K[:OUTPUT]"),
    "topk output": ("--topk 1:logits", "--topk 1:logits@-1: the model has no output 'logits'"),
    "missing input": ("--input nope.npz", "--input nope.npz: no such file or directory"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_value_is_one_line_naming_the_flag_before_any_run(
    case: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    flags, start = BAD[case]
    monkeypatch.chdir(tmp_path)  # for the relative --input
    ran = tmp_path / "ran"
    backend = marker_backend(ran)
    began = time.perf_counter()
    code, out, err = cli(capsys, str(YOLO), "--ref", backend, "--target", backend, *flags.split())
    elapsed = time.perf_counter() - began
    assert code == 2, out + err
    assert err.splitlines() == [err.rstrip("\n")], err  # exactly one line
    assert err.startswith(f"error: {start}"), err
    assert "Traceback" not in out + err and "Value error" not in err
    assert not ran.exists(), "a backend ran before the options were checked"
    assert elapsed < 5, elapsed


@pytest.mark.parametrize(
    ("args", "start"),
    [
        (["dump", str(YOLO), "-b", "cpu", "-o", "d", "--seed", "-1"], "--seed must be an integer"),
        (["dump", str(YOLO), "-b", "cpu", "-o", "d", "--max-memory", "1"], "--max-memory 1 cannot"),
        (["dump", str(YOLO), "-b", "cpu", "-o", "d", "--shape", "images=0x3x160x160"], "--shape"),
        (["reduce", str(YOLO), "-t", "cpu", "-o", "b", "--threshold", "nan"], "--threshold must"),
        (
            ["reduce", str(YOLO), "-t", "cpu", "-o", "b", "--max-memory", "1"],
            "--max-memory 1 cannot",
        ),
        (["reduce", str(YOLO), "-t", "cpu", "-o", "b", "--timeout", "-1"], "--timeout must"),
        (["reduce", str(YOLO), "-t", "cpu", "-o", "b", "--metric", "l1"], "--metric: 'l1' is not"),
        (["repro", "b", "--threshold", "nan"], "--threshold must be a finite number"),
        (["repro", "b", "--metric", "l2"], "--metric: 'l2' is not one of"),
        (["repro", "b", "--atol", "-1"], "--atol must be a finite number >= 0"),
    ],
)
def test_subcommands_check_values_the_same_way(
    args: list[str],
    start: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.chdir(tmp_path)
    began = time.perf_counter()
    code, out, err = cli(capsys, *args, main=True)
    assert code == 2 and err.startswith(f"error: {start}"), out + err
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert time.perf_counter() - began < 5
    assert not list(tmp_path.iterdir()), "nothing is written for a bad value"


HOST_HAS_CUDA_EP = pytest.mark.skipif(
    "CUDAExecutionProvider" in ort.get_available_providers(),
    reason="this onnxruntime build has CUDAExecutionProvider, so cuda is not missing",
)


@HOST_HAS_CUDA_EP
def test_missing_cuda_names_the_pip_package(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = cli(capsys, str(YOLO), "--target", "cuda")
    assert code == 2 and len(err.splitlines()) == 1
    assert "install the onnxruntime-gpu package in place of onnxruntime" in err


# --- the API: the same rules, in its own names ----------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"threshold": math.nan}, "threshold must be a finite number >= 0 or 'auto', got nan"),
        ({"threshold": "1e-3"}, "threshold must be a number or 'auto', got '1e-3'"),
        ({"seed": -1}, "seed must be an integer >= 0, got -1"),
        ({"seed": 1.5}, "seed must be an integer >= 0, got 1.5"),
        ({"metric": "l2"}, "metric: 'l2' is not one of rel_l2, max_abs, mean_abs, cosine, sqnr_db"),
        ({"max_memory": 0}, "max_memory must be a whole number of bytes >= 1, got 0"),
        ({"timeout": -5.0}, "timeout must be a finite number > 0 or None, got -5.0"),
        ({"always_scan": "yes"}, "always_scan must be True or False, got 'yes'"),
        ({"shapes": {"images": (1, 3, 0, 160)}}, "shapes: 'images' is (1, 3, 0, 160); dims must"),
        ({"topk": ["x"]}, "topk 'x': expected K[:OUTPUT][@AXIS][[START:STOP]]"),
    ],
)
def test_api_errors_name_the_parameter_not_the_flag(
    overrides: dict[str, object], message: str
) -> None:
    with pytest.raises(InputError) as err:
        onnx_bisect.bisect(YOLO, target="cpu", **overrides)  # type: ignore[arg-type]
    assert str(err.value).startswith(message)
    assert err.value.option == next(iter(overrides))
    assert "--" not in str(err.value)
    with pytest.raises(InputError):  # the same rules, from the options object
        BisectOptions(**overrides)  # type: ignore[arg-type]


def test_api_input_and_memory_errors_name_no_flags(tmp_path: Path) -> None:
    target = FaultyBackend(FAULT)
    with pytest.raises(InputError) as err:
        onnx_bisect.bisect(YOLO, target=target, inputs=tmp_path / "nope.npz")
    assert str(err.value) == f"inputs {tmp_path / 'nope.npz'}: no such file or directory"
    with pytest.raises(InputError) as err:
        onnx_bisect.bisect(YOLO, target=target, max_memory=1024)
    assert str(err.value).startswith("max_memory 1024 cannot hold the generated inputs")
    with pytest.raises(InputError) as err:
        onnx_bisect.bisect(YOLO, target=target, max_memory=1_000_000)
    assert str(err.value).startswith("max_memory 1000000 cannot hold the largest tensor")
    with pytest.raises(InputError) as err:
        onnx_bisect.bisect(YOLO, target=target, shapes={"images": (1, 3, 160)})
    assert str(err.value).startswith("shapes images: rank 3 but the model's input has rank 4")
    assert target.runs == 0


def test_api_needs_a_target() -> None:
    with pytest.raises(TypeError, match="target"):
        onnx_bisect.bisect(YOLO)  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        onnx_bisect.bisect(YOLO, "cpu", "cpu")  # type: ignore[misc]


def test_every_flag_named_in_errors_exists() -> None:
    """FLAGS maps API parameters to flags: each is a parameter and a real flag of bisect."""
    fields = set(BisectOptions.__dataclass_fields__)
    opts = {o for p in typer.main.get_command(bisect_app).params for o in p.opts}
    for name, flag in FLAGS.items():
        assert name in fields and flag in opts, (name, flag)


# --- conventions ------------------------------------------------------------------------------


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    assert onnx_bisect.__version__ == importlib.metadata.version("onnx-bisect")
    for main in (False, True):
        code, out, err = cli(capsys, "--version", main=main)
        assert (code, out, err) == (0, f"onnx-bisect {onnx_bisect.__version__}\n", "")


@pytest.mark.parametrize(
    "args", [[], ["run"], ["reduce"], ["repro"], ["dump"], ["backends"]], ids=lambda a: a[:1]
)
def test_h_is_help_everywhere(args: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    short = cli(capsys, *args, "-h", main=True)
    assert short == cli(capsys, *args, "--help", main=True)
    code, out, err = short
    assert code == 0 and "Usage:" in out and err == ""
    if not args:
        assert cli(capsys, "-h") == cli(capsys, "--help")


def test_no_command_prints_help_and_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = cli(capsys, main=True)
    assert code == 2 and "Usage:" in out and "Commands" in out
    assert err == "", "no empty 'error:' line"


@pytest.mark.parametrize(
    "args", [["run"], ["reduce"], ["repro"], ["dump"], ["backends"], []], ids=lambda a: a[:1]
)
def test_help_shows_what_to_type_not_python_types(
    args: list[str], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLUMNS", "200")  # a metavar cut by wrapping would hide a placeholder
    _, out, _ = cli(capsys, *args, "--help", main=True)
    # typer's type column says <str>, <bool>, <list[str]> unless told what to type; <path>
    # (the MODEL and DIR arguments' own column) is a fact about the value, not a type.
    assert set(re.findall(r"<[^<>\s]*>", out)) <= {"<path>"}, out


def test_usage_error_from_the_parser_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = cli(capsys, str(YOLO))
    assert code == 2 and err == (
        "error: --target: missing; name the backend under test, e.g. --target openvino, or "
        "--target 'exec:{python} my_rt.py {model} {inputs} {outputs}' for your own runtime "
        "(onnx-bisect backends lists what works here)\n"
    )


def test_every_missing_parameter_reads_as_the_tools_own_errors(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # typer's own style ("Missing argument 'MODEL'.") is not the tool's: the name first.
    code, _, err = cli(capsys)
    assert code == 2
    said = "error: MODEL: missing; e.g. bisect model.onnx --target openvino (bisect --help)\n"
    assert err == said
    code, _, err = cli(capsys, "repro", main=True)
    assert code == 2 and err == "error: DIR: missing (onnx-bisect repro --help)\n"
    code, _, err = cli(capsys, "dump", str(YOLO), main=True)
    assert code == 2 and err == "error: --backend: missing (onnx-bisect dump --help)\n"


def test_the_parsers_own_errors_read_as_the_tools(capsys: pytest.CaptureFixture[str]) -> None:
    # click's sentences ("No such option: --targte (Possible options: ...)") in the tool's
    # shape: the name first, lower case, no full stop, where to look.
    code, _, err = cli(capsys, str(YOLO), "--targte", "cpu")
    assert code == 2 and err == (
        "error: --targte: no such option; did you mean --state, --strategy, --target? "
        "(bisect --help)\n"
    )
    code, _, err = cli(capsys, "nosuch", main=True)
    assert code == 2 and err == "error: no such command 'nosuch' (onnx-bisect --help)\n"
    code, _, err = cli(capsys, str(YOLO), "--target")
    assert code == 2 and err.startswith("error: --target: needs a value"), err


# --- the subcommands take the main command's options, and they act ----------------------------


def _params(typer_app: typer.Typer, name: str) -> dict[str, typer.core.TyperOption]:
    group = typer.main.get_command(typer_app)
    command = group.commands[name] if hasattr(group, "commands") else group  # type: ignore[attr-defined]
    return {p.name: p for p in command.params if p.name}


@pytest.mark.parametrize("name", ["reduce", "dump", "repro"])
def test_subcommand_options_are_the_main_commands(name: str) -> None:
    main, sub = _params(bisect_app, "bisect"), _params(app, name)
    # Declared apart: --out means another directory; repro's defaults are the bundle's.
    own = {"out", "target", "ref", "metric", "threshold"} if name == "repro" else {"out"}
    shared = set(main) & set(sub) - own
    assert shared, name
    for p in shared:
        assert sub[p].opts == main[p].opts and sub[p].help == main[p].help, p
        assert sub[p].default == main[p].default, p
    wanted = {
        "reduce": {"metric", "atol", "rtol", "target_model", "timeout", "max_memory", "threshold"},
        "repro": {"ref", "metric", "threshold", "target"},
        "dump": {"quiet", "verbose", "max_memory", "seed"},
    }[name]
    assert wanted <= set(sub), wanted - set(sub)


def test_reduce_metric_and_repro_threshold_take_effect(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bundle = tmp_path / "b"
    target = faulty("--fault", f"{FAULT}=0.05")
    code, out, err = cli(
        capsys, "reduce", str(YOLO), "-t", target, "-o", str(bundle),
        "--metric", "max_abs", "--threshold", "1e-3", main=True,
    )  # fmt: skip
    assert code == 1, out + err
    script = (bundle / "repro.py").read_text()
    assert '\nMETRIC = "max_abs"\nTHRESHOLD = 0.001\n' in script
    code, out, _ = cli(capsys, "repro", str(bundle), main=True)
    assert code == 1 and "REPRODUCED" in out and "max_abs > 0.001" in out
    # A threshold no error reaches: the same bundle no longer reproduces.
    code, out, _ = cli(capsys, "repro", str(bundle), "--threshold", "1e9", main=True)
    assert code == 0 and "NOT REPRODUCED" in out and "every output agrees: max_abs <= 1e+09" in out
    # The reduction's own threshold, above the fault's max_abs: nothing to reduce.
    code, out, _ = cli(
        capsys, "reduce", str(YOLO), "-t", target, "-o", str(tmp_path / "c"),
        "--metric", "max_abs", "--threshold", "1", main=True,
    )  # fmt: skip
    assert code == 0 and out.startswith("No divergence")


def test_dump_quiet(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = cli(capsys, "dump", str(YOLO), "-b", "cpu", "-o", str(tmp_path / "d"), "-q",
                         main=True)  # fmt: skip
    assert (code, out, err) == (0, "", "")
    assert (tmp_path / "d" / "manifest.json").is_file()
    code, out, _ = cli(capsys, "dump", str(YOLO), "-b", "cpu", "-o", str(tmp_path / "e"), main=True)
    assert code == 0 and out.startswith("197 tensors from cpu")
