"""Words and numbers for people: the formatting every layer that writes prose shares.

It sits below everything (no imports from the package), so the result's own summary, the
engine's log lines and the reports count and round the same way.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

__all__ = ["fmt", "fmt_amp", "plural", "runs_text"]


def fmt(x: float | None) -> str:
    """A metric value in at most ~10 characters: 4 significant digits, or scientific."""
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "—"
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    if x == 0:
        return "0"
    if 1e-3 <= abs(x) < 1e4:
        return f"{x:.4g}"
    return f"{x:.3e}"


def fmt_amp(x: float | None) -> str:
    return "—" if x is None else f"×{fmt(x)}"


def plural(n: int, noun: str, many: str = "") -> str:
    """``1 run``, ``0 runs``, ``2 runs``; ``many`` for a plural that is not noun + s
    (``plural(n, "match", "matches")``)."""
    return f"{n} {noun if n == 1 else many or noun + 's'}"


def runs_text(runs: Mapping[str, int]) -> str:
    """``ref 1 run, target 2 runs`` per backend role, in name order (float64, ref, target:
    the order in which threads finish varies); ``no runs`` when there were none."""
    counted = [f"{role} {plural(n, 'run')}" for role, n in sorted(runs.items()) if n]
    return ", ".join(counted) or "no runs"
