"""``bisect()``: the whole diagnosis as one typed call. The CLI is a thin layer over it."""

from __future__ import annotations

import atexit
import logging
import os
import platform
import shutil
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import onnx

from onnx_bisect.adapters.base import Backend, BackendSpec, create_backend, parse_spec
from onnx_bisect.adapters.exec import ExecBackend
from onnx_bisect.chain import ChainLink, amplification_chain
from onnx_bisect.errors import BackendCrash, BackendError, InputError
from onnx_bisect.feeds import input_specs, make_feeds, validate_feeds
from onnx_bisect.locate import (
    IsolationFailure,
    Observed,
    culprit_cause,
    first_divergence,
    isolate,
    judge,
    root_cause,
    scan,
    screen,
)
from onnx_bisect.matching import Matching, match_tensors
from onnx_bisect.metrics import NOISE_EPS, NOISE_K, Comparison, Criterion, compare_tensors
from onnx_bisect.model import (
    METADATA_OPS,
    LoadedModel,
    fix_input_shapes,
    load_model,
    prefix_model,
    tensor_nbytes,
    with_outputs,
)
from onnx_bisect.narrow import CutResult, cut_search, find_pattern
from onnx_bisect.noise import NoiseFloor, measure_float64
from onnx_bisect.reduce import ReproInfo, build_bundle
from onnx_bisect.repro_script import render_repro_script
from onnx_bisect.result import (
    BackendInfo,
    BisectResult,
    NodeResult,
    RootCause,
    SearchInfo,
    Verdict,
)
from onnx_bisect.run import RunStats, TensorStore, plan_chunks, timed_run
from onnx_bisect.sandbox import SandboxBackend
from onnx_bisect.search import CutSearch
from onnx_bisect.topk import TopKSpec, parse_topk, topk_checks
from onnx_bisect.transforms import TransformRecord, apply_transforms

__all__ = [
    "DEFAULT_MAX_MEMORY",
    "ISOLATION_BATCH_BYTES",
    "STRATEGIES",
    "bisect",
    "environment",
]

log = logging.getLogger(__name__)

DEFAULT_MAX_MEMORY = 4 << 30
STRATEGIES = ("auto", "scan", "bisect")
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
    threshold: float | str = 1e-3,
    noise_k: float = NOISE_K,
    noise_eps: float = NOISE_EPS,
    atol: float | None = None,
    rtol: float | None = None,
    max_memory: int = DEFAULT_MAX_MEMORY,
    parallel: bool = True,
    always_scan: bool = False,
    strategy: str = "auto",
    isolate_crashes: bool | None = None,
    timeout: float | None = None,
    repro: str | os.PathLike[str] | None = None,
    target_model: str | os.PathLike[str] | onnx.ModelProto | None = None,
    topk: Sequence[str | TopKSpec] = (),
    command: str = "",
) -> BisectResult:
    """Find the first node where ``target`` departs from ``ref`` and the node that causes it.

    ``inputs`` is a path (.npz/.npy/test-case dir) or a dict of arrays; without it, seeded random
    inputs are generated (``shapes`` fixes dynamic dims). ``parallel`` runs the reference and
    the target concurrently where both are needed (set False for backends that are not
    thread-safe together). ``always_scan`` runs the scan and isolation even when the final
    outputs agree, for the per-node error curve; the verdict still follows the outputs.
    ``strategy``: ``scan`` marks every tensor and isolates every node; ``bisect`` searches
    over cuts, marking only the tensors live across each (keeps the target's fusions); ``auto``
    scans and switches to bisect when marking outputs changes the target's result.
    ``threshold="auto"`` measures each tensor's fp32 noise against a float64 reference and
    flags errors above ``noise_k`` × noise + ``noise_eps`` (see ``noise``).
    ``isolate_crashes`` runs every target step in a child process (always so for ``exec:``
    targets, which are child processes already), so a segfault or abort is caught and bisected
    to the node that causes it; ``timeout`` (seconds per target run) turns a hang into a crash.
    ``target_model`` runs a different model on the target (an optimized copy, say) and matches
    tensors by name, leaving out names whose meaning changed.
    ``topk`` adds task-level checks on the final outputs (``"5:logits"``: do the top-5
    labels agree per row?); they are reported and do not change the verdict.
    ``repro`` names a directory for a minimal repro bundle (ONNX test case + ``repro.py``),
    written and verified when the outputs diverge.
    Raises ``OnnxBisectError`` subclasses for bad input and unusable backends.
    """
    if strategy not in STRATEGIES:
        raise InputError(f"unknown strategy {strategy!r}; choose from {', '.join(STRATEGIES)}")
    auto = threshold == "auto"
    try:
        fixed = 1e-3 if auto else float(threshold)
        crit = Criterion(metric=metric, threshold=fixed, atol=atol, rtol=rtol)
        if auto and (metric != "rel_l2" or crit.allclose):
            raise ValueError("--threshold auto needs --metric rel_l2 (and no --atol/--rtol)")
    except ValueError as exc:
        raise InputError(str(exc)) from None
    t0 = time.perf_counter()
    timings: dict[str, float] = {}
    topk_specs = [parse_topk(t) if isinstance(t, str) else t for t in topk]
    loaded = load_model(model)
    _check_topk_outputs(topk_specs, loaded)
    ref_spec, tgt_spec = _spec(ref), _spec(target)
    ref_b, tgt_b = _backend(ref, False, None), _backend(target, isolate_crashes, timeout)
    if inputs is None:
        # A dump carries the inputs it was made with; comparing other inputs would be noise.
        inputs = next((d for b in (ref_b, tgt_b) if (d := _dump_inputs(b)) is not None), None)
    feeds = make_feeds(
        loaded.model,
        inputs=Path(inputs) if isinstance(inputs, str) else inputs,
        shapes=shapes,
        seed=seed,
    )
    other = load_model(target_model) if target_model is not None else None
    label = str(other.path or "<in-memory ModelProto>") if other else ""
    transformed: list[TransformRecord] = []
    if (ref_spec and ref_spec.transforms) or (tgt_spec and tgt_spec.transforms):
        loaded, other, label, transformed = _transformed(loaded, other, ref_spec, tgt_spec, feeds)
    if other is not None:
        validate_feeds(feeds, input_specs(other.model))
    timings["load"] = time.perf_counter() - t0
    stats = RunStats()
    notes = list(loaded.notes) + [r.summary() for r in transformed]

    sizes = tensor_nbytes(fix_input_shapes(loaded.model, {k: v.shape for k, v in feeds.items()}))
    float64_dir = tempfile.TemporaryDirectory(prefix="onnx-bisect-f64-")
    if auto:
        t = time.perf_counter()
        float64 = TensorStore(
            None if 2 * _total(loaded, sizes) <= max_memory else Path(float64_dir.name)
        )
        measure_float64(loaded, feeds, sizes, max_memory, float64, stats)
        crit = replace(crit, noise=NoiseFloor(float64), k=noise_k, eps=noise_eps)
        timings["float64"] = time.perf_counter() - t
    common: dict[str, Any] = {
        "model": str(loaded.path) if loaded.path else "<in-memory ModelProto>",
        "ref": _info(ref_b, ref_spec),
        "target": _info(tgt_b, tgt_spec),
        "transforms": tuple(transformed),
        "target_model": label,
        "criterion": crit,
        "outputs": (),
        "not_probed": loaded.not_probed,
        "inputs": feeds,
        "versions": environment(ref_b, tgt_b),
        "command": command,
    }
    t = time.perf_counter()
    try:
        screened = screen(ref_b, tgt_b, loaded, feeds, crit, stats, parallel, other)
    except BackendCrash as exc:
        if exc.role != "target":
            raise
        timings["screen"] = time.perf_counter() - t
        ctx = _Context(loaded, feeds, crit, stats, timings, notes)
        result = _crash_result(loaded, tgt_b, feeds, stats, timings, notes, t0, exc, common)
        if repro is None or result.root_cause is None:
            return result
        # The crash node's inputs, as the reference computes them, feed the bundle.
        store = TensorStore(None if _total(loaded, sizes) <= max_memory else Path(_scratch("b")))
        scan(ref_b, None, loaded, feeds, crit, sizes, max_memory, store, stats, parallel)
        spec_given = isinstance(target, str | BackendSpec)
        crash_nodes = result.root_cause.nodes
        crash_bundle = _bundle(ctx, ref_b, tgt_b, store, crash_nodes, True, Path(repro), spec_given)
        return _with_bundle_docs(replace(result, repro=crash_bundle, runs=dict(stats.runs)))
    outputs = tuple(screened.comparisons.values())
    common["outputs"] = outputs
    common["task_checks"] = topk_checks(topk_specs, screened.ref_outputs, screened.target_outputs)
    timings["screen"] = time.perf_counter() - t
    diverged = screened.diverged
    # After a transform the per-tensor picture is the point (fp16's error curve, proof that
    # no renamed tensor moved), so the scan runs even when the outputs agree.
    if not diverged and not always_scan and not transformed:
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

    total = _total(loaded, sizes)
    ctx = _Context(loaded, feeds, crit, stats, timings, notes)
    with tempfile.TemporaryDirectory(prefix="onnx-bisect-cache-") as cache:
        # Within budget the reference's tensors stay in memory; beyond it they go to disk.
        store = TensorStore(None if total <= max_memory else Path(cache))
        t = time.perf_counter()
        matching: Matching | None = None
        # A repro bundle is cut from the model the target ran, fed under that model's names.
        bundle_ctx, bundle_store = ctx, store
        if other is not None:
            found, matching, bundle_store = _by_models(
                ctx, ref_b, tgt_b, other, sizes, max_memory, store
            )
            bundle_ctx = replace(ctx, loaded=other)
            used = "scan"
            notes.append(matching.summary())
            notes += [f"excluded {t}: {why}" for t, why in list(matching.excluded.items())[:5]]
            timings["scan"] = time.perf_counter() - t
        elif getattr(tgt_b, "partial", False):
            scanned = scan(
                ref_b, tgt_b, loaded, feeds, crit, sizes, max_memory, store, stats, parallel
            )
            timings["scan"] = time.perf_counter() - t
            found = _by_dump(ctx, scanned)
            used = "scan"
            notes.append(
                "the target is a dump: only accumulated errors can be known (no isolation, "
                "window or cut search); a node whose inputs match and whose output does not is "
                "named as the culprit"
            )
        elif strategy == "bisect":
            scan(ref_b, None, loaded, feeds, crit, sizes, max_memory, store, stats, parallel)
            timings["scan"] = time.perf_counter() - t
            found = _by_cut_search(ctx, tgt_b, store, "requested with --strategy bisect")
            used = "bisect"
        else:
            scanned = scan(
                ref_b, tgt_b, loaded, feeds, crit, sizes, max_memory, store, stats, parallel
            )
            timings["scan"] = time.perf_counter() - t
            observer = _observer_problem(loaded, screened, scanned, crit)
            if observer:
                log.info("%s", observer)
                notes.append(observer)
            t = time.perf_counter()
            iso_budget = min(max_memory, ISOLATION_BATCH_BYTES)
            isolated = isolate(tgt_b, loaded, feeds, crit, iso_budget, store, stats)
            timings["isolate"] = time.perf_counter() - t
            found = _by_scan(ctx, tgt_b, store, scanned, isolated, diverged)
            used = "scan"
            if observer and diverged and strategy == "auto":
                reason = "switched from the scan: " + observer
                log.info("switching to the bisect strategy")
                notes.append("switched to the bisect strategy, which marks only cut tensors")
                found = _by_cut_search(ctx, tgt_b, store, reason, scan_nodes=found.nodes)
                used = "scan+bisect"
        bundle: ReproInfo | None = None
        if repro is not None and diverged:
            t = time.perf_counter()
            start = _bundle_start(found.cause, found.first)
            spec_given = isinstance(target, str | BackendSpec)
            bundle = _bundle(
                bundle_ctx, ref_b, tgt_b, bundle_store, start, False, Path(repro), spec_given
            )
            timings["repro"] = time.perf_counter() - t
    nodes, first, cause, search = found.nodes, found.first, found.cause, found.search
    notes += _widespread(nodes)
    if not diverged and first is not None:
        notes.append(
            f"the final outputs agree, but {first.name!r} and later tensors diverge inside the "
            "graph: the error does not reach the outputs beyond the threshold"
        )
    timings["total"] = time.perf_counter() - t0
    return _with_bundle_docs(
        BisectResult(
            verdict="diverged" if diverged else "match",
            strategy=used,
            first_divergence=first,
            root_cause=cause if diverged or first is not None else None,
            nodes=tuple(nodes),
            timings=timings,
            runs=dict(stats.runs),
            notes=tuple(notes),
            search=search,
            # Only a scan's accumulated errors are the target's own result all along the graph.
            chain=_chain(other or loaded, nodes, cause, first) if used == "scan" else (),
            matching=matching,
            repro=bundle,
            **common,
        )
    )


def _with_bundle_docs(result: BisectResult) -> BisectResult:
    from onnx_bisect.report.files import write_bundle_docs

    write_bundle_docs(result)
    return result


def _widespread(nodes: Sequence[NodeResult]) -> list[str]:
    """Many culprits at once is a precision policy (bf16, fp16, TF32), not one bad kernel."""
    culprits = [n for n in nodes if n.verdict is Verdict.CULPRIT]
    ops = sorted({n.op_type for n in culprits})
    if len(culprits) < 5 or len(culprits) < 0.1 * sum(1 for n in nodes if n.isolated):
        return []
    return [
        f"{len(culprits)} nodes ({', '.join(ops[:4])}) are each wrong on their own: that is "
        "usually the target computing at lower precision (bf16/fp16/TF32) rather than one bad "
        "kernel; compare at fp32 (e.g. openvino?precision=f32) to test the kernels, or use "
        "--threshold auto to see which errors exceed fp32 rounding"
    ]


def _by_models(
    ctx: _Context,
    ref: Backend,
    target: Backend,
    other: LoadedModel,
    sizes: Mapping[str, int | None],
    budget: int,
    store: TensorStore,
) -> tuple[_Found, Matching, TensorStore]:
    """Reference model against a different target model: tensors matched by name, the
    target model's nodes isolated on the reference's values where those exist."""
    scan(ref, None, ctx.loaded, ctx.feeds, ctx.crit, sizes, budget, store, ctx.stats, False)
    matching = match_tensors(ctx.loaded, other)
    pairs = matching.pairs
    shapes = {k: v.shape for k, v in ctx.feeds.items()}
    other_sizes = tensor_nbytes(fix_input_shapes(other.model, shapes))
    comparisons: dict[str, Comparison] = {}
    for chunk in plan_chunks(list(pairs), other_sizes, budget):
        out = timed_run(target, with_outputs(other.model, chunk), ctx.feeds, "target", ctx.stats)
        for name in chunk:
            ref_value = store.get(pairs[name])
            comparisons[name] = compare_tensors(name, ref_value, out.get(name), ctx.crit)
    view = store.view(pairs)
    # The target model's own constant arithmetic (weights folded at run time) has no
    # counterpart; the reference backend computes it from the target model, so isolation
    # still feeds every node trusted values.
    own = [t for t in other.constants if t not in view]
    if own:
        values = timed_run(ref, with_outputs(other.model, own), ctx.feeds, "ref", ctx.stats)
        for name in own:
            view.put(name, values[name])
    iso_budget = min(budget, ISOLATION_BATCH_BYTES)
    isolated = isolate(target, other, ctx.feeds, ctx.crit, iso_budget, view, ctx.stats)
    nodes = judge(other, comparisons, isolated, ctx.crit)
    first = first_divergence(nodes)
    return _Found(nodes, first, root_cause(nodes, first)), matching, view


def _dump_inputs(backend: Backend) -> dict[str, npt.NDArray[Any]] | None:
    get = getattr(backend, "inputs", None)
    return get() if getattr(backend, "partial", False) and callable(get) else None


def _by_dump(ctx: _Context, scanned: Observed) -> _Found:
    """Verdicts from accumulated errors alone: a divergent node with clean inputs is the
    culprit as far as a dump can tell."""
    nodes = judge(ctx.loaded, scanned.comparisons, {}, ctx.crit)
    diverged = {t for t, c in scanned.comparisons.items() if c.diverged}
    derived = []
    for n in nodes:
        if n.diverged and not any(t in diverged for t in n.inputs):
            n = replace(
                n,
                verdict=Verdict.CULPRIT,
                note="derived from the dump: its inputs match the reference, its output does not",
            )
        derived.append(n)
    first = first_divergence(derived)
    culprit = next((n for n in derived if n.verdict is Verdict.CULPRIT), None)
    cause = None
    if culprit is not None:
        cause = RootCause(
            "culprit",
            (culprit.name,),
            f"{culprit.op_type} {culprit.name!r}: its inputs match the reference and its output "
            "does not (derived from a dump, which cannot be isolated; a fusion ending at this "
            "node is as likely as a kernel bug)",
        )
    elif first is not None:
        cause = RootCause("none", (), "the dump diverges, but no node with clean inputs does")
    return _Found(derived, first, cause)


def _bundle_start(cause: RootCause | None, first: NodeResult | None) -> tuple[str, ...]:
    if cause is not None and cause.nodes:
        return cause.nodes
    return (first.name,) if first is not None else ()


def _bundle(
    ctx: _Context,
    ref: Backend,
    target: Backend,
    store: TensorStore,
    start: Sequence[str],
    crash: bool,
    out_dir: Path,
    spec_given: bool,
) -> ReproInfo:
    """Write and verify the repro bundle; a target object (no spec) is verified in-process."""
    crit = ctx.crit
    threshold = crit.threshold
    if crit.auto:
        # repro.py has no float64 reference: freeze the noise-floor threshold of the root node.
        node = next((n for n in ctx.loaded.nodes if n.name in start), None)
        floors = [crit.threshold_for(t, store.get(t))[0] for t in (node.outputs if node else ())]
        threshold = min(floors, default=crit.eps)
    script = render_repro_script(
        ref=ref.spec.text,
        target=target.spec.text,
        metric=crit.metric,
        threshold=threshold,
        atol=crit.atol,
        rtol=crit.rtol,
        title=f"{target.spec.text} vs {ref.spec.text}",
        workdir=os.getcwd(),
    )
    return build_bundle(
        ctx.loaded, ctx.feeds, store, target, crit, ctx.stats, start, crash, out_dir, script,
        verify_in_process=not spec_given,
    )  # fmt: skip


def _chain(
    loaded: LoadedModel,
    nodes: Sequence[NodeResult],
    cause: RootCause | None,
    first: NodeResult | None,
) -> tuple[ChainLink, ...]:
    names = {n.name: n.index for n in nodes}
    starts = [names[n] for n in cause.nodes if n in names] if cause else []
    start = max(starts) if starts else (first.index if first else None)
    if start is None:
        return ()
    consumers: dict[int, list[int]] = {}
    producer = loaded.producer
    for n in loaded.nodes:
        if n.op_type in METADATA_OPS:
            continue
        for t in n.inputs:
            if t in producer:
                consumers.setdefault(producer[t].index, []).append(n.index)
    return amplification_chain(nodes, consumers, start)


@dataclass(frozen=True)
class _Context:
    loaded: LoadedModel
    feeds: Mapping[str, npt.NDArray[Any]]
    crit: Criterion
    stats: RunStats
    timings: dict[str, float]
    notes: list[str]


@dataclass(frozen=True)
class _Found:
    nodes: Sequence[NodeResult]
    first: NodeResult | None
    cause: RootCause | None
    search: SearchInfo | None = None


def _by_scan(
    ctx: _Context,
    target: Backend,
    store: TensorStore,
    scanned: Observed,
    isolated: Mapping[str, dict[str, Comparison] | IsolationFailure],
    diverged: bool,
) -> _Found:
    """Verdicts from scan and isolation; a pattern search when no node is wrong alone."""
    nodes = judge(ctx.loaded, scanned.comparisons, isolated, ctx.crit)
    first = first_divergence(nodes)
    cause = root_cause(nodes, first)
    if first is None or (cause is not None and cause.kind != "none"):
        return _Found(nodes, first, cause)
    return _with_pattern(ctx, target, store, nodes, first, cause, None)


def _by_cut_search(
    ctx: _Context,
    target: Backend,
    store: TensorStore,
    reason: str,
    scan_nodes: Sequence[NodeResult] = (),
) -> _Found:
    """Binary search over cuts, then isolation of the transition node, then a pattern."""
    t = time.perf_counter()
    cut = cut_search(target, ctx.loaded, ctx.feeds, ctx.crit, store, ctx.stats)
    ctx.timings["bisect"] = time.perf_counter() - t
    isolated = isolate(
        target, ctx.loaded, ctx.feeds, ctx.crit, 1 << 62, store, ctx.stats, [cut.node]
    )
    judged = judge(ctx.loaded, cut.comparisons, isolated, ctx.crit)
    if scan_nodes:
        # Keep the scan's full table; the search decides only the transition node's row.
        by_name = {n.name: n for n in judged}
        judged = [by_name[n.name] if n.name == cut.node.name else n for n in scan_nodes]
    first = next(n for n in judged if n.name == cut.node.name)
    if not first.diverged:
        first = replace(first, accumulated=_worst_at(cut, ctx.crit))
    search = SearchInfo(
        reason=reason,
        runs=cut.outcome.runs,
        probes=cut.outcome.probes,
        monotone=cut.outcome.monotone,
        refined=cut.outcome.refined,
        transition_node=cut.node.name,
    )
    if not cut.outcome.monotone:
        ctx.notes.append(
            "divergence is not monotone along the topological order (it vanished one cut past "
            f"the transition); a linear pass around it chose {cut.node.name!r}"
        )
    if first.verdict is Verdict.CULPRIT and first.isolated is not None:
        return _Found(judged, first, culprit_cause(first), search)
    fallback = RootCause("none", (), "no single node or small window reproduces the divergence")
    return _with_pattern(ctx, target, store, judged, first, fallback, search)


def _worst_at(cut: CutResult, crit: Criterion) -> Comparison | None:
    outs = [cut.comparisons[o] for o in cut.node.outputs if o in cut.comparisons]
    return max(outs, key=crit.badness) if outs else None


def _with_pattern(
    ctx: _Context,
    target: Backend,
    store: TensorStore,
    nodes: Sequence[NodeResult],
    first: NodeResult,
    fallback: RootCause | None,
    search: SearchInfo | None,
) -> _Found:
    t = time.perf_counter()
    start = ctx.loaded.nodes[first.index]
    pattern = find_pattern(target, ctx.loaded, ctx.feeds, ctx.crit, store, ctx.stats, start)
    ctx.timings["pattern"] = time.perf_counter() - t
    if pattern is None:
        return _Found(nodes, first, fallback, search)
    names = tuple(n.name for n in pattern.nodes)
    ops = " -> ".join(n.op_type for n in pattern.nodes)
    worst = max(pattern.comparisons.values(), key=ctx.crit.badness)
    cause = RootCause(
        "pattern",
        names,
        f"no node diverges alone, but the window {ops} ({len(names)} nodes) does when fed the "
        f"reference's inputs ({worst.reason or worst.status.value}): a pattern or fusion bug",
    )
    window = set(names)
    note = f"pattern window: {', '.join(names)}"
    marked = [
        replace(n, verdict=Verdict.PATTERN, note=note)
        if n.name == first.name or (n.name in window and n.diverged)
        else n
        for n in nodes
    ]
    first = next(n for n in marked if n.name == first.name)
    if search is not None:
        search = replace(search, pattern_windows_tried=pattern.tried)
    return _Found(marked, first, cause, search)


def _observer_problem(
    loaded: LoadedModel, plain: Observed, instrumented: Observed, crit: Criterion
) -> str:
    """Marking outputs can break the target's fusions; say so when the results show it."""
    changed = [
        n
        for n, v in instrumented.target_outputs.items()
        if n in plain.target_outputs
        and compare_tensors(n, plain.target_outputs[n], v, crit).diverged
    ]
    if changed:
        return (
            "instrumentation changes the target's result: with every tensor marked as an "
            f"output, {', '.join(changed[:3])} differ from the plain run (a fusion is likely "
            "involved)"
        )
    if plain.diverged and not instrumented.diverged:
        return (
            "instrumentation changes the target's result: the plain run diverges but the run "
            "with every tensor marked as an output does not (likely a fusion the markers break)"
        )
    return ""


def _scratch(prefix: str) -> str:
    path = tempfile.mkdtemp(prefix=prefix)
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


def _total(loaded: LoadedModel, sizes: Mapping[str, int | None]) -> int:
    """Bytes of every probe; an unknown size counts as the largest known."""
    known = [s for s in sizes.values() if s is not None]
    return sum(sizes.get(p) or max(known, default=0) for p in loaded.probes)


def _backend(b: BackendLike, isolate: bool | None, timeout: float | None) -> Backend:
    if not isinstance(b, str | BackendSpec):
        if isolate:
            raise InputError(
                "isolate_crashes needs the backend as a spec string (e.g. 'pkg.module:Class'), "
                "so that a child process can build it"
            )
        return b
    spec = (parse_spec(b) if isinstance(b, str) else b).without_transforms()
    backend = create_backend(spec)  # validates the spec and availability here, not in a child
    if isinstance(backend, ExecBackend):
        backend.timeout = timeout
        return backend
    if isolate:
        return SandboxBackend(spec, timeout)
    return backend


def _crashes_on_anything(
    loaded: LoadedModel, target: Backend, feeds: Mapping[str, npt.NDArray[Any]], stats: RunStats
) -> bool:
    """Whether the target dies even on Identity: then no node is to blame."""
    src = loaded.model
    first = next(i for i in src.graph.input if i.name in feeds)
    graph = onnx.helper.make_graph(
        [onnx.helper.make_node("Identity", [first.name], ["identity_out"], name="identity")],
        "sanity",
        [first],
        [onnx.helper.make_value_info("identity_out", onnx.TypeProto())],
    )
    model = onnx.helper.make_model(graph, opset_imports=list(src.opset_import))
    model.ir_version = src.ir_version
    try:
        timed_run(target, model, {first.name: feeds[first.name]}, "target", stats)
    except BackendCrash:
        return True
    except BackendError:
        return False
    return False


def _crash_result(
    loaded: LoadedModel,
    target: Backend,
    feeds: Mapping[str, npt.NDArray[Any]],
    stats: RunStats,
    timings: dict[str, float],
    notes: list[str],
    t0: float,
    crash: BackendCrash,
    common: dict[str, Any],
) -> BisectResult:
    """The target dies on the full model: find the first node whose presence kills it."""

    def crashes(position: int) -> bool:
        try:
            timed_run(target, prefix_model(loaded, position), feeds, "target", stats)
        except BackendCrash:
            return True
        except BackendError as exc:
            log.info("prefix %d failed without crashing: %s", position, exc)
        return False

    if _crashes_on_anything(loaded, target, feeds, stats):
        raise BackendCrash(f"{crash} (it also crashes on a one-node Identity model)", role="target")
    t = time.perf_counter()
    outcome = CutSearch(0, len(loaded.nodes)).run(crashes)
    timings["bisect"] = time.perf_counter() - t
    node = loaded.nodes[outcome.transition - 1]
    message = str(crash).removeprefix("target failed: ")
    rows = [
        NodeResult(
            index=n.index,
            name=n.name,
            op_type=n.op_type,
            inputs=n.inputs,
            outputs=n.outputs,
            verdict=Verdict.CRASHED if n is node else Verdict.NOT_PROBED,
            accumulated=None,
            note=f"the target crashes when this node is in the model: {message}"
            if n is node
            else "",
        )
        for n in loaded.nodes
    ]
    cause = RootCause(
        "crash",
        (node.name,),
        f"the target crashes whenever {node.op_type} {node.name!r} is in the model, and runs "
        f"every smaller prefix of the graph ({message})",
    )
    if not outcome.monotone:
        notes.append("crashes were not monotone along the order; a linear pass decided")
    search = SearchInfo(
        reason="the target crashed on the full model",
        runs=outcome.runs,
        probes=outcome.probes,
        monotone=outcome.monotone,
        refined=outcome.refined,
        transition_node=node.name,
    )
    timings["total"] = time.perf_counter() - t0
    return BisectResult(
        verdict="diverged",
        strategy="crash-bisect",
        first_divergence=rows[node.index],
        root_cause=cause,
        nodes=tuple(rows),
        timings=timings,
        runs=dict(stats.runs),
        notes=tuple(notes),
        search=search,
        **common,
    )


def _info(b: Backend, spec: BackendSpec | None) -> BackendInfo:
    # The spec as written, transforms included: the backend itself only knows the runtime part.
    return BackendInfo(spec.text if spec else b.spec.text, b.describe(), b.versions())


def _check_topk_outputs(specs: Sequence[TopKSpec], loaded: LoadedModel) -> None:
    for spec in specs:
        if spec.output is not None and spec.output not in loaded.outputs:
            known = ", ".join(loaded.outputs)
            raise InputError(
                f"--topk {spec.text}: the model has no output {spec.output!r} (outputs: {known})"
            )


def _spec(b: BackendLike) -> BackendSpec | None:
    if isinstance(b, str):
        return parse_spec(b)
    return b if isinstance(b, BackendSpec) else None


def _transformed(
    loaded: LoadedModel,
    other: LoadedModel | None,
    ref: BackendSpec | None,
    target: BackendSpec | None,
    feeds: Mapping[str, npt.NDArray[Any]],
) -> tuple[LoadedModel, LoadedModel, str, list[TransformRecord]]:
    """The reference and target models after their specs' ``+transform``s. The two then differ,
    so the search matches tensors by name (a transform may rename or fuse them)."""
    shapes = {k: v.shape for k, v in feeds.items()}
    source = str(loaded.path or "<in-memory ModelProto>")
    original, records = loaded, list[TransformRecord]()
    if ref is not None and ref.transforms:
        model, done = apply_transforms(loaded.model, ref.transforms, "ref", shapes)
        loaded, records = load_model(model), [*records, *done]
    target_source = other or original
    label = str(other.path or "<in-memory ModelProto>") if other else source
    if target is not None and target.transforms:
        model, done = apply_transforms(target_source.model, target.transforms, "target", shapes)
        other, records = load_model(model), [*records, *done]
        label += "".join(f" +{t}" for t in target.transforms)
    return loaded, other or original, label, records


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
