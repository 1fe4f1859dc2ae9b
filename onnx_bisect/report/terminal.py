"""The rich terminal summary."""

from __future__ import annotations

from textwrap import indent
from typing import TYPE_CHECKING

from rich.console import Console
from rich.table import Table

from onnx_bisect.report.format import (
    chain_line,
    curve_lines,
    first_divergence_phrase,
    fmt,
    fmt_amp,
    search_line,
)
from onnx_bisect.report.passes import pass_headline

if TYPE_CHECKING:
    from onnx_bisect.result import BisectResult

__all__ = ["print_summary"]

_VERDICT_STYLE = {
    "culprit": "bold red",
    "propagated": "yellow",
    "unsupported": "magenta",
    "failed": "magenta",
    "crashed": "bold magenta",
    "pattern": "bold red",
    "ok": "green",
}


def print_summary(result: BisectResult, console: Console | None = None, top: int = 10) -> None:
    console = console or Console()
    head = f"[bold]{result.target.spec}[/] vs [bold]{result.ref.spec}[/] on {result.model}"
    if result.target_model:
        head += f" (the target runs {result.target_model})"
    if not result.diverged:
        console.print(
            f"[green]No divergence[/]: {head}: all {len(result.outputs)} output(s) pass "
            f"{result.criterion.describe()} ({result.timings.get('total', 0.0):.2f}s)"
        )
        _task_checks(result, console)
        if not result.nodes:
            return
    else:
        console.print(f"[bold red]Diverged[/]: {head}")
    for c in result.outputs:
        if c.diverged:
            console.print(
                f"  output [bold]{c.tensor}[/]: {c.status.value}, "
                f"rel_l2={fmt(c.metrics.get('rel_l2'))} max_abs={fmt(c.metrics.get('max_abs'))}"
            )
    if result.diverged:
        _task_checks(result, console)
    _finding(result, console)
    if result.pass_bisection is not None:
        console.print(f"[bold]Optimizer pass[/]: {pass_headline(result.pass_bisection)}")
    if any(n.accumulated is not None for n in result.nodes):
        table = Table(title=f"Top {top} nodes by accumulated error", show_lines=False)
        key = result.criterion.key
        for col in ("#", "node", "op", "verdict", f"acc {key}", f"iso {key}", "amp"):
            table.add_column(col, overflow="fold")
        for n in result.top(top):
            style = _VERDICT_STYLE.get(n.verdict.value, "")
            table.add_row(
                str(n.index),
                n.name,
                n.op_type,
                f"[{style}]{n.verdict.value}[/]" if style else n.verdict.value,
                fmt(n.accumulated_error),
                fmt(n.isolated_error),
                fmt_amp(n.amplification),
            )
        console.print(table)
    if result.transforms and curve_lines(result):
        # A transform's error is spread over the graph: the curve shows where it grows.
        console.print("[bold]Error curve[/]")
        for line in curve_lines(result):
            console.print(line, markup=False, highlight=False)
    for note in result.notes:
        console.print(f"[dim]note:[/] {note}")
    if result.search is not None:
        console.print(f"[dim]{search_line(result)}[/]")
    if result.repro is not None:
        r = result.repro
        mark = "[green]verified[/]" if r.reproduces else "[yellow]NOT verified[/]"
        console.print(f"[bold]Repro bundle[/] {r.path} ({r.kind}, {mark}): {r.message}")
    if chain_line(result):
        console.print(f"[bold]Amplification chain[/]: {chain_line(result)}")
    runs = ", ".join(f"{k} {v}" for k, v in result.runs.items())
    steps = ", ".join(f"{k} {v:.2f}s" for k, v in result.timings.items())
    console.print(f"[dim]strategy {result.strategy}; runs: {runs}; {steps}[/]")


def _finding(result: BisectResult, console: Console) -> None:
    """The first divergence and the root cause, with the target's own words where it failed."""
    fd = result.first_divergence
    if fd is not None and fd.accumulated is not None:
        m = fd.accumulated.metrics
        console.print(
            f"[bold]First divergence[/]: {fd.op_type} [cyan]{fd.name}[/] (#{fd.index}) "
            f"tensor {fd.tensor}: rel_l2={fmt(m.get('rel_l2'))} max_abs={fmt(m.get('max_abs'))} "
            f"cosine={fmt(m.get('cosine'))}"
        )
    elif fd is not None:
        console.print(
            f"[bold]First divergence[/]: {fd.op_type} [cyan]{fd.name}[/] (#{fd.index}): "
            f"{first_divergence_phrase(fd)}"
        )
    else:
        console.print("[bold]First divergence[/]: none among the probed tensors")
    rc = result.root_cause
    if rc is not None:
        names = ", ".join(rc.nodes) or "—"
        below = "" if result.diverged else ", below the output threshold"
        console.print(
            f"[bold]Root cause[/] ([red]{rc.kind}[/]{below}): [cyan]{names}[/] — {rc.reason}"
        )
        if rc.message:
            console.print("[bold]The target said[/]:")
            console.print(indent(rc.message, "  "), markup=False, highlight=False)


def _task_checks(result: BisectResult, console: Console) -> None:
    for check in result.task_checks:
        style = "green" if check.agrees else "yellow"
        console.print(f"[{style}]task check[/]: {check.summary()}", highlight=False)
