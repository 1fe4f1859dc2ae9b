"""``sweep()``: every (model, target) case diagnosed as ``bisect`` would, each in a process of
its own, in local processes or as Ray tasks; each case's row kept as it finishes
(``<model>/<slug>/case.json``, so that ``resume`` skips it) and the tables rewritten."""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

from onnx_bisect.backends.registry import check_known
from onnx_bisect.cases.child import kill_running, new_sweep, run_case
from onnx_bisect.cases.plan import (
    Case,
    CaseOptions,
    find_models,
    parse_targets,
    plan_cases,
)
from onnx_bisect.engine.dataset.worker import thread_env
from onnx_bisect.errors import InputError
from onnx_bisect.report.manifest import MANIFEST, manifest_text, read_manifest
from onnx_bisect.report.outdir import check_out_dir
from onnx_bisect.report.sweep_files import (
    SWEEP_FILES,
    write_baseline_file,
    write_results_csv,
    write_sweep,
)
from onnx_bisect.sweep_result import (
    CaseOutcome,
    CaseResult,
    SweepResult,
    compare_baseline,
    read_baseline_dict,
)

__all__ = ["CASE_FILE", "sweep"]

CASE_FILE = "case.json"  # a finished case's row, in its folder


def sweep(
    models: Sequence[str | os.PathLike[str]],
    targets: Sequence[str],
    *,
    out: str | os.PathLike[str],
    ref: str = "cpu",
    inputs: str | os.PathLike[str] | None = None,
    shapes: Sequence[str] = (),
    timeout: float | None = None,
    case_timeout: float | None = None,
    max_memory: int | None = None,
    isolate_crashes: bool | None = None,
    repro: bool = True,
    jobs: int = 1,
    ray: str | None = None,
    resume: bool = False,
    baseline: str | os.PathLike[str] | None = None,
    write_baseline: str | os.PathLike[str] | None = None,
    on_case: Callable[[CaseResult], None] | None = None,
) -> SweepResult:
    """Diagnose every model (files, or folders searched for ``*.onnx``) on every target
    (``SPEC`` or ``LABEL=SPEC``) against ``ref``; each case's reports in
    ``out/<model>/<target-slug>/``, the tables in ``out`` (results.csv, junit.xml,
    summary.md, summary.html). ``inputs``: a folder of ``<model>.npz``; ``shapes``,
    ``timeout`` (per target run), ``max_memory`` and ``isolate_crashes`` are ``bisect``'s
    options for every case; ``case_timeout`` bounds a whole case (past it: ``hang``).
    ``jobs`` cases at a time here, or ``ray`` (an address or ``local``): each case a Ray
    task. ``resume``: the cases whose rows a killed sweep wrote are not run again.
    ``baseline``: a file ``write_baseline`` wrote, against which the
    result's ``failed`` counts only the cases that got worse. ``on_case`` is told each row as
    its case finishes (in the order they finish)."""
    start = time.perf_counter()
    if jobs < 1:
        raise InputError(f"jobs must be at least 1, got {jobs}", option="jobs")
    if ray is not None and not ray.strip():
        raise InputError("ray must be 'local' or a cluster address, got ''", option="ray")
    check_known(ref)
    opts = CaseOptions(
        ref=ref,
        shapes=tuple(shapes),
        timeout=timeout,
        max_memory=max_memory,
        isolate_crashes=isolate_crashes,
        case_timeout=case_timeout,
        repro=repro,
    )
    out_dir = Path(out)
    entries = find_models(
        [Path(m) for m in models], inputs=None if inputs is None else Path(inputs), out=out_dir
    )
    labels = parse_targets(targets)
    before = _read_baseline(Path(baseline)) if baseline is not None else None
    cases = plan_cases(entries, labels)
    owned = [*SWEEP_FILES, *dict.fromkeys(e.name for e in entries)]
    check_out_dir(out_dir, owned=owned, reads=[e.path for e in entries])
    out_dir.mkdir(parents=True, exist_ok=True)
    # An earlier sweep's model folders stay the tool's, whether or not this one sweeps them.
    (out_dir / MANIFEST).write_text(manifest_text({*read_manifest(out_dir), *owned}))
    done = _resumed(cases, out_dir) if resume else {}
    rows = dict(done)

    def finished(result: CaseResult) -> None:
        _write_case(out_dir / result.folder, result)
        rows[result.key] = result
        write_results_csv([rows[c.key] for c in cases if c.key in rows], out_dir)
        if on_case is not None:
            on_case(result)

    pending = [c for c in cases if c.key not in done]
    if ray is not None:
        from onnx_bisect.cases.remote import run_on_cluster

        run_on_cluster(pending, opts, out_dir, address=ray.strip(), jobs=jobs, finished=finished)
    else:
        _run_local(pending, opts, out_dir, jobs=jobs, finished=finished)
    ordered = tuple(rows[c.key] for c in cases)
    result = SweepResult(
        cases=ordered,
        models=tuple(e.name for e in entries),
        targets=tuple(t.label for t in labels),
        ref=opts.ref,
        out=str(out_dir),
        seconds=round(time.perf_counter() - start, 3),
        baseline=None if before is None else compare_baseline(ordered, before, str(baseline)),
        resumed=tuple(done),
        specs={t.label: t.spec for t in labels},
    )
    write_sweep(result, out_dir)
    if write_baseline is not None:
        write_baseline_file(result, Path(write_baseline))
    return result


def _run_local(
    cases: Sequence[Case],
    options: CaseOptions,
    out: Path,
    *,
    jobs: int,
    finished: Callable[[CaseResult], None],
) -> None:
    """Each case's ``bisect`` in a child process, ``jobs`` at a time (threads only wait)."""
    env = thread_env(jobs)
    new_sweep()
    with ThreadPoolExecutor(max_workers=jobs, thread_name_prefix="sweep-case") as pool:
        futures = [pool.submit(run_case, case, options, out, env=env) for case in cases]
        try:
            for future in as_completed(futures):
                finished(future.result())
        except BaseException:
            # Ctrl-C or SIGTERM: no case may go on running, nor a queued one start.
            for future in futures:
                future.cancel()
            kill_running()
            raise


def _write_case(folder: Path, result: CaseResult) -> None:
    """The row, written whole or not at all (a killed sweep leaves no half file to resume)."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / CASE_FILE
    partial = folder / f".{CASE_FILE}.{os.getpid()}"
    partial.write_text(json.dumps(result.to_dict(), indent=2) + "\n")
    os.replace(partial, path)


def _resumed(cases: Sequence[Case], out: Path) -> dict[tuple[str, str], CaseResult]:
    """The rows a killed (or finished) sweep wrote for these same cases (same target spec)."""
    found: dict[tuple[str, str], CaseResult] = {}
    for case in cases:
        path = out / case.folder / CASE_FILE
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
            row = CaseResult.from_dict(json.loads(path.read_text()))
            if row.key == case.key and row.spec == case.target.spec:
                found[case.key] = row
    return found


def _read_baseline(path: Path) -> dict[tuple[str, str], CaseOutcome]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise InputError(f"baseline {path}: cannot read it ({exc})", option="baseline") from None
    try:
        return read_baseline_dict(data)
    except ValueError as exc:
        raise InputError(f"baseline {path}: {exc}", option="baseline") from None
