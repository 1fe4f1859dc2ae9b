"""Result types of dataset mode: each input's screen, the per-node statistics over the sample,
the culprit's confirmation and the task checks over the inputs; typed data and the lines they
say of themselves (JSON and CSV are ``report.serialize``'s)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from onnx_bisect.compare.criterion import Comparison
from onnx_bisect.compare.topk import TopKCheck
from onnx_bisect.text import plural

__all__ = [
    "Confirmation",
    "DatasetSummary",
    "InputScreen",
    "NodeStats",
    "Spread",
    "TaskAgreement",
]


@dataclass(frozen=True)
class InputScreen:
    """One input's plain runs: its final outputs compared, or the target's error on it."""

    index: int  # position in the dataset
    label: str
    outputs: tuple[Comparison, ...]
    diverged: bool
    error: float | None  # the worst output's deciding number (None when the target failed)
    badness: float  # orders inputs worst first (Criterion.badness of the worst output)
    failed: str = ""  # the target's error on this input, one line
    task_checks: tuple[TopKCheck, ...] = ()
    runs: Mapping[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class Spread:
    """A number over the inputs: mean, 95th percentile (linear interpolation) and maximum."""

    mean: float
    p95: float
    max: float


@dataclass(frozen=True)
class NodeStats:
    """One node over the sampled inputs on which it was measured."""

    index: int
    name: str
    op_type: str
    inputs: int  # sampled inputs on which the node was measured
    diverged: int  # ... on which its accumulated error fails the criterion
    wrong_alone: int  # ... on which it is a culprit: its isolated error fails
    accumulated: Spread | None  # of the deciding number, over the inputs that measured it
    isolated: Spread | None

    @property
    def diverged_fraction(self) -> float:
        return self.diverged / self.inputs if self.inputs else 0.0

    @property
    def wrong_alone_fraction(self) -> float:
        return self.wrong_alone / self.inputs if self.inputs else 0.0


@dataclass(frozen=True)
class Confirmation:
    """The worst input's culprit, checked on every sampled input: is it wrong alone there?"""

    nodes: tuple[str, ...]
    confirmed: int  # sampled inputs on which every culprit node is wrong in isolation
    sampled: int  # sampled inputs measured
    diverging: int  # sampled inputs whose outputs diverge
    confirmed_diverging: int  # of those, the confirmed ones


@dataclass(frozen=True)
class TaskAgreement:
    """One ``--topk`` check over the screened inputs."""

    spec: str
    output: str
    k: int
    inputs: int
    agreeing: int  # inputs on which no row's top-k set changed
    top1_agreement: float  # mean over the inputs of the share of rows whose top-1 agrees
    topk_overlap: float  # mean over the inputs of the mean top-k overlap
    rows_changed: int  # summed over the inputs

    @property
    def agreement_rate(self) -> float:
        return self.agreeing / self.inputs if self.inputs else 1.0

    def summary(self) -> str:
        return (
            f"{self.output} top-{self.k} ({self.spec}): agrees on {self.agreeing} of "
            f"{plural(self.inputs, 'input')} ({self.agreement_rate:.0%}); top-1 labels agree "
            f"on {self.top1_agreement:.2%} of rows on average, "
            f"{plural(self.rows_changed, 'row')} changed in all"
        )


@dataclass(frozen=True)
class DatasetSummary:
    """What a dataset run adds to the worst input's diagnosis."""

    source: str
    screened: tuple[InputScreen, ...]  # every input, worst first
    sample: tuple[str, ...]  # the labels scanned and isolated, worst first
    worst: str  # the input diagnosed in full (the result's own nodes and root cause)
    confirmation: Confirmation | None  # None: no culprit to confirm
    nodes: tuple[NodeStats, ...]  # graph order
    task_checks: tuple[TaskAgreement, ...] = ()
    jobs: int = 1
    ray: str | None = None
    runs: Mapping[str, int] = field(default_factory=dict)  # screen and sample, every input

    @property
    def diverged(self) -> int:
        return sum(1 for s in self.screened if s.diverged)

    @property
    def failed(self) -> int:
        return sum(1 for s in self.screened if s.failed)

    def node(self, name: str) -> NodeStats | None:
        return next((n for n in self.nodes if n.name == name), None)

    def lines(self) -> list[str]:
        """What the summary says of the dataset, in a line or two."""
        total = plural(len(self.screened), "input")
        failed = f" (the target failed on {self.failed})" if self.failed else ""
        head = (
            f"outputs diverge on {self.diverged} of {total}{failed}; "
            f"{len(self.sample)} sampled, worst first; the worst, {self.worst}, is shown below"
        )
        c = self.confirmation
        if c is None:
            return [head, *(t.summary() for t in self.task_checks)]
        names = ", ".join(c.nodes)
        confirm = (
            f"culprit {names} wrong alone on {c.confirmed} of {c.sampled} sampled inputs "
            f"({c.confirmed_diverging} of the {c.diverging} that diverge)"
        )
        return [head, confirm, *(t.summary() for t in self.task_checks)]
