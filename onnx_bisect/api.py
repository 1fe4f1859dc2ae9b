"""``bisect()``: the whole diagnosis as one typed call. The CLI is a thin layer over it."""

from __future__ import annotations

import logging
import os
import platform
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import onnx

from onnx_bisect.adapters.base import Backend, BackendSpec, create_backend
from onnx_bisect.errors import InputError
from onnx_bisect.feeds import make_feeds
from onnx_bisect.locate import first_divergence, isolate, judge, root_cause, scan, screen
from onnx_bisect.metrics import Criterion
from onnx_bisect.model import LoadedModel, fix_input_shapes, load_model, tensor_nbytes
from onnx_bisect.result import BackendInfo, BisectResult
from onnx_bisect.run import RunStats, TensorStore

__all__ = ["DEFAULT_MAX_MEMORY", "ISOLATION_BATCH_BYTES", "bisect", "environment"]

log = logging.getLogger(__name__)

DEFAULT_MAX_MEMORY = 4 << 30
# An isolation batch holds the reference's inputs and the target's outputs of every node in it,
# with no buffer reuse between them. Past this size a batch costs more memory than it saves
# time: on YOLOv8n-320 one batch took 0.82 s at 434 MB peak, three took 0.93 s at 343 MB.
ISOLATION_BATCH_BYTES = 64 << 20
BackendLike = str | BackendSpec | Backend


def bisect(
    model: str | os.PathLike[str] | onnx.ModelProto,
    ref: BackendLike = "cpu",
    target: BackendLike = "cpu",
    *,
    inputs: Path | Mapping[str, npt.NDArray[Any]] | None = None,
    shapes: Mapping[str, Sequence[int]] | None = None,
    seed: int = 0,
    metric: str = "rel_l2",
    threshold: float = 1e-3,
    atol: float | None = None,
    rtol: float | None = None,
    max_memory: int = DEFAULT_MAX_MEMORY,
    parallel: bool = True,
    always_scan: bool = False,
    command: str = "",
) -> BisectResult:
    """Find the first node where ``target`` departs from ``ref`` and the node that causes it.

    ``inputs`` is a path (.npz/.npy/test-case dir) or a dict of arrays; without it, seeded random
    inputs are generated (``shapes`` fixes dynamic dims). ``parallel`` runs the reference and
    the target concurrently where both are needed (set False for backends that are not
    thread-safe together). ``always_scan`` runs the scan and isolation even when the final
    outputs agree, for the per-node error curve; the verdict still follows the outputs.
    Raises ``OnnxBisectError`` subclasses for bad input and unusable backends.
    """
    try:
        crit = Criterion(metric=metric, threshold=threshold, atol=atol, rtol=rtol)
    except ValueError as exc:
        raise InputError(str(exc)) from None
    t0 = time.perf_counter()
    timings: dict[str, float] = {}
    loaded = load_model(model)
    feeds = make_feeds(
        loaded.model,
        inputs=Path(inputs) if isinstance(inputs, str) else inputs,
        shapes=shapes,
        seed=seed,
    )
    ref_b, tgt_b = _backend(ref), _backend(target)
    timings["load"] = time.perf_counter() - t0
    stats = RunStats()
    notes = list(loaded.notes)

    t = time.perf_counter()
    outputs = screen(ref_b, tgt_b, loaded, feeds, crit, stats, parallel)
    timings["screen"] = time.perf_counter() - t
    common: dict[str, Any] = {
        "model": str(loaded.path) if loaded.path else "<in-memory ModelProto>",
        "ref": _info(ref_b),
        "target": _info(tgt_b),
        "criterion": crit,
        "outputs": outputs,
        "not_probed": loaded.not_probed,
        "inputs": feeds,
        "versions": environment(ref_b, tgt_b),
        "command": command,
    }
    diverged = any(c.diverged for c in outputs)
    if not diverged and not always_scan:
        timings["total"] = time.perf_counter() - t0
        return BisectResult(
            verdict="match",
            strategy="screen",
            first_divergence=None,
            root_cause=None,
            nodes=(),
            timings=timings,
            runs=dict(stats.runs),
            notes=tuple(notes),
            **common,
        )

    sizes = tensor_nbytes(fix_input_shapes(loaded.model, {k: v.shape for k, v in feeds.items()}))
    known = [s for s in sizes.values() if s is not None]
    total = sum(sizes.get(p) or max(known, default=0) for p in loaded.probes)
    with tempfile.TemporaryDirectory(prefix="onnx-bisect-cache-") as cache:
        # Within budget the reference's tensors stay in memory; beyond it they go to disk.
        store = TensorStore(None if total <= max_memory else Path(cache))
        t = time.perf_counter()
        accumulated = scan(
            ref_b, tgt_b, loaded, feeds, crit, sizes, max_memory, store, stats, parallel
        )
        timings["scan"] = time.perf_counter() - t
        notes += _observer_notes(loaded, outputs, accumulated)
        t = time.perf_counter()
        iso_budget = min(max_memory, ISOLATION_BATCH_BYTES)
        isolated = isolate(tgt_b, loaded, feeds, crit, iso_budget, store, stats)
        timings["isolate"] = time.perf_counter() - t
    nodes = judge(loaded, accumulated, isolated, crit)
    first = first_divergence(nodes)
    if not diverged and first is not None:
        notes.append(
            f"the final outputs agree, but {first.name!r} and later tensors diverge inside the "
            "graph: the error does not reach the outputs beyond the threshold"
        )
    timings["total"] = time.perf_counter() - t0
    return BisectResult(
        verdict="diverged" if diverged else "match",
        strategy="scan",
        first_divergence=first,
        root_cause=root_cause(nodes, first) if diverged or first is not None else None,
        nodes=tuple(nodes),
        timings=timings,
        runs=dict(stats.runs),
        notes=tuple(notes),
        **common,
    )


def _backend(b: BackendLike) -> Backend:
    if isinstance(b, str | BackendSpec):
        return create_backend(b)
    return b


def _info(b: Backend) -> BackendInfo:
    return BackendInfo(b.spec.text, b.describe(), b.versions())


def _observer_notes(
    loaded: LoadedModel, plain: Sequence[Any], accumulated: Mapping[str, Any]
) -> list[str]:
    """Marking outputs can break the target's fusions; say so when the results show it."""
    plain_div = {c.tensor for c in plain if c.diverged}
    instrumented_div = {t for t in loaded.outputs if t in accumulated and accumulated[t].diverged}
    if plain_div and not instrumented_div:
        return [
            "instrumentation changes the target's result: the plain run diverges but the run "
            "with every tensor marked as an output does not (likely a fusion the markers break)"
        ]
    return []


def environment(*backends: Backend) -> dict[str, str]:
    env = {
        "onnx-bisect": _version("onnx-bisect"),
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "machine": platform.machine(),
        "onnx": onnx.__version__,
        "numpy": np.__version__,
    }
    for b in backends:
        env.update(b.versions())
    return env


def _version(dist: str) -> str:
    try:
        return version(dist)
    except PackageNotFoundError:
        return "unknown"
