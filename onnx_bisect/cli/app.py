"""The two console scripts, ``bisect`` and ``onnx-bisect``, and how their exit codes come out."""

from __future__ import annotations

import signal
import sys
import traceback
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from types import FrameType
from typing import Any

import typer
from typer.core import TyperCommand, TyperGroup

from onnx_bisect.cli.commands import (
    backends_command,
    dump_command,
    reduce_command,
    repro_command,
    run_command,
    view_command,
)
from onnx_bisect.cli.helptext import print_command_help, print_group_help
from onnx_bisect.cli.output import EXIT_INTERNAL, EXIT_USAGE, err
from onnx_bisect.cli.params import OUTPUTS, PANELS, VersionOpt
from onnx_bisect.cli.sweep import sweep_command
from onnx_bisect.leftovers import run_temp_dir
from onnx_bisect.process import return_large_frees, signal_handlers

__all__ = ["app", "bisect_app", "bisect_entry", "main_entry"]


def _flag_without_type(option: Any) -> Any:
    # typer labels the help flag <bool>, a Python type where the other flags show nothing.
    if option is not None:
        option.metavar = ""
        option.rich_help_panel = OUTPUTS  # with --version and --quiet, not a panel of its own
    return option


# Three commands a newcomer types first: their own inputs, a precision fixed, their runtime.
BISECT_EPILOG = """\b
Examples:
  bisect model.onnx --target openvino --input inputs.npz --out report
  bisect model.onnx --target 'openvino?precision=f32' --shape images=1x3x640x640
  bisect model.onnx -t 'exec:{python} my_rt.py {model} {inputs} {outputs}'

Exit codes: 0 no divergence, 1 divergence found, 2 usage or input error
(a reference that fails or crashes on the model included: the node is named),
3 internal error. The guide: docs/guide.md.
"""


class _Command(TyperCommand):
    def get_help_option(self, ctx: Any) -> Any:
        return _flag_without_type(super().get_help_option(ctx))

    def format_help(self, ctx: Any, formatter: Any) -> None:
        print_command_help(self, ctx, PANELS)


class _Group(TyperGroup):
    def get_help_option(self, ctx: Any) -> Any:
        return _flag_without_type(super().get_help_option(ctx))

    def format_help(self, ctx: Any, formatter: Any) -> None:
        print_group_help(self, ctx)


_HELP_FLAGS = {"help_option_names": ["-h", "--help"]}

app = typer.Typer(
    name="onnx-bisect",
    help="Find where an ONNX model's numbers go wrong on another backend.",
    epilog="`onnx-bisect run` is `bisect`: `bisect --help` lists its options, with examples.",
    cls=_Group,
    add_completion=False,
    context_settings=_HELP_FLAGS,
    pretty_exceptions_enable=False,
)
bisect_app = typer.Typer(
    add_completion=False, context_settings=_HELP_FLAGS, pretty_exceptions_enable=False
)

bisect_app.command(name="bisect", cls=_Command, epilog=BISECT_EPILOG)(run_command)
app.command("run", cls=_Command, help="Same as the `bisect` command.", epilog=BISECT_EPILOG)(
    run_command
)
app.command("reduce", cls=_Command)(reduce_command)
app.command("sweep", cls=_Command)(sweep_command)
app.command("repro", cls=_Command)(repro_command)
app.command("dump", cls=_Command)(dump_command)
app.command("backends", cls=_Command)(backends_command)
app.command("view", cls=_Command)(view_command)


@app.callback(invoke_without_command=True)
def _main(ctx: typer.Context, version: VersionOpt = False) -> None:
    # No command is a usage error, as in click and git: the help, then exit 2 (no "error:"
    # line, since the help says it all).
    if ctx.invoked_subcommand is None:
        text = ctx.get_help()  # rich prints it itself and returns ""
        if text:
            typer.echo(text)
        raise typer.Exit(EXIT_USAGE)


def _usage_error(exc: Exception) -> str:
    """typer's usage error as one line. A bad value reads like our own errors, flag first:
    ``--seed: 'x' is not an integer`` rather than ``Invalid value for '--seed': Value error,
    ...`` (the validation library's prefix for a parser's ValueError)."""
    kind = type(exc).__name__
    if kind == "MissingParameter":
        return _missing(exc)
    if type(exc) is typer.BadParameter and exc.param is not None and exc.param.opts:
        flag = max(exc.param.opts, key=len)
        return f"{flag}: {exc.message.removeprefix('Value error, ')}"
    ctx = getattr(exc, "ctx", None)
    see = f" ({ctx.command_path} --help)" if ctx is not None else ""
    if kind == "NoSuchOption":
        near = sorted(getattr(exc, "possibilities", None) or ())
        guess = f"; did you mean {', '.join(near)}?" if near else ""
        return f"{exc.option_name}: no such option{guess}{see}"  # type: ignore[attr-defined]
    if kind == "BadOptionUsage" and "requires an argument" in str(exc):
        return f"{exc.option_name}: needs a value{see}"  # type: ignore[attr-defined]
    # Anything else in the same shape as the rest: lower case, no full stop, where to look.
    said = str(exc.format_message()).rstrip(".")  # type: ignore[attr-defined]
    return f"{said[:1].lower()}{said[1:]}{see}"


# What a missing --target could be: the first thing a newcomer needs is a spec to copy.
_TARGET_EXAMPLE = (
    "name the backend under test, e.g. --target openvino, or --target "
    "'exec:{python} my_rt.py {model} {inputs} {outputs}' for your own runtime "
    "(onnx-bisect backends lists what works here)"
)


def _missing(exc: Any) -> str:
    """A missing argument or option in the tool's own style: what, then an example."""
    param, ctx = getattr(exc, "param", None), getattr(exc, "ctx", None)
    path = ctx.command_path if ctx is not None else "bisect"
    if param is None:
        return str(exc.format_message())
    if getattr(param, "param_type_name", "") == "argument":
        name = param.metavar or param.name.upper()
        if ctx is not None and ctx.info_name in ("bisect", "run"):
            return f"{name}: missing; e.g. {path} model.onnx --target openvino ({path} --help)"
        return f"{name}: missing ({path} --help)"
    flag = max(param.opts, key=len)
    if flag == "--target":
        return f"--target: missing; {_TARGET_EXAMPLE}"
    return f"{flag}: missing ({path} --help)"


EXIT_INTERRUPTED = 130  # 128 + SIGINT, as a shell reports a command that Ctrl-C stopped
# SIGTERM (a CI cancel, ``timeout``, ``kill``) and SIGHUP (a closed terminal) stop a run as
# Ctrl-C does; the exit code says which, as a shell reports it: 128 + the signal's number.
_STOP_SIGNALS = {signal.SIGTERM: "terminated (SIGTERM)", signal.SIGHUP: "hung up (SIGHUP)"}


class _Stopped(KeyboardInterrupt):
    """SIGTERM or SIGHUP, raised where Ctrl-C would be: every ``finally`` that removes a
    folder or ends a child's process group runs on the way out, as for Ctrl-C."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


_stopped: list[int] = []


def _stop(signum: int, frame: FrameType | None) -> None:
    _stopped.append(signum)
    # The cleanup on the way out must not be cut short by a second one (a supervisor's
    # repeated TERM); a second Ctrl-C still cuts a child's grace short, and SIGKILL is final.
    for other in _STOP_SIGNALS:
        signal.signal(other, signal.SIG_IGN)
    raise _Stopped(signum)


@contextmanager
def _stop_signals() -> Iterator[None]:
    """SIGTERM and SIGHUP raise ``_Stopped`` in the main thread while the command runs."""
    with signal_handlers(list(_STOP_SIGNALS), _stop):
        yield


def _entry(typer_app: typer.Typer, prog: str, args: Sequence[str] | None) -> None:
    """Run an app, turning usage errors into one line and exit code 2, and Ctrl-C, SIGTERM and
    SIGHUP into one line and 128 + the signal (staging directories and child processes are
    cleaned up on the way out, by the ``finally`` blocks that made them; every temporary
    folder is in the command's own, ``leftovers.run_temp_dir``, removed last)."""
    return_large_frees()  # the memory budget is a bound on resident memory (process.py)
    del _stopped[:]
    try:
        with _stop_signals(), run_temp_dir():
            code = typer_app(args=args, prog_name=prog, standalone_mode=False)
    except typer.Exit as exc:
        sys.exit(exc.exit_code)
    except (typer.Abort, KeyboardInterrupt):
        # Click (older Typer) turns Ctrl-C into Abort; outside a command it is bare.
        _interrupted()
    except Exception as exc:
        # Typer vendors click in some releases and not others; match its usage errors by shape.
        if hasattr(exc, "format_message") and hasattr(exc, "exit_code"):
            err.print(f"error: {_usage_error(exc)}", markup=False)
            sys.exit(EXIT_USAGE)
        # A bug outside a command's own handling (cli/output.user_errors): exit 3 still, not
        # Python's 1 for an uncaught exception, which reads "divergence found".
        if "--debug" in (sys.argv[1:] if args is None else args):
            err.print("".join(traceback.format_exception(exc)), markup=False, end="")
        err.print(f"error: internal error: {type(exc).__name__}: {exc}", markup=False)
        sys.exit(EXIT_INTERNAL)
    if code == EXIT_INTERRUPTED or _stopped:
        # Typer turns Ctrl-C into this code without a word; no command returns it otherwise.
        _interrupted()
    sys.exit(code if isinstance(code, int) else 0)


def _interrupted() -> None:
    if _stopped:
        err.print(_STOP_SIGNALS[signal.Signals(_stopped[0])], markup=False)
        sys.exit(128 + _stopped[0])
    err.print("interrupted", markup=False)
    sys.exit(EXIT_INTERRUPTED)


def bisect_entry(args: Sequence[str] | None = None) -> None:
    """``bisect``; ``args`` default to the command line's."""
    _entry(bisect_app, "bisect", args)


def main_entry(args: Sequence[str] | None = None) -> None:
    """``onnx-bisect``; ``args`` default to the command line's."""
    _entry(app, "onnx-bisect", args)
