"""The commands: ``bisect``/``run``, ``reduce``, ``repro``, ``dump``, ``backends``."""

from __future__ import annotations

import shlex
import sys
from enum import Enum
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from onnx_bisect.api import bisect as run_bisect
from onnx_bisect.backends.registry import adapters
from onnx_bisect.backends.spec import ALIASES
from onnx_bisect.cli.output import EXIT_DIVERGED, EXIT_MATCH, fail, stdout, user_errors
from onnx_bisect.cli.params import (
    DEFAULTS,
    MAX_MEMORY_TEXT,
    THRESHOLD_TEXT,
    DebugOpt,
    InputOpt,
    MaxMemoryOpt,
    MetricName,
    ModelArg,
    RangeOpt,
    RefOpt,
    SeedOpt,
    ShapeOpt,
    StrategyName,
    TargetOpt,
    ThresholdOpt,
    ValueOpt,
    by_input,
    parse_bytes,
    parse_range,
    parse_threshold,
    parse_value,
)
from onnx_bisect.cli.progress import configure_logging, live_progress
from onnx_bisect.inputs.feeds import parse_shape
from onnx_bisect.report.files import check_formats, write_reports
from onnx_bisect.repro.verify import run_bundle
from onnx_bisect.text import plural

__all__ = ["backends_command", "dump_command", "reduce_command", "repro_command", "run_command"]


def run_command(
    model: ModelArg,
    target: TargetOpt,
    ref: RefOpt = "cpu",
    target_model: Annotated[
        Path | None,
        typer.Option(help="Run this other model on the target (e.g. an optimized copy)."),
    ] = None,
    input: InputOpt = None,
    shape: ShapeOpt = None,
    value: ValueOpt = None,
    range_: RangeOpt = None,
    seed: SeedOpt = DEFAULTS.seed,
    metric: Annotated[
        MetricName, typer.Option(help="Metric that decides divergence.")
    ] = DEFAULTS.metric,  # type: ignore[assignment]
    threshold: ThresholdOpt = THRESHOLD_TEXT,
    noise_k: Annotated[
        float, typer.Option(help="With --threshold auto: multiplier on each tensor's fp32 noise.")
    ] = DEFAULTS.noise_k,
    noise_eps: Annotated[
        float, typer.Option(help="With --threshold auto: added to every threshold (rel_l2).")
    ] = DEFAULTS.noise_eps,
    atol: Annotated[
        float | None, typer.Option(help="Use allclose semantics with this atol.")
    ] = None,
    rtol: Annotated[
        float | None, typer.Option(help="Use allclose semantics with this rtol.")
    ] = None,
    max_memory: MaxMemoryOpt = MAX_MEMORY_TEXT,
    strategy: Annotated[
        StrategyName,
        typer.Option(
            help="scan: mark everything; bisect: search over cuts; auto: scan, then "
            "bisect if marking outputs changes the target's result."
        ),
    ] = DEFAULTS.strategy,  # type: ignore[assignment]
    isolate_crashes: Annotated[
        bool | None,
        typer.Option(
            "--isolate-crashes/--no-isolate-crashes",
            help="Run target steps in a child process so a crash is caught and localized "
            "(always on for exec: targets).",
            show_default=False,
        ),
    ] = None,
    timeout: Annotated[
        float | None, typer.Option(help="Seconds per target run before it counts as a crash.")
    ] = None,
    always_scan: Annotated[
        bool, typer.Option(help="Scan and isolate even when the final outputs agree.")
    ] = DEFAULTS.always_scan,
    topk: Annotated[
        list[str] | None,
        typer.Option(
            help="Task-level check: top-K label agreement, K[:OUTPUT][@AXIS][[START:STOP]] "
            "(e.g. 5:logits, 1:output0@1[4:]). Repeatable; reported, not a verdict.",
        ),
    ] = None,
    out: Annotated[Path | None, typer.Option("--out", "-o", help="Write reports here.")] = None,
    repro: Annotated[
        bool,
        typer.Option(
            help="With --out and a divergence: write a verified repro bundle to OUT/repro."
        ),
    ] = True,
    format: Annotated[
        str, typer.Option("--format", "-f", help="Report formats: md,json,csv.")
    ] = "md,json,csv",
    top: Annotated[int, typer.Option(help="Rows in the terminal's top table.")] = 10,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="Only the exit code.")] = False,
    verbose: Annotated[
        bool, typer.Option("--verbose", "-v", help="Log each phase with its time and runs.")
    ] = False,
    debug: DebugOpt = False,
) -> None:
    """Find the first node where TARGET departs from REF, and the node that causes it."""
    configure_logging(verbose=verbose, debug=debug)
    per_input = {"--shape": shape, "--value": value, "--range": range_}
    command = shlex.join(["bisect", *_argv_of(model, ref, target, input, out, per_input)])
    with user_errors(debug), live_progress(quiet=quiet) as progress:
        formats = [f.strip() for f in format.split(",") if f.strip()]
        check_formats(formats)  # before the diagnosis, not after it
        result = run_bisect(
            model,
            ref=ref,
            target=target,
            inputs=input,
            **_generated(shape, value, range_),
            seed=seed,
            metric=str(metric.value if isinstance(metric, Enum) else metric),
            threshold=parse_threshold(threshold),
            noise_k=noise_k,
            noise_eps=noise_eps,
            atol=atol,
            rtol=rtol,
            max_memory=parse_bytes(max_memory),
            always_scan=always_scan,
            target_model=target_model,
            topk=topk or (),
            repro=out / "repro" if repro and out is not None else None,
            isolate_crashes=isolate_crashes,
            timeout=timeout,
            strategy=str(strategy.value if isinstance(strategy, Enum) else strategy),
            command=command,
            progress=progress,
        )
        written = write_reports(result, out, formats) if out is not None else []
    if not quiet:
        from onnx_bisect.report import print_summary

        console = stdout()
        print_summary(result, console, top=top)
        if written:
            console.print(f"[dim]reports in {out}/[/]")
    raise typer.Exit(EXIT_DIVERGED if result.diverged else EXIT_MATCH)


def _generated(
    shape: list[str] | None, value: list[str] | None, range_: list[str] | None
) -> dict[str, Any]:
    """The options of generated inputs, from their flags, each input named once per flag."""
    return {
        "shapes": by_input("--shape", shape, parse_shape),
        "values": by_input("--value", value, parse_value),
        "ranges": by_input("--range", range_, parse_range),
    }


def _argv_of(
    model: Path,
    ref: str,
    target: str,
    inp: Path | None,
    out: Path | None,
    per_input: dict[str, list[str] | None],
) -> list[str]:
    """Reconstruct the invocation for the report, whether called from a shell or a test."""
    if sys.argv and Path(sys.argv[0]).name in ("bisect", "onnx-bisect"):
        return sys.argv[1:]
    args = [str(model), "--ref", ref, "--target", target]
    if inp is not None:
        args += ["--input", str(inp)]
    for flag, texts in per_input.items():
        for text in texts or []:
            args += [flag, text]
    if out is not None:
        args += ["--out", str(out)]
    return args


def reduce_command(
    model: ModelArg,
    target: TargetOpt,
    out: Annotated[Path, typer.Option("--out", "-o", help="Bundle directory.")],
    ref: RefOpt = "cpu",
    input: InputOpt = None,
    shape: ShapeOpt = None,
    value: ValueOpt = None,
    range_: RangeOpt = None,
    seed: SeedOpt = DEFAULTS.seed,
    threshold: ThresholdOpt = THRESHOLD_TEXT,
    debug: DebugOpt = False,
) -> None:
    """Write a minimal, verified repro bundle for MODEL to OUT (no reports)."""
    with user_errors(debug), live_progress(quiet=False) as progress:
        result = run_bisect(
            model, ref=ref, target=target, inputs=input, **_generated(shape, value, range_),
            seed=seed, threshold=parse_threshold(threshold), repro=out, progress=progress,
        )  # fmt: skip
    console = stdout()
    if result.repro is None:
        console.print("No divergence: nothing to reduce.")
        raise typer.Exit(EXIT_MATCH)
    r = result.repro
    spent = plural(r.runs, "target run")
    console.print(f"{r.path}: {len(r.nodes)} of {plural(r.nodes_before, 'node')}, {spent}")
    console.print(("reproduces: " if r.reproduces else "NOT verified: ") + r.message)
    raise typer.Exit(EXIT_DIVERGED)


def repro_command(
    bundle: Annotated[Path, typer.Argument(metavar="DIR", show_default=False)],
    target: Annotated[
        str | None, typer.Option("--target", "-t", help="Try another backend.")
    ] = None,
) -> None:
    """Re-run a repro bundle: exit 1 if it reproduces, 0 if not, 2 if DIR is not a bundle."""

    if not (bundle / "repro.py").is_file() or not (bundle / "model.onnx").is_file():
        fail(f"{bundle}: not a repro bundle (no repro.py and model.onnx)")
    code, output = run_bundle(bundle, target)
    if code not in (EXIT_MATCH, EXIT_DIVERGED):
        fail(f"{bundle}: repro.py could not run: {output.splitlines()[-1] if output else code}")
    stdout().print(output, markup=False)
    raise typer.Exit(code)


def dump_command(
    model: ModelArg,
    backend: Annotated[str, typer.Option("--backend", "-b", help="Backend to dump (spec).")],
    out: Annotated[Path, typer.Option("--out", "-o", help="Directory to write.")],
    input: InputOpt = None,
    shape: ShapeOpt = None,
    value: ValueOpt = None,
    range_: RangeOpt = None,
    seed: SeedOpt = DEFAULTS.seed,
    max_memory: MaxMemoryOpt = MAX_MEMORY_TEXT,
    debug: DebugOpt = False,
) -> None:
    """Write every tensor BACKEND computes to OUT, to compare later with --target dump:OUT."""
    from onnx_bisect.dumper import dump

    with user_errors(debug):
        done = dump(
            model, backend, out, inputs=input, **_generated(shape, value, range_), seed=seed,
            max_memory=parse_bytes(max_memory),
        )  # fmt: skip
    tensors, runs = plural(done.tensors, "tensor"), plural(done.runs, "run")
    stdout().print(f"{tensors} from {backend} in {done.path}/ ({runs})")


def backends_command() -> None:
    """List each backend adapter and whether it can run here (and why not)."""
    table = Table(title="Backends")
    for col in ("name", "available", "description"):
        table.add_column(col)
    for name, adapter in sorted(adapters().items()):
        reason = adapter.availability()
        details = adapter.details() if reason is None else None
        available = "yes" if reason is None else f"no: {reason}"
        description = f"{adapter.description} ({details})" if details else adapter.description
        table.add_row(name, available, description)
    console = stdout()
    console.print(table)
    aliases = ", ".join(f"{k} = {v[0]}:{v[1]}" for k, v in ALIASES.items())
    console.print(f"aliases: {aliases}")
