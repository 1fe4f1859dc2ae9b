"""The rich terminal summary: the result's own summary lines, then the table and the details.

Dynamic text (node names, runtime messages, notes) goes in as ``Text``, never as markup, so a
name like ``/layers[attn]/MatMul`` prints as it is. How wide lines may be is the console's
business (``cli.output.stdout``): a terminal's width, or unwrapped for a pipe.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from rich import box
from rich.cells import cell_len
from rich.console import Console, ConsoleOptions, RenderableType, RenderResult
from rich.measure import Measurement
from rich.table import Table
from rich.text import Text

from onnx_bisect.report.format import (
    chain_line,
    curve_lines,
    fmt_amp,
    fmt_error,
    plural,
    search_line,
    stage_runs_line,
)

if TYPE_CHECKING:
    from onnx_bisect.result import BisectResult, NodeResult

__all__ = ["NO_FLOAT64_VALUE", "ORACLE_STAND_IN", "THRESHOLD_FELL_BACK", "print_summary"]

# How engine/diagnose.py's note begins when no float64 oracle ran for ``--threshold auto``.
THRESHOLD_FELL_BACK = "--threshold auto: no float64 values"
# ... when the oracle ran, but some nodes' values are not float64 ones (engine/diagnose.py).
NO_FLOAT64_VALUE = "--threshold auto: no float64 value of"
# How the oracle's note on a node torch did not compute begins (engine/oracle/job.py).
ORACLE_STAND_IN = "float64 oracle: "

# Notes that say what the verdict was judged against: printed next to it, whatever it is.
_JUDGED_BY = (THRESHOLD_FELL_BACK, NO_FLOAT64_VALUE, ORACLE_STAND_IN)

_VERDICT_STYLE = {
    "culprit": "bold red",
    "propagated": "yellow",
    "unsupported": "magenta",
    "failed": "magenta",
    "crashed": "bold magenta",
    "pattern": "bold red",
    "harmless": "dim",
    "ok": "green",
}


def print_summary(result: BisectResult, console: Console | None = None, top: int = 10) -> None:
    console = console or Console()
    console.print(result.summary_text())
    for note in result.notes:
        # The verdict was judged against a fixed threshold, not the noise floor asked for (a
        # small fault can pass it), or some floors came another way: said next to the verdict.
        if note.startswith((THRESHOLD_FELL_BACK, NO_FLOAT64_VALUE)):
            console.print(Text.assemble(("warning:", "bold yellow"), f" {note}"))
        elif note.startswith(ORACLE_STAND_IN):
            console.print(Text.assemble(("note:", "dim"), f" {note}"))
    if not result.diverged and not result.nodes:
        return
    _print_table(result, console, top)
    if result.transforms and curve_lines(result):
        # A transform's error is spread over the graph: the curve shows where it grows.
        console.print("[bold]Error curve[/]")
        for line in curve_lines(result):
            console.print(line, markup=False, highlight=False)
    for note in result.notes:
        if not note.startswith(_JUDGED_BY):
            console.print(Text.assemble(("note:", "dim"), f" {note}"))
    if result.search is not None:
        console.print(Text(search_line(result), style="dim"))
    if result.repro is not None:
        r = result.repro
        mark = ("verified", "green") if r.reproduces else ("NOT verified", "yellow")
        console.print(
            Text.assemble(
                ("Repro bundle", "bold"), f" {r.path} ({r.kind}, ", mark, f"): {r.message}"
            )
        )
    if chain_line(result):
        console.print(Text.assemble(("Amplification chain", "bold"), f": {chain_line(result)}"))
    runs = ", ".join(f"{k} {v}" for k, v in result.runs.items())
    steps = ", ".join(f"{k} {v:.2f}s" for k, v in result.timings.items())
    console.print(Text(f"strategy {result.strategy}; runs: {runs}; {steps}", style="dim"))
    if stage_runs_line(result):
        console.print(Text(stage_runs_line(result), style="dim"))


def _print_table(result: BisectResult, console: Console, top: int) -> None:
    """The ``top`` nodes with the largest accumulated error, worst first. Where the full table
    does not fit (80 columns), a compact one without the op column and the box, so that the
    node names keep room instead of folding into columns a few letters wide."""
    rows = result.top(top)
    if not rows:
        return
    pinned = _pinned(result, rows)
    title = f"Top {plural(len(rows), 'node')} by accumulated error"
    if pinned:
        title += ", and " + " and ".join(dict.fromkeys(what for what, _ in pinned))
    rows += [n for _, n in pinned]
    table = _table(result, rows, title, compact=False)
    # Measured without the console's limit, which a measurement is otherwise clamped to.
    natural = Measurement.get(console, console.options.update_width(1 << 20), table).maximum
    if natural > console.width:
        table = _table(result, rows, title, compact=True)
    console.print(table)


def _pinned(result: BisectResult, rows: list[NodeResult]) -> list[tuple[str, NodeResult]]:
    """The first divergence and the root cause's nodes that the top rows leave out, each with
    what it is: the table must show where the error starts and what causes it, however many
    nodes the error grows larger in downstream (ten ``propagated`` rows can hide the culprit)."""
    by_name = {n.name: n for n in result.nodes}
    roles: dict[str, list[str]] = {}
    fd = result.first_divergence
    if fd is not None and fd.name in by_name:
        roles.setdefault(fd.name, []).append("first divergence")
    rc = result.root_cause
    for name in rc.nodes[:_MOST_PINNED] if rc is not None else ():
        if name in by_name:
            roles.setdefault(name, []).append("root cause")
    shown = {n.name for n in rows}
    return [
        ("the " + " and ".join(what), by_name[name])
        for name, what in roles.items()
        if name not in shown
    ]


# A pattern's window can hold many nodes: its first few are pinned, the rest are in nodes.csv.
_MOST_PINNED = 3


def _table(result: BisectResult, rows: list[NodeResult], title: str, *, compact: bool) -> Table:
    if compact:
        table = Table(title=title, box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True)
    else:
        table = Table(title=title)
    key = result.criterion.key
    columns = ["#", "node", "verdict", f"acc {key}", f"iso {key}", "amp"]
    if not compact:
        columns.insert(2, "op")
    for col in columns:
        # Only names break: a number or a verdict broken over two lines misreads.
        table.add_column(col, overflow="fold", no_wrap=col not in ("node", "op"))
    for n in rows:
        cells: list[RenderableType] = [
            str(n.index),
            _NodeName(n.name),
            n.op_type,
            Text(n.verdict.value, style=_VERDICT_STYLE.get(n.verdict.value, "")),
            fmt_error(n.accumulated, key),
            fmt_error(n.isolated, key),
            fmt_amp(n.amplification),
        ]
        table.add_row(*(cells[:2] + cells[3:] if compact else cells))
    return table


# Where a node name may break: after a "/", or, within a piece wider than the column, after
# any separator.
_PATH_PIECES = re.compile(r"[^/]*/+|[^/]+")
_PIECES = re.compile(r"[^/._:]*[/._:]+|[^/._:]+")


class _NodeName:
    """A node name in a table cell: where the column is narrower than the name it breaks
    after a separator (``/`` first, then ``.``, ``_``, ``:``), never inside a word, so that
    ``/c2f1/m.0/cv2/bn/BatchNormalization`` does not read ``BatchNormali`` / ``zation``. Only a
    word wider than the whole column still folds, as nothing else fits."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __rich_measure__(self, console: Console, options: ConsoleOptions) -> Measurement:
        words = _PIECES.findall(self.name) or [""]
        return Measurement(max(cell_len(w) for w in words), cell_len(self.name))

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        width = options.max_width
        lines = [""]
        for path_piece in _PATH_PIECES.findall(self.name):
            fits = cell_len(path_piece) <= width
            for piece in [path_piece] if fits else _PIECES.findall(path_piece):
                if lines[-1] and cell_len(lines[-1] + piece) > width:
                    lines.append("")
                lines[-1] += piece
        yield Text("\n".join(lines), overflow="fold")
