"""Minimal repro bundles: the smallest subgraph that still diverges, written as an ONNX backend
test case with a standalone ``repro.py``, and proven by running it before we say so.

Candidates, smallest first: the root cause itself (one culprit, a pattern window, a crash
node), then windows grown around it, then doubling ranges of its ancestors (16, 32, ... nodes
back), then the whole prefix of the graph up to it (the context in which the divergence was
seen, fed the model's own inputs). Each is run on the target fed the reference's tensors at its
cut; the first that reproduces is trimmed to the outputs that diverge, written, and re-run in a
fresh process exactly as ``repro.py`` would run it. A bundle that does not reproduce there makes
way for the next candidate; if none does, the report says so.
"""

from __future__ import annotations

import logging
import subprocess
import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import onnx
from onnx import numpy_helper

from onnx_bisect.adapters.base import Backend
from onnx_bisect.errors import BackendCrash, BackendError
from onnx_bisect.locate import reference_operands
from onnx_bisect.metrics import Criterion, compare_tensors
from onnx_bisect.model import LoadedModel, NodeInfo, prefix_model, window_model
from onnx_bisect.narrow import window_candidates
from onnx_bisect.run import RunStats, TensorStore, timed_run

__all__ = ["ReproInfo", "build_bundle", "load_bundle", "run_bundle"]

log = logging.getLogger(__name__)

VERIFY_TIMEOUT_S = 600


@dataclass(frozen=True)
class ReproInfo:
    path: str
    kind: str  # what the bundle reproduces: "divergence" or "crash"
    nodes: tuple[str, ...]  # the bundle's nodes, in topological order
    nodes_before: int  # nodes in the whole model
    runs: int  # target runs spent minimizing (verification runs not included)
    isolated: bool  # fed the reference's tensors at its cut, not the model's own inputs
    reproduces: bool  # the written bundle was re-run in a fresh process and diverged
    message: str

    def to_dict(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "kind": self.kind,
            "nodes": list(self.nodes),
            "nodes_before": self.nodes_before,
            "nodes_after": len(self.nodes),
            "runs": self.runs,
            "isolated": self.isolated,
            "reproduces": self.reproduces,
            "message": self.message,
        }


@dataclass(frozen=True)
class _Candidate:
    nodes: tuple[NodeInfo, ...]
    prefix: bool  # the whole graph before the cut, fed the model's own inputs


@dataclass(frozen=True)
class _Built:
    model: onnx.ModelProto
    inputs: dict[str, npt.NDArray[Any]]
    outputs: dict[str, npt.NDArray[Any]]  # the reference's values


def build_bundle(
    loaded: LoadedModel,
    feeds: Mapping[str, npt.NDArray[Any]],
    store: TensorStore,
    target: Backend,
    crit: Criterion,
    stats: RunStats,
    start: Sequence[str],
    crash: bool,
    out_dir: Path,
    script: str,
    verify_in_process: bool = False,
) -> ReproInfo:
    """Find, write and verify the smallest reproducing bundle around the nodes ``start``."""
    kind = "crash" if crash else "divergence"
    runs_before = stats.runs.get("target", 0)
    last_written: tuple[_Candidate, str] | None = None
    for cand in _candidates(loaded, store, start):
        built = _reproduce(loaded, feeds, store, target, crit, stats, cand, crash)
        if built is None:
            continue
        _write(out_dir, built, script)
        runs = stats.runs.get("target", 0) - runs_before
        if verify_in_process:
            ok, tail = _rerun_in_process(out_dir, target, crit, crash)
        else:
            code, output = run_bundle(out_dir)
            ok, tail = code == 1, _tail(output)
        names = tuple(n.name for n in cand.nodes)
        last_written = (cand, tail)
        if ok:
            shown = ", ".join(names[:4]) + (" …" if len(names) > 4 else "")
            message = f"{len(names)} node(s): {shown} ({runs} target run(s) to minimize)"
            if cand.prefix:
                message = (
                    f"does not reproduce in isolation, smallest reproducing subgraph has "
                    f"{len(names)} nodes (the graph up to {names[-1]!r})"
                )
            return ReproInfo(
                str(out_dir), kind, names, len(loaded.nodes), runs, not cand.prefix, True, message
            )
        log.info("bundle of %d nodes did not reproduce in a fresh process: %s", len(names), tail)
    runs = stats.runs.get("target", 0) - runs_before
    if last_written is None:
        return ReproInfo(
            str(out_dir), kind, (), len(loaded.nodes), runs, False, False,
            "no subgraph reproduces the divergence when run on its own; no bundle was written",
        )  # fmt: skip
    cand, tail = last_written
    names = tuple(n.name for n in cand.nodes)
    return ReproInfo(
        str(out_dir), kind, names, len(loaded.nodes), runs, not cand.prefix, False,
        f"the last bundle written ({len(names)} nodes) reproduced in this process but not when "
        f"re-run in a fresh one (nondeterminism?): {tail}",
    )  # fmt: skip


def _candidates(
    loaded: LoadedModel, store: TensorStore, start: Sequence[str]
) -> Iterator[_Candidate]:
    index = {n.name: n.index for n in loaded.nodes}
    first = sorted(index[s] for s in start if s in index)
    if not first:
        return
    yield _Candidate(tuple(loaded.nodes[i] for i in first), False)
    seen = {tuple(first)}
    for window in window_candidates(loaded, store, loaded.nodes[first[-1]]):
        merged = tuple(sorted(set(window) | set(first)))
        if merged not in seen:
            seen.add(merged)
            yield _Candidate(tuple(loaded.nodes[i] for i in merged), False)
    yield from _ranges(loaded, first[-1])
    yield _Candidate(tuple(loaded.nodes[: first[-1] + 1]), True)


def _ranges(loaded: LoadedModel, end: int) -> Iterator[_Candidate]:
    """Ancestors of ``end`` among the 16, 32, 64, ... nodes before it, fed at the cut.

    For a divergence that needs a region of the graph rather than a window: the first range
    that reproduces is within twice the smallest one that would, at one target run per
    doubling, before the whole prefix is the last resort.
    """
    ancestors = _ancestors(loaded, end)
    step = 16
    while step < end:
        start = end - step
        nodes = tuple(n for n in loaded.nodes[start : end + 1] if n.index in ancestors)
        yield _Candidate(nodes, False)
        step *= 2


def _ancestors(loaded: LoadedModel, end: int) -> set[int]:
    producer = loaded.producer
    seen = {end}
    todo = [end]
    while todo:
        n = loaded.nodes[todo.pop()]
        for t in (*n.inputs, *n.implicit_inputs):
            p = producer.get(t)
            if p is not None and p.index not in seen:
                seen.add(p.index)
                todo.append(p.index)
    return seen


def _reproduce(
    loaded: LoadedModel,
    feeds: Mapping[str, npt.NDArray[Any]],
    store: TensorStore,
    target: Backend,
    crit: Criterion,
    stats: RunStats,
    cand: _Candidate,
    crash: bool,
) -> _Built | None:
    """Run a candidate on the target; when it reproduces, the bundle trimmed to what shows it."""
    built = _build(loaded, feeds, store, cand, None)
    try:
        out = timed_run(target, built.model, built.inputs, "target", stats)
    except BackendCrash:
        return built if crash else None
    except BackendError as exc:
        log.info("candidate failed on the target: %s", exc)
        return None
    if crash:
        return None
    diverged = _diverged(built.outputs, out, crit)
    if not diverged:
        return None
    if len(diverged) < len(built.outputs):
        return _build(loaded, feeds, store, cand, diverged)
    return built


def _diverged(
    expected: Mapping[str, npt.NDArray[Any]], got: Mapping[str, npt.NDArray[Any]], crit: Criterion
) -> list[str]:
    return [t for t, ref in expected.items() if compare_tensors(t, ref, got.get(t), crit).diverged]


def _build(
    loaded: LoadedModel,
    feeds: Mapping[str, npt.NDArray[Any]],
    store: TensorStore,
    cand: _Candidate,
    outputs: Sequence[str] | None,
) -> _Built:
    if cand.prefix:
        model = prefix_model(loaded, len(cand.nodes))
        if outputs is not None:
            model = _keep_outputs(model, outputs)
        names = [o.name for o in model.graph.output]
        used = {i.name for i in model.graph.input}
        inputs = {k: np.asarray(v) for k, v in feeds.items() if k in used}
    else:
        needed = [t for n in cand.nodes for t in n.inputs]
        metas, constants = reference_operands(loaded, store, needed)
        model, fed, names = window_model(
            loaded, cand.nodes, metas, constants, outputs=outputs, keep_names=True
        )
        inputs = {k: np.asarray(v) for k, v in feeds.items() if k in _input_names(model)}
        inputs.update({name: np.asarray(loaded.as_fed(t, store.get(t))) for name, t in fed.items()})
    model = _finish(model)
    refs = {t: np.asarray(store.get(t)) for t in names if t in store}
    return _Built(model, inputs, refs)


def _input_names(model: onnx.ModelProto) -> set[str]:
    return {i.name for i in model.graph.input}


def _keep_outputs(model: onnx.ModelProto, names: Sequence[str]) -> onnx.ModelProto:
    out = onnx.ModelProto()
    out.CopyFrom(model)
    keep = [o for o in out.graph.output if o.name in set(names)]
    del out.graph.output[:]
    out.graph.output.extend(keep)
    return out


def _finish(model: onnx.ModelProto) -> onnx.ModelProto:
    """Shape-inferred, with a descriptive graph name, and valid under the full checker."""
    model.graph.name = "onnx_bisect_repro"
    try:
        model = onnx.shape_inference.infer_shapes(model, data_prop=True)
    except Exception as exc:  # a custom op defeats inference; the bundle still runs
        log.info("shape inference on the bundle failed: %s", exc)
    return model


def _write(out_dir: Path, built: _Built, script: str) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    onnx.save_model(built.model, str(out_dir / "model.onnx"))
    data = out_dir / "test_data_set_0"
    if data.exists():
        for old in data.glob("*.pb"):
            old.unlink()
    data.mkdir(exist_ok=True)
    for i, inp in enumerate(i for i in built.model.graph.input if i.name in built.inputs):
        tensor = numpy_helper.from_array(np.ascontiguousarray(built.inputs[inp.name]), inp.name)
        (data / f"input_{i}.pb").write_bytes(tensor.SerializeToString())
    for i, out in enumerate(built.model.graph.output):
        if out.name in built.outputs:
            tensor = numpy_helper.from_array(np.asarray(built.outputs[out.name]), out.name)
            (data / f"output_{i}.pb").write_bytes(tensor.SerializeToString())
    (out_dir / "repro.py").write_text(script)


def load_bundle(
    bundle: Path,
) -> tuple[onnx.ModelProto, dict[str, npt.NDArray[Any]], dict[str, npt.NDArray[Any]]]:
    """The model, inputs and expected outputs of a bundle, read back from its files."""
    model = onnx.load(str(bundle / "model.onnx"))
    data = bundle / "test_data_set_0"

    def read(prefix: str) -> dict[str, npt.NDArray[Any]]:
        out = {}
        for f in sorted(data.glob(f"{prefix}_*.pb"), key=lambda p: int(p.stem.split("_")[-1])):
            t = onnx.TensorProto()
            t.ParseFromString(f.read_bytes())
            out[t.name] = numpy_helper.to_array(t)
        return out

    return model, read("input"), read("output")


def _rerun_in_process(
    bundle: Path, target: Backend, crit: Criterion, crash: bool
) -> tuple[bool, str]:
    """For a target given as a Python object, which no fresh process can rebuild: the written
    files, read back and run here."""
    model, inputs, expected = load_bundle(bundle)
    try:
        out = target.run(model, inputs)
    except BackendCrash as exc:
        return crash, f"crashed: {exc}"
    except BackendError as exc:
        return False, f"failed: {exc}"
    bad = _diverged(expected, out, crit)
    return (bool(bad) and not crash), f"diverged: {', '.join(bad)}" if bad else "no divergence"


def run_bundle(
    bundle: Path, target: str | None = None, timeout: float = VERIFY_TIMEOUT_S
) -> tuple[int, str]:
    """Run ``bundle/repro.py`` in a fresh interpreter: its exit code (1 reproduces, 0 does not,
    2 could not run) and everything it printed."""
    argv = [sys.executable, str(bundle / "repro.py"), "--dir", str(bundle)]
    if target is not None:
        argv += ["--target", target]
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return 2, f"repro.py did not finish in {timeout:g}s"
    return proc.returncode, (proc.stdout + proc.stderr).strip()


def _tail(text: str) -> str:
    return " | ".join(text.splitlines()[-4:])
