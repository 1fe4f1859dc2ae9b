"""What the CLI shows: exit codes, one-line errors on stderr, the stdout console."""

from __future__ import annotations

import contextlib
import json
import os
import sys
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import typer
from rich.console import Console

from onnx_bisect.cli.params import for_cli
from onnx_bisect.errors import OnnxBisectError
from onnx_bisect.process import ERROR_FILE_VARIABLE

__all__ = [
    "EXIT_DIVERGED",
    "EXIT_INTERNAL",
    "EXIT_MATCH",
    "EXIT_USAGE",
    "err",
    "fail",
    "stdout",
    "user_errors",
]

EXIT_MATCH, EXIT_DIVERGED, EXIT_USAGE, EXIT_INTERNAL = 0, 1, 2, 3
# The width a pipe gets: wider than any line, so none is broken (rich has no "unlimited").
UNWRAPPED = 1 << 20


err = Console(stderr=True, highlight=False, soft_wrap=True)


@contextmanager
def user_errors(debug: bool) -> Iterator[None]:
    """What the user can fix: one line, exit 2. Anything else is our bug: one line, exit 3,
    the traceback before it with --debug. --debug never changes the code: re-raising would
    let Python exit 1, which reads "divergence found"."""
    try:
        yield
    except OnnxBisectError as exc:
        _record(exc)
        fail(for_cli(exc))
    except typer.BadParameter as exc:
        fail(exc.message)
    except typer.Exit:
        raise
    except Exception as exc:
        if debug:
            err.print("".join(traceback.format_exception(exc)), markup=False, end="")
            fail(f"internal error: {type(exc).__name__}: {exc}", EXIT_INTERNAL)
        fail(f"internal error: {type(exc).__name__}: {exc} (rerun with --debug)", EXIT_INTERNAL)


def _record(exc: OnnxBisectError) -> None:
    """The error's class and text to the file a sweep named (process.ERROR_FILE_VARIABLE)."""
    path = os.environ.get(ERROR_FILE_VARIABLE)
    if path:
        text = json.dumps({"class": type(exc).__name__, "message": for_cli(exc)})
        with contextlib.suppress(OSError):
            Path(path).write_text(text)


def stdout() -> Console:
    """A terminal's own width; anything else (a pipe, a file, CI logs) is never wrapped, so
    each line stays whole for grep and diff, and a table takes its natural width."""
    if sys.stdout.isatty():
        return Console(highlight=False)
    return Console(highlight=False, width=UNWRAPPED)


def fail(message: str, code: int = EXIT_USAGE) -> None:
    err.print(f"error: {' '.join(message.split())}", markup=False)
    raise typer.Exit(code)
