"""A sweep's machine-read files: results.csv (one row per case) and junit.xml (one testcase
per case; a failure's text is its root-cause line and the command that reproduces it)."""

from __future__ import annotations

import csv
import io
import xml.etree.ElementTree as ET
from collections.abc import Sequence

from onnx_bisect.sweep_result import CaseResult, Change, SweepResult

__all__ = ["RESULT_COLUMNS", "junit_xml", "results_csv"]

RESULT_COLUMNS = (
    "model", "target", "status", "stage", "root_kind", "root_nodes", "root_ops",
    "first_divergence", "seconds", "peak_memory_mb", "report", "bundle", "reason", "spec",
    "command",
)  # fmt: skip


def _row(case: CaseResult) -> dict[str, object]:
    peak = "" if case.peak_memory is None else round(case.peak_memory / 2**20, 1)
    return {
        "model": case.model,
        "target": case.target,
        "status": case.outcome.value,
        "stage": case.stage.value,
        "root_kind": case.root_kind,
        "root_nodes": ";".join(case.root_nodes),
        "root_ops": ";".join(case.root_ops),
        "first_divergence": case.first_divergence,
        "seconds": f"{case.seconds:.2f}",
        "peak_memory_mb": peak,
        "report": case.report,
        "bundle": case.bundle,
        "reason": case.reason,
        "spec": case.spec,
        "command": case.command,
    }


def results_csv(cases: Sequence[CaseResult]) -> str:
    """results.csv: one row per case, ``;`` between a root cause's several nodes."""
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=RESULT_COLUMNS, lineterminator="\n")
    writer.writeheader()
    for case in cases:
        writer.writerow(_row(case))
    return buffer.getvalue()


def _failure_text(case: CaseResult) -> str:
    where = f" at {', '.join(case.root_nodes)}" if case.root_nodes else ""
    lines = [f"{case.outcome} ({case.stage}){where}: {case.reason}".rstrip(": ")]
    if case.first_divergence and case.first_divergence not in case.root_nodes:
        lines.append(f"first divergence: {case.first_divergence}")
    lines.append(f"repro: {case.command}")
    if case.report:
        lines.append(f"report: {case.report}")
    if case.bundle:
        lines.append(f"bundle: {case.bundle}")
    return "\n".join(lines)


_COUNTED = {"failure": "failures", "error": "errors", "skipped": "skipped"}


def junit_xml(result: SweepResult) -> str:
    """junit.xml: a testsuite per target, a testcase per model on it (classname the target,
    name the model). A case that does not pass is a ``failure`` (diverged, unsupported,
    precision never fails) or an ``error`` (crash, hang, error); with a baseline, a failing
    case no worse than it is ``skipped`` with its text, so that CI shows only regressions
    red."""
    regressions = None
    if result.baseline is not None:
        regressions = set(result.baseline.keys(Change.REGRESSION))
    suites = ET.Element("testsuites", name="onnx-bisect sweep")
    for target in result.targets:
        cases = [c for c in result.cases if c.target == target]
        suite = ET.SubElement(suites, "testsuite", name=target, tests=str(len(cases)))
        counts = {"failures": 0, "errors": 0, "skipped": 0}
        for case in cases:
            element = ET.SubElement(
                suite, "testcase", classname=target, name=case.model, time=f"{case.seconds:.3f}"
            )
            if case.passed:
                continue
            message = f"{case.outcome}: {case.reason}"
            if regressions is not None and case.key not in regressions:
                tag = "skipped"
                message = f"known in the baseline: {message}"
            elif case.outcome.value in ("diverged", "unsupported"):
                tag = "failure"
            else:
                tag = "error"
            counts[_COUNTED[tag]] += 1
            node = ET.SubElement(element, tag, message=message, type=case.outcome.value)
            node.text = _failure_text(case)
        for name, n in counts.items():
            suite.set(name, str(n))
    ET.indent(suites)
    return '<?xml version="1.0" encoding="utf-8"?>\n' + ET.tostring(suites, "unicode") + "\n"
