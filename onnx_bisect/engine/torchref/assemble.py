"""The ``BisectResult`` of a PyTorch-side run: a node row per mapped module, the first
divergence and root cause as ONNX nodes, their sources with the torch class, the two sides
named as they were given (PyTorch the reference or the target), and the notes."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy.typing as npt

from onnx_bisect.backends.environment import environment
from onnx_bisect.backends.protocol import Backend
from onnx_bisect.compare.criterion import Comparison
from onnx_bisect.engine.diagnose import node_sources
from onnx_bisect.engine.session import StageTimer
from onnx_bisect.engine.torchref.cause import Cause
from onnx_bisect.graph.source import SourceInfo
from onnx_bisect.graph.view import LoadedModel
from onnx_bisect.options import BisectOptions
from onnx_bisect.result import (
    BackendInfo,
    BisectResult,
    CauseKind,
    NodeResult,
    Outcome,
    ReproInfo,
    RootCause,
    Verdict,
)
from onnx_bisect.torch_result import ModuleRecord, TorchRefSummary

__all__ = ["IN_MEMORY", "Sides", "torch_result"]

Array = npt.NDArray[Any]
IN_MEMORY = "<in-memory model>"
# The culprit row's verdict, by the root cause's kind.
BLAMED = {
    CauseKind.EXPORT: Verdict.CULPRIT,
    CauseKind.RUNTIME: Verdict.CULPRIT,
    CauseKind.REFERENCE: Verdict.REFERENCE_OFF,
}


@dataclass(frozen=True)
class Sides:
    """Which side is PyTorch: ``torch_is_ref`` (the ONNX model on ``backend``, the target,
    is under test) or not (the module is under test against the ONNX model on ``backend``,
    the reference); ``given`` is the backend as given, for the report."""

    torch_is_ref: bool
    backend: Backend
    given: Any

    def pair(self, torch_value: Any, onnx_value: Any) -> tuple[Any, Any]:
        """(reference, target) of a torch value and an ONNX one."""
        if self.torch_is_ref:
            return torch_value, onnx_value
        return onnx_value, torch_value

    @property
    def onnx_role(self) -> str:
        return "target" if self.torch_is_ref else "reference"


def torch_result(
    loaded: LoadedModel,
    sides: Sides,
    summary: TorchRefSummary,
    outputs: tuple[Comparison, ...],
    found: tuple[Cause | None, ReproInfo | None],
    feeds: Mapping[str, Array],
    timer: StageTimer,
    opts: BisectOptions,
    notes: tuple[str, ...],
) -> BisectResult:
    import torch

    cause, repro = found
    root = cause.root if cause is not None else None
    nodes = _nodes(summary, root)
    first = next((n for n in nodes if summary.first and n.name == summary.first.node), None)
    named = ((first.name,) if first else ()) + (root.nodes if root else ())
    sources = node_sources(loaded, named)
    if summary.first is not None:  # torch knows the class where a scoped name does not
        for name in named:
            sources[name] = _with_class(sources.get(name), summary.first)
    backend = sides.backend
    given = sides.given
    spec = given if isinstance(given, str) else getattr(given, "text", backend.spec.text)
    onnx_info = BackendInfo(spec, backend.describe(), backend.versions())
    torch_info = BackendInfo(f"pytorch:{summary.source}", f"PyTorch {torch.__version__} (eager)")
    ref, target = sides.pair(torch_info, onnx_info)
    diverged = any(c.diverged for c in outputs) or summary.first is not None
    onnx_runs = 1 + (cause.target_runs if cause else 0)
    runs = {"float64": 1} if cause else {}
    runs[sides.onnx_role] = onnx_runs
    return BisectResult(
        verdict=Outcome.DIVERGED if diverged else Outcome.MATCH,
        model=str(loaded.path or IN_MEMORY),
        ref=ref,
        target=target,
        criterion=opts.criterion(),
        strategy="torch",
        outputs=outputs,
        first_divergence=first,
        root_cause=root,
        nodes=nodes,
        not_probed=(),
        inputs=feeds,
        timings=timer.finish(),
        runs=runs,
        notes=notes,
        versions={**environment(backend), "torch": torch.__version__},
        command=opts.command,
        sources=sources,
        torch=summary,
        repro=repro,
    )


def _nodes(summary: TorchRefSummary, root: RootCause | None) -> tuple[NodeResult, ...]:
    """A row per mapped module's ONNX node (the innermost module where two share one)."""
    seen: dict[str, NodeResult] = {}
    blamed = BLAMED.get(root.kind) if root is not None else None
    for r in summary.mapped:
        if r.node in seen:
            continue
        verdict = Verdict.OK
        if r.comparison.diverged:
            first = r.module == summary.first_module
            verdict = blamed if first and blamed else Verdict.PROPAGATED
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


def torch_notes(
    summary: TorchRefSummary,
    cause: Cause | None,
    training: Sequence[str],
    said: Sequence[str],
) -> tuple[str, ...]:
    """The notes of the run: training mode on either side, unmapped modules, what the root
    cause's comparisons measured; ``said``: the precision's and the bundle's notes."""
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
    notes.extend(said)
    if summary.unmapped:
        notes.append(
            f"{len(summary.unmapped)} of {summary.modules} modules not mapped to an ONNX tensor "
            "(no output captured, no node of their scope, or no tensor of their output's "
            "shape): skipped"
        )
    if cause is not None:
        theirs, mine = cause.theirs, cause.mine
        line = f"the root cause's nodes in float64 against torch: rel_l2={theirs.shown('rel_l2')}"
        if mine is not None:
            line += f"; the ONNX backend against float64: rel_l2={mine.shown('rel_l2')}"
        notes.append(line)
        if not cause.from_torch:
            notes.append(
                "none of the module's captured inputs has the shape of a tensor its nodes "
                "read: they were fed the ONNX backend's values, so the root cause is less sure"
            )
    return tuple(notes)
