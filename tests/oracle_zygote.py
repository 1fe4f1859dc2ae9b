"""The float64 oracle's processes forked from one that has imported torch already.

For every ``--threshold auto`` diagnosis the product starts ``python -m
onnx_bisect.engine.oracle.child``; that process's import of torch costs 1.5-2 CPU seconds. The
suite runs a few hundred such diagnoses in-process, and those imports were nearly half of its
CPU time. Here a test worker starts one *zygote* (``python tests/oracle_zygote.py``), which
imports torch and the oracle's modules and then waits; each oracle process the product asks
for is a fork of it that runs the child module as ``__main__``, as ``python -m`` would, in the
asker's environment and directory, in a session of its own, on pipes the asker made. The
product's ``OracleChild`` drives it unchanged through ``ZygotePopen``, which has the parts of
``subprocess.Popen`` it uses: the pipes, ``pid``, ``poll``, ``wait``, ``kill`` and
``returncode`` (the zygote reaps the fork and sends its wait status).

So each diagnosis still gets a fresh process of its own, killed when the diagnosis is
cancelled; what differs is that it starts with torch imported, that numpy's BLAS runs one
thread in it as in the test workers (tests/blas.py), and that its parent is the zygote, not
the test worker. tests/test_float64_child.py (the child's own start) and tests
marked ``fresh_oracle`` run the product's ``python -m``; console-script subprocesses always
start their own.

Linux only (``socket.send_fds``, ``os.pidfd_open``, and fork after importing torch is safe
there while no torch op has run); elsewhere the product's own processes run.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import runpy
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import traceback
import weakref
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Any

__all__ = ["Zygote", "ZygotePopen", "supported"]

CHILD_MODULE = "onnx_bisect.engine.oracle.child"


def supported() -> bool:
    import importlib.util

    return (
        sys.platform == "linux"
        and hasattr(socket, "send_fds")
        and hasattr(os, "pidfd_open")
        and importlib.util.find_spec("torch") is not None
    )


# --- the test worker's side ----------------------------------------------------------------


class Zygote:
    """``python tests/oracle_zygote.py SOCKET``, started on first use; it ends when its stdin
    does (``close``, or this process dying)."""

    def __init__(self) -> None:
        self._dir = tempfile.mkdtemp(prefix="oracle-zygote-")
        self.address = str(Path(self._dir) / "socket")
        self._proc: subprocess.Popen[bytes] | None = None
        self._lock = threading.Lock()
        self.forks = 0

    def ensure(self) -> str:
        with self._lock:
            if self._proc is None or self._proc.poll() is not None:
                from onnx_bisect.process import python_child_env

                self._proc = subprocess.Popen(
                    [sys.executable, __file__, self.address],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    env=python_child_env(),
                    start_new_session=True,
                )
                assert self._proc.stdout is not None
                ready = self._proc.stdout.readline()
                if ready != b"ready\n":
                    raise RuntimeError(f"the oracle zygote did not start: {ready!r}")
            return self.address

    def popen(self, args: Sequence[str], **kwargs: Any) -> ZygotePopen:
        """``subprocess.Popen`` for ``oracle/child.py``: its one command, forked."""
        assert list(args[1:]) == ["-m", CHILD_MODULE], args
        assert kwargs.get("stdin") == kwargs.get("stdout") == kwargs.get("stderr")
        assert kwargs.get("stdin") == subprocess.PIPE and kwargs.get("start_new_session")
        self.forks += 1
        env = kwargs.get("env")
        return ZygotePopen(self.ensure(), list(args), dict(os.environ if env is None else env))

    def close(self) -> None:
        with self._lock:
            proc, self._proc = self._proc, None
        if proc is not None:
            assert proc.stdin is not None
            proc.stdin.close()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()
        with contextlib.suppress(OSError):
            os.unlink(self.address)
            os.rmdir(self._dir)


class ZygotePopen:
    """A forked oracle process, as ``subprocess.Popen(..., stdin=stdout=stderr=PIPE)``.

    Safe across threads as ``Popen`` is (the product kills from one thread while another
    waits): one thread reads the exit status at a time, and ``poll`` does not wait for it.
    The kill goes through a pidfd, so it can only reach this process, even after the zygote
    has reaped it and its pid is free again."""

    def __init__(self, address: str, args: list[str], env: Mapping[str, str]) -> None:
        self.args = args
        self.returncode: int | None = None
        self._lock = threading.Lock()
        ends = [os.pipe() for _ in range(3)]  # stdin, stdout, stderr: (read, write)
        theirs = [ends[0][0], ends[1][1], ends[2][1]]
        self._conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._conn.connect(address)
            socket.send_fds(self._conn, [b"F"], theirs)
            request = {"env": dict(env), "cwd": os.getcwd()}
            self._conn.sendall(json.dumps(request).encode() + b"\n")
        finally:
            for fd in theirs:
                os.close(fd)
        self._replies = self._conn.makefile("rb")
        self.pid = int(self._replies.readline())
        # The fork lives until its stdin (ours) closes or it is killed: it is not reaped yet.
        # Open as long as this object is, so that a kill racing the wait never meets a reused fd.
        self._pidfd = os.pidfd_open(self.pid)
        weakref.finalize(self, os.close, self._pidfd)
        self.stdin: IO[bytes] = os.fdopen(ends[0][1], "wb")
        self.stdout: IO[bytes] = os.fdopen(ends[1][0], "rb")
        self.stderr: IO[bytes] = os.fdopen(ends[2][0], "rb")

    def _reaped(self, timeout: float | None) -> bool:
        """Whether the exit status is in; waits up to ``timeout`` (None: for ever)."""
        if self.returncode is not None:
            return True
        if not self._lock.acquire(timeout=-1 if timeout is None else timeout):
            return False  # another thread is reading it
        try:
            if self.returncode is not None:
                return True
            if timeout is not None and not select.select([self._conn], [], [], timeout)[0]:
                return False
            line = self._replies.readline()  # the zygote's waitpid status, once it has reaped
            self.returncode = os.waitstatus_to_exitcode(int(line)) if line else -signal.SIGKILL
            self._replies.close()
            self._conn.close()
            return True
        finally:
            self._lock.release()

    def poll(self) -> int | None:
        self._reaped(0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._reaped(timeout):
            raise subprocess.TimeoutExpired(self.args, timeout or 0)
        assert self.returncode is not None
        return self.returncode

    def kill(self) -> None:
        if self.poll() is None:  # None too while another thread waits: that one is unblocked
            with contextlib.suppress(ProcessLookupError):  # it has just ended
                signal.pidfd_send_signal(self._pidfd, signal.SIGKILL)


# --- the zygote ----------------------------------------------------------------------------


def _serve(address: str) -> None:
    import torch  # noqa: F401  -- what every fork would import first

    import onnx_bisect.backends.torch  # noqa: F401
    import onnx_bisect.backends.torch.interpreter  # noqa: F401
    import onnx_bisect.engine.oracle.child  # noqa: F401
    import onnx_bisect.engine.oracle.job  # noqa: F401
    from tests.blas import limit_blas_threads

    limit_blas_threads(1)  # as in the test workers (tests/blas.py): the forks inherit it
    gc.freeze()  # a fork's collections then leave these objects', and so their pages', alone

    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(address)
    listener.listen(16)
    # The worker's end of our stdin closing (it closed us, or it died) ends us; read with
    # os.read, so that no lock of sys.stdin's is held in a fork.
    threading.Thread(target=_exit_at_eof, daemon=True).start()
    os.write(1, b"ready\n")
    while True:
        conn, _ = listener.accept()
        _, fds, _, _ = socket.recv_fds(conn, 1, 3)
        request = json.loads(conn.makefile("rb").readline())
        pid = os.fork()
        if pid == 0:
            listener.close()
            _become_child(conn, fds, request)
        for fd in fds:
            os.close(fd)
        conn.sendall(f"{pid}\n".encode())
        threading.Thread(target=_report_exit, args=(conn, pid), daemon=True).start()


def _exit_at_eof() -> None:
    while os.read(0, 4096):
        pass
    os._exit(0)


def _report_exit(conn: socket.socket, pid: int) -> None:
    _, status = os.waitpid(pid, 0)
    with contextlib.suppress(OSError), conn:
        conn.sendall(f"{status}\n".encode())


def _become_child(conn: socket.socket, fds: list[int], request: dict[str, Any]) -> None:
    """In the fork: what ``python -m onnx_bisect.engine.oracle.child`` would be."""
    code = 1
    try:
        conn.close()
        os.setsid()
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
        os.closerange(3, os.sysconf("SC_OPEN_MAX") if hasattr(os, "sysconf") else 1024)
        os.environ.clear()
        os.environ.update(request["env"])
        extra = [p for p in request["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
        sys.path[:0] = [p for p in extra if p not in sys.path]
        os.chdir(request["cwd"])
        signal.signal(signal.SIGINT, signal.default_int_handler)
        try:
            runpy.run_module(CHILD_MODULE, run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 0 if exc.code is None else 1
    except BaseException:
        traceback.print_exc()
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


if __name__ == "__main__":
    _serve(sys.argv[1])
