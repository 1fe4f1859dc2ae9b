"""What the ML-compiler adapters (``iree``, ``tvm``) share: a model pinned to the shapes it is
fed, and a cache of compiled artifacts keyed by the model's hash.

A compiler specializes a model to its input shapes, and a strict importer (IREE's) refuses any
output or ``value_info`` without a full type and shape. So the model it gets is a copy with
every input's dims set to those of its array, the stale ``value_info`` and output shapes
dropped (a symbolic dim there would contradict the pinned ones), and types inferred anew.

A compile costs seconds to minutes, so each adapter keeps what it compiled in one cache per
process, keyed by the model's bytes, the input shapes and the backend's settings: a backend
built anew from its spec (a pass bisection's runs) and a model run on other inputs of the
same shapes (a dataset's) reuse it. Under ``--isolate-crashes`` every run is a fresh child
process, so the cache also lives on disk: ``WorkerBackend`` names a folder of its own in
``COMPILED_DIR_ENV`` (inside the command's temporary folder), where each child reads what an
earlier child compiled and writes what it compiled itself. A repro bundle's check names one
too, for the one model it runs (``repro/bundle.py``): what is already kept in memory is
written there when asked for while the folder is named.

A compile that fails (IREE's "failed to legalize operation", TVM's unsupported op) is kept by
the same key, so that a model is not compiled twice to fail twice: in memory, a fresh error of
the same class, message and ``detail`` is raised again, and in the folder a ``{key}.failed``
file (JSON) says the same to the other processes, which log that they read it back. Only the
classes in ``_FAILURES`` are kept: a crash, a timeout or an error of Python's (memory, an
interrupt) may not happen again, and is left to the next run.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar

import numpy as np
import numpy.typing as npt
import onnx

from onnx_bisect.errors import BackendError

__all__ = [
    "COMPILED_DIR_ENV",
    "CompileCache",
    "CompileFailure",
    "OnDisk",
    "compiles_here",
    "fed_inputs",
    "pinned_model",
]

log = logging.getLogger(__name__)

T = TypeVar("T")

# The folder a sandboxed child keeps compiled artifacts in, shared with the command's other
# children (set by ``WorkerBackend``; unset, the cache is this process's alone).
COMPILED_DIR_ENV = "ONNX_BISECT_COMPILED_DIR"

# The errors a failed compile is kept as, by importable name: what an adapter raises when the
# compiler refuses a model. Exact classes: ``BackendCrash`` (a death, a timeout) is not one.
_FAILURES: dict[str, type[BackendError]] = {"onnx_bisect.errors.BackendError": BackendError}

# Builds by every cache of this process, for a caller that must tell whether a run compiled
# (``repro/bundle.py``), whichever adapter ran it.
_COMPILES = 0
_COMPILES_LOCK = threading.Lock()


def compiles_here() -> int:
    """How many compiles (failed ones too) the caches of this process have started."""
    return _COMPILES


@dataclass(frozen=True)
class OnDisk(Generic[T]):
    """How an adapter's artifact is written to a file and read back (IREE's vmfb bytes, TVM's
    shared library), for the cache that sandboxed children share."""

    suffix: str
    save: Callable[[T, Path], object]
    load: Callable[[Path], T]


def fed_inputs(model: onnx.ModelProto) -> list[onnx.ValueInfoProto]:
    """The graph inputs a caller feeds: those that are not initializers, in graph order."""
    initializers = {t.name for t in model.graph.initializer}
    return [i for i in model.graph.input if i.name not in initializers]


def pinned_model(model: onnx.ModelProto, feeds: Mapping[str, npt.NDArray[Any]]) -> onnx.ModelProto:
    """A copy of ``model`` whose inputs have the shapes (and dtypes) of ``feeds``, with every
    other type inferred from them (see module); ``model`` is left untouched."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    graph = out.graph
    initializers = {t.name for t in graph.initializer}
    kept = [i for i in graph.input if i.name not in initializers]
    del graph.input[:]
    graph.input.extend(kept)  # an initializer listed as an input is a constant to a compiler
    for inp in graph.input:
        if inp.name not in feeds:
            continue
        value = np.asarray(feeds[inp.name])
        tensor = inp.type.tensor_type
        tensor.elem_type = onnx.helper.np_dtype_to_tensor_dtype(value.dtype)
        tensor.shape.Clear()
        tensor.shape.SetInParent()  # a 0-d input has a shape with no dims, not no shape
        for n in value.shape:
            tensor.shape.dim.add().dim_value = int(n)
    del graph.value_info[:]
    inputs = {i.name: i for i in graph.input}
    for o in graph.output:
        if o.name in inputs:  # no node makes it, so inference would leave it untyped
            o.type.CopyFrom(inputs[o.name].type)
        else:
            o.type.tensor_type.ClearField("shape")
    try:
        # Without data propagation: IREE's importer re-verifies the dims it would compute.
        return onnx.shape_inference.infer_shapes(out, data_prop=False)
    except Exception as exc:  # a custom domain defeats inference; the compiler then says why
        log.debug("shape inference on the pinned model failed: %s", exc)
        return out


@dataclass(frozen=True)
class CompileFailure:
    """A compile that failed, as kept: its error's class (a name in ``_FAILURES``), message and
    ``detail``."""

    kind: str
    message: str
    detail: str | None

    @classmethod
    def of(cls, exc: BaseException) -> CompileFailure | None:
        """``exc`` as kept, or None where it is not a compiler's refusal (see ``_FAILURES``)."""
        kind = f"{type(exc).__module__}.{type(exc).__qualname__}"
        if not isinstance(exc, BackendError) or _FAILURES.get(kind) is not type(exc):
            return None
        return cls(kind, str(exc), exc.detail)

    @classmethod
    def parse(cls, text: str) -> CompileFailure:
        """Read back from its file's JSON; ValueError where it is not one."""
        data = json.loads(text)
        kind, message, detail = data.get("kind"), data.get("message"), data.get("detail")
        if kind not in _FAILURES or not isinstance(message, str):
            raise ValueError(f"not a kept compile failure: {text[:80]!r}")
        if detail is not None and not isinstance(detail, str):
            raise ValueError(f"not a kept compile failure: {text[:80]!r}")
        return cls(kind, message, detail)

    def text(self) -> str:
        return json.dumps({"kind": self.kind, "message": self.message, "detail": self.detail})

    def error(self) -> BackendError:
        """A fresh error to raise (the search sets ``role`` on what it catches)."""
        return _FAILURES[self.kind](self.message, detail=self.detail)


class CompileCache(Generic[T]):
    """Compiled artifacts by model hash, the ``size`` most recently used kept, and as many
    failed compiles; with ``disk``, also in the folder ``COMPILED_DIR_ENV`` names, where there
    is one. ``compiles`` counts the builds (failed ones too), ``reused`` the answers without."""

    def __init__(self, size: int = 8, disk: OnDisk[T] | None = None) -> None:
        self.size = size
        self.disk = disk
        self._items: OrderedDict[str, T] = OrderedDict()
        self._failed: OrderedDict[str, CompileFailure] = OrderedDict()
        self._lock = threading.Lock()  # dataset mode runs sessions in threads
        self.compiles = 0
        self.reused = 0

    @staticmethod
    def key(model: onnx.ModelProto, *settings: object) -> str:
        digest = hashlib.sha256(model.SerializeToString(deterministic=True))
        digest.update(repr(settings).encode())
        return digest.hexdigest()

    def get(self, key: str, build: Callable[[], T]) -> T:
        """The artifact for ``key``, built by ``build`` only when not already kept (two
        threads asking at once may both build it; the compile is not held under the lock).
        A compile that failed for ``key`` before raises its error again (see module)."""
        path = self._path(key)
        kept, failure = self._kept(key)
        if failure is not None:
            if path is not None and not _failed_path(path).exists():
                self._save_failure(failure, _failed_path(path))  # as for an artifact, below
            raise failure.error()
        if kept is not None:
            if path is not None and not path.exists():
                # Compiled before the folder was named: written now for the processes that
                # read it (a repro bundle's check, ``repro/bundle.py``).
                self._save(kept, path)
            return kept
        if path is not None:
            artifact = self._read_back(key, path)
            if artifact is not None:
                return artifact
        return self._build(key, build, path)

    def _kept(self, key: str) -> tuple[T | None, CompileFailure | None]:
        with self._lock:
            kept, failure = self._items.get(key), self._failed.get(key)
            if kept is not None:
                self._items.move_to_end(key)
            elif failure is not None:
                self._failed.move_to_end(key)
            else:
                return None, None
            self.reused += 1
            return kept, failure if kept is None else None

    def _read_back(self, key: str, path: Path) -> T | None:
        """What another process compiled for ``key`` into the folder; raises the error of a
        compile of it that failed there."""
        if path.exists():
            artifact = self._load(path)
            if artifact is not None:
                log.info("compiled model %s read back from %s", key[:12], path.parent)
                self._keep(key, artifact)
                self.reused += 1
                return artifact
        failure = _load_failure(_failed_path(path))
        if failure is None:
            return None
        log.info("failed compile of model %s read back from %s", key[:12], path.parent)
        self._keep_failure(key, failure)
        self.reused += 1
        raise failure.error()

    def _build(self, key: str, build: Callable[[], T], path: Path | None) -> T:
        global _COMPILES
        with _COMPILES_LOCK:
            _COMPILES += 1
        try:
            artifact = build()
        except BackendError as exc:
            self.compiles += 1
            failure = CompileFailure.of(exc)
            if failure is not None:
                self._keep_failure(key, failure)
                if path is not None:
                    self._save_failure(failure, _failed_path(path))
            raise
        self.compiles += 1
        self._keep(key, artifact)
        if path is not None:
            self._save(artifact, path)
        return artifact

    def _keep(self, key: str, artifact: T) -> None:
        with self._lock:
            self._items[key] = artifact
            while len(self._items) > self.size:
                self._items.popitem(last=False)

    def _keep_failure(self, key: str, failure: CompileFailure) -> None:
        with self._lock:
            self._failed[key] = failure
            while len(self._failed) > self.size:
                self._failed.popitem(last=False)

    def _path(self, key: str) -> Path | None:
        folder = os.environ.get(COMPILED_DIR_ENV)
        if self.disk is None or not folder or not Path(folder).is_dir():
            return None
        return Path(folder) / f"{key}{self.disk.suffix}"

    def _load(self, path: Path) -> T | None:
        assert self.disk is not None
        try:
            return self.disk.load(path)
        except Exception as exc:  # a damaged file costs a compile, not the diagnosis
            log.warning("cannot read the compiled model %s (%s); compiling again", path, exc)
            return None

    def _save(self, artifact: T, path: Path) -> None:
        disk = self.disk
        assert disk is not None
        _written(path, lambda partial: disk.save(artifact, partial))

    def _save_failure(self, failure: CompileFailure, path: Path) -> None:
        _written(path, lambda partial: partial.write_text(failure.text()))


def _failed_path(path: Path) -> Path:
    """The file beside an artifact's ``path`` that says its compile failed."""
    return path.with_name(f"{path.name.split('.')[0]}.failed")


def _load_failure(path: Path) -> CompileFailure | None:
    try:
        return CompileFailure.parse(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:  # a damaged file costs a compile, not the diagnosis
        log.warning("cannot read the failed compile %s (%s); compiling again", path, exc)
        return None


def _written(path: Path, write: Callable[[Path], object]) -> None:
    """``path`` written by ``write`` under another name and renamed: a process reading it
    meanwhile never reads half of one."""
    partial = path.with_name(f".{os.getpid()}-{threading.get_ident()}{path.name}")
    try:
        write(partial)
        os.replace(partial, path)
    except Exception as exc:  # no room, or a toolchain missing: the next process compiles
        partial.unlink(missing_ok=True)
        log.warning("cannot keep the compiled model in %s: %s", path.parent, exc)
