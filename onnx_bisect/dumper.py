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
from onnx_bisect.backends.registry import create_backend
from onnx_bisect.engine.measure.memory import plan_memory
from onnx_bisect.engine.measure.observe import probe_runs
from onnx_bisect.engine.measure.runs import RunStats, timed_run
from onnx_bisect.engine.recorded import run_feeds
from onnx_bisect.errors import InputError
from onnx_bisect.graph.load import load_model
from onnx_bisect.graph.sizes import fix_input_shapes, tensor_nbytes
from onnx_bisect.inputs.feeds import save_npz
from onnx_bisect.options import DEFAULT_MAX_MEMORY, BisectOptions
from onnx_bisect.report.outdir import check_out_dir, is_stage_name, staging_dir, swap_in

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
    allow_nonfinite: bool = False,
) -> DumpResult:
    """Write every top-level tensor ``backend`` computes, plus the inputs and a manifest.

    ``out`` holds one dump: an earlier dump there is replaced as a set, and a directory that
    holds anything else is refused, before anything runs. The files are written beside it and
    renamed into place, so an interruption leaves the earlier dump or the new one.
    """
    # The options it shares with bisect(), checked by the same rules.
    BisectOptions(
        shapes=shapes, values=values, ranges=ranges, seed=seed, max_memory=max_memory,
        allow_nonfinite=allow_nonfinite,
    )  # fmt: skip
    directory = Path(out)
    check_out_dir(directory, reads=[Path(model)] if isinstance(model, (str, os.PathLike)) else [])
    earlier = _earlier_dump(directory)
    loaded = load_model(model)
    runner = create_backend(backend)
    feeds = run_feeds(
        loaded.model, [runner], inputs=inputs, shapes=shapes, values=values, ranges=ranges,
        seed=seed, max_memory=max_memory, allow_nonfinite=allow_nonfinite,
    )  # fmt: skip
    sizes = tensor_nbytes(fix_input_shapes(loaded.model, {k: v.shape for k, v in feeds.items()}))
    feed_bytes = sum(v.nbytes for v in feeds.values())
    memory = plan_memory(loaded, sizes, max_memory, float64=False, feeds=feed_bytes)
    memory.require()
    stats = RunStats()
    written: dict[str, str] = {}
    with staging_dir(directory) as stage:

        def use(chunk: list[str], marked: onnx.ModelProto) -> None:
            computed = timed_run(runner, marked, feeds, "target", stats)
            # A partial backend (a dump itself) answers for the tensors it holds only.
            for name in (n for n in chunk if n in computed):
                written[name] = file_name(name)
                np.save(stage / written[name], np.asarray(computed[name]), allow_pickle=False)

        probe_runs(loaded.model, loaded.probes, sizes, memory.chunk(), use)
        save_npz(stage / INPUTS_FILE, feeds)
        manifest = {
            "model": str(loaded.path) if loaded.path else "<in-memory ModelProto>",
            "backend": backend,
            "description": runner.describe(),
            "versions": environment(runner),
            "tensors": written,
            "naming": "file = percent-encoded tensor name + '.npy' (onnx_bisect.backends.dump)",
        }
        (stage / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
        swap_in(stage, directory, earlier)
    return DumpResult(directory, len(written), stats.runs.get("target", 0))


def _earlier_dump(directory: Path) -> tuple[str, ...]:
    """The files of an earlier dump in ``directory``, which a new one replaces. Anything else
    there is refused: ``dump:DIR`` reads every tensor file in DIR, so a mix of two models (or
    of a dump and other files) would be read as one."""
    if not directory.is_dir():
        return ()
    entries = sorted(p.name for p in directory.iterdir() if not is_stage_name(p.name))
    listed: set[str] = set()
    try:
        tensors = json.loads((directory / MANIFEST).read_text())["tensors"]
        listed = {MANIFEST, INPUTS_FILE, *(str(f) for f in tensors.values())}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        pass  # no manifest, or not ours: then every entry is someone else's
    others = [e for e in entries if e not in listed]
    if others:
        shown = ", ".join(others[:3]) + (", …" if len(others) > 3 else "")
        raise InputError(
            f"--out {directory}: holds {len(others)} file(s) that are not part of an onnx-bisect "
            f"dump ({shown}); a dump directory holds one dump only (dump:DIR reads every tensor "
            "file in it): choose an empty or new directory"
        )
    return tuple(entries)
