"""A case's row from what its ``bisect`` left: the report.json it wrote, the error it exited 2
or 3 with, or the signal that killed it (pure: no process is run here)."""

from __future__ import annotations

import signal
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from onnx_bisect.cases.plan import Case
from onnx_bisect.sweep_result import CaseOutcome, CaseResult, Stage

__all__ = ["from_error", "from_report", "from_signal"]

_BY_KIND = {
    "precision": CaseOutcome.PRECISION,
    "quantization": CaseOutcome.PRECISION,
    "unsupported": CaseOutcome.UNSUPPORTED,
    "crash": CaseOutcome.CRASH,
    "error": CaseOutcome.ERROR,
}
# The errors that stop a run before the target has run anything: the model, its inputs or
# the backend itself.
_LOAD_ERRORS = ("ModelLoadError", "InputError", "SpecError", "BackendUnavailableError")


def _line(text: str) -> str:
    return " ".join(str(text).split())


def _failure_stage(outcome: CaseOutcome, compiles: bool) -> Stage:
    """Where a target that failed on a node stopped: a compiler in its compile; another
    runtime converting the model (a missing op) or running it."""
    if compiles:
        return Stage.COMPILE
    return Stage.CONVERT if outcome is CaseOutcome.UNSUPPORTED else Stage.RUN


def from_report(case: Case, report: Mapping[str, Any], *, where: str) -> CaseResult:
    """The row of a case whose ``bisect`` wrote its report."""
    first = report.get("first_divergence") or {}
    cause = report.get("root_cause")
    row = CaseResult(
        model=case.model.name,
        target=case.target.label,
        spec=case.target.spec,
        outcome=CaseOutcome.AGREE if report.get("verdict") == "match" else CaseOutcome.DIVERGED,
        stage=Stage.NUMERICS,
        first_divergence=str(first.get("node") or ""),
        folder=where,
        report=f"{where}/report.md",
        bundle=f"{where}/repro" if report.get("repro") else "",
    )
    if row.outcome is CaseOutcome.AGREE or cause is None:
        return row
    kind = str(cause.get("kind", ""))
    reason = _line(cause.get("reason", ""))
    outcome = _BY_KIND.get(kind, CaseOutcome.DIVERGED)
    if outcome is CaseOutcome.CRASH and "hangs (timed out" in reason:
        outcome = CaseOutcome.HANG
    compiles = bool((report.get("target") or {}).get("compiles"))
    numeric = outcome in (CaseOutcome.DIVERGED, CaseOutcome.PRECISION)
    ops = {n.get("node"): n.get("op_type", "") for n in report.get("nodes") or []}
    nodes = tuple(str(n) for n in cause.get("nodes") or ())
    return replace(
        row,
        outcome=outcome,
        stage=Stage.NUMERICS if numeric else _failure_stage(outcome, compiles),
        root_kind=kind,
        root_nodes=nodes,
        root_ops=tuple(str(ops.get(n, "")) for n in nodes),
        reason=reason,
    )


def from_error(
    case: Case, code: int, error: Mapping[str, Any] | None, last: str, *, where: str
) -> CaseResult:
    """The row of a case whose ``bisect`` exited with an error and no report (2: the model,
    its inputs, the backend; 3: a bug of ours), its stage from the error's class."""
    kind = str((error or {}).get("class", ""))
    message = _line((error or {}).get("message", "") or last.removeprefix("error: "))
    if kind == "ModelLoadError" and message.startswith("transform +"):
        stage = Stage.CONVERT
    elif kind in _LOAD_ERRORS:
        stage = Stage.LOAD
    else:
        stage = Stage.RUN
    outcome = CaseOutcome.CRASH if kind in ("BackendCrash", "WorkerCrash") else CaseOutcome.ERROR
    what = f"exit {code}" + (f", {kind}" if kind else "")
    return CaseResult(
        model=case.model.name,
        target=case.target.label,
        spec=case.target.spec,
        outcome=outcome,
        stage=stage,
        root_kind="error",
        reason=f"{message} ({what})" if message else what,
        folder=where,
    )


def from_signal(
    case: Case,
    code: int,
    *,
    hung: bool,
    report: Mapping[str, Any] | None,
    where: str,
    limit: float | None = None,
) -> CaseResult:
    """The row of a case whose process died by a signal (``code`` is minus its number) or ran
    past the case's timeout (``hung``); ``report``: the run again with ``--isolate-crashes``
    that names the node, where it wrote one."""
    if hung:
        took = f" of {limit:g} s" if limit is not None else ""
        died = f"the case ran past its timeout{took} and was killed"
    else:
        try:
            died = f"the case's process died by {signal.Signals(-code).name}"
        except ValueError:
            died = f"the case's process died by signal {-code}"
        if -code == signal.SIGKILL:
            died += " (the OOM killer, or a kill)"
    outcome = CaseOutcome.HANG if hung else CaseOutcome.CRASH
    if report is not None:
        found = from_report(case, report, where=where)
        if found.outcome in (CaseOutcome.CRASH, CaseOutcome.HANG):
            return found
        # The isolated run found something else (or nothing): the crash stays the verdict.
        isolated = found.reason or found.outcome.value
        return replace(
            found,
            outcome=outcome,
            stage=Stage.RUN,
            reason=f"{died}; run again with --isolate-crashes: {isolated}",
        )
    return CaseResult(
        model=case.model.name,
        target=case.target.label,
        spec=case.target.spec,
        outcome=outcome,
        stage=Stage.RUN,
        root_kind=outcome.value,
        reason=died,
        folder=where,
    )
