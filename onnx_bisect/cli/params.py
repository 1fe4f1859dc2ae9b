"""What the commands share: option declarations, their defaults (``BisectOptions()``, so the CLI
and the API cannot disagree), and the parsing of sizes, thresholds and choices."""

from __future__ import annotations

import re
from enum import Enum
from pathlib import Path
from typing import Annotated

import typer

from onnx_bisect.compare.metrics import METRICS
from onnx_bisect.options import STRATEGIES, BisectOptions

__all__ = [
    "DEFAULTS",
    "DebugOpt",
    "InputOpt",
    "MAX_MEMORY_TEXT",
    "MaxMemoryOpt",
    "MetricName",
    "ModelArg",
    "RefOpt",
    "SeedOpt",
    "ShapeOpt",
    "StrategyName",
    "THRESHOLD_TEXT",
    "TargetOpt",
    "ThresholdOpt",
    "format_bytes",
    "parse_bytes",
    "parse_threshold",
]

DEFAULTS = BisectOptions()


MetricName = Enum("MetricName", {m: m for m in METRICS}, type=str)  # type: ignore[misc]


StrategyName = Enum("StrategyName", {s: s for s in STRATEGIES}, type=str)  # type: ignore[misc]


def parse_bytes(text: str) -> int:
    """``4GB``, ``512MiB``, ``1e9`` -> bytes."""
    m = re.fullmatch(r"\s*([\d.eE+]+)\s*([kKmMgGtT]?)(i?[bB])?\s*", text)
    if not m:
        raise typer.BadParameter(f"{text!r} is not a size; try 4GB or 512MB")
    scale = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}[m[2].lower()]
    return int(float(m[1]) * scale)


def parse_threshold(text: str) -> float | str:
    if text.strip().lower() == "auto":
        return "auto"
    try:
        return float(text)
    except ValueError:
        raise typer.BadParameter(f"--threshold {text!r}: a number, or 'auto'") from None


def format_bytes(n: int) -> str:
    """The inverse of ``parse_bytes`` for whole GB/MB: how a default is shown in --help."""
    for unit, shift in (("GB", 30), ("MB", 20), ("KB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift}{unit}"
    return str(n)


# The defaults as the CLI shows and parses them.
MAX_MEMORY_TEXT = format_bytes(DEFAULTS.max_memory)
THRESHOLD_TEXT = str(DEFAULTS.threshold)

ModelArg = Annotated[
    Path, typer.Argument(help="The ONNX model.", metavar="MODEL", show_default=False)
]
TargetOpt = Annotated[str, typer.Option("--target", "-t", help="Backend under test (spec).")]
RefOpt = Annotated[str, typer.Option("--ref", "-r", help="Trusted backend (spec).")]
InputOpt = Annotated[
    Path | None, typer.Option("--input", "-i", help=".npz, .npy or test-case dir of .pb")
]
ShapeOpt = Annotated[
    list[str] | None,
    typer.Option("--shape", "-s", help="NAME=1x3x640x640; fixes dynamic dims. Repeatable."),
]
SeedOpt = Annotated[int, typer.Option(help="Seed for generated inputs.")]
ThresholdOpt = Annotated[
    str,
    typer.Option(
        help="Divergence threshold for --metric, or 'auto': k × each tensor's fp32 noise "
        "(measured against a float64 reference) + eps."
    ),
]
MaxMemoryOpt = Annotated[
    str, typer.Option(help="Most probe output bytes one run may hold, e.g. 4GB, 256MB.")
]
DebugOpt = Annotated[bool, typer.Option(help="Show tracebacks for internal errors.")]
