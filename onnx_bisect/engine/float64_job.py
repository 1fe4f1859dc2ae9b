"""In the float64 oracle's process: one job, the probes in float64 and fp32, values to files.

Run by ``float64_child``'s loop; the parent (``float64``) reads the answer.
"""

from __future__ import annotations

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

# The oracle the child runs, and its fp32 twin.
ORACLE = "torch:cpu?dtype=float64"
TWIN = "torch:cpu"


def run_job(job: Mapping[str, Any]) -> dict[str, Any]:
    """In the child: the probes of ``job["chunks"]`` in float64 and fp32, values to .npy files.

    Returns what the parent needs, as JSON: each value's file, dtype and shape; the fp32
    twin's noise per tensor; the oracle's description and notes; each run's seconds.
    """
    model = onnx.load(job["model"])
    with np.load(job["feeds"], allow_pickle=False) as data:
        feeds = {k: data[k] for k in data.files}
    backend = create_backend(ORACLE)
    fp32 = create_backend(TWIN)
    out_dir = Path(job["out"])
    out_dir.mkdir(parents=True, exist_ok=True)
    files: dict[str, tuple[str, str, list[int]]] = {}
    noise: dict[str, float] = {}
    seconds: list[float] = []
    for chunk in job["chunks"]:
        marked = with_outputs(model, chunk)
        out = _timed(backend, marked, feeds, seconds)
        out32 = _timed(fp32, marked, feeds, seconds)
        for name in chunk:
            files[name] = _save(out_dir, len(files), name, out[name])
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


def _save(directory: Path, index: int, name: str, value: Any) -> tuple[str, str, list[int]]:
    array = np.asarray(value, order="C")
    path = directory / f"{index:06d}.npy"
    np.save(path, array, allow_pickle=False)
    return str(path), array.dtype.str, list(array.shape)
