"""Task functions for tests/test_parallel.py. They live in a module of their own so that worker
processes import them by name without importing pytest's test module."""

from __future__ import annotations

import hashlib
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from onnx_bisect.engine.dataset.parallel import worker_cached
from onnx_bisect.errors import BackendError, InputError

# In each process: how often a session was made, and how often a Model was unpickled there.
made: list[str] = []
unpickled: list[int] = []
# In the process that pickles (the caller): how often a Model was pickled.
pickled: list[int] = []


def _restore(data: bytes, padding: np.ndarray) -> Model:
    unpickled.append(1)
    return Model(data, padding)


@dataclass(frozen=True)
class Model:
    """A serialized ONNX model; counts its own pickling and unpickling."""

    data: bytes
    # Ballast, so that Ray would put the argument in its object store even if we did not.
    padding: np.ndarray

    def __reduce__(self) -> tuple[Any, ...]:
        pickled.append(1)
        return (_restore, (self.data, self.padding))


@dataclass(frozen=True)
class Ran:
    y: np.ndarray
    pid: int
    sessions: int  # sessions made in that process so far
    unpickled: int  # times the shared model was unpickled in that process


def run_model(model: Model, seed: int) -> Ran:
    """Run the model on input ``seed``, with one session per process."""
    key = ("session", hashlib.sha256(model.data).hexdigest())
    session = worker_cached(key, lambda: _session(model.data))
    x = np.random.default_rng(seed).standard_normal((2, 8)).astype(np.float32)
    (y,) = session.run(None, {"x": x})
    return Ran(y, os.getpid(), len(made), len(unpickled))


def _session(data: bytes) -> ort.InferenceSession:
    made.append("session")
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    return ort.InferenceSession(data, options, providers=["CPUExecutionProvider"])


def fail_on(bad: int, item: int) -> int:
    if item == bad:
        raise InputError(f"values: input {item} holds a NaN", option="values")
    if item == bad + 1:
        raise BackendError("target failed", node="mm1", role="target", detail="the whole text")
    return item


def die_on(bad: int, item: int) -> int:
    """A worker that ends without an exception, as a segfault in a runtime would."""
    if item == bad:
        os._exit(7)
    time.sleep(0.2)
    return item


def sleep_marked(marks: str, item: int) -> int:
    """Note this process's pid, then sleep: a long task to interrupt."""
    with Path(marks).open("a") as f:
        f.write(f"{os.getpid()}\n")
    time.sleep(600)
    return item


def thread_vars(_: None, item: int) -> tuple[str | None, ...]:
    names = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")
    return tuple(os.environ.get(name) for name in names)


def package_paths(_: None, item: int) -> list[str]:
    """The entries of this process's sys.path that hold an onnx_bisect package."""
    return [p for p in sys.path if (Path(p) / "onnx_bisect" / "__init__.py").is_file()]
