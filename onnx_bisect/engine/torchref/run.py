"""The PyTorch-reference diagnosis: the module captured, its outputs mapped to ONNX tensors,
those compared on the target, the first divergent module's root cause, and a ``BisectResult``
whose first divergence and root cause name the ONNX nodes and whose sources name the module."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from onnx_bisect.backends.environment import environment
from onnx_bisect.backends.protocol import Backend
from onnx_bisect.backends.registry import create_backend
from onnx_bisect.backends.spec import BackendSpec, parse_spec
from onnx_bisect.compare.criterion import Comparison, Criterion
from onnx_bisect.compare.tensors import compare_tensors
from onnx_bisect.engine.diagnose import node_sources
from onnx_bisect.engine.recorded import option_feeds
from onnx_bisect.engine.session import StageTimer
from onnx_bisect.engine.torchref.capture import Captured, capture, load_torch_ref
from onnx_bisect.engine.torchref.cause import Cause, module_cause, module_window, training_ops
from onnx_bisect.engine.torchref.mapping import (
    Mapped,
    candidates,
    map_modules,
    module_paths,
    scope_nodes,
)
from onnx_bisect.errors import InputError
from onnx_bisect.graph.extract import with_outputs
from onnx_bisect.graph.load import load_model
from onnx_bisect.graph.source import SourceInfo
from onnx_bisect.graph.view import LoadedModel
from onnx_bisect.options import BisectOptions, ModelLike
from onnx_bisect.result import (
    BackendInfo,
    BisectResult,
    CauseKind,
    NodeResult,
    Outcome,
    RootCause,
    Verdict,
)
from onnx_bisect.torch_result import ModuleRecord, TorchRefSummary

__all__ = ["bisect_torch"]

Array = npt.NDArray[Any]
IN_MEMORY = "<in-memory model>"


def bisect_torch(
    model: ModelLike, ref: object, target: Any, opts: BisectOptions, timer: StageTimer
) -> BisectResult:
    """The ONNX model on ``target`` against the PyTorch module ``ref`` (an ``nn.Module`` or
    ``pytorch:FILE.py:FACTORY``), module by module."""
    other = [f"--{k}" for k in ("dataset", "steps", "target_model") if getattr(opts, k)]
    if other:
        flags = ", ".join(o.replace("_", "-") for o in other)
        raise InputError(f"ref pytorch: cannot be combined with {flags} yet", option="ref")
    with timer.stage("load"):
        loaded = load_model(model)
        tgt = target if not isinstance(target, str | BackendSpec) else _backend(target)
        feeds = option_feeds(loaded.model, (tgt,), opts)
        torch_model = load_torch_ref(ref)
    with timer.stage("torch"):
        got = capture(torch_model, feeds, loaded.inputs)
    paths = module_paths(loaded)
    found = candidates(loaded, paths, list(got.outputs))
    marked = list(dict.fromkeys([*loaded.outputs, *(t for ts in found.values() for t in ts)]))
    with timer.stage("target"):
        values = tgt.run(with_outputs(loaded.model, marked), feeds)
    crit = opts.criterion()
    records = _records(map_modules(loaded, found, got.outputs, values), got, values, crit)
    outputs = tuple(
        compare_tensors(name, _f32(ref_out), _f32(values.get(name)), crit)
        for name, ref_out in zip(loaded.outputs, got.final, strict=False)
    )
    first = next((r for r in records if r.comparison.diverged), None)
    cause = None
    if first is not None:
        with timer.stage("root cause"):
            cause = _cause(loaded, paths, first, got, (feeds, values), tgt, crit)
    summary = TorchRefSummary(
        source=torch_model.source,
        modules=got.modules,
        mapped=tuple(records),
        unmapped=tuple(m for m in got.classes if m not in {r.module for r in records}),
        first_module=first.module if first is not None else None,
        was_training=torch_model.was_training,
    )
    notes = _notes(summary, opts, cause, training_ops(loaded))
    return _result(loaded, tgt, target, summary, outputs, cause, feeds, timer, opts, notes)


def _backend(target: str | BackendSpec) -> Backend:
    spec = parse_spec(target) if isinstance(target, str) else target
    if spec.transforms:
        raise InputError(
            f"target {spec.text}: +transforms are not taken with a PyTorch reference yet",
            option="target",
        )
    return create_backend(spec)


def _f32(value: Array | None) -> Array | None:
    """Compared in float32: torch's float64 against the export's float32 is no divergence
    by itself."""
    if value is None:
        return None
    v = np.asarray(value)
    return v.astype(np.float32) if v.dtype.kind == "f" else v


def _records(
    mapped: Sequence[Mapped], got: Captured, values: Mapping[str, Array], crit: Criterion
) -> list[ModuleRecord]:
    return [
        ModuleRecord(
            module=m.module,
            class_name=got.classes.get(m.module, ""),
            tensor=m.tensor,
            node=m.node.name,
            op_type=m.node.op_type,
            index=m.node.index,
            comparison=compare_tensors(
                m.tensor, _f32(got.outputs[m.module]), _f32(values[m.tensor]), crit
            ),
        )
        for m in mapped
    ]


def _cause(
    loaded: LoadedModel,
    paths: Mapping[str, str],
    first: ModuleRecord,
    got: Captured,
    ran: tuple[Mapping[str, Array], Mapping[str, Array]],
    tgt: Backend,
    crit: Criterion,
) -> Cause:
    """The first divergent module's ONNX nodes fed its own captured inputs (tensors they read
    from elsewhere are the target's: ``ran`` holds the feeds and the first run's values)."""
    feeds, values = ran
    fetched: list[str] = []

    def fetch(names: Sequence[str]) -> Mapping[str, Array]:
        # The first run's values where it marked them; one more run for the rest.
        rest = [n for n in names if n not in values]
        fetched.extend(rest)
        more = tgt.run(with_outputs(loaded.model, rest), feeds) if rest else {}
        return {**{n: values[n] for n in names if n in values}, **more}

    scope = scope_nodes(loaded, paths, first.module)
    window = module_window(
        loaded, scope, first.tensor, got.inputs.get(first.module, []), feeds, fetch
    )
    cls = f" ({first.class_name})" if first.class_name else ""
    label = f"module {first.module or '(top)'}{cls}"
    cause = module_cause(window, first.tensor, got.outputs[first.module], tgt, crit, label)
    return dataclasses.replace(cause, target_runs=cause.target_runs + bool(fetched))


def _result(
    loaded: LoadedModel,
    tgt: Backend,
    target: Any,
    summary: TorchRefSummary,
    outputs: tuple[Comparison, ...],
    cause: Cause | None,
    feeds: Mapping[str, Array],
    timer: StageTimer,
    opts: BisectOptions,
    notes: tuple[str, ...],
) -> BisectResult:
    import torch

    root = cause.root if cause is not None else None
    nodes = _nodes(summary, root)
    first = next((n for n in nodes if summary.first and n.name == summary.first.node), None)
    named = ((first.name,) if first else ()) + (root.nodes if root else ())
    sources = node_sources(loaded, named)
    if summary.first is not None:  # torch knows the class where a scoped name does not
        for name in named:
            sources[name] = _with_class(sources.get(name), summary.first)
    spec = target if isinstance(target, str) else getattr(target, "text", tgt.spec.text)
    diverged = any(c.diverged for c in outputs) or summary.first is not None
    return BisectResult(
        verdict=Outcome.DIVERGED if diverged else Outcome.MATCH,
        model=str(loaded.path or IN_MEMORY),
        ref=BackendInfo(f"pytorch:{summary.source}", f"PyTorch {torch.__version__} (eager)"),
        target=BackendInfo(spec, tgt.describe(), tgt.versions()),
        criterion=opts.criterion(),
        strategy="torch",
        outputs=outputs,
        first_divergence=first,
        root_cause=root,
        nodes=nodes,
        not_probed=(),
        inputs=feeds,
        timings=timer.finish(),
        runs={"float64": 1, "target": 1 + cause.target_runs} if cause else {"target": 1},
        notes=notes,
        versions={**environment(tgt), "torch": torch.__version__},
        command=opts.command,
        sources=sources,
        torch=summary,
    )


def _nodes(summary: TorchRefSummary, root: RootCause | None) -> tuple[NodeResult, ...]:
    """A row per mapped module's ONNX node (the innermost module where two share one)."""
    seen: dict[str, NodeResult] = {}
    blamed = root is not None and root.kind in (CauseKind.EXPORT, CauseKind.RUNTIME)
    for r in summary.mapped:
        if r.node in seen:
            continue
        verdict = Verdict.OK
        if r.comparison.diverged:
            first = r.module == summary.first_module
            verdict = Verdict.CULPRIT if first and blamed else Verdict.PROPAGATED
        cls = f" ({r.class_name})" if r.class_name else ""
        seen[r.node] = NodeResult(
            index=r.index,
            name=r.node,
            op_type=r.op_type,
            inputs=(),
            outputs=(r.tensor,),
            verdict=verdict,
            accumulated=r.comparison,
            note=f"module {r.module or '(top)'}{cls}",
        )
    return tuple(seen.values())


def _with_class(src: SourceInfo | None, record: ModuleRecord) -> SourceInfo:
    if src is None:
        return SourceInfo(record.module, record.class_name)
    if src.class_name or src.module != record.module:
        return src
    return dataclasses.replace(src, class_name=record.class_name)


def _notes(
    summary: TorchRefSummary,
    opts: BisectOptions,
    cause: Cause | None,
    training: Sequence[str],
) -> tuple[str, ...]:
    notes = []
    if training:
        more = f" (+{len(training) - 3} more)" if len(training) > 3 else ""
        notes.append(
            f"the ONNX model was exported in training mode: {'; '.join(training[:3])}{more}; "
            "torch ran in eval mode"
        )
    if summary.was_training:
        notes.append(
            f"{summary.source} was in training mode; it was put in eval mode (dropout off, "
            "batch-norm running statistics): export it in eval mode too"
        )
    if opts.auto_threshold:
        notes.append(
            "--threshold auto: a fixed rel_l2 threshold of 1e-3 against PyTorch (no float64 "
            "noise floors in this mode yet)"
        )
    if summary.unmapped:
        notes.append(
            f"{len(summary.unmapped)} of {summary.modules} modules not mapped to an ONNX tensor "
            "(no output captured, no node of their scope, or no tensor of their output's "
            "shape): skipped"
        )
    if cause is not None:
        theirs, mine = cause.theirs, cause.mine
        said = f"the root cause's nodes in float64 against torch: rel_l2={theirs.shown('rel_l2')}"
        if mine is not None:
            said += f"; the target against float64: rel_l2={mine.shown('rel_l2')}"
        notes.append(said)
        if not cause.from_torch:
            notes.append(
                "none of the module's captured inputs has the shape of a tensor its nodes "
                "read: they were fed the target's values, so the root cause is less sure"
            )
    if opts.repro is not None:
        notes.append("no repro bundle in PyTorch-reference mode yet")
    return tuple(notes)
