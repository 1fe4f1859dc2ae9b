"""The console scripts' entry points (``cli``'s, with the float64 oracle started first).

``bisect`` with ``--threshold auto`` (the default) needs torch's float64 values; importing
torch takes 1.1–1.6 s. Starting its process here, before typer, onnxruntime, onnx and pandas
are imported (~0.6 s), lets that import run on another core while this process loads the
model and screens. The command line is only peeked at: a wrong guess starts a process that is
never used and is killed at exit.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

__all__ = ["bisect_entry", "main_entry", "wants_float64"]

# Flags after which the criterion is not a noise floor (auto applies to rel_l2 only).
_FIXED = ("--atol", "--rtol")
_NO_RUN = ("-h", "--help", "--version")
_IN_PROCESS_OR_ISOLATED = ("--isolate-crashes", "--no-isolate-crashes")


def wants_float64(args: Sequence[str]) -> bool:
    """Whether a ``bisect`` command line will (probably) measure float64 noise floors."""
    if any(a in _NO_RUN for a in args) or any(a.split("=")[0] in _FIXED for a in args):
        return False
    auto = _value(args, "--threshold", "auto") == "auto"
    return auto and _value(args, "--metric", "rel_l2") == "rel_l2"


def _value(args: Sequence[str], flag: str, default: str) -> str:
    value = default
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            value = args[i + 1]
        elif arg.startswith(flag + "="):
            value = arg.split("=", 1)[1]
    return value


def bisect_entry(args: Sequence[str] | None = None) -> None:
    """``bisect``; ``args`` default to the command line's."""
    argv = list(sys.argv[1:] if args is None else args)
    if args is None:
        _contain_reference(argv)
    with _prewarmed(wants_float64(argv)):
        from onnx_bisect.cli import bisect_entry as run

        run(args)


def main_entry(args: Sequence[str] | None = None) -> None:
    """``onnx-bisect``; ``args`` default to the command line's."""
    argv = list(sys.argv[1:] if args is None else args)
    if args is None and argv[:1] == ["run"]:
        _contain_reference(argv[1:])
    with _prewarmed(argv[:1] == ["run"] and wants_float64(argv[1:])):
        from onnx_bisect.cli import main_entry as run

        run(args)


def _contain_reference(args: Sequence[str]) -> None:
    """A diagnosis whose reference runs in this process (the default) runs in a forked child,
    so that the reference's crash is survived (``process.survive_reference_crash``); the
    target runs in a worker of its own already. Not with ``--isolate-crashes`` (the reference
    is in a worker then) nor ``--no-isolate-crashes`` (everything here, as asked), and only
    when the console script is the process's main program."""
    if any(a in _NO_RUN or a in _IN_PROCESS_OR_ISOLATED for a in args):
        return
    # Only as the process's own script: a caller that runs the entry point in its process
    # (a test, a wrapper) would go on in both the child and the parent after the command.
    main = getattr(sys.modules.get("__main__"), "__file__", None)
    if main is None or main != sys.argv[0]:
        return
    from onnx_bisect.process import survive_reference_crash

    survive_reference_crash()


@contextmanager
def _prewarmed(wanted: bool) -> Iterator[None]:
    """The oracle's process started first when ``wanted``; one the command did not use is
    stopped when it ends (in-process callers, tests, run many commands)."""
    if not wanted:
        yield
        return
    from onnx_bisect.engine.oracle import child as oracle_child

    oracle_child.prewarm()
    try:
        yield
    finally:
        oracle_child.discard()
