"""Writing a sweep's files into its output directory: results.csv as each case finishes, the
rest when the sweep ends, and the baseline file. Each file is written whole or not at all."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path

from onnx_bisect.report.sweep_summary import render_summary_html, render_summary_md
from onnx_bisect.report.sweep_tables import junit_xml, results_csv
from onnx_bisect.sweep_result import CaseResult, SweepResult, baseline_dict

__all__ = ["SWEEP_FILES", "write_baseline_file", "write_results_csv", "write_sweep"]

SWEEP_FILES = ("results.csv", "junit.xml", "summary.md", "summary.html")


def _write(path: Path, text: str) -> Path:
    partial = path.with_name(f".{path.name}.{os.getpid()}")
    partial.write_text(text, encoding="utf-8")
    os.replace(partial, path)
    return path


def write_results_csv(cases: Sequence[CaseResult], out: Path) -> Path:
    """results.csv with the cases finished so far."""
    return _write(out / "results.csv", results_csv(cases))


def write_sweep(result: SweepResult, out: Path) -> list[Path]:
    """Every table of a finished sweep."""
    return [
        write_results_csv(result.cases, out),
        _write(out / "junit.xml", junit_xml(result)),
        _write(out / "summary.md", render_summary_md(result)),
        _write(out / "summary.html", render_summary_html(result)),
    ]


def write_baseline_file(result: SweepResult, path: Path) -> Path:
    """Each case's outcome, for a later sweep's ``--baseline``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    return _write(path, json.dumps(baseline_dict(result.cases), indent=2) + "\n")
