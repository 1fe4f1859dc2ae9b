"""Reports: terminal summary, Markdown, JSON and CSV. The only package besides the CLI that
prints or writes files."""

from onnx_bisect.report.files import write_reports
from onnx_bisect.report.markdown import render_markdown
from onnx_bisect.report.terminal import print_summary

__all__ = ["print_summary", "render_markdown", "write_reports"]
