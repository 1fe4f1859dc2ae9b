"""The two console scripts, ``bisect`` and ``onnx-bisect``, and how their exit codes come out."""

from __future__ import annotations

import sys

import typer

from onnx_bisect.cli.commands import (
    backends_command,
    dump_command,
    reduce_command,
    repro_command,
    run_command,
)
from onnx_bisect.cli.output import EXIT_USAGE, err

__all__ = ["app", "bisect_app", "bisect_entry", "main_entry"]

app = typer.Typer(
    name="onnx-bisect",
    help="Find where an ONNX model's numbers go wrong on another backend.",
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)
bisect_app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)

bisect_app.command(name="bisect")(run_command)
app.command("run", help="Same as the `bisect` command.")(run_command)
app.command("reduce")(reduce_command)
app.command("repro")(repro_command)
app.command("dump")(dump_command)
app.command("backends")(backends_command)


EXIT_INTERRUPTED = 130  # 128 + SIGINT, as a shell reports a command that Ctrl-C stopped


def _entry(typer_app: typer.Typer, prog: str) -> None:
    """Run an app, turning usage errors into one line and exit code 2, and Ctrl-C into one
    line and 130 (staging directories and child processes are cleaned up on the way out, by
    the ``finally`` blocks that made them)."""
    try:
        code = typer_app(prog_name=prog, standalone_mode=False)
    except typer.Exit as exc:
        sys.exit(exc.exit_code)
    except (typer.Abort, KeyboardInterrupt):
        # Click (older Typer) turns Ctrl-C into Abort; outside a command it is bare.
        _interrupted()
    except Exception as exc:
        # Typer vendors click in some releases and not others; match its usage errors by shape.
        if hasattr(exc, "format_message") and hasattr(exc, "exit_code"):
            err.print(f"error: {exc.format_message()}", markup=False)
            sys.exit(EXIT_USAGE)
        raise
    if code == EXIT_INTERRUPTED:
        # Typer turns Ctrl-C into this code without a word; no command returns it otherwise.
        _interrupted()
    sys.exit(code if isinstance(code, int) else 0)


def _interrupted() -> None:
    err.print("interrupted", markup=False)
    sys.exit(EXIT_INTERRUPTED)


def bisect_entry() -> None:
    _entry(bisect_app, "bisect")


def main_entry() -> None:
    _entry(app, "onnx-bisect")
