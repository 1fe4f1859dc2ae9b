"""``onnx-bisect dump``: every tensor of a model as one backend computes it, for offline
comparison (dump on the Mac, compare on Linux with ``--target dump:DIR``)."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import onnx

from onnx_bisect.backends.dump import INPUTS_FILE, MANIFEST, file_name
from onnx_bisect.backends.environment import environment
from onnx_bisect.backends.protocol import Tensors
from onnx_bisect.backends.registry import create_backend
from onnx_bisect.engine.observe import probe_runs
from onnx_bisect.engine.runs import RunStats, check_budget, timed_run
from onnx_bisect.graph.load import load_model
from onnx_bisect.graph.sizes import fix_input_shapes, tensor_nbytes
from onnx_bisect.inputs.feeds import make_feeds, save_npz
from onnx_bisect.options import DEFAULT_MAX_MEMORY, BisectOptions

__all__ = ["DumpResult", "dump"]


@dataclass(frozen=True)
class DumpResult:
    path: Path
    tensors: int
    runs: int


def dump(
    model: str | os.PathLike[str] | onnx.ModelProto,
    backend: str,
    out: str | os.PathLike[str],
    *,
    inputs: Path | Mapping[str, npt.NDArray[Any]] | None = None,
    shapes: Mapping[str, Sequence[int]] | None = None,
    values: Mapping[str, float] | None = None,
    ranges: Mapping[str, tuple[float, float]] | None = None,
    seed: int = 0,
    max_memory: int = DEFAULT_MAX_MEMORY,
) -> DumpResult:
    """Write every top-level tensor ``backend`` computes, plus the inputs and a manifest."""
    # The options it shares with bisect(), checked by the same rules.
    BisectOptions(shapes=shapes, values=values, ranges=ranges, seed=seed, max_memory=max_memory)
    loaded = load_model(model)
    feeds = make_feeds(
        loaded.model, inputs=inputs, shapes=shapes, values=values, ranges=ranges, seed=seed
    )
    sizes = tensor_nbytes(fix_input_shapes(loaded.model, {k: v.shape for k, v in feeds.items()}))
    check_budget(loaded.probes, sizes, max_memory)
    runner = create_backend(backend)
    directory = Path(out)
    directory.mkdir(parents=True, exist_ok=True)
    stats = RunStats()

    def run(marked: onnx.ModelProto) -> Tensors:
        return timed_run(runner, marked, feeds, "target", stats)

    for chunk, computed in probe_runs(loaded.model, loaded.probes, sizes, max_memory, run):
        for name in chunk:
            np.save(directory / file_name(name), np.asarray(computed[name]), allow_pickle=False)
    save_npz(directory / INPUTS_FILE, feeds)
    manifest = {
        "model": str(loaded.path) if loaded.path else "<in-memory ModelProto>",
        "backend": backend,
        "description": runner.describe(),
        "versions": environment(runner),
        "tensors": {name: file_name(name) for name in loaded.probes},
        "naming": "file = percent-encoded tensor name + '.npy' (onnx_bisect.backends.dump)",
    }
    (directory / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return DumpResult(directory, len(loaded.probes), stats.runs.get("target", 0))
