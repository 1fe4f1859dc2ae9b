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
process, so the cache also lives on disk: ``SandboxBackend`` names a folder of its own in
``COMPILED_DIR_ENV`` (inside the command's temporary folder), where each child reads what an
earlier child compiled and writes what it compiled itself. A repro bundle's check names one
too, for the one model it runs (``repro/bundle.py``): what is already kept in memory is
written there when asked for while the folder is named.
"""

from __future__ import annotations

import hashlib
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

__all__ = ["COMPILED_DIR_ENV", "CompileCache", "OnDisk", "fed_inputs", "pinned_model"]

log = logging.getLogger(__name__)

T = TypeVar("T")

# The folder a sandboxed child keeps compiled artifacts in, shared with the command's other
# children (set by ``SandboxBackend``; unset, the cache is this process's alone).
COMPILED_DIR_ENV = "ONNX_BISECT_COMPILED_DIR"


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


class CompileCache(Generic[T]):
    """Compiled artifacts by model hash, the ``size`` most recently used kept; with ``disk``,
    also in the folder ``COMPILED_DIR_ENV`` names, where there is one."""

    def __init__(self, size: int = 8, disk: OnDisk[T] | None = None) -> None:
        self.size = size
        self.disk = disk
        self._items: OrderedDict[str, T] = OrderedDict()
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
        threads asking at once may both build it; the compile is not held under the lock)."""
        path = self._path(key)
        with self._lock:
            kept = self._items.get(key)
            if kept is not None:
                self._items.move_to_end(key)
                self.reused += 1
        if kept is not None:
            if path is not None and not path.exists():
                # Compiled before the folder was named: written now for the processes that
                # read it (a repro bundle's check, ``repro/bundle.py``).
                self._save(kept, path)
            return kept
        if path is not None and path.exists():
            artifact = self._load(path)
            if artifact is not None:
                log.info("compiled model %s read back from %s", key[:12], path.parent)
                self._keep(key, artifact)
                self.reused += 1
                return artifact
        artifact = build()
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
        assert self.disk is not None
        # Written under another name and renamed: a child reading it meanwhile never loads
        # half of one.
        partial = path.with_name(f".{os.getpid()}-{threading.get_ident()}{path.name}")
        try:
            self.disk.save(artifact, partial)
            os.replace(partial, path)
        except Exception as exc:  # no room, or a toolchain missing: the next child compiles
            partial.unlink(missing_ok=True)
            log.warning("cannot keep the compiled model in %s: %s", path.parent, exc)
