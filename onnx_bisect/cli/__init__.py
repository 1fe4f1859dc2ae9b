"""Command line: ``bisect MODEL ...`` and ``onnx-bisect SUBCOMMAND ...``; a thin layer over the API.

Exit codes: 0 no divergence, 1 divergence found, 2 usage or input error, 3 internal error.
"""

from onnx_bisect.cli.app import app, bisect_app, bisect_entry, main_entry
from onnx_bisect.cli.output import EXIT_DIVERGED, EXIT_INTERNAL, EXIT_MATCH, EXIT_USAGE

__all__ = [
    "EXIT_DIVERGED",
    "EXIT_INTERNAL",
    "EXIT_MATCH",
    "EXIT_USAGE",
    "app",
    "bisect_app",
    "bisect_entry",
    "main_entry",
]
