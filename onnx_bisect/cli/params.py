"""What the commands share: every option's declaration (flag, help, metavar), their defaults
(``BisectOptions()``, so the CLI and the API cannot disagree), the parsing of the values typed
on a command line, and the flag that stands for each API parameter in an error."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, TypeVar

import typer

from onnx_bisect import __version__
from onnx_bisect.cli.values import (
    by_input,
    format_bytes,
    parse_bytes,
    parse_count,
    parse_int,
    parse_range,
    parse_real,
    parse_threshold,
    parse_value,
)
from onnx_bisect.compare.metrics import METRICS
from onnx_bisect.errors import OnnxBisectError
from onnx_bisect.options import DEFAULT_SAMPLE, PASS_MODES, STRATEGIES, BisectOptions

__all__ = [
    "AllowNonfiniteOpt",
    "AlwaysScanOpt",
    "AtolOpt",
    "ChunksOpt",
    "FreeRunOpt",
    "StateOpt",
    "StepsOpt",
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
    "COMPARE",
    "INPUTS",
    "JUDGEMENT",
    "OUTPUTS",
    "PANELS",
    "RESOURCES",
    "SEARCH",
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
    "CalibrationOpt",
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
    "calibration": "--calibration",
    "unroll_max": "--unroll-max",
    "bisect_passes": "--bisect-passes",
    "passes": "--passes",
    "dataset": "--dataset",
    "sample": "--sample",
    "jobs": "--jobs",
    "ray": "--ray",
    "steps": "--steps",
    "state": "--state",
    "chunks": "--chunks",
    "free_run": "--free-run",
}


def for_cli(exc: OnnxBisectError) -> str:
    """The error as the command line says it: the parameter it leads with as its flag."""
    text, option = str(exc), exc.option
    if option is None or option not in FLAGS:
        return text
    return FLAGS[option] + text.removeprefix(option)


def _show_version(value: bool) -> None:
    if value:
        typer.echo(f"onnx-bisect {__version__}")
        raise typer.Exit(0)


# The defaults as the CLI shows and parses them.
MAX_MEMORY_TEXT = format_bytes(DEFAULTS.max_memory)
THRESHOLD_TEXT = str(DEFAULTS.threshold)

# --- the declarations ------------------------------------------------------------------------
# --help's panels, in this order (cli/helptext.py): each declaration names its own, so every
# command that shares an option shows it in the same panel.
COMPARE = "What to compare"
INPUTS = "Inputs"
JUDGEMENT = "Judgement"
SEARCH = "Search"
OUTPUTS = "Outputs"
RESOURCES = "Resources"
PANELS = (COMPARE, INPUTS, JUDGEMENT, SEARCH, OUTPUTS, RESOURCES)

# Every metavar is spelled out: typer's own (<str>, <bool>, <list[str]>) name Python types,
# not what to type. Flags take none.

ModelArg = Annotated[
    Path,
    typer.Argument(
        help="The ONNX model.", metavar="MODEL", show_default=False, rich_help_panel=COMPARE
    ),
]
TargetOpt = Annotated[
    str,
    typer.Option(
        "--target",
        "-t",
        metavar="SPEC",
        help="Under test: e.g. openvino, 'openvino?precision=f32', "
        "'torch:cpu?dtype=bfloat16', 'exec:{python} rt.py {model} {inputs} {outputs}', "
        "pytorch:F.py:FACTORY. `onnx-bisect backends` lists those that work here.",
        rich_help_panel=COMPARE,
    ),
]
RefOpt = Annotated[
    str,
    typer.Option(
        "--ref",
        "-r",
        metavar="SPEC",
        help="The trusted backend (a spec, as --target), or pytorch:FILE.py:FACTORY.",
        rich_help_panel=COMPARE,
    ),
]
TargetModelOpt = Annotated[
    Path | None,
    typer.Option(
        metavar="MODEL",
        help="Another model to run on the target: an optimized or quantized copy.",
        rich_help_panel=COMPARE,
    ),
]
TargetPrecisionOpt = Annotated[
    str | None,
    typer.Option(
        metavar="float16|bfloat16|tf32|float32",
        help="What an exec: target computes float32 work in; it is judged against the "
        "error that precision predicts.",
        rich_help_panel=COMPARE,
    ),
]
InputOpt = Annotated[
    Path | None,
    typer.Option(
        "--input",
        "-i",
        metavar="PATH",
        help="The inputs: .npz, .npy, or an ONNX test-case folder of .pb files.",
        rich_help_panel=INPUTS,
    ),
]
DatasetOpt = Annotated[
    str | None,
    typer.Option(
        metavar="DIR|GLOB|FILE.npz",
        help="Many inputs: a folder (.npz files, test_data_set_*), a quoted glob, or one .npz "
        "split along axis 0.",
        rich_help_panel=INPUTS,
    ),
]
SampleOpt = Annotated[
    int | None,
    typer.Option(
        parser=parse_int,
        metavar="K",
        help=f"With --dataset: how many of the worst inputs to search (default {DEFAULT_SAMPLE}).",
        show_default=False,
        rich_help_panel=INPUTS,
    ),
]
JobsOpt = Annotated[
    int,
    typer.Option(
        parser=parse_int,
        metavar="N",
        help="With --dataset: N worker processes.",
        rich_help_panel=RESOURCES,
    ),
]
RayOpt = Annotated[
    str | None,
    typer.Option(
        metavar="ADDRESS|local",
        help="With --dataset: Ray tasks at ADDRESS, or 'local' (needs onnx-bisect\\[ray]).",
        rich_help_panel=RESOURCES,
    ),
]
StepsOpt = Annotated[
    int | None,
    typer.Option(
        parser=parse_int,
        metavar="N",
        help="Run N steps in lockstep; diagnose the first that diverges (docs/steps.md).",
        show_default=False,
        rich_help_panel=INPUTS,
    ),
]
StateOpt = Annotated[
    list[str] | None,
    typer.Option(
        metavar="OUT=IN",
        help="With --steps: OUT feeds IN next step; * globs.",
        show_default=False,
        rich_help_panel=INPUTS,
    ),
]
ChunksOpt = Annotated[
    Path | None,
    typer.Option(
        metavar="FILE.npz",
        help="With --steps: step k gets array\\[k] of each.",
        show_default=False,
        rich_help_panel=INPUTS,
    ),
]
FreeRunOpt = Annotated[
    bool,
    typer.Option(
        "--free-run",
        metavar="",
        help="With --steps: also let each side feed itself.",
        rich_help_panel=INPUTS,
    ),
]
ShapeOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--shape",
        "-s",
        metavar="NAME=DIMS",
        help="A generated input's shape: images=1x3x640x640 or images:[1,3,640,640]. "
        "Repeat per input.",
        rich_help_panel=INPUTS,
    ),
]
ValueOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--value",
        metavar="NAME=V",
        help="Fill generated input NAME with V (e.g. sr=16000). Repeat per input.",
        rich_help_panel=INPUTS,
    ),
]
RangeOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--range",
        metavar="NAME=LOW,HIGH",
        help="Draw generated input NAME from [LOW, HIGH) (integers: [LOW, HIGH]). "
        "Repeat per input.",
        rich_help_panel=INPUTS,
    ),
]
AllowNonfiniteOpt = Annotated[
    bool,
    typer.Option(
        metavar="",
        help="Accept inputs holding NaN or Inf (refused otherwise: they hide divergences).",
        rich_help_panel=INPUTS,
    ),
]
SeedOpt = Annotated[
    int,
    typer.Option(
        parser=parse_int,
        metavar="N",
        help="Seed for generated inputs (>= 0).",
        rich_help_panel=INPUTS,
    ),
]
MetricOpt = Annotated[
    str,
    typer.Option(
        metavar="NAME",
        help=f"Metric that decides divergence: {', '.join(METRICS)}.",
        rich_help_panel=JUDGEMENT,
    ),
]
ThresholdOpt = Annotated[
    str,
    typer.Option(
        metavar="X|auto",
        help="A tensor diverges past this: a number for --metric, or auto: k × the "
        "tensor's own fp32 noise (against float64) + eps.",
        rich_help_panel=JUDGEMENT,
    ),
]
NoiseKOpt = Annotated[
    float,
    typer.Option(
        parser=parse_real,
        metavar="K",
        help="With --threshold auto: k, the multiplier on fp32 noise.",
        rich_help_panel=JUDGEMENT,
    ),
]
NoiseEpsOpt = Annotated[
    float,
    typer.Option(
        parser=parse_real,
        metavar="EPS",
        help="With --threshold auto: eps, added to every threshold.",
        rich_help_panel=JUDGEMENT,
    ),
]
AtolOpt = Annotated[
    float | None,
    typer.Option(
        parser=parse_real,
        metavar="X",
        help="Judge as allclose, with this atol.",
        rich_help_panel=JUDGEMENT,
    ),
]
RtolOpt = Annotated[
    float | None,
    typer.Option(
        parser=parse_real,
        metavar="X",
        help="Judge as allclose, with this rtol.",
        rich_help_panel=JUDGEMENT,
    ),
]
MaxMemoryOpt = Annotated[
    str,
    typer.Option(
        metavar="SIZE",
        help="Memory for tensors in every process of the run, e.g. 4GB; weights and about "
        "600MB come on top.",
        rich_help_panel=RESOURCES,
    ),
]
StrategyOpt = Annotated[
    str,
    typer.Option(
        metavar="|".join(STRATEGIES),
        help="scan marks every tensor; bisect searches cuts, keeping fusions; auto scans, "
        "then bisects if marking changes the target's result.",
        rich_help_panel=SEARCH,
    ),
]
IsolateCrashesOpt = Annotated[
    bool | None,
    typer.Option(
        "--isolate-crashes/--no-isolate-crashes",
        metavar="",
        help="A fresh process per target run, the reference in a worker (default: one "
        "worker; --no-: all here).",
        show_default=False,
        rich_help_panel=RESOURCES,
    ),
]
TimeoutOpt = Annotated[
    float | None,
    typer.Option(
        parser=parse_real,
        metavar="SECONDS",
        help="A target run past this many seconds is a hang.",
        rich_help_panel=RESOURCES,
    ),
]
UnrollMaxOpt = Annotated[
    int,
    typer.Option(
        parser=parse_count,
        metavar="N",
        help="Unroll a Loop or Scan of at most N iterations, so its body's nodes are probed.",
        rich_help_panel=SEARCH,
    ),
]
BisectPassesOpt = Annotated[
    str,
    typer.Option(
        metavar="|".join(PASS_MODES),
        help="After a divergence, find which of the target's optimizer passes causes it.",
        rich_help_panel=SEARCH,
    ),
]
PassesOpt = Annotated[
    str,
    typer.Option(
        metavar="A,B,C",
        help="An exec: runtime's pass names, for {disable} in its command.",
        rich_help_panel=SEARCH,
    ),
]
AlwaysScanOpt = Annotated[
    bool,
    typer.Option(
        metavar="",
        help="Search even when the final outputs agree.",
        rich_help_panel=SEARCH,
    ),
]
TopKOpt = Annotated[
    list[str] | None,
    typer.Option(
        metavar="K[:OUTPUT]",
        help="Also report top-K label agreement: K[:OUTPUT]\\[@AXIS][[START:STOP]], e.g. "
        "5:logits. Repeatable.",
        rich_help_panel=JUDGEMENT,
    ),
]
QuantGoalOpt = Annotated[
    str | None,
    typer.Option(
        metavar="GOAL",
        help="The keep-in-float(32) set's goal on every input: X (worst rel_l2), "
        "top1[:OUT]\\[@last]>=P or rel_l2[:OUT]\\[@last]<=X (default: 80% of int8's loss "
        "back; fp16's prediction).",
        rich_help_panel=JUDGEMENT,
    ),
]
CalibrationOpt = Annotated[
    str | None,
    typer.Option(
        metavar="DIR|FILE.npz",
        help="Quantized --target-model: inputs to quantize it again with (the check of the "
        "keep-in-float set).",
        rich_help_panel=JUDGEMENT,
    ),
]
ReproOpt = Annotated[
    bool,
    typer.Option(
        metavar="",
        help="With --out: write a verified repro bundle to OUT/repro.",
        rich_help_panel=OUTPUTS,
    ),
]
FormatOpt = Annotated[
    str,
    typer.Option(
        "--format",
        "-f",
        metavar="FORMATS",
        help="Report formats: md,json,csv,html,png,explorer.",
        rich_help_panel=OUTPUTS,
    ),
]
TopOpt = Annotated[
    int,
    typer.Option(
        parser=parse_count,
        metavar="N",
        help="Rows in the terminal's top table.",
        rich_help_panel=OUTPUTS,
    ),
]
QuietOpt = Annotated[
    bool,
    typer.Option("--quiet", "-q", metavar="", help="Only the exit code.", rich_help_panel=OUTPUTS),
]
VerboseOpt = Annotated[
    bool,
    typer.Option(
        "--verbose",
        "-v",
        metavar="",
        help="Log each phase with its time and runs.",
        rich_help_panel=OUTPUTS,
    ),
]
DebugOpt = Annotated[
    bool,
    typer.Option(metavar="", help="Show tracebacks for internal errors.", rich_help_panel=OUTPUTS),
]
# repro: repro.py's own options, whose defaults are what the bundle recorded.
BundleRefOpt = Annotated[
    str | None,
    typer.Option(
        "--ref",
        "-r",
        metavar="SPEC",
        help="Trusted backend (spec); default: the bundle's.",
        rich_help_panel=COMPARE,
    ),
]
BundleTargetOpt = Annotated[
    str | None,
    typer.Option(
        "--target",
        "-t",
        metavar="SPEC",
        help="Backend under test (spec); default: the bundle's.",
        rich_help_panel=COMPARE,
    ),
]
BundleMetricOpt = Annotated[
    str | None,
    typer.Option(
        metavar="NAME",
        help=f"Metric that decides divergence: {', '.join(METRICS)}; default: the bundle's.",
        rich_help_panel=JUDGEMENT,
    ),
]
BundleThresholdOpt = Annotated[
    float | None,
    typer.Option(
        parser=parse_real,
        metavar="X",
        help="Divergence threshold for --metric; default: the bundle's.",
        rich_help_panel=JUDGEMENT,
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
        rich_help_panel=OUTPUTS,
    ),
]
