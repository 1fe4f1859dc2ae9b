"""The error curve drawn by matplotlib: inline SVG for report.html, PNG for error_curve.png.

matplotlib is an optional extra (``onnx-bisect[plots]``): it is imported inside the functions
that draw, and without it they return None and the caller says how to get it. The figure is a
bare ``matplotlib.figure.Figure`` (no pyplot): nothing registers it in a global figure manager
or switches the process's backend, and ``rc_context`` restores every setting it changes.
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from onnx_bisect.report.curve import error_curve

if TYPE_CHECKING:
    from onnx_bisect.result import BisectResult, NodeResult

__all__ = ["PLOTS_HINT", "curve_png", "curve_svg", "plots_available"]

PLOTS_HINT = "pip install 'onnx-bisect[plots]'"


@dataclass(frozen=True)
class _Series:
    """The numbers the curve shows, per node in topological order."""

    accumulated: tuple[tuple[int, float, bool], ...]  # index, rel_l2, diverged
    isolated: tuple[tuple[int, float], ...]
    threshold: tuple[tuple[int, float], ...]  # only when rel_l2 is the deciding number
    noise: tuple[tuple[int, float], ...]
    marks: tuple[tuple[int, str, str], ...]  # index, label, colour
    # A lower-precision target: the error its precision predicts (accumulated floor).
    floor: tuple[tuple[int, float], ...] = ()


def plots_available() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def curve_svg(result: BisectResult) -> str | None:
    """The curve as an ``<svg>`` element to inline in HTML; None without matplotlib or data."""
    data = _render(result, "svg")
    if data is None:
        return None
    text = data.decode("utf-8")
    # The XML prolog and DOCTYPE belong to a standalone file, not to an element in a page.
    return text[text.index("<svg") :] if "<svg" in text else None


def curve_png(result: BisectResult) -> bytes | None:
    """The curve as a PNG image; None without matplotlib or data."""
    return _render(result, "png")


def _render(result: BisectResult, fmt_name: str) -> bytes | None:
    series = _series(result)
    if not series.accumulated or not plots_available():
        return None
    from matplotlib import rc_context

    # Text stays text in the SVG (smaller, selectable, the page's font); a fixed hash salt
    # keeps the element ids, hence the file, the same from run to run.
    with rc_context({"svg.fonttype": "none", "svg.hashsalt": "onnx-bisect", "font.size": 9.0}):
        fig = _figure(result, series)
        buf = io.BytesIO()
        # No date (the same run gives the same bytes) and, in the SVG, no RDF block naming
        # URLs: the page has no address in it that is not its own.
        meta: dict[str, Any] = (
            {"Date": None, "Creator": None, "Format": None, "Type": None}
            if fmt_name == "svg"
            else {"Software": None}
        )
        fig.savefig(buf, format=fmt_name, dpi=150, metadata=meta)
    return buf.getvalue()


def _series(result: BisectResult) -> _Series:
    nodes = result.nodes
    by_name = {n.name: n for n in nodes}
    points = error_curve(nodes, segments=max(1, len(nodes)))  # one point per scored node
    diverged = {n.index: n.diverged for n in nodes}
    accumulated = tuple((p.first, p.error, diverged[p.first]) for p in points)
    isolated = tuple((n.index, e) for n in nodes if (e := _iso_rel_l2(n)) is not None)
    threshold: tuple[tuple[int, float], ...] = ()
    noise: tuple[tuple[int, float], ...] = ()
    if result.criterion.key == "rel_l2":
        threshold = tuple(
            (n.index, float(n.accumulated.threshold))
            for n in nodes
            if n.accumulated is not None and n.accumulated.threshold is not None
        )
        noise = tuple(
            (n.index, float(n.accumulated.noise))
            for n in nodes
            if n.accumulated is not None and n.accumulated.noise is not None
        )
    marks: list[tuple[int, str, str]] = []
    if result.first_divergence is not None:
        marks.append((result.first_divergence.index, "first divergence", "#d62728"))
    rc = result.root_cause
    for name in rc.nodes if rc is not None else ():
        if name in by_name:
            marks.append((by_name[name].index, f"root cause ({rc.kind})", "#7b1fa2"))  # type: ignore[union-attr]
    floor = tuple(
        (n.index, float(n.accumulated.precision_floor))
        for n in nodes
        if n.accumulated is not None and n.accumulated.precision_floor is not None
    )
    return _Series(accumulated, isolated, threshold, noise, tuple(marks), floor)


def _iso_rel_l2(n: NodeResult) -> float | None:
    value = n.isolated.metrics.get("rel_l2") if n.isolated is not None else None
    return None if value is None or not math.isfinite(value) else float(value)


def _xy(points: list[tuple[int, float]]) -> tuple[list[int], list[float]]:
    return [x for x, _ in points], [y for _, y in points]


def _figure(result: BisectResult, s: _Series) -> Any:
    from matplotlib.figure import Figure

    finite = [e for _, e, _ in s.accumulated] + [e for _, e in s.isolated]
    finite += [t for _, t in s.threshold] + [t for _, t in s.noise] + [f for _, f in s.floor]
    finite = [v for v in finite if v > 0 and math.isfinite(v)]
    top = max(finite, default=1.0) * 10

    def shown(v: float) -> float:
        """Exact zeros cannot sit on a log axis: they leave a gap. Infinities sit at the top."""
        return math.nan if v <= 0 else top if math.isinf(v) else v

    fig = Figure(figsize=(10, 4.2), layout="constrained")
    ax = fig.add_subplot()
    ax.set_yscale("log")
    xs = [i for i, _, _ in s.accumulated]
    ax.plot(
        xs,
        [shown(e) for _, e, _ in s.accumulated],
        color="#1f77b4",
        lw=1.1,
        label="accumulated (full run)",
    )
    bad = [(i, shown(e)) for i, e, d in s.accumulated if d and e > 0]
    if bad:
        ax.scatter(*_xy(bad), s=7, color="#d62728", zorder=3, label="diverged")
    iso = [(i, shown(e)) for i, e in s.isolated if e > 0]
    if iso:
        ax.scatter(
            *_xy(iso),
            s=12,
            marker="x",
            color="#ff7f0e",
            lw=0.9,
            zorder=3,
            label="isolated (fed the reference's inputs)",
        )
    steps = [
        (s.threshold, "#444", 0.9, "--",
         "threshold (k × noise + eps)" if result.criterion.auto else "threshold"),
        (s.noise, "#999", 0.8, ":", "fp32 noise floor"),
    ]  # fmt: skip
    if result.criterion.floors is not None:
        name = result.criterion.floors.precision.value
        steps.append((s.floor, "#2a7ab0", 0.9, "-.", f"{name} precision floor"))
    for points, colour, width, style, label in steps:
        if points:
            xs, ys = _xy(list(points))
            ax.step(xs, [shown(y) for y in ys], where="mid", color=colour, lw=width, ls=style,
                    label=label)  # fmt: skip
    seen: set[str] = set()
    for index, label, colour in s.marks:
        style = "-." if label.startswith("root") else "--"
        ax.axvline(index, color=colour, lw=1.2, ls=style, label=None if label in seen else label)
        seen.add(label)
    ax.set_xlabel("node, in topological order")
    ax.set_ylabel("rel_l2 (log scale)")
    ax.set_title("Error per node (an exact zero leaves a gap)", fontsize=9)
    ax.grid(True, which="major", color="#e4e4e4", lw=0.5)
    pad = max(1.0, 0.01 * (max(xs) - min(xs)))  # a mark at the first node clears the axis
    ax.set_xlim(min(xs) - pad, max(xs) + pad)
    fig.legend(loc="outside lower center", ncols=4, fontsize=7.5, frameon=False)
    return fig
