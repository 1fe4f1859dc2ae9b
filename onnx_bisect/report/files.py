"""Writing the report files and the exact inputs used."""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from onnx_bisect.errors import InputError
from onnx_bisect.inputs.feeds import save_npz
from onnx_bisect.report.issue import render_bundle_readme, render_issue
from onnx_bisect.report.markdown import render_markdown
from onnx_bisect.report.serialize import NODE_COLUMNS, node_rows, to_dict

if TYPE_CHECKING:
    from onnx_bisect.result import BisectResult

__all__ = ["FORMATS", "check_formats", "write_bundle_docs", "write_reports"]

FORMATS = ("md", "json", "csv")


def check_formats(formats: Sequence[str]) -> None:
    unknown = sorted(set(formats) - set(FORMATS))
    if unknown:
        raise InputError(
            f"unknown report format(s) {', '.join(unknown)}; choose from {', '.join(FORMATS)}"
        )


def write_reports(
    result: BisectResult, out_dir: str | Path, formats: Sequence[str] = FORMATS
) -> list[Path]:
    """Write the reports and ``inputs.npz`` to ``out_dir``; returns the paths written."""
    check_formats(formats)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    if "json" in formats:
        path = out_dir / "report.json"
        path.write_text(json.dumps(to_dict(result), indent=2, allow_nan=False) + "\n")
        written.append(path)
    if "md" in formats:
        path = out_dir / "report.md"
        path.write_text(render_markdown(result))
        written.append(path)
    if "csv" in formats:
        path = out_dir / "nodes.csv"
        _write_csv(path, node_rows(result))
        written.append(path)
    path = out_dir / "inputs.npz"
    save_npz(path, result.inputs)
    written.append(path)
    return written


def _write_csv(path: Path, rows: list[dict[str, Any]]) -> None:
    """The nodes table as pandas would write it (NaN as empty), without importing pandas."""

    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(NODE_COLUMNS))
        writer.writeheader()
        for row in rows:
            writer.writerow(
                {k: "" if isinstance(v, float) and math.isnan(v) else v for k, v in row.items()}
            )


def write_bundle_docs(result: BisectResult) -> list[Path]:
    """README.md and issue.md beside the repro bundle's files, when there is a bundle."""
    if result.repro is None or not Path(result.repro.path).is_dir():
        return []
    bundle = Path(result.repro.path)
    (bundle / "README.md").write_text(render_bundle_readme(result))
    (bundle / "issue.md").write_text(render_issue(result))
    return [bundle / "README.md", bundle / "issue.md"]
