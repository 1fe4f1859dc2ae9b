"""Reports: terminal summary, Markdown, JSON, CSV, HTML and the error curve's PNG. The only
package besides the CLI that prints or writes report files."""

from onnx_bisect.report.files import write_bundle_docs, write_reports
from onnx_bisect.report.markdown import render_markdown
from onnx_bisect.report.serialize import node_rows, to_dict, to_frame
from onnx_bisect.report.terminal import print_summary

__all__ = [
    "node_rows",
    "print_summary",
    "render_markdown",
    "to_dict",
    "to_frame",
    "write_bundle_docs",
    "write_reports",
]
