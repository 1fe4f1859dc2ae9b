"""An in-process runtime run in child processes of this package, so that a segfault, an abort
or a Rust panic ends a child, not the tool.

``WorkerBackend`` wraps the backend built here (which answers for its spec, versions,
precision, passes and static types, and never runs) and sends every run to a child, ``python -m
onnx_bisect.backends.serve SPEC``, over a pipe: the model written for the child
(``save_for_child``: weights stay where they are), the feeds and the outputs as .npz files in
the child's own folder, one JSON line each way.

Two ways to use children (docs/architecture.md, "Crashes"):
- persistent (the default): one long-lived child serves run after run, started when the
  backend is built so that the runtime's import overlaps the tool's own start. A child that
  dies is a ``BackendCrash`` for the run it was serving; from then on every run gets a fresh
  child, as under ``--isolate-crashes``: after a crash the runtime's state is suspect, and the
  failure search must see each prefix on its own.
- ``fresh``: a child per run (``--isolate-crashes``).

A compiler's children share one folder of compiled models (``backends/compiled.py``), made in
the command's temporary folder and removed with it.
"""

from __future__ import annotations

import json
import logging
import os
import selectors
import shutil
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy.typing as npt
import onnx

from onnx_bisect.backends.compiled import COMPILED_DIR_ENV
from onnx_bisect.backends.exec import exited
from onnx_bisect.backends.handover import read_arrays, write_arrays
from onnx_bisect.backends.passes import PassControl, supports_passes
from onnx_bisect.backends.protocol import Backend, BackendBase, Tensors, computes_in
from onnx_bisect.backends.spec import BackendSpec
from onnx_bisect.backends.static_view import StaticType, static_types
from onnx_bisect.compare.precision import PrecisionInfo
from onnx_bisect.errors import (
    BackendCrash,
    BackendError,
    BackendUnavailableError,
    InputError,
    ModelLoadError,
    OnnxBisectError,
    SpecError,
)
from onnx_bisect.graph.save import save_for_child
from onnx_bisect.process import python_child_env, start_server, stop_child

__all__ = ["WorkerBackend"]

log = logging.getLogger(__name__)

# What a child's error comes back as, by its class's name; anything else is a BackendError.
_ERRORS: dict[str, type[OnnxBisectError]] = {
    c.__name__: c
    for c in (BackendError, BackendCrash, ModelLoadError, InputError, SpecError)
    + (BackendUnavailableError,)
}


class WorkerBackend(BackendBase):
    """``inner``'s runs in child processes (see module)."""

    def __init__(
        self,
        spec: BackendSpec,
        inner: Backend,
        timeout: float | None = None,
        *,
        fresh: bool = False,
        pool: _Pool | None = None,
    ) -> None:
        super().__init__(spec)
        self.inner, self.timeout = inner, timeout
        # What the runtime declares holds in the child too (a compiler still compiles every
        # run); a stream cannot cross the process boundary.
        self.capabilities = replace(
            inner.capabilities, child_process=True, streams=False, process_per_run=fresh
        )
        self._pool = pool or _Pool(spec.text, fresh)
        self._compiled: str | None = None
        if pool is None:  # the owner's: a sibling dropped leaves the children serving
            weakref.finalize(self, _stop_all, self._pool.live)
        if pool is None and not fresh:
            self._idle.append(self._start())  # now: the runtime's import overlaps our work

    def sibling(self, spec: BackendSpec, inner: Backend) -> WorkerBackend:
        """A backend of the same runtime under another spec (the fp32 workaround's
        ``openvino?precision=f32``) whose runs go to this backend's children: no second
        start, no second import; a crash of either gives both a fresh child per run."""
        return WorkerBackend(spec, inner, self.timeout, fresh=self.fresh, pool=self._pool)

    # The children and what they know, shared with the siblings.
    @property
    def fresh(self) -> bool:
        return self._pool.fresh

    @property
    def crashes(self) -> int:
        return self._pool.crashes

    @property
    def _idle(self) -> list[_Worker]:
        return self._pool.idle

    @property
    def _live(self) -> set[_Worker]:
        return self._pool.live

    @property
    def _lock(self) -> threading.Lock:
        return self._pool.lock

    def _run(self, model: onnx.ModelProto, feeds: Mapping[str, npt.NDArray[Any]]) -> Tensors:
        worker = self._take()
        try:
            out = worker.run(self.spec.text, model, feeds, self.timeout, self._note)
        except BackendCrash:
            self._drop(worker)
            self._crashed()
            raise
        except OnnxBisectError:  # the runtime's error, answered: the child serves on
            self._done(worker)
            raise
        except BaseException:  # an answer that did not come (Ctrl-C): the child is in doubt
            self._drop(worker)
            raise
        self._done(worker)
        return out

    def _done(self, worker: _Worker) -> None:
        if self.fresh:
            self._drop(worker)
        else:
            with self._lock:
                self._idle.append(worker)

    def _take(self) -> _Worker:
        with self._lock:
            if self._idle and not self.fresh:
                return self._idle.pop()
        return self._start()

    def _start(self) -> _Worker:
        worker = _Worker(self._pool.spec, self.environment())
        with self._lock:
            self._live.add(worker)
        return worker

    def _drop(self, worker: _Worker) -> None:
        with self._lock:
            self._live.discard(worker)
        worker.stop()

    def _crashed(self) -> None:
        """A child died: every later run gets a fresh child (see module)."""
        self._pool.crashes += 1
        if self.fresh:
            self.capabilities = replace(self.capabilities, process_per_run=True)
            return
        self._note(
            f"{self.spec.text} crashed in its worker process; every later run of it got a fresh "
            "process, as under --isolate-crashes",
            once=True,
        )
        self._pool.fresh = True
        self.capabilities = replace(self.capabilities, process_per_run=True)
        with self._lock:
            idle, self._pool.idle = self._idle, []
        for worker in idle:
            self._drop(worker)

    def environment(self) -> dict[str, str]:
        env = python_child_env()
        if self.capabilities.compiles:
            env[COMPILED_DIR_ENV] = self._compiled_dir()
        return env

    def _compiled_dir(self) -> str:
        """This backend's folder of compiled models, made at its first child (in the command's
        temporary folder, which the CLI removes; removed with the backend otherwise)."""
        if self._compiled is None or not Path(self._compiled).is_dir():
            self._compiled = tempfile.mkdtemp(prefix="onnx-bisect-compiled-")
            weakref.finalize(self, shutil.rmtree, self._compiled, True)
        return self._compiled

    def close(self) -> None:
        """End every child now (they end with the backend, or with this process, anyway)."""
        _stop_all(self._live)
        with self._lock:
            self._pool.idle = []

    # What the runtime answers for itself, from the backend built here.
    def describe(self) -> str:
        if self.fresh and not self.crashes:
            return f"{self.spec.text} (in a child process per run)"
        return self.inner.describe()

    def versions(self) -> dict[str, str]:
        return self.inner.versions()

    def computes_in(self) -> PrecisionInfo | None:
        return computes_in(self.inner)

    def recorded_inputs(self) -> Tensors | None:
        return self.inner.recorded_inputs()

    def pass_control(self, declared: Sequence[str]) -> PassControl | None:
        return supports_passes(self.inner, declared)

    def static_types(
        self, model: onnx.ModelProto, feeds: Mapping[str, npt.NDArray[Any]]
    ) -> dict[str, StaticType] | None:
        # Read here, not in a child: the failure search asks it only of a prefix whose nodes
        # the child has read and run already (each smaller prefix runs), so reading them
        # cannot crash this process where it did not crash the child.
        return static_types(self.inner, model, feeds)


class _Pool:
    """The children of one runtime, shared by its ``WorkerBackend`` and their siblings:
    ``spec``, the one each child is started with; ``fresh``, a child per run."""

    def __init__(self, spec: str, fresh: bool) -> None:
        self.spec, self.fresh, self.crashes = spec, fresh, 0
        self.idle: list[_Worker] = []
        self.live: set[_Worker] = set()
        self.lock = threading.Lock()


def _stop_all(live: set[_Worker]) -> None:
    for worker in list(live):
        live.discard(worker)
        worker.stop()


class _Worker:
    """One child process and its folder."""

    def __init__(self, spec: str, env: Mapping[str, str]) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="onnx-bisect-worker-"))
        self.log = self.dir / "stderr.txt"
        # -P: not the working folder first, as -m would put it: a folder holding another
        # onnx_bisect (a checkout) would give the child other code than ours, and another
        # protocol. Our own path comes in PYTHONPATH (``python_child_env``).
        argv = [sys.executable, "-P", "-m", "onnx_bisect.backends.serve", spec]
        with self.log.open("ab") as err:  # appended to: emptied before each run, from here
            self.proc = start_server(argv, env=env, stderr=err)
        self._buffer = b""
        self._runs = 0  # each run's files get fresh names: the tool may still map the last

    def run(
        self,
        spec: str,
        model: onnx.ModelProto,
        feeds: Mapping[str, npt.NDArray[Any]],
        timeout: float | None,
        note: Callable[..., None],
    ) -> Tensors:
        """``model`` run by the child as ``spec``; what the runtime noted meanwhile, failed or
        not (a compile that failed is counted too), goes to ``note`` (``BackendBase._note``)."""
        start = time.perf_counter()
        self._runs += 1
        wanted = {i.name for i in model.graph.input}
        inputs = self.dir / f"inputs-{self._runs}.bin"
        outputs = self.dir / f"outputs-{self._runs}.bin"
        job: dict[str, Any] = {
            "spec": spec,
            "model": str(save_for_child(model, self.dir)),
            "inputs": str(inputs),
            "index": write_arrays(inputs, {k: v for k, v in feeds.items() if k in wanted}),
            "outputs": str(outputs),
        }
        os.truncate(self.log, 0)
        asked = time.perf_counter()
        try:
            answer = self._ask(spec, job, timeout)
        finally:
            inputs.unlink(missing_ok=True)  # the child has it mapped, or is gone
        answered = time.perf_counter()
        facts = frozenset(answer.get("facts", ()))
        for text, count in answer.get("notes", {}).items():
            note(text, count, once=text in facts)
        if "error" in answer:
            kind = _ERRORS.get(answer["error"], BackendError)
            if issubclass(kind, BackendError):
                raise kind(answer["message"], detail=answer.get("detail"))
            raise kind(answer["message"])
        try:
            out = read_arrays(outputs, answer["index"])
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise BackendError(f"{spec}: its worker's outputs cannot be read: {exc}") from None
        log.debug(
            "worker %d: written in %.3f s, answered in %.3f s, read in %.3f s",
            self.proc.pid, asked - start, answered - asked, time.perf_counter() - answered,
        )  # fmt: skip
        return out

    def _ask(self, spec: str, job: Mapping[str, Any], timeout: float | None) -> dict[str, Any]:
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write((json.dumps(job) + "\n").encode())
            self.proc.stdin.flush()
        except BrokenPipeError:
            raise self._died(spec) from None
        line = self._line(timeout)
        if line is None:
            self.stop()
            raise BackendCrash(f"{spec}: timed out after {timeout:.3g} s")
        if not line:
            raise self._died(spec)
        answer: dict[str, Any] = json.loads(line)
        return answer

    def _line(self, timeout: float | None) -> bytes | None:
        """The child's next answer line; b"" when its pipe closed, None past ``timeout``."""
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        deadline = None if timeout is None else time.monotonic() + timeout
        with selectors.DefaultSelector() as sel:
            sel.register(fd, selectors.EVENT_READ)
            while b"\n" not in self._buffer:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return None
                if not sel.select(left):
                    continue
                data = os.read(fd, 1 << 16)
                if not data:
                    return b""
                self._buffer += data
        line, _, self._buffer = self._buffer.partition(b"\n")
        return line

    def _died(self, spec: str) -> BackendCrash:
        """The crash of a child that stopped answering: its status and last words. Any exit
        is a crash here (a runtime that calls ``exit``): the child itself never exits."""
        stop_child(self.proc)
        error = exited(spec, self.proc.returncode or 0, self.log.read_bytes())
        self.stop()
        if isinstance(error, BackendCrash):
            return error
        return BackendCrash(str(error), detail=error.detail)

    def stop(self) -> None:
        stop_child(self.proc)
        shutil.rmtree(self.dir, ignore_errors=True)
