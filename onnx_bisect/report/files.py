"""Writing the report files and the exact inputs used."""

from __future__ import annotations

import csv
import dataclasses
import logging
import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from onnx_bisect.errors import InputError
from onnx_bisect.inputs.feeds import save_npz
from onnx_bisect.report.explorer import EXPLORER_DIR, write_explorer
from onnx_bisect.report.html import render_html
from onnx_bisect.report.issue import render_bundle_readme, render_issue
from onnx_bisect.report.jsontext import json_text
from onnx_bisect.report.markdown import render_markdown
from onnx_bisect.report.outdir import Replaced, check_out_dir, replace_owned, staging_dir
from onnx_bisect.report.plots import PLOTS_HINT, curve_png, plots_available
from onnx_bisect.report.serialize import node_columns, node_rows, to_dict

if TYPE_CHECKING:
    from onnx_bisect.result import BisectResult

__all__ = [
    "FORMATS",
    "REPORT_FILES",
    "Published",
    "StagedOut",
    "check_formats",
    "staged_out",
    "write_bundle_docs",
    "write_reports",
]

logger = logging.getLogger(__name__)

# ``png`` is error_curve.png, a format of its own: it needs the optional matplotlib, and one
# may want the page without the image or the image alone (to paste into a chat).
# ``explorer`` is the Model Explorer overlays in explorer/.
FORMATS = ("md", "json", "csv", "html", "png", "explorer")
# Everything ``bisect --out DIR`` may write in DIR: a rerun replaces all of it, even what it
# does not write this time (a clean run leaves no earlier bundle behind).
REPORT_FILES = (
    "report.json",
    "report.md",
    "nodes.csv",
    "report.html",
    "error_curve.png",
    "inputs.npz",
    "repro",
    EXPLORER_DIR,
)


def check_formats(formats: Sequence[str]) -> None:
    unknown = sorted(set(formats) - set(FORMATS))
    if unknown:
        raise InputError(
            f"unknown report format(s) {', '.join(unknown)}; choose from {', '.join(FORMATS)}"
        )


def write_reports(
    result: BisectResult,
    out_dir: str | Path,
    formats: Sequence[str] = FORMATS,
    *,
    shown_as: str | Path | None = None,
) -> list[Path]:
    """Write the reports and ``inputs.npz`` to ``out_dir``; returns the paths written.
    ``shown_as``: the folder the reports will be in, where ``out_dir`` is a staging folder
    (what "onnx-bisect view FOLDER" in their next steps names)."""
    check_formats(formats)
    out_dir = Path(out_dir)
    folder = Path(shown_as or out_dir) if "explorer" in formats else None
    out_dir.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    if "json" in formats:
        path = out_dir / "report.json"
        path.write_text(json_text(to_dict(result)))
        written.append(path)
    if "md" in formats:
        path = out_dir / "report.md"
        path.write_text(render_markdown(result, folder))
        written.append(path)
    if "csv" in formats:
        path = out_dir / "nodes.csv"
        _write_csv(path, node_columns(result), node_rows(result))
        written.append(path)
    if "html" in formats:
        path = out_dir / "report.html"
        path.write_text(render_html(result, folder), encoding="utf-8")
        written.append(path)
    if "png" in formats:
        written += _write_png(result, out_dir / "error_curve.png")
    path = out_dir / "inputs.npz"
    save_npz(path, result.inputs)
    written.append(path)
    if "explorer" in formats:
        written += write_explorer(result, out_dir / EXPLORER_DIR)
    return written


def _write_png(result: BisectResult, path: Path) -> list[Path]:
    """error_curve.png, or a warning why not: a run without the plots extra still writes
    every other report (the default formats ask for the image)."""
    if not plots_available():
        logger.warning("error_curve.png not written: it needs matplotlib (%s)", PLOTS_HINT)
        return []
    png = curve_png(result)
    if png is None:
        logger.info("error_curve.png not written: no node has a measured error")
        return []
    path.write_bytes(png)
    return [path]


def _write_csv(path: Path, columns: Sequence[str], rows: list[dict[str, Any]]) -> None:
    """The nodes table as pandas would write it (NaN as empty), without importing pandas."""

    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(columns))
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


@dataclass(frozen=True)
class Published:
    """The result as published (its bundle's path where the bundle now lies), and what
    replacing the output directory's files did (None without an output directory)."""

    result: BisectResult
    replaced: Replaced | None

    @property
    def written(self) -> bool:
        return self.replaced is not None

    def kept_line(self) -> str | None:
        """A line naming what was left alone in the output directory, when anything was."""
        kept = self.replaced.kept if self.replaced else ()
        if self.replaced is None or not kept:
            return None
        shown = ", ".join(kept[:3]) + (", …" if len(kept) > 3 else "")
        return (
            f"kept {len(kept)} file(s) in {self.replaced.path}/ that onnx-bisect did not "
            f"write: {shown}"
        )


@dataclass(frozen=True)
class StagedOut:
    """A command's output directory while the command runs: everything goes to ``stage`` and
    reaches ``out`` at ``publish``. Without ``out`` there is nothing to write."""

    out: Path | None
    stage: Path | None
    bundle_name: str  # where in ``out`` the repro bundle goes ("" for ``out`` itself)
    owned: tuple[str, ...]

    @property
    def bundle(self) -> Path | None:
        return None if self.stage is None else self.stage / self.bundle_name

    def publish(self, result: BisectResult, formats: Sequence[str] = ()) -> Published:
        """Write the reports in ``formats`` beside the bundle, then swap the whole set into
        ``out``, replacing what an earlier run left there."""
        if self.out is None or self.stage is None:
            return Published(result, None)
        shown = self.out / self.bundle_name
        if result.repro is not None and Path(result.repro.path) == self.bundle:
            result = dataclasses.replace(
                result, repro=dataclasses.replace(result.repro, path=str(shown))
            )
        if formats:
            write_reports(result, self.stage, formats, shown_as=self.out)
        return Published(result, replace_owned(self.stage, self.out, self.owned))


@contextmanager
def staged_out(
    out: Path | None, *, bundle_name: str, owned: Sequence[str], reads: Sequence[Path] = ()
) -> Iterator[StagedOut]:
    """Check ``out`` now, before any work (``reads``: the files the run reads, the model),
    and stage what will be written to it; the staging directory is gone when the block ends,
    whether it was published or interrupted."""
    if out is None:
        yield StagedOut(None, None, bundle_name, tuple(owned))
        return
    check_out_dir(out, owned=owned, reads=reads)
    with staging_dir(out) as stage:
        yield StagedOut(out, stage, bundle_name, tuple(owned))
