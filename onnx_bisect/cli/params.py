"""What the commands share: option declarations, their defaults (``BisectOptions()``, so the CLI
and the API cannot disagree), and the parsing of sizes, thresholds and choices."""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from enum import Enum
from pathlib import Path
from typing import Annotated, TypeVar

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
    "PassMode",
    "RangeOpt",
    "RefOpt",
    "SeedOpt",
    "ShapeOpt",
    "StrategyName",
    "THRESHOLD_TEXT",
    "TargetOpt",
    "ThresholdOpt",
    "ValueOpt",
    "by_input",
    "format_bytes",
    "parse_bytes",
    "parse_range",
    "parse_threshold",
    "parse_value",
]

T = TypeVar("T")

DEFAULTS = BisectOptions()


MetricName = Enum("MetricName", {m: m for m in METRICS}, type=str)  # type: ignore[misc]


StrategyName = Enum("StrategyName", {s: s for s in STRATEGIES}, type=str)  # type: ignore[misc]


PassMode = Enum("PassMode", {m: m for m in ("auto", "on", "off")}, type=str)  # type: ignore[misc]


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
