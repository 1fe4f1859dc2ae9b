"""What the commands share: every option's declaration (flag, help, metavar), their defaults
(``BisectOptions()``, so the CLI and the API cannot disagree), the parsing of the values typed
on a command line, and the flag that stands for each API parameter in an error."""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Annotated, TypeVar

import typer

from onnx_bisect import __version__
from onnx_bisect.compare.metrics import METRICS
from onnx_bisect.errors import OnnxBisectError
from onnx_bisect.options import DEFAULT_SAMPLE, PASS_MODES, STRATEGIES, BisectOptions

__all__ = [
    "AllowNonfiniteOpt",
    "AlwaysScanOpt",
    "AtolOpt",
    "BisectPassesOpt",
    "BundleMetricOpt",
    "BundleRefOpt",
    "BundleTargetOpt",
    "BundleThresholdOpt",
    "DEFAULTS",
    "DatasetOpt",
    "DebugOpt",
    "FLAGS",
    "FormatOpt",
    "InputOpt",
    "IsolateCrashesOpt",
    "JobsOpt",
    "MAX_MEMORY_TEXT",
    "MaxMemoryOpt",
    "MetricOpt",
    "ModelArg",
    "NoiseEpsOpt",
    "NoiseKOpt",
    "PassesOpt",
    "QuietOpt",
    "RangeOpt",
    "RayOpt",
    "RefOpt",
    "ReproOpt",
    "RtolOpt",
    "SampleOpt",
    "SeedOpt",
    "ShapeOpt",
    "StrategyOpt",
    "THRESHOLD_TEXT",
    "TargetModelOpt",
    "TargetPrecisionOpt",
    "TargetOpt",
    "ThresholdOpt",
    "TimeoutOpt",
    "TopOpt",
    "UnrollMaxOpt",
    "TopKOpt",
    "QuantGoalOpt",
    "ValueOpt",
    "VerboseOpt",
    "VersionOpt",
    "by_input",
    "for_cli",
    "format_bytes",
    "parse_bytes",
    "parse_range",
    "parse_threshold",
    "parse_value",
]

T = TypeVar("T")

DEFAULTS = BisectOptions()

# The flag of each ``bisect()`` parameter that has one: an error about a parameter's value
# leads with its name (``OnnxBisectError.option``), which the CLI shows as the flag typed.
FLAGS = {
    "inputs": "--input",
    "shapes": "--shape",
    "values": "--value",
    "ranges": "--range",
    "seed": "--seed",
    "allow_nonfinite": "--allow-nonfinite",
    "metric": "--metric",
    "threshold": "--threshold",
    "noise_k": "--noise-k",
    "noise_eps": "--noise-eps",
    "atol": "--atol",
    "rtol": "--rtol",
    "max_memory": "--max-memory",
    "always_scan": "--always-scan",
    "strategy": "--strategy",
    "isolate_crashes": "--isolate-crashes",
    "timeout": "--timeout",
    "target_model": "--target-model",
    "target_precision": "--target-precision",
    "topk": "--topk",
    "quant_goal": "--quant-goal",
    "unroll_max": "--unroll-max",
    "bisect_passes": "--bisect-passes",
    "passes": "--passes",
    "dataset": "--dataset",
    "sample": "--sample",
    "jobs": "--jobs",
    "ray": "--ray",
}


def for_cli(exc: OnnxBisectError) -> str:
    """The error as the command line says it: the parameter it leads with as its flag."""
    text, option = str(exc), exc.option
    if option is None or option not in FLAGS:
        return text
    return FLAGS[option] + text.removeprefix(option)


# --- values typed on the command line --------------------------------------------------------
# typer's parser= functions: a ValueError becomes "--flag: <message>" (cli/app.py), in our
# words rather than the validation library's.


def _integer(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"{text!r} is not an integer") from None


def _real(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"{text!r} is not a number") from None


def _count(text: str) -> int:
    value = _integer(text)
    if value < 0:
        raise ValueError(f"must be an integer >= 0, got {value}")
    return value


def parse_bytes(text: str) -> int:
    """``4GB``, ``512MiB``, ``1e9`` -> bytes; whether the budget is enough is the options'
    check (BisectOptions), and the model's (the largest tensor)."""
    m = re.fullmatch(r"\s*(\d+\.?\d*(?:[eE][+-]?\d+)?|\.\d+)\s*([kKmMgGtT]?)(i?[bB])?\s*", text)
    size = float(m[1]) if m else math.nan
    if not m or not math.isfinite(size):
        raise typer.BadParameter(f"--max-memory {text!r} is not a size; try 4GB or 512MB")
    scale = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}[m[2].lower()]
    return int(size * scale)


def parse_threshold(text: str) -> float | str:
    """A number or ``auto``; which numbers a metric accepts is the options' check."""
    if text.strip().lower() == "auto":
        return "auto"
    try:
        return float(text)
    except ValueError:
        raise typer.BadParameter(f"--threshold {text!r}: a number, or 'auto'") from None


def parse_value(text: str) -> tuple[str, float]:
    """``sr=16000`` -> ("sr", 16000). Integers stay ints, exact for int64 inputs."""
    name, sep, number = text.rpartition("=")
    value = _number(number) if sep and name else None
    if value is None:
        raise typer.BadParameter(f"--value {text!r}: expected NAME=NUMBER, e.g. sr=16000")
    return name, value


# Polygraphy's --val-range form, ``x:[0,1]``, beside ours, ``x=0,1``; the name may hold colons.
_BRACKETED = re.compile(r"(?P<name>.+):\[(?P<body>[^\[\]]*)\]")


def parse_range(text: str) -> tuple[str, tuple[float, float]]:
    """``x=-1,1`` or ``x:[-1,1]`` -> ("x", (-1, 1)); the order of the bounds is the options'
    check (BisectOptions), not this one's."""
    m = _BRACKETED.fullmatch(text.strip())
    name, sep, body = (m["name"], "=", m["body"]) if m else text.rpartition("=")
    bounds = [_number(b) for b in body.split(",")] if sep and name else []
    if len(bounds) != 2 or bounds[0] is None or bounds[1] is None:
        raise typer.BadParameter(
            f"--range {text!r}: expected NAME=LOW,HIGH or NAME:[LOW,HIGH], e.g. x=-1,1"
        )
    return name, (bounds[0], bounds[1])


def _number(text: str) -> float | None:
    text = text.strip()
    if re.fullmatch(r"[+-]?\d+", text):
        return int(text)
    try:
        return float(text)
    except ValueError:
        return None


def by_input(
    flag: str, texts: Sequence[str] | None, parse: Callable[[str], tuple[str, T]]
) -> dict[str, T]:
    """A repeatable per-input option, one entry per input: the same input twice is a mistake
    (which should win is a guess), so it is an error rather than last-wins."""
    found: dict[str, tuple[str, T]] = {}
    for text in texts or []:
        name, value = parse(text)
        if name in found:
            raise typer.BadParameter(
                f"{flag} names input {name!r} twice ({found[name][0]} and {text}); "
                "give each input once"
            )
        found[name] = (text, value)
    return {name: value for name, (_, value) in found.items()}


def format_bytes(n: int) -> str:
    """The inverse of ``parse_bytes`` for whole GB/MB: how a default is shown in --help."""
    for unit, shift in (("GB", 30), ("MB", 20), ("KB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift}{unit}"
    return str(n)


def _show_version(value: bool) -> None:
    if value:
        typer.echo(f"onnx-bisect {__version__}")
        raise typer.Exit(0)


# The defaults as the CLI shows and parses them.
MAX_MEMORY_TEXT = format_bytes(DEFAULTS.max_memory)
THRESHOLD_TEXT = str(DEFAULTS.threshold)

# --- the declarations ------------------------------------------------------------------------
# Every metavar is spelled out: typer's own (<str>, <bool>, <list[str]>) name Python types,
# not what to type. Flags take none.

ModelArg = Annotated[
    Path, typer.Argument(help="The ONNX model.", metavar="MODEL", show_default=False)
]
TargetOpt = Annotated[
    str, typer.Option("--target", "-t", metavar="SPEC", help="Backend under test (spec).")
]
RefOpt = Annotated[str, typer.Option("--ref", "-r", metavar="SPEC", help="Trusted backend (spec).")]
TargetModelOpt = Annotated[
    Path | None,
    typer.Option(
        metavar="MODEL", help="Run this other model on the target (e.g. an optimized copy)."
    ),
]
TargetPrecisionOpt = Annotated[
    str | None,
    typer.Option(
        metavar="float16|bfloat16|tf32|float32",
        help="What the target computes float32 work in, where its spec does not say (an "
        "exec: runtime): it is then judged against the error that precision predicts.",
    ),
]
InputOpt = Annotated[
    Path | None,
    typer.Option("--input", "-i", metavar="PATH", help=".npz, .npy or test-case dir of .pb"),
]
DatasetOpt = Annotated[
    str | None,
    typer.Option(
        metavar="DIR|GLOB|FILE.npz",
        help="Many inputs instead of one: a directory of .npz files or test_data_set_* "
        "folders, a glob (quoted), or one .npz whose arrays are split along their leading axis. "
        "Every input is screened and ranked; the worst --sample are scanned and isolated.",
    ),
]
SampleOpt = Annotated[
    int | None,
    typer.Option(
        parser=_integer,
        metavar="K",
        help=f"With --dataset: the K worst inputs are scanned and isolated (default "
        f"{DEFAULT_SAMPLE}).",
        show_default=False,
    ),
]
JobsOpt = Annotated[
    int,
    typer.Option(
        parser=_integer,
        metavar="N",
        help="With --dataset: run the per-input work in N local processes.",
    ),
]
RayOpt = Annotated[
    str | None,
    typer.Option(
        metavar="ADDRESS|local",
        help="With --dataset: run the per-input work as Ray tasks on the cluster at ADDRESS, "
        "or on one started here with 'local' (needs onnx-bisect\\[ray]).",
    ),
]
ShapeOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--shape",
        "-s",
        metavar="NAME=DIMS",
        help="The shape of generated input NAME, for its dynamic dims: 1x3x640x640, or "
        "Polygraphy's NAME:[1,3,640,640]. Repeat for each input.",
    ),
]
ValueOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--value",
        metavar="NAME=V",
        help="Every element of generated input NAME is V (an integer for integer inputs, 0 "
        "or 1 for bool). Repeat for each input.",
    ),
]
RangeOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--range",
        metavar="NAME=LOW,HIGH",
        help="Generated input NAME is uniform in [LOW, HIGH) for floats, integers in [LOW, "
        "HIGH] (both included) for integer inputs. Repeat for each input.",
    ),
]
AllowNonfiniteOpt = Annotated[
    bool,
    typer.Option(
        metavar="",
        help="Use inputs holding NaN or Inf (generated or given), which are refused otherwise: "
        "they hide divergences.",
    ),
]
SeedOpt = Annotated[
    int, typer.Option(parser=_integer, metavar="N", help="Seed for generated inputs (>= 0).")
]
MetricOpt = Annotated[
    str,
    typer.Option(
        metavar="NAME",
        help=f"Metric that decides divergence: {', '.join(METRICS)}.",
    ),
]
ThresholdOpt = Annotated[
    str,
    typer.Option(
        metavar="X|auto",
        help="Divergence threshold for --metric, or 'auto': k × each tensor's fp32 noise "
        "(measured against a float64 reference) + eps.",
    ),
]
NoiseKOpt = Annotated[
    float,
    typer.Option(
        parser=_real,
        metavar="K",
        help="With --threshold auto: multiplier on each tensor's fp32 noise.",
    ),
]
NoiseEpsOpt = Annotated[
    float,
    typer.Option(
        parser=_real,
        metavar="EPS",
        help="With --threshold auto: added to every threshold (rel_l2).",
    ),
]
AtolOpt = Annotated[
    float | None,
    typer.Option(parser=_real, metavar="X", help="Use allclose semantics with this atol."),
]
RtolOpt = Annotated[
    float | None,
    typer.Option(parser=_real, metavar="X", help="Use allclose semantics with this rtol."),
]
MaxMemoryOpt = Annotated[
    str,
    typer.Option(
        metavar="SIZE",
        help="Memory for tensors across the whole process tree (this tool, in-process "
        "runtimes, exec: runtimes): probe outputs, runtimes' working sets, kept values. "
        "Weights and a fixed overhead (at most 600MB measured) come on top. E.g. 4GB, 256MB.",
    ),
]
StrategyOpt = Annotated[
    str,
    typer.Option(
        metavar="|".join(STRATEGIES),
        help="scan: mark everything; bisect: search over cuts; auto: scan, then bisect if "
        "marking outputs changes the target's result.",
    ),
]
IsolateCrashesOpt = Annotated[
    bool | None,
    typer.Option(
        "--isolate-crashes/--no-isolate-crashes",
        metavar="",
        help="Run the target in a fresh child process per run and the reference in a worker "
        "(default: the target in a long-lived worker process, fresh ones after a crash; a "
        "crash is caught and localized either way). --no-isolate-crashes: the target in this "
        "process, where a crash ends the tool.",
        show_default=False,
    ),
]
TimeoutOpt = Annotated[
    float | None,
    typer.Option(
        parser=_real,
        metavar="SECONDS",
        help="Seconds per target run before it counts as a crash.",
    ),
]
UnrollMaxOpt = Annotated[
    int,
    typer.Option(
        parser=_count,
        metavar="N",
        help="Unroll a Loop or Scan that runs at most N iterations for these inputs, so its "
        "body's nodes are probed and can be named.",
    ),
]
BisectPassesOpt = Annotated[
    str,
    typer.Option(
        metavar="|".join(PASS_MODES),
        help="After a divergence, find which of the target's optimizer passes causes it "
        "(auto: where the target has passes to switch off; on: also say when it has none).",
    ),
]
PassesOpt = Annotated[
    str,
    typer.Option(
        metavar="A,B,C",
        help="An exec: runtime's pass names; its command takes {disable}, replaced by the "
        "passes to turn off.",
    ),
]
AlwaysScanOpt = Annotated[
    bool, typer.Option(metavar="", help="Scan and isolate even when the final outputs agree.")
]
TopKOpt = Annotated[
    list[str] | None,
    typer.Option(
        metavar="K[:OUTPUT]",
        help="Task-level check: top-K label agreement, K[:OUTPUT]\\[@AXIS][[START:STOP]] "
        "(e.g. 5:logits, 1:output0@1[4:]). Repeatable; reported, not a verdict.",
    ),
]
QuantGoalOpt = Annotated[
    float | None,
    typer.Option(
        parser=_real,
        metavar="X",
        help="Quantized --target-model: the keep-in-float search's goal, the worst output "
        "channel's rel_l2 (with --topk: 1 - top-1 agreement) to reach. Default: the few "
        "nodes that recover 80% of the loss quantization causes.",
    ),
]
ReproOpt = Annotated[
    bool,
    typer.Option(
        metavar="", help="With --out and a divergence: write a verified repro bundle to OUT/repro."
    ),
]
FormatOpt = Annotated[
    str,
    typer.Option(
        "--format", "-f", metavar="FORMATS", help="Report formats: md,json,csv,html,png,explorer."
    ),
]
TopOpt = Annotated[
    int,
    typer.Option(parser=_count, metavar="N", help="Rows in the terminal's top table (>= 0)."),
]
QuietOpt = Annotated[bool, typer.Option("--quiet", "-q", metavar="", help="Only the exit code.")]
VerboseOpt = Annotated[
    bool, typer.Option("--verbose", "-v", metavar="", help="Log each phase with its time and runs.")
]
DebugOpt = Annotated[bool, typer.Option(metavar="", help="Show tracebacks for internal errors.")]
# repro: repro.py's own options, whose defaults are what the bundle recorded.
BundleRefOpt = Annotated[
    str | None,
    typer.Option(
        "--ref", "-r", metavar="SPEC", help="Trusted backend (spec); default: the bundle's."
    ),
]
BundleTargetOpt = Annotated[
    str | None,
    typer.Option(
        "--target", "-t", metavar="SPEC", help="Backend under test (spec); default: the bundle's."
    ),
]
BundleMetricOpt = Annotated[
    str | None,
    typer.Option(
        metavar="NAME",
        help=f"Metric that decides divergence: {', '.join(METRICS)}; default: the bundle's.",
    ),
]
BundleThresholdOpt = Annotated[
    float | None,
    typer.Option(
        parser=_real, metavar="X", help="Divergence threshold for --metric; default: the bundle's."
    ),
]
VersionOpt = Annotated[
    bool,
    typer.Option(
        "--version",
        metavar="",
        callback=_show_version,
        is_eager=True,
        expose_value=False,
        help="Show the version and exit.",
    ),
]
