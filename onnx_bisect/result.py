"""Result types: frozen dataclasses, typed data only.

Their JSON form (the report schema), the CSV rows and the pandas frame are in
``report.serialize``: rendering is the report's concern, not the data's.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import numpy.typing as npt

from onnx_bisect.compare.criterion import Comparison, Criterion
from onnx_bisect.compare.topk import TopKCheck
from onnx_bisect.graph.match import Matching
from onnx_bisect.graph.view import NodeInfo, NotProbed
from onnx_bisect.transforms.registry import TransformRecord

__all__ = [
    "BackendInfo",
    "BisectResult",
    "CauseKind",
    "ChainLink",
    "NodeResult",
    "Outcome",
    "PassBisection",
    "PassOutcome",
    "ReproInfo",
    "RootCause",
    "SearchInfo",
    "Verdict",
]


@dataclass(frozen=True)
class ChainLink:
    node: str
    op_type: str
    index: int
    rel_l2: float
    gain: float | None  # this node's amplification (output error ÷ worst input error)


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


class Outcome(StrEnum):
    """The diagnosis as a whole: do the final outputs agree?"""

    MATCH = "match"
    DIVERGED = "diverged"


class CauseKind(StrEnum):
    """``culprit``: one node is wrong by itself; ``reference``: the node's reference value is
    the one off (the target agrees with float64); ``parameter``: the target holds a different
    value of a constant or weight (a transform or a precision policy rounded it) and no node
    computes wrongly; ``pattern``: only a window of connected nodes reproduces it; ``crash``:
    the target dies when the node is present; ``unsupported``: the target cannot run the node
    (a missing kernel or conversion); ``error``: the target reports another error whenever the
    node is present; ``none``: none of these could be shown."""

    CULPRIT = "culprit"
    REFERENCE = "reference"
    PARAMETER = "parameter"
    PATTERN = "pattern"
    CRASH = "crash"
    UNSUPPORTED = "unsupported"
    ERROR = "error"
    NONE = "none"


class Verdict(StrEnum):
    """``reference-off``: fed the same inputs, the target agrees with float64 and the reference
    does not; ``parameter``: a constant (a Constant node, or arithmetic on initializers alone)
    whose value differs, never a culprit; ``not-comparable``: a constant whose two values
    cannot be compared (shape () against (0,), folded away by the runtime)."""

    OK = "ok"
    CULPRIT = "culprit"
    REFERENCE_OFF = "reference-off"
    PARAMETER = "parameter"
    NOT_COMPARABLE = "not-comparable"
    PROPAGATED = "propagated"
    PATTERN = "pattern"
    UNSUPPORTED = "unsupported"
    FAILED = "failed"
    CRASHED = "crashed"
    NOT_PROBED = "not-probed"


@dataclass(frozen=True)
class NodeResult:
    """One node: its error in the full run (accumulated) and fed reference inputs (isolated)."""

    index: int
    name: str
    op_type: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    verdict: Verdict
    accumulated: Comparison | None
    isolated: Comparison | None = None
    amplification: float | None = None
    note: str = ""

    @classmethod
    def of(
        cls,
        node: NodeInfo,
        verdict: Verdict,
        accumulated: Comparison | None = None,
        **found: Any,
    ) -> NodeResult:
        """The result row of a graph node: its identity copied, what was found given."""
        return cls(
            index=node.index,
            name=node.name,
            op_type=node.op_type,
            inputs=node.inputs,
            outputs=node.outputs,
            verdict=verdict,
            accumulated=accumulated,
            **found,
        )

    @property
    def tensor(self) -> str | None:
        return self.accumulated.tensor if self.accumulated else None

    @property
    def accumulated_error(self) -> float | None:
        return self.accumulated.score if self.accumulated else None

    @property
    def isolated_error(self) -> float | None:
        return self.isolated.score if self.isolated else None

    @property
    def diverged(self) -> bool:
        if self.verdict is Verdict.NOT_COMPARABLE:
            return False
        return bool(self.accumulated and self.accumulated.diverged)

    @property
    def rel_l2(self) -> float | None:
        """Accumulated rel_l2 whatever the deciding metric: the one number comparable across
        tensors (the chain and the error curve use it); None when unknown or NaN."""
        value = self.accumulated.metrics.get("rel_l2") if self.accumulated else None
        return None if value is None or math.isnan(value) else float(value)


@dataclass(frozen=True)
class RootCause:
    """Where the divergence comes from (see ``CauseKind``) and why we say so."""

    kind: CauseKind
    nodes: tuple[str, ...]
    reason: str
    # The target's own words where it crashed or failed, whole: that is what gets filed.
    message: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "nodes": list(self.nodes),
            "reason": self.reason,
            "message": self.message,
        }


@dataclass(frozen=True)
class SearchInfo:
    """How the cut search went: positions asked, target runs spent, whether it was monotone."""

    reason: str
    runs: int
    asked: tuple[tuple[int, bool], ...]  # cut positions asked, with their answers
    monotone: bool
    refined: bool
    transition_node: str
    pattern_windows_tried: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {
            "reason": self.reason,
            "runs": self.runs,
            "probes": [{"position": p, "diverged": d} for p, d in self.asked],
            "monotone": self.monotone,
            "refined": self.refined,
            "transition_node": self.transition_node,
            "pattern_windows_tried": self.pattern_windows_tried,
        }


@dataclass(frozen=True)
class BackendInfo:
    spec: str
    description: str
    versions: Mapping[str, str] = field(default_factory=dict)


class PassOutcome(StrEnum):
    GUILTY = "guilty"  # these passes, enabled alone, make the target diverge
    NOT_OPTIMIZER = "not_optimizer"  # it diverges with every optimization off too
    NO_PASSES = "no_passes"  # the runtime named no pass that rewrites this model
    FAILED = "failed"  # the passes could not be listed


@dataclass(frozen=True)
class PassBisection:
    """Which optimizer passes of the target make it diverge, and how to turn them off."""

    outcome: PassOutcome
    target: str  # the spec whose passes were bisected
    passes: tuple[str, ...] = ()  # the passes that rewrite this model, in applied order
    guilty: tuple[str, ...] = ()
    runs: int = 0  # target runs to name them, the optimizations-off check included
    workaround: str = ""  # the spec with the guilty passes off
    workaround_forms: tuple[tuple[str, str], ...] = ()  # (where, text): Python, C/C++, ...
    workaround_verified: bool = False  # the workaround spec agrees (one more run)
    rewritten: tuple[str, ...] = ()  # the model's nodes the guilty passes replace
    reason: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {
            "outcome": self.outcome.value,
            "target": self.target,
            "passes": list(self.passes),
            "guilty": list(self.guilty),
            "runs": self.runs,
            "workaround": {
                "spec": self.workaround,
                **{where: text for where, text in self.workaround_forms},
                "verified": self.workaround_verified,
            }
            if self.workaround
            else None,
            "rewritten": list(self.rewritten),
            "reason": self.reason,
        }


@dataclass(frozen=True)
class BisectResult:
    verdict: Outcome
    model: str
    ref: BackendInfo
    target: BackendInfo
    criterion: Criterion
    strategy: str
    outputs: tuple[Comparison, ...]
    first_divergence: NodeResult | None
    root_cause: RootCause | None
    nodes: tuple[NodeResult, ...]
    not_probed: tuple[NotProbed, ...]
    inputs: Mapping[str, npt.NDArray[Any]] = field(repr=False, compare=False)
    timings: Mapping[str, float] = field(default_factory=dict)
    runs: Mapping[str, int] = field(default_factory=dict)
    notes: tuple[str, ...] = ()
    versions: Mapping[str, str] = field(default_factory=dict)
    command: str = ""
    search: SearchInfo | None = None
    chain: tuple[ChainLink, ...] = ()  # from the root cause towards the outputs
    repro: ReproInfo | None = None  # when a bundle was asked for
    matching: Matching | None = None  # when the target ran a different model
    target_model: str = ""  # that other model
    transforms: tuple[TransformRecord, ...] = ()  # +NAME suffixes applied to either model
    task_checks: tuple[TopKCheck, ...] = ()  # per output, when asked for
    pass_bisection: PassBisection | None = None  # when the target has passes to switch off

    @property
    def diverged(self) -> bool:
        return self.verdict is Outcome.DIVERGED

    def culprits(self) -> list[NodeResult]:
        return [n for n in self.nodes if n.verdict is Verdict.CULPRIT]

    def top(self, k: int = 10) -> list[NodeResult]:
        """The k nodes with the largest accumulated error, worst first."""
        scored = [n for n in self.nodes if n.accumulated is not None]
        crit = self.criterion
        return sorted(scored, key=lambda n: crit.badness(n.accumulated), reverse=True)[:k]  # type: ignore[arg-type]
