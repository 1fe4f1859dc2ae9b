"""The float64 oracle in a process of its own, started as early as the command line can.

``--threshold auto`` needs every probe in float64, from torch, whose import alone takes
1.1–1.6 s on two cores. In a thread beside the screen that import holds the GIL and the
import lock, and measured slower than doing it first (2.24 s vs 1.93 s). In a child process
started by the console script before it imports onnxruntime, onnx and pandas, the import runs
on the other core while this process loads, prepares and screens; the values come back as
.npy files that the parent maps, so only their writing is paid twice.

Protocol: one JSON job per line on the child's stdin, one JSON answer per line on its
stdout (the answer to a job is ``{"ok": ...}`` or ``{"error": ..., "kind": ...}``). End of
input ends the child, so a parent that dies takes its child with it.

This module imports only the standard library at the top: the console script imports it
before anything heavy.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import subprocess
import sys
import threading
from collections.abc import Mapping
from typing import IO, Any

__all__ = ["OracleChild", "answer_jobs", "discard", "prewarm", "take_child"]


class OracleChild:
    """A running ``python -m onnx_bisect.engine.oracle.child``, importing torch meanwhile."""

    def __init__(self) -> None:
        from onnx_bisect.process import python_child_env

        # A session of its own: the terminal's Ctrl-C is ours to handle, and the child
        # must not print a KeyboardInterrupt traceback beside our one-line "interrupted".
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "onnx_bisect.engine.oracle.child"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=python_child_env(),
            start_new_session=os.name == "posix",
        )
        self._stderr: list[bytes] = []
        # Drained as it comes, so that a chatty child never blocks on a full pipe.
        self._drain = threading.Thread(target=self._read_stderr, daemon=True)
        self._drain.start()
        atexit.register(self.close)

    def _read_stderr(self) -> None:
        assert self._proc.stderr is not None
        for line in self._proc.stderr:
            self._stderr.append(line)

    def compute(self, job: Mapping[str, Any]) -> dict[str, Any]:
        """Send ``job`` and wait for its answer. A child that died raises ``ChildProcessError``
        with the end of what it wrote to stderr."""
        proc = self._proc
        assert proc.stdin is not None and proc.stdout is not None
        try:
            proc.stdin.write(json.dumps(dict(job)).encode() + b"\n")
            proc.stdin.flush()
            line = proc.stdout.readline()
        except (BrokenPipeError, OSError):
            line = b""
        if not line:
            proc.wait()
            self._drain.join(timeout=1)
            tail = b"".join(self._stderr).decode(errors="replace").strip().splitlines()[-3:]
            raise ChildProcessError(
                f"the float64 oracle's process exited ({proc.returncode})"
                + (f": {' '.join(tail)}" if tail else "")
            )
        answer: dict[str, Any] = json.loads(line)
        return answer

    def kill(self) -> None:
        """Stop the process; a ``compute`` waiting on it then raises ``ChildProcessError``."""
        if self._proc.poll() is None:
            self._proc.kill()

    def close(self) -> None:
        self.kill()
        self._proc.wait()
        for pipe in (self._proc.stdin, self._proc.stdout):
            if pipe is not None:
                with contextlib.suppress(OSError):  # a dead reader: unflushed bytes go nowhere
                    pipe.close()


_prewarmed: OracleChild | None = None


def prewarm() -> None:
    """Start the oracle's process now, for the next ``take_child`` (when torch is here)."""
    global _prewarmed
    import importlib.util

    if _prewarmed is None and importlib.util.find_spec("torch") is not None:
        _prewarmed = OracleChild()


def take_child() -> OracleChild:
    """The prewarmed child, else a new one. Each is used for one job, then closed."""
    global _prewarmed
    child, _prewarmed = _prewarmed, None
    return child if child is not None else OracleChild()


def discard() -> None:
    """Stop a prewarmed child nobody took."""
    global _prewarmed
    child, _prewarmed = _prewarmed, None
    if child is not None:
        child.close()


def answer_jobs(stdin: IO[bytes], stdout: IO[bytes]) -> None:
    """The child's loop: import torch first, then answer each job line until end of input."""
    import torch  # noqa: F401  -- the point of this process: imported while the parent works

    from onnx_bisect.engine.oracle.job import run_job

    for line in stdin:
        try:
            answer: dict[str, Any] = {"ok": run_job(json.loads(line))}
        except Exception as exc:  # answered, to fall back to the next oracle  # noqa: BLE001
            from onnx_bisect.errors import BackendUnavailableError

            kind = "unavailable" if isinstance(exc, BackendUnavailableError) else "error"
            answer = {"error": f"{type(exc).__name__}: {exc}", "kind": kind}
        stdout.write(json.dumps(answer).encode() + b"\n")
        stdout.flush()


if __name__ == "__main__":
    # Protocol lines only on the real stdout; anything a library prints goes to stderr.
    protocol = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    answer_jobs(sys.stdin.buffer, protocol)
