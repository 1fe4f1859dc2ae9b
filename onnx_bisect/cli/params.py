"""Option parsing shared by the commands: sizes, thresholds, choices."""

from __future__ import annotations

import re
from enum import Enum

import typer

from onnx_bisect.compare.metrics import METRICS
from onnx_bisect.options import STRATEGIES

__all__ = ["MetricName", "StrategyName", "parse_bytes", "parse_threshold"]


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
