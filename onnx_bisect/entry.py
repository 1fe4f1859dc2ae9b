"""The console scripts' entry points (``cli``'s, with the float64 oracle started first).

``bisect`` with ``--threshold auto`` (the default) needs torch's float64 values; importing
torch takes 1.1–1.6 s. Starting its process here, before typer, onnxruntime, onnx and pandas
are imported (~0.6 s), lets that import run on another core while this process loads the
model and screens. The command line is only peeked at: a wrong guess starts a process that is
never used and is killed at exit.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

__all__ = ["bisect_entry", "main_entry", "single_threaded_blas", "wants_float64"]

# Flags after which the criterion is not a noise floor (auto applies to rel_l2 only).
_FIXED = ("--atol", "--rtol")
_NO_RUN = ("-h", "--help", "--version")


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


def single_threaded_blas() -> None:
    """numpy's BLAS in one thread unless the user says otherwise, set before numpy loads.
    The scan's metrics are dot products over every tensor; OpenBLAS's threads spinning
    beside ONNX Runtime's and the float64 oracle's made them 4x slower on two busy cores
    (YOLOv8n-320 QDQ: the two-model scan 25 s -> 3.8 s, the whole run 61 s -> 23 s)."""
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")


def bisect_entry(args: Sequence[str] | None = None) -> None:
    """``bisect``; ``args`` default to the command line's."""
    single_threaded_blas()
    argv = list(sys.argv[1:] if args is None else args)
    with _prewarmed(wants_float64(argv)):
        from onnx_bisect.cli import bisect_entry as run

        run(args)


def main_entry(args: Sequence[str] | None = None) -> None:
    """``onnx-bisect``; ``args`` default to the command line's."""
    single_threaded_blas()
    argv = list(sys.argv[1:] if args is None else args)
    with _prewarmed(argv[:1] == ["run"] and wants_float64(argv[1:])):
        from onnx_bisect.cli import main_entry as run

        run(args)


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
