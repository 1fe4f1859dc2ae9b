"""In the float64 oracle's process: one job, the probes in float64 and fp32, values to files.

Run by ``float64_child``'s loop; the parent (``float64``) reads the answer.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from onnx_bisect.backends.protocol import Backend, BackendBase, Tensors
from onnx_bisect.backends.registry import create_backend
from onnx_bisect.compare.noise import fp32_noise
from onnx_bisect.graph.extract import with_outputs

__all__ = ["ORACLE", "TWIN", "run_job"]


def _threads() -> int:
    """Half the cores this process may use: the oracle runs beside the screen's runtimes, and
    an OpenMP team larger than the free cores makes every small op wait for it (a 64x16
    float64 MatMul took 8 ms on two busy cores with two threads, 5 us with one)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        cores = os.cpu_count() or 2
    return max(1, cores // 2)


# The oracle the child runs, and its fp32 twin.
ORACLE = f"torch:cpu?dtype=float64&threads={_threads()}"
TWIN = f"torch:cpu?threads={_threads()}"


def run_job(job: Mapping[str, Any]) -> dict[str, Any]:
    """In the child: the probes of ``job["chunks"]`` in float64 and fp32, values to files.

    Returns what the parent needs, as JSON: each value's file, offset, dtype and shape; the fp32
    twin's noise per tensor; the oracle's description and notes; each run's seconds.
    """
    model = onnx.load(job["model"])
    with np.load(job["feeds"], allow_pickle=False) as data:
        feeds = {k: data[k] for k in data.files}
    backend = create_backend(ORACLE)
    fp32 = create_backend(TWIN)
    out_dir = Path(job["out"])
    out_dir.mkdir(parents=True, exist_ok=True)
    files: dict[str, tuple[str, int, str, list[int]]] = {}
    noise: dict[str, float] = {}
    seconds: list[float] = []
    for index, chunk in enumerate(job["chunks"]):
        marked = with_outputs(model, chunk)
        out = _timed(backend, marked, feeds, seconds)
        out32 = _timed(fp32, marked, feeds, seconds)
        files |= _pack(out_dir / f"chunk{index:04d}.bin", {name: out[name] for name in chunk})
        for name in chunk:
            single = out32.get(name)
            measured = None if single is None else fp32_noise(out[name], single)
            if measured is not None:
                noise[name] = measured
    notes = [n for b in (backend, fp32) if isinstance(b, BackendBase) for n in b.notes()]
    return {
        "files": files,
        "noise": noise,
        "describe": backend.describe(),
        "notes": notes,
        "seconds": seconds,
    }


def _timed(
    backend: Backend, model: onnx.ModelProto, feeds: Tensors, seconds: list[float]
) -> Tensors:
    start = time.perf_counter()
    out = backend.run(model, feeds)
    seconds.append(time.perf_counter() - start)
    return out


# Values start at multiples of this, so that every view of the mapped file is aligned.
_ALIGN = 64


def _pack(path: Path, values: Mapping[str, Any]) -> dict[str, tuple[str, int, str, list[int]]]:
    """``values`` back to back in one file (raw, C order, aligned); per value its file,
    offset, dtype and shape. One file per chunk, not per tensor: the parent maps each once
    (``TensorStore.adopt``), and 20,000 small files cost minutes to open and delete."""
    placed: dict[str, tuple[str, int, str, list[int]]] = {}
    with open(path, "wb") as f:
        for name, value in values.items():
            array = np.asarray(value, order="C")  # ascontiguousarray would make 0-d 1-d
            offset = -(-f.tell() // _ALIGN) * _ALIGN
            f.write(b"\0" * (offset - f.tell()))
            f.write(array.reshape(-1).view(np.uint8).data)
            placed[name] = (str(path), offset, array.dtype.str, list(array.shape))
    return placed
