"""The commands: ``bisect``/``run``, ``reduce``, ``repro``, ``dump``, ``backends``, ``view``."""

from __future__ import annotations

import importlib.util
import shlex
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table
from rich.text import Text

from onnx_bisect.api import bisect as run_bisect
from onnx_bisect.backends.registry import adapters
from onnx_bisect.backends.spec import ALIASES
from onnx_bisect.cli.output import EXIT_DIVERGED, EXIT_MATCH, fail, stdout, user_errors
from onnx_bisect.cli.params import (
    DEFAULTS,
    MAX_MEMORY_TEXT,
    OUTPUTS,
    THRESHOLD_TEXT,
    AllowNonfiniteOpt,
    AlwaysScanOpt,
    AtolOpt,
    BisectPassesOpt,
    BundleMetricOpt,
    BundleRefOpt,
    BundleTargetOpt,
    BundleThresholdOpt,
    CalibrationOpt,
    ChunksOpt,
    DatasetOpt,
    DebugOpt,
    FormatOpt,
    FreeRunOpt,
    InputOpt,
    IsolateCrashesOpt,
    JobsOpt,
    MaxMemoryOpt,
    MetricOpt,
    ModelArg,
    NoiseEpsOpt,
    NoiseKOpt,
    PassesOpt,
    QuantGoalOpt,
    QuietOpt,
    RangeOpt,
    RayOpt,
    RefOpt,
    ReproOpt,
    RtolOpt,
    SampleOpt,
    SeedOpt,
    ShapeOpt,
    StateOpt,
    StepsOpt,
    StrategyOpt,
    TargetModelOpt,
    TargetOpt,
    TargetPrecisionOpt,
    ThresholdOpt,
    TimeoutOpt,
    TopKOpt,
    TopOpt,
    UnrollMaxOpt,
    ValueOpt,
    VerboseOpt,
    VersionOpt,
    by_input,
    parse_bytes,
    parse_range,
    parse_threshold,
    parse_value,
)
from onnx_bisect.cli.progress import configure_logging, live_progress
from onnx_bisect.inputs.feeds import parse_shape
from onnx_bisect.options import BisectOptions
from onnx_bisect.report.explorer import read_explorer
from onnx_bisect.report.files import REPORT_FILES, check_formats, staged_out
from onnx_bisect.repro.bundle import BUNDLE_FILES
from onnx_bisect.repro.verify import run_bundle
from onnx_bisect.text import plural

__all__ = [
    "backends_command",
    "dump_command",
    "reduce_command",
    "repro_command",
    "run_command",
    "view_command",
]


def run_command(
    model: ModelArg,
    target: TargetOpt,
    ref: RefOpt = "cpu",
    target_model: TargetModelOpt = None,
    target_precision: TargetPrecisionOpt = None,
    input: InputOpt = None,
    dataset: DatasetOpt = None,
    sample: SampleOpt = None,
    jobs: JobsOpt = DEFAULTS.jobs,
    ray: RayOpt = None,
    steps: StepsOpt = None,
    state: StateOpt = None,
    chunks: ChunksOpt = None,
    free_run: FreeRunOpt = DEFAULTS.free_run,
    shape: ShapeOpt = None,
    value: ValueOpt = None,
    range_: RangeOpt = None,
    seed: SeedOpt = DEFAULTS.seed,
    allow_nonfinite: AllowNonfiniteOpt = DEFAULTS.allow_nonfinite,
    metric: MetricOpt = DEFAULTS.metric,
    threshold: ThresholdOpt = THRESHOLD_TEXT,
    noise_k: NoiseKOpt = DEFAULTS.noise_k,
    noise_eps: NoiseEpsOpt = DEFAULTS.noise_eps,
    atol: AtolOpt = None,
    rtol: RtolOpt = None,
    max_memory: MaxMemoryOpt = MAX_MEMORY_TEXT,
    strategy: StrategyOpt = DEFAULTS.strategy,
    isolate_crashes: IsolateCrashesOpt = None,
    timeout: TimeoutOpt = None,
    always_scan: AlwaysScanOpt = DEFAULTS.always_scan,
    unroll_max: UnrollMaxOpt = DEFAULTS.unroll_max,
    bisect_passes: BisectPassesOpt = DEFAULTS.bisect_passes,
    passes: PassesOpt = "",
    topk: TopKOpt = None,
    quant_goal: QuantGoalOpt = None,
    calibration: CalibrationOpt = None,
    out: Annotated[
        Path | None,
        typer.Option(
            "--out", "-o", metavar="DIR", help="Write the reports here.", rich_help_panel=OUTPUTS
        ),
    ] = None,
    repro: ReproOpt = True,
    format: FormatOpt = "md,json,csv,html,png,explorer",
    top: TopOpt = 10,
    quiet: QuietOpt = False,
    verbose: VerboseOpt = False,
    debug: DebugOpt = False,
    version: VersionOpt = False,
) -> None:
    """Find the first node where TARGET departs from REF, and the node that causes it."""
    configure_logging(verbose=verbose, debug=debug)
    per_input = {"--shape": shape, "--value": value, "--range": range_}
    given = {"--input": input, "--dataset": dataset, "--chunks": chunks}
    command = shlex.join(["bisect", *_argv_of(model, ref, target, given, out, per_input)])
    with (
        user_errors(debug),
        staged_out(
            out, bundle_name="repro", owned=REPORT_FILES, reads=_models(model, target_model)
        ) as staged,
        live_progress(quiet=quiet) as progress,
    ):
        formats = [f.strip() for f in format.split(",") if f.strip()]
        check_formats(formats)  # before the diagnosis, not after it
        result = run_bisect(
            model,
            ref=ref,
            target=target,
            options=_options(
                input=input,
                shape=shape,
                value=value,
                range_=range_,
                seed=seed,
                allow_nonfinite=allow_nonfinite,
                metric=metric,
                threshold=threshold,
                noise_k=noise_k,
                noise_eps=noise_eps,
                atol=atol,
                rtol=rtol,
                max_memory=max_memory,
                strategy=strategy,
                isolate_crashes=isolate_crashes,
                timeout=timeout,
                target_model=target_model,
                target_precision=target_precision,
                unroll_max=unroll_max,
                bisect_passes=bisect_passes,
                passes=tuple(p.strip() for p in passes.split(",") if p.strip()),
                dataset=dataset,
                sample=sample,
                jobs=jobs,
                ray=ray,
                steps=steps,
                state=tuple(state or ()),
                chunks=chunks,
                free_run=free_run,
            ),
            always_scan=always_scan,
            topk=topk or (),
            quant_goal=quant_goal,
            calibration=calibration,
            repro=staged.bundle if repro else None,
            command=command,
            progress=progress,
        )
        published = staged.publish(result, formats)
    result = published.result
    if not quiet:
        from onnx_bisect.report import print_summary

        console = stdout()
        print_summary(result, console, top=top)
        if published.written:
            console.print(f"[dim]reports in {out}/[/]")
        if kept := published.kept_line():
            console.print(kept, markup=False)
    raise typer.Exit(EXIT_DIVERGED if result.diverged else EXIT_MATCH)


def _models(model: Path, target_model: Path | None) -> list[Path]:
    """The models a run reads, which its --out must not hold."""
    return [model] + ([target_model] if target_model is not None else [])


def _options(
    *,
    input: Path | None,
    shape: list[str] | None,
    value: list[str] | None,
    range_: list[str] | None,
    threshold: str,
    max_memory: str,
    **as_typed: Any,
) -> BisectOptions:
    """What ``bisect`` and ``reduce`` share, from their flags: texts parsed, numbers as typed,
    all of it checked by ``BisectOptions`` (whose errors name the option, shown as its flag)."""
    return BisectOptions(
        inputs=input,
        **_generated(shape, value, range_),
        threshold=parse_threshold(threshold),
        max_memory=parse_bytes(max_memory),
        **as_typed,
    )


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
    given: dict[str, Path | str | None],
    out: Path | None,
    per_input: dict[str, list[str] | None],
) -> list[str]:
    """Reconstruct the invocation for the report, whether called from a shell or a test."""
    if sys.argv and Path(sys.argv[0]).name in ("bisect", "onnx-bisect"):
        return sys.argv[1:]
    args = [str(model), "--ref", ref, "--target", target]
    for flag, path in given.items():
        if path is not None:
            args += [flag, str(path)]
    for flag, texts in per_input.items():
        for text in texts or []:
            args += [flag, text]
    if out is not None:
        args += ["--out", str(out)]
    return args


def reduce_command(
    model: ModelArg,
    target: TargetOpt,
    out: Annotated[Path, typer.Option("--out", "-o", metavar="DIR", help="Bundle directory.")],
    ref: RefOpt = "cpu",
    target_model: TargetModelOpt = None,
    target_precision: TargetPrecisionOpt = None,
    input: InputOpt = None,
    shape: ShapeOpt = None,
    value: ValueOpt = None,
    range_: RangeOpt = None,
    seed: SeedOpt = DEFAULTS.seed,
    allow_nonfinite: AllowNonfiniteOpt = DEFAULTS.allow_nonfinite,
    metric: MetricOpt = DEFAULTS.metric,
    threshold: ThresholdOpt = THRESHOLD_TEXT,
    noise_k: NoiseKOpt = DEFAULTS.noise_k,
    noise_eps: NoiseEpsOpt = DEFAULTS.noise_eps,
    atol: AtolOpt = None,
    rtol: RtolOpt = None,
    max_memory: MaxMemoryOpt = MAX_MEMORY_TEXT,
    strategy: StrategyOpt = DEFAULTS.strategy,
    isolate_crashes: IsolateCrashesOpt = None,
    timeout: TimeoutOpt = None,
    unroll_max: UnrollMaxOpt = DEFAULTS.unroll_max,
    quiet: QuietOpt = False,
    verbose: VerboseOpt = False,
    debug: DebugOpt = False,
) -> None:
    """Write a minimal, verified repro bundle for MODEL to OUT (no reports)."""
    configure_logging(verbose=verbose, debug=debug)
    with (
        user_errors(debug),
        staged_out(
            out, bundle_name="", owned=BUNDLE_FILES, reads=_models(model, target_model)
        ) as staged,
        live_progress(quiet=quiet) as progress,
    ):
        result = run_bisect(
            model,
            ref=ref,
            target=target,
            options=_options(
                input=input,
                shape=shape,
                value=value,
                range_=range_,
                seed=seed,
                allow_nonfinite=allow_nonfinite,
                metric=metric,
                threshold=threshold,
                noise_k=noise_k,
                noise_eps=noise_eps,
                atol=atol,
                rtol=rtol,
                max_memory=max_memory,
                strategy=strategy,
                isolate_crashes=isolate_crashes,
                timeout=timeout,
                target_model=target_model,
                target_precision=target_precision,
                unroll_max=unroll_max,
            ),
            repro=staged.bundle,
            progress=progress,
        )
        published = staged.publish(result)
    result = published.result
    r = result.repro
    lines = [kept] if (kept := published.kept_line()) else []
    if r is None:
        lines += ["No divergence: nothing to reduce."]
    else:
        lines += [
            f"{r.path}: {len(r.nodes)} of {plural(r.nodes_before, 'node')}, "
            f"{plural(r.runs, 'target run')}",
            ("reproduces: " if r.reproduces else "NOT verified: ") + r.message,
        ]
    if not quiet:
        console = stdout()
        for line in lines:
            console.print(line)
    raise typer.Exit(EXIT_MATCH if r is None else EXIT_DIVERGED)


def repro_command(
    bundle: Annotated[Path, typer.Argument(metavar="DIR", show_default=False)],
    target: BundleTargetOpt = None,
    ref: BundleRefOpt = None,
    metric: BundleMetricOpt = None,
    threshold: BundleThresholdOpt = None,
    atol: AtolOpt = None,
    rtol: RtolOpt = None,
    timeout: TimeoutOpt = None,
) -> None:
    """Re-run a repro bundle: exit 1 if it reproduces, 0 if not, 2 if DIR is not a bundle."""
    changed = dict(metric=metric, threshold=threshold, atol=atol, rtol=rtol, timeout=timeout)
    given: dict[str, Any] = {k: v for k, v in changed.items() if v is not None}
    with user_errors(debug=False):
        BisectOptions(**given)  # the rules of bisect's options, before the bundle runs
    if not (bundle / "repro.py").is_file() or not (bundle / "model.onnx").is_file():
        fail(f"{bundle}: not a repro bundle (no repro.py and model.onnx)")
    flags = {"--target": target, "--ref": ref, **{f"--{k}": v for k, v in given.items()}}
    code, output = run_bundle(bundle, flags)
    if code not in (EXIT_MATCH, EXIT_DIVERGED):
        fail(f"{bundle}: repro.py could not run: {output.splitlines()[-1] if output else code}")
    stdout().print(output, markup=False)
    raise typer.Exit(code)


def dump_command(
    model: ModelArg,
    backend: Annotated[
        str, typer.Option("--backend", "-b", metavar="SPEC", help="Backend to dump (spec).")
    ],
    out: Annotated[Path, typer.Option("--out", "-o", metavar="DIR", help="Directory to write.")],
    input: InputOpt = None,
    shape: ShapeOpt = None,
    value: ValueOpt = None,
    range_: RangeOpt = None,
    seed: SeedOpt = DEFAULTS.seed,
    allow_nonfinite: AllowNonfiniteOpt = DEFAULTS.allow_nonfinite,
    max_memory: MaxMemoryOpt = MAX_MEMORY_TEXT,
    quiet: QuietOpt = False,
    verbose: VerboseOpt = False,
    debug: DebugOpt = False,
) -> None:
    """Write every tensor BACKEND computes to OUT, to compare later with --target dump:OUT."""
    from onnx_bisect.dumper import dump

    configure_logging(verbose=verbose, debug=debug)
    with user_errors(debug):
        done = dump(
            model,
            backend,
            out,
            inputs=input,
            **_generated(shape, value, range_),
            seed=seed,
            max_memory=parse_bytes(max_memory),
            allow_nonfinite=allow_nonfinite,
        )
    if not quiet:
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
        # Plain text: as markup, the extra in "pip install 'onnx-bisect[torch]'" is a style tag.
        table.add_row(Text(name), Text(available), Text(description))
    console = stdout()
    console.print(table)
    aliases = ", ".join(f"{k} = {v[0]}:{v[1]}" for k, v in ALIASES.items())
    console.print(f"aliases: {aliases}", markup=False)


def _launch(argv: Sequence[str]) -> int:
    return subprocess.call(list(argv))


# Tests swap this out: starting a server and a browser is Model Explorer's business.
launcher: Callable[[Sequence[str]], int] = _launch


def view_command(
    out: Annotated[Path, typer.Argument(metavar="OUT", show_default=False)],
) -> None:
    """Open Model Explorer on the model with the error overlays of a bisect --out OUT."""
    files = read_explorer(out)
    if files is None:
        return fail(f"{out}: no explorer/view.json; write one with bisect MODEL ... --out {out}")
    missing = [p for p in (files.model, *files.overlays) if not p.is_file()]
    if missing:
        fail(f"{missing[0]}: not found; rerun bisect with --out {out}")
    argv = files.command()
    if importlib.util.find_spec("model_explorer") is None:
        stdout().print(
            "Model Explorer is not installed; install it and run:\n"
            "  pip install 'onnx-bisect[explorer]'\n"
            f"  {shlex.join(argv)}",
            markup=False,
        )
        raise typer.Exit(EXIT_MATCH)
    # The console script of this interpreter's Model Explorer, not whichever is on PATH.
    raise typer.Exit(launcher([sys.executable, "-m", "model_explorer", *argv[1:]]))
