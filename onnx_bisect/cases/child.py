"""One case in a child process: the ``bisect`` command itself, in a process group of its own
(``process.run_child``), its report.json read back into a ``CaseResult``.

A child, even for an in-process runtime: a runtime that segfaults or aborts, hangs or is
killed for memory takes down its case's process, never the sweep. A case whose process died
by a signal is run once more with ``--isolate-crashes`` (the target in a grandchild per run),
so that its row names the node the target dies on; one that ran past the case's timeout is a
hang.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

from onnx_bisect.cases.plan import Case, CaseOptions, bisect_args, repro_command
from onnx_bisect.cases.verdict import from_error, from_report, from_signal
from onnx_bisect.process import ERROR_FILE_VARIABLE, python_child_env, run_child
from onnx_bisect.sweep_result import CaseResult

__all__ = ["Ran", "kill_running", "new_sweep", "run_case"]

# ``bisect`` as its console script runs it (the float64 oracle started first), named so in
# sys.argv so that the report's command is the one typed.
_BISECT = (
    "import sys; sys.argv[0] = 'bisect'; from onnx_bisect.entry import bisect_entry; bisect_entry()"
)
_SAMPLE_S = 0.25

# The process groups of the cases running now (in threads): Ctrl-C reaches the main thread
# only, and each case runs in a session of its own, so the sweep ends them itself.
_running: set[int] = set()
_lock = threading.Lock()
# Set by kill_running: a case killed so is not run again to name a crash it never had.
_stopping = threading.Event()


def new_sweep() -> None:
    """Cases may run again (after an earlier sweep in this process was stopped)."""
    _stopping.clear()


def kill_running() -> None:
    """SIGKILL to every case's process group that is running now; the cases under way return
    at once (none is run again)."""
    with _lock:
        _stopping.set()
        groups = list(_running)
    for group in groups:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(group, signal.SIGKILL)


@dataclass(frozen=True)
class Ran:
    """What one run of a case's process left: exit code (negative: the signal), the seconds,
    the peak resident memory of its tree, whether it timed out, its stderr's last line."""

    code: int
    seconds: float
    peak: int | None
    hung: bool
    last: str


def run_case(
    case: Case,
    options: CaseOptions,
    out: Path,
    *,
    folder: Path | None = None,
    env: Mapping[str, str] | None = None,
    model: Path | None = None,
    inputs: Path | None = None,
) -> CaseResult:
    """Diagnose ``case`` of the sweep writing to ``out``, with its reports in ``folder``
    (default: its own, ``out/<model>/<slug>``; elsewhere on a Ray worker, as are ``model`` and
    ``inputs``, its copies of the case's files). The row names the case's folder relative to
    ``out``, and its command writes there."""
    folder = out / case.folder if folder is None else folder
    folder.mkdir(parents=True, exist_ok=True)
    where = case.folder
    run = partial(_run, case, options, folder, env=env, model=model, inputs=inputs)
    ran, error = run(isolate=False)
    seconds, peak = ran.seconds, ran.peak
    isolated = ran.code < 0 and not (ran.hung or options.isolate_crashes or _stopping.is_set())
    if isolated:
        # Died by a signal: once more with the target in a child per run, to name the node.
        again, error = run(isolate=True)
        seconds += again.seconds
        peak = max((p for p in (peak, again.peak) if p is not None), default=None)
        report = _report(folder) if again.code in (0, 1) else None
        result = from_signal(case, ran.code, hung=False, report=report, where=where)
    elif ran.hung or ran.code < 0:
        result = from_signal(
            case, ran.code, hung=ran.hung, report=None, where=where, limit=options.case_timeout
        )
    elif ran.code in (0, 1) and (report := _report(folder)) is not None:
        result = from_report(case, report, where=where)
    else:
        result = from_error(case, ran.code, error, ran.last, where=where)
    command = repro_command(case, options, out / case.folder, isolate=isolated)
    return replace(
        result, seconds=round(seconds, 3), peak_memory=peak, command=command, exit_code=ran.code
    )


def _run(
    case: Case,
    options: CaseOptions,
    folder: Path,
    *,
    env: Mapping[str, str] | None,
    model: Path | None,
    inputs: Path | None,
    isolate: bool,
) -> tuple[Ran, dict[str, Any] | None]:
    args = bisect_args(case, options, folder, model=model, inputs=inputs, isolate=isolate)
    with tempfile.TemporaryDirectory(prefix="onnx-bisect-case-") as scratch:
        error_file = Path(scratch) / "error.json"
        child_env = {**python_child_env(), **(env or {}), ERROR_FILE_VARIABLE: str(error_file)}
        ran = _timed([sys.executable, "-c", _BISECT, *args], options.case_timeout, child_env)
        error = None
        with contextlib.suppress(OSError, ValueError):
            error = json.loads(error_file.read_text())
    return ran, error


def _timed(argv: list[str], timeout: float | None, env: Mapping[str, str]) -> Ran:
    start = time.perf_counter()
    peak: list[int] = []
    with _watched(peak) as started:
        try:
            done = run_child(argv, timeout=timeout, env=env, started=started)
        except subprocess.TimeoutExpired:
            return Ran(-9, time.perf_counter() - start, max(peak, default=None), True, "")
    lines = done.stderr.decode(errors="replace").strip().splitlines()
    seconds = time.perf_counter() - start
    return Ran(done.returncode, seconds, max(peak, default=None), False, lines[-1] if lines else "")


@contextlib.contextmanager
def _watched(peaks: list[int]) -> Iterator[Callable[[int], None]]:
    """A callback for the child's pid: its group is registered (``kill_running``) and its
    tree's resident memory (the sum over its processes) sampled every 0.25 s into ``peaks``
    (with psutil, where it is installed) until the block ends."""
    stop = threading.Event()
    threads: list[threading.Thread] = []
    pids: list[int] = []

    def started(pid: int) -> None:
        with _lock:
            _running.add(pid)
            pids.append(pid)
            if _stopping.is_set():  # started as the sweep was being stopped
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(pid, signal.SIGKILL)
        if importlib.util.find_spec("psutil") is not None:
            thread = threading.Thread(target=_sample, args=(pid, peaks, stop), daemon=True)
            threads.append(thread)
            thread.start()

    try:
        yield started
    finally:
        with _lock:
            _running.difference_update(pids)
        stop.set()
        for thread in threads:
            thread.join()


def _sample(pid: int, peaks: list[int], stop: threading.Event) -> None:
    import psutil  # type: ignore[import-untyped]

    with contextlib.suppress(psutil.Error):
        root = psutil.Process(pid)
        while not stop.is_set():
            total = 0
            for proc in [root, *root.children(recursive=True)]:
                with contextlib.suppress(psutil.Error):
                    total += proc.memory_info().rss
            peaks.append(total)
            stop.wait(_SAMPLE_S)


def _report(folder: Path) -> dict[str, Any] | None:
    try:
        data = json.loads((folder / "report.json").read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None
