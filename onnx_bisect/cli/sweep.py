"""``onnx-bisect sweep``: every model on every target, a table of cases, a CI gate."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from onnx_bisect.cli.output import EXIT_DIVERGED, EXIT_MATCH, stdout, user_errors
from onnx_bisect.cli.params import (
    MAX_MEMORY_TEXT,
    DebugOpt,
    IsolateCrashesOpt,
    MaxMemoryOpt,
    QuietOpt,
    RefOpt,
    ReproOpt,
    ShapeOpt,
    TimeoutOpt,
    VerboseOpt,
    parse_bytes,
)
from onnx_bisect.cli.progress import configure_logging
from onnx_bisect.sweep_result import CaseResult

__all__ = ["sweep_command"]

_CASES = "Cases"
_SCALE = "Scale"
_GATE = "Baseline"

ModelsArg = Annotated[
    list[Path],
    typer.Argument(
        metavar="MODEL_OR_DIR",
        help="Models, or folders searched for *.onnx.",
        show_default=False,
    ),
]
TargetsOpt = Annotated[
    list[str],
    typer.Option(
        "--target",
        "-t",
        metavar="[LABEL=]SPEC",
        help="A backend under test; repeat for each. LABEL names it in the tables.",
        show_default=False,
    ),
]
OutOpt = Annotated[
    Path,
    typer.Option(
        "--out",
        "-o",
        metavar="DIR",
        help="Tables here, each case's reports in DIR/MODEL/TARGET/.",
        show_default=False,
    ),
]
InputsOpt = Annotated[
    Path | None,
    typer.Option(
        metavar="DIR",
        help="MODEL.npz inputs per model (else test_data_set_0 beside the model, else generated).",
        rich_help_panel=_CASES,
    ),
]
CaseTimeoutOpt = Annotated[
    float | None,
    typer.Option(
        metavar="SECONDS",
        help="Seconds for a whole case; past it the case is a hang.",
        rich_help_panel=_CASES,
    ),
]
SweepJobsOpt = Annotated[
    int,
    typer.Option(metavar="N", help="Cases run at once here.", rich_help_panel=_SCALE),
]
SweepRayOpt = Annotated[
    str | None,
    typer.Option(
        metavar="ADDRESS|local",
        help="Each case a Ray task on the cluster at ADDRESS, or on one started here.",
        rich_help_panel=_SCALE,
    ),
]
ResumeOpt = Annotated[
    bool,
    typer.Option(
        "--resume",
        metavar="",
        help="Skip the cases a killed sweep into DIR finished.",
        rich_help_panel=_SCALE,
    ),
]
BaselineOpt = Annotated[
    Path | None,
    typer.Option(
        metavar="FILE",
        help="Exit 1 only for a case worse than in FILE (from --write-baseline).",
        rich_help_panel=_GATE,
    ),
]
WriteBaselineOpt = Annotated[
    Path | None,
    typer.Option(metavar="FILE", help="Write each case's outcome to FILE.", rich_help_panel=_GATE),
]


def sweep_command(
    models: ModelsArg,
    target: TargetsOpt,
    out: OutOpt,
    ref: RefOpt = "cpu",
    inputs: InputsOpt = None,
    shape: ShapeOpt = None,
    timeout: TimeoutOpt = None,
    case_timeout: CaseTimeoutOpt = None,
    max_memory: MaxMemoryOpt = MAX_MEMORY_TEXT,
    isolate_crashes: IsolateCrashesOpt = None,
    repro: ReproOpt = True,
    jobs: SweepJobsOpt = 1,
    ray: SweepRayOpt = None,
    resume: ResumeOpt = False,
    baseline: BaselineOpt = None,
    write_baseline: WriteBaselineOpt = None,
    quiet: QuietOpt = False,
    verbose: VerboseOpt = False,
    debug: DebugOpt = False,
) -> None:
    """Diagnose every model on every --target as bisect does; tables and a CI gate in --out."""
    from onnx_bisect.cases.run import sweep

    configure_logging(verbose=verbose, debug=debug)
    console = stdout()
    count: list[int] = []

    def shown(case: CaseResult) -> None:
        count.append(1)
        if quiet:
            return
        where = f" at {', '.join(case.root_nodes)}" if case.root_nodes else ""
        console.print(
            f"[{len(count)}] {case.model} x {case.target}: {case.outcome}{where} "
            f"({case.seconds:.1f} s)",
            markup=False,
            highlight=False,
        )

    with user_errors(debug):
        result = sweep(
            models,
            target,
            out=out,
            ref=ref,
            inputs=inputs,
            shapes=tuple(shape or ()),
            timeout=timeout,
            case_timeout=case_timeout,
            max_memory=None if max_memory == MAX_MEMORY_TEXT else parse_bytes(max_memory),
            isolate_crashes=isolate_crashes,
            repro=repro,
            jobs=jobs,
            ray=ray,
            resume=resume,
            baseline=baseline,
            write_baseline=write_baseline,
            on_case=shown,
        )
    if not quiet:
        for line in result.summary():
            console.print(line, markup=False, highlight=False)
        console.print(f"tables in {out}/ (summary.html, results.csv, junit.xml)", markup=False)
    raise typer.Exit(EXIT_DIVERGED if result.failed else EXIT_MATCH)
