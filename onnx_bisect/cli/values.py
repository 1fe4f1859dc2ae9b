"""Values typed on a command line, parsed: sizes, thresholds, per-input NAME=VALUE options.

typer's ``parser=`` functions: a ValueError becomes ``--flag: <message>`` (cli/app.py), in our
words rather than the validation library's.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from typing import TypeVar

import typer

__all__ = [
    "by_input",
    "format_bytes",
    "parse_bytes",
    "parse_count",
    "parse_int",
    "parse_real",
    "parse_range",
    "parse_threshold",
    "parse_value",
]

T = TypeVar("T")


def parse_int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"{text!r} is not an integer") from None


def parse_real(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"{text!r} is not a number") from None


def parse_count(text: str) -> int:
    value = parse_int(text)
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
