"""Child processes: of our own interpreter (sandboxed backends, transforms) or of any program
(exec: runtimes, a bundle's repro.py), run so that nothing they start outlives them."""

from __future__ import annotations

import contextlib
import ctypes
import os
import selectors
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import IO, Any

__all__ = [
    "REF_WORKER_ENV",
    "ERROR_FILE_VARIABLE",
    "INTERRUPT_GRACE_S",
    "python_child_env",
    "return_large_frees",
    "run_child",
    "signal_handlers",
    "start_server",
    "survive_reference_crash",
    "stop_child",
]

# How long a child has to clean up after Ctrl-C (a repro.py kills its own target's process
# group then) before its whole group is killed.
INTERRUPT_GRACE_S = 5.0


# Where the CLI writes the class and text of the error it exits 2 with, when set: a sweep's
# case (cases/child.py) takes its stage from the error's type, not its wording.
ERROR_FILE_VARIABLE = "ONNX_BISECT_ERROR_FILE"


# glibc's mallopt parameter number for the mmap threshold.
_M_MMAP_THRESHOLD = -3
_MMAP_THRESHOLD = 1 << 20


def return_large_frees() -> bool:
    """Make every allocation of 1 MiB or more a mapping of its own, returned to the system
    when freed. glibc otherwise raises its threshold to the largest block freed (up to 32 MiB),
    serves tensors of that size from its heap and keeps what they free: each run's peak then
    sits on the last one's leftovers (on a conv net with 4 MiB tensors, ~90 MB more under
    torch, ~40 MB under ONNX Runtime). Process-wide, so the CLI calls it, not the library.
    False where the C library is not glibc."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD))
    except (OSError, AttributeError):
        return False


def python_child_env() -> dict[str, str]:
    """The environment for a ``python -m onnx_bisect....`` child: it must import what we
    import (plugins on sys.path, tests' own modules); our "" is the working folder."""
    return dict(os.environ, PYTHONPATH=os.pathsep.join(p or os.getcwd() for p in sys.path))


def run_child(
    argv: Sequence[str],
    *,
    timeout: float | None = None,
    env: Mapping[str, str] | None = None,
    cwd: str | None = None,
    started: Callable[[int], None] | None = None,
) -> subprocess.CompletedProcess[bytes]:
    """Run ``argv`` to completion with its output captured, in a process group of its own.

    Like ``subprocess.run``, it raises ``TimeoutExpired`` past ``timeout``; but it kills the
    whole group then (a runtime's workers with it). Unlike it, the output is read until the
    child exits, not until every process holding its pipes does: what it left running in its
    group is killed then, and one that left the group is not waited for (``_collect``). On
    Ctrl-C, SIGTERM or any other exception it
    forwards SIGINT to the group, waits ``INTERRUPT_GRACE_S`` for it to clean up, and kills
    what is left: in a session of its own, the child does not get the terminal's SIGINT, and
    it must not outlive us. Where nothing of ours runs any more (SIGKILL), the kernel kills
    the child (Linux's parent-death signal). ``started`` is told the child's pid (a sweep
    samples the memory of its tree).
    """
    proc = subprocess.Popen(
        list(argv),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=dict(env) if env is not None else None,
        cwd=cwd,
        start_new_session=os.name == "posix",
        preexec_fn=_dies_with_parent(),
    )
    try:
        if started is not None:
            started(proc.pid)
        out, err = _collect(proc, timeout)
    except subprocess.TimeoutExpired:
        _signal_group(proc, signal.SIGKILL)
        _reap(proc)
        raise
    except BaseException:
        try:
            _signal_group(proc, signal.SIGINT)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(INTERRUPT_GRACE_S)
        finally:
            # Even when a second Ctrl-C cuts the grace short.
            _signal_group(proc, signal.SIGKILL)
            _reap(proc)
        raise
    return subprocess.CompletedProcess(list(argv), proc.returncode, out, err)


_PR_SET_PDEATHSIG = 1
# Long-lived children are started from this one thread: Linux's parent-death signal fires when
# the thread that started a child exits, and a run may ask for a child from a pool's thread
# (isolation's, the screen's pair) that ends long before the child should.
_STARTER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="onnx-bisect-starter")


def start_server(
    argv: Sequence[str], *, env: Mapping[str, str] | None = None, stderr: IO[bytes]
) -> subprocess.Popen[bytes]:
    """Start ``argv``, a child that serves requests on its stdin and answers on its stdout, in
    a process group of its own that dies with us (see ``_dies_with_parent``); its stderr goes
    to ``stderr``. ``stop_child`` ends it with whatever it started."""

    def start() -> subprocess.Popen[bytes]:
        return subprocess.Popen(
            list(argv),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=stderr,
            env=dict(env) if env is not None else None,
            start_new_session=os.name == "posix",
            preexec_fn=_dies_with_parent(),
        )

    return _STARTER.submit(start).result()


def stop_child(proc: subprocess.Popen[bytes]) -> None:
    """Kill ``proc``'s whole group and reap it (a no-op on one that was stopped already)."""
    if proc.returncode is None:
        _signal_group(proc, signal.SIGKILL)
    _reap(proc)
    if proc.stdin is not None:
        with contextlib.suppress(OSError):
            proc.stdin.close()


def _dies_with_parent() -> Callable[[], None] | None:
    """For the child, between fork and exec: SIGKILL when the thread that started it dies, as
    it does when we are killed with SIGKILL and no ``finally`` runs (Linux only). The C
    function is looked up here, so that the forked child calls it and nothing else."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def arm() -> None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent:  # died before the signal was armed
            os._exit(1)

    return arm


# After the child exits, how long what it wrote may still take to arrive through its pipes
# from processes that left its group and hold them open.
_DRAIN_S = 0.5
_POLL_S = 0.05


def _collect(proc: subprocess.Popen[bytes], timeout: float | None) -> tuple[bytes, bytes]:
    """The child's stdout and stderr, read until it exits. ``communicate`` would wait for end
    of file, which never comes while a descendant (a runtime's ``sleep 1000 &``, a daemon)
    holds a pipe: the tool hung forever, or until ``--timeout`` called a success a hang."""
    assert proc.stdout is not None and proc.stderr is not None
    if os.name != "posix":  # no selectable pipes; no process groups either
        return proc.communicate(timeout=timeout)
    deadline = None if timeout is None else time.monotonic() + timeout
    chunks: dict[int, list[bytes]] = {proc.stdout.fileno(): [], proc.stderr.fileno(): []}
    exited: float | None = None
    with selectors.DefaultSelector() as sel:
        for fd in chunks:
            os.set_blocking(fd, False)
            sel.register(fd, selectors.EVENT_READ)
        while sel.get_map():
            now = time.monotonic()
            if exited is None and _exited(proc):
                exited = now
                # Nothing it started outlives it (a member of its group holds the pipes).
                # Not reaped yet: its pid, and so its group's id, cannot have been reused.
                _signal_group(proc, signal.SIGKILL)
            if exited is not None and now - exited > _DRAIN_S:
                break
            if exited is None and deadline is not None and now >= deadline:
                raise subprocess.TimeoutExpired(proc.args, timeout or 0.0)
            for key, _ in sel.select(_POLL_S):
                data = os.read(key.fd, 1 << 16)
                if data:
                    chunks[key.fd].append(data)
                else:
                    sel.unregister(key.fd)
    proc.wait()
    out, err = (b"".join(chunks[p.fileno()]) for p in (proc.stdout, proc.stderr))
    proc.stdout.close()
    proc.stderr.close()
    return out, err


def _exited(proc: subprocess.Popen[bytes]) -> bool:
    """Whether the child has exited, without reaping it (``poll`` would)."""
    if not hasattr(os, "waitid"):  # macOS
        return proc.poll() is not None
    try:
        return os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:  # reaped already
        return True


def _signal_group(proc: subprocess.Popen[bytes], sig: int) -> None:
    """``sig`` to the child's group (the child alone where there are no groups); members that
    outlived their leader still get it."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        if os.name == "posix":
            os.killpg(proc.pid, sig)
        else:
            proc.kill()


def _reap(proc: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=5)
    for pipe in (proc.stdout, proc.stderr):
        if pipe is not None:
            pipe.close()


@contextlib.contextmanager
def signal_handlers(signals: Sequence[int], handler: Callable[[int, Any], None]) -> Iterator[None]:
    """``handler`` for ``signals`` while the block runs, the previous ones restored after. Only
    the main thread may set handlers (an embedding application's thread runs the block bare);
    Python delivers signals to the main thread anyway."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.signal(s, handler) for s in signals}
    try:
        yield
    finally:
        for s, old in previous.items():
            signal.signal(s, old if old is not None else signal.SIG_DFL)


# Set for a command run again after the tool died of a crash signal: the reference then runs
# in a worker process (``engine/diagnose.py``), where its crash is an error that names a node.
REF_WORKER_ENV = "ONNX_BISECT_REF_IN_WORKER"
# What a runtime's crash in this process ends it with (Rust's panic aborts: SIGABRT).
_CRASH_SIGNALS = frozenset(
    {signal.SIGSEGV, signal.SIGABRT, signal.SIGBUS, signal.SIGILL, signal.SIGFPE}
)
_FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)


def survive_reference_crash() -> None:
    """Run the rest of this command in a forked child and wait for it here; when the child
    dies of a crash signal (the reference, which runs in this process, segfaulted or
    aborted), return in this process with ``REF_WORKER_ENV`` set, to run the command again
    with the reference in a worker. Otherwise end as the child ended (its exit code, or its
    signal raised again here).

    Nothing is paid per run: one fork before the command's heavy imports (the pages shared;
    the child's later work measured at the same CPU as without it), and a parent that
    sleeps in ``waitpid``. The work before a crash is done again, which a
    crash alone pays for (docs/architecture.md, "The reference's crash"). Linux only;
    elsewhere the command runs here, unsupervised."""
    # Linux only: macOS's system libraries are not fork-safe once loaded (numpy's
    # Accelerate), Windows has no fork.
    if not sys.platform.startswith("linux") or os.environ.get(REF_WORKER_ENV):
        return
    sys.stdout.flush()
    sys.stderr.flush()
    arm = _dies_with_parent()  # killed with SIGKILL, this process takes the command along
    pid = os.fork()
    if pid == 0:
        if arm is not None:
            arm()
        return
    status = _wait_forwarding(pid)
    if os.WIFEXITED(status):
        raise SystemExit(os.WEXITSTATUS(status))
    sig = os.WTERMSIG(status)
    if sig in _CRASH_SIGNALS:
        os.environ[REF_WORKER_ENV] = signal.Signals(sig).name  # said in the report's notes
        return
    signal.signal(sig, signal.SIG_DFL)
    os.kill(os.getpid(), sig)
    raise SystemExit(128 + sig)


def _wait_forwarding(pid: int) -> int:
    """``pid``'s wait status; the signals that stop a command, sent to this process, passed
    on to it. A Ctrl-C at a terminal reaches the child itself (one process group): one that
    this process's group gets as the terminal's foreground group is not sent twice."""

    def forward(signum: int, _frame: object) -> None:
        if signum in (signal.SIGINT, signal.SIGQUIT, signal.SIGHUP) and _terminal_sent():
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signum)

    for sig in _FORWARDED:
        signal.signal(sig, forward)
    while True:
        done, status = os.waitpid(pid, 0)  # retried after a handler (PEP 475)
        if done == pid:
            return status


def _terminal_sent() -> bool:
    """Whether a terminal's signal (Ctrl-C) reached our whole process group: ours is its
    foreground group."""
    for fd in (0, 1, 2):
        with contextlib.suppress(OSError):
            return os.tcgetpgrp(fd) == os.getpgrp()
    return False
