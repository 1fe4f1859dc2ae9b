"""Dataset statistics, pure: inputs ranked, the sample chosen, per-node spreads, the culprit's
confirmation and the task checks over the inputs. Nothing here runs a backend."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from onnx_bisect.compare.topk import TopKCheck
from onnx_bisect.dataset_result import (
    Confirmation,
    DatasetSummary,
    InputScreen,
    NodeStats,
    Spread,
    TaskAgreement,
)
from onnx_bisect.result import CauseKind, NodeResult, RootCause, Verdict

__all__ = [
    "MeasuredInput",
    "NodeSample",
    "confirm",
    "node_stats",
    "rank",
    "spread",
    "summarize",
    "task_agreement",
]


@dataclass(frozen=True)
class NodeSample:
    """One node on one input: the numbers a ``NodeResult`` holds, without its tensors' names,
    shapes and metrics (a worker sends back a few floats per node, not comparisons)."""

    index: int
    name: str
    op_type: str
    accumulated: float | None
    isolated: float | None
    diverged: bool
    wrong_alone: bool  # a culprit on this input

    @classmethod
    def of(cls, n: NodeResult) -> NodeSample:
        return cls(
            index=n.index,
            name=n.name,
            op_type=n.op_type,
            accumulated=n.accumulated_error,
            isolated=n.isolated_error,
            diverged=n.diverged,
            wrong_alone=n.verdict is Verdict.CULPRIT,
        )


@dataclass(frozen=True)
class MeasuredInput:
    """A sampled input scanned and isolated: every node's numbers, and the runs it took."""

    index: int
    label: str
    diverged: bool
    nodes: tuple[NodeSample, ...]
    runs: dict[str, int] = field(default_factory=dict)


def rank(screens: Sequence[InputScreen]) -> list[InputScreen]:
    """Worst first: inputs the target failed on, then diverged ones, then by the worst output's
    badness; ties in dataset order, so that a rerun ranks alike."""
    return sorted(screens, key=lambda s: (not s.failed, not s.diverged, -s.badness, s.index))


def spread(values: Sequence[float]) -> Spread | None:
    """Mean, p95 and max, NaN left out (an infinite error stays: it is the worst there is);
    None when nothing is left."""
    known = sorted(float(v) for v in values if not math.isnan(v))
    if not known:
        return None
    return Spread(float(np.mean(known)), _percentile(known, 0.95), known[-1])


def _percentile(ordered: Sequence[float], q: float) -> float:
    """numpy's default (linear) percentile, except that an infinite neighbour gives inf
    rather than numpy's NaN from inf - inf."""
    pos = q * (len(ordered) - 1)
    lo = math.floor(pos)
    frac = pos - lo
    if frac == 0 or ordered[lo + 1] == ordered[lo]:
        return ordered[lo]
    return ordered[lo] + frac * (ordered[lo + 1] - ordered[lo])


def node_stats(measured: Sequence[MeasuredInput]) -> tuple[NodeStats, ...]:
    """Per node over the inputs that measured it, in graph order (by the first input's index
    where inlined control flow gave inputs different nodes)."""
    samples: dict[str, list[NodeSample]] = {}
    for m in measured:
        for s in m.nodes:
            samples.setdefault(s.name, []).append(s)
    stats = [
        NodeStats(
            index=got[0].index,
            name=name,
            op_type=got[0].op_type,
            inputs=len(got),
            diverged=sum(s.diverged for s in got),
            wrong_alone=sum(s.wrong_alone for s in got),
            accumulated=spread([s.accumulated for s in got if s.accumulated is not None]),
            isolated=spread([s.isolated for s in got if s.isolated is not None]),
        )
        for name, got in samples.items()
    ]
    return tuple(sorted(stats, key=lambda n: n.index))


def confirm(cause: RootCause | None, measured: Sequence[MeasuredInput]) -> Confirmation | None:
    """On how many sampled inputs the worst input's culprit is wrong alone; None unless the
    root cause is a culprit (a pattern, a crash or a wrong reference has no per-input test)."""
    if cause is None or cause.kind is not CauseKind.CULPRIT or not cause.nodes:
        return None
    culprit = set(cause.nodes)

    def confirmed(m: MeasuredInput) -> bool:
        wrong = {s.name for s in m.nodes if s.wrong_alone}
        return culprit <= wrong

    diverging = [m for m in measured if m.diverged]
    return Confirmation(
        nodes=cause.nodes,
        confirmed=sum(confirmed(m) for m in measured),
        sampled=len(measured),
        diverging=len(diverging),
        confirmed_diverging=sum(confirmed(m) for m in diverging),
    )


def task_agreement(screens: Sequence[InputScreen]) -> tuple[TaskAgreement, ...]:
    """Each ``--topk`` check (per spec and output) over the inputs that ran."""
    by_check: dict[tuple[str, str], list[TopKCheck]] = {}
    for s in screens:
        for c in s.task_checks:
            by_check.setdefault((c.spec, c.output), []).append(c)
    return tuple(
        TaskAgreement(
            spec=spec,
            output=output,
            k=checks[0].k,
            inputs=len(checks),
            agreeing=sum(c.agrees for c in checks),
            top1_agreement=float(np.mean([c.top1_agreement for c in checks])),
            topk_overlap=float(np.mean([c.topk_overlap for c in checks])),
            rows_changed=sum(c.rows_changed for c in checks),
        )
        for (spec, output), checks in by_check.items()
    )


def summarize(
    source: str,
    ranked: Sequence[InputScreen],
    measured: Sequence[MeasuredInput],
    cause: RootCause | None,
    *,
    sample: int,
    jobs: int = 1,
    ray: str | None = None,
) -> DatasetSummary:
    """The dataset's part of the result, from the ranked screens, the measured sample and the
    worst input's root cause."""
    runs: dict[str, int] = {}
    for r in (*(s.runs for s in ranked), *(m.runs for m in measured)):
        for role, n in r.items():
            runs[role] = runs.get(role, 0) + n
    return DatasetSummary(
        source=source,
        screened=tuple(ranked),
        sample=tuple(s.label for s in ranked[:sample]),
        worst=ranked[0].label,
        confirmation=confirm(cause, measured),
        nodes=node_stats(measured),
        task_checks=task_agreement(ranked),
        jobs=jobs,
        ray=ray,
        runs=runs,
    )
