"""What the CLI shows: exit codes, one-line errors on stderr, the stdout console."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import typer
from rich.console import Console

from onnx_bisect.cli.params import for_cli
from onnx_bisect.errors import OnnxBisectError

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


err = Console(stderr=True, highlight=False, soft_wrap=True)


@contextmanager
def user_errors(debug: bool) -> Iterator[None]:
    """What the user can fix: one line, exit 2. Anything else is our bug: one line, exit 3
    (the traceback with --debug)."""
    try:
        yield
    except OnnxBisectError as exc:
        fail(for_cli(exc))
    except typer.BadParameter as exc:
        fail(exc.message)
    except typer.Exit:
        raise
    except Exception as exc:
        if debug:
            raise
        fail(f"internal error: {type(exc).__name__}: {exc} (rerun with --debug)", EXIT_INTERNAL)


def stdout() -> Console:
    """Logs and CI capture are not terminals; 80 columns would fold every node name."""
    console = Console(highlight=False)
    if not console.is_terminal:
        console = Console(highlight=False, width=max(console.width, 140))
    return console


def fail(message: str, code: int = EXIT_USAGE) -> None:
    err.print(f"error: {' '.join(message.split())}", markup=False)
    raise typer.Exit(code)
