"""Result types: frozen dataclasses, typed data only, plus the few lines they say of
themselves (a one-line ``repr``, ``BisectResult.summary()``).

Their JSON form (the report schema), the CSV rows and the pandas frame are in
``report.serialize``, the tables and files in ``report``: rendering is the report's concern.
The summary lives here because ``print(result)`` and ``result.summary()`` must work in a
notebook, and the terminal prints the same lines, styled, above its table.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import numpy.typing as npt
from rich.text import Text

from onnx_bisect.compare.criterion import Comparison, Criterion
from onnx_bisect.compare.precision import FLOAT32_DEFAULT, PrecisionInfo
from onnx_bisect.compare.topk import TopKCheck
from onnx_bisect.dataset_result import DatasetSummary
from onnx_bisect.graph.match import Matching
from onnx_bisect.graph.source import SourceInfo, shown_source, source_lines
from onnx_bisect.graph.view import NodeInfo, NotProbed
from onnx_bisect.pass_result import PassBisection, PassOutcome, PassScope, target_arg
from onnx_bisect.quant_result import KeepInFp32, QuantReport
from onnx_bisect.run_info import (
    REPRO_CHECK,
    BackendInfo,
    ChainLink,
    ReproInfo,
    SearchInfo,
    chain_positions,
)
from onnx_bisect.steps_result import StepsSummary
from onnx_bisect.text import fmt, plural
from onnx_bisect.torch_result import TorchRefSummary
from onnx_bisect.transforms.registry import TransformRecord

__all__ = [
    "BackendInfo",
    "BisectResult",
    "CauseKind",
    "agreement",
    "ChainLink",
    "NodeResult",
    "chain_positions",
    "Outcome",
    "PassBisection",
    "PassOutcome",
    "PassScope",
    "ReproInfo",
    "REPRO_CHECK",
    "RootCause",
    "SearchInfo",
    "Verdict",
    "INSIDE",
    "INSIDE_CAUSE",
    "INSIDE_FIRST",
    "first_divergence_phrase",
    "headline",
    "lowered_by_runtime",
    "no_divergence_found",
    "nonfinite_origin",
    "nonfinite_phrase",
    "target_arg",
]


class Outcome(StrEnum):
    """The diagnosis as a whole: do the final outputs agree?"""

    MATCH = "match"
    DIVERGED = "diverged"


class CauseKind(StrEnum):
    """What kind of cause a root cause is (``culprit``, ``reference``, ``parameter``, ``range``,
    ``precision``, ``quantization``, ``pattern``, ``crash``, ``unsupported``, ``error``,
    ``export``, ``runtime``, ``preprocessing``, ``none``): each is defined, as the user reads
    it, in docs/guide.md's glossary and docs/report-format.md's ``root_cause.kind``."""

    CULPRIT = "culprit"
    RANGE = "range"
    PRECISION = "precision"
    QUANTIZATION = "quantization"
    REFERENCE = "reference"
    PARAMETER = "parameter"
    PATTERN = "pattern"
    CRASH = "crash"
    UNSUPPORTED = "unsupported"
    ERROR = "error"
    EXPORT = "export"
    RUNTIME = "runtime"
    PREPROCESSING = "preprocessing"
    NONE = "none"


class Verdict(StrEnum):
    """``reference-off``: fed the same inputs, the target agrees with float64 and the reference
    does not; ``parameter``: a constant (a Constant node, or arithmetic on initializers alone)
    whose value differs, never a culprit; ``not-comparable``: a constant whose two values
    cannot be compared (shape () against (0,), folded away by the runtime); ``range``: fed the
    reference's inputs, values its precision holds come back 0, ±Inf or NaN; ``precision``:
    beyond fp32 noise, within the error the target's lower precision predicts; ``harmless``:
    a culprit, range problem or changed constant among several whose target values, put in the
    reference run, leave the outputs within the criterion (discarded downstream)."""

    OK = "ok"
    CULPRIT = "culprit"
    RANGE = "range"
    PRECISION = "precision"
    REFERENCE_OFF = "reference-off"
    PARAMETER = "parameter"
    NOT_COMPARABLE = "not-comparable"
    HARMLESS = "harmless"
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
    def probed(self) -> bool:
        """Whether a tensor of it was compared, in the model or fed the reference's inputs (a
        cut search or a crash's bisection runs nodes without comparing theirs)."""
        return self.accumulated is not None or self.isolated is not None

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

    def __repr__(self) -> str:
        # The comparisons' metrics and shapes would make a list of these unreadable.
        acc, iso = _score(self.accumulated), _score(self.isolated)
        where = f"#{self.index} {self.op_type} {self.name}"
        return f"<NodeResult {where} {self.verdict}: acc {acc} iso {iso}>"


def _score(c: Comparison | None) -> str:
    return "—" if c is None else c.nonfinite or fmt(c.score)


def first_divergence_phrase(n: NodeResult) -> str:
    """What a first divergence without its own diverged tensor is: the cut search's transition
    node, where the final outputs start to differ (never printed as "ok")."""
    if n.verdict.value in ("ok", "not-probed"):
        return "the final outputs diverge from here on, though its own tensor does not"
    return n.verdict.value


@dataclass(frozen=True)
class RootCause:
    """Where the divergence comes from (see ``CauseKind``) and why we say so."""

    kind: CauseKind
    nodes: tuple[str, ...]
    reason: str
    # The target's own words where it crashed or failed, whole: that is what gets filed.
    message: str = ""
    # A spec that avoids it (a runtime's lowered precision: its fp32 setting), run and shown.
    workaround: str = ""
    # What the target said on the full model, where that differs from ``message`` (the first
    # failing prefix's): a runtime may refuse the whole for another reason (TVM's LSTM).
    model_message: str = ""
    # The workaround was run on the whole model and agrees with the reference at fp32 noise.
    workaround_verified: bool = False
    # Where the target gives up, where not the node named (which lost a rank: search/typeloss).
    fails_at: str = ""

    @property
    def is_bug(self) -> bool:
        """Whether a runtime's maintainer has something to fix: a precision the runtime
        chose is a setting to change, not a bug to report or a pass to bisect."""
        return self.kind not in (CauseKind.PRECISION, CauseKind.QUANTIZATION)

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "nodes": list(self.nodes),
            "reason": self.reason,
            "message": self.message,
            "workaround": self.workaround or None,
            "workaround_verified": self.workaround_verified,
            "model_message": self.model_message,
            "fails_at": self.fails_at or None,
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
    # The target runtime's runs per stage, in the order the stages ran (compiles, where the
    # target declares that its runs compile): ``RunStats.target_by_stage``.
    stage_runs: Mapping[str, int] = field(default_factory=dict)
    notes: tuple[str, ...] = ()
    versions: Mapping[str, str] = field(default_factory=dict)
    command: str = ""
    search: SearchInfo | None = None
    chain: tuple[ChainLink, ...] = ()  # from the root cause towards the outputs
    repro: ReproInfo | None = None  # when a bundle was asked for
    matching: Matching | None = None  # when the target ran a different model
    quant: QuantReport | None = None  # a quantized target model: pairing, table, keep-in-float
    keep_fp32: KeepInFp32 | None = None  # a float16 conversion at fault: what to keep float32
    target_model: str = ""  # that other model
    transforms: tuple[TransformRecord, ...] = ()  # +NAME suffixes applied to either model
    task_checks: tuple[TopKCheck, ...] = ()  # per output, when asked for
    pass_bisection: PassBisection | None = None  # when the target has passes to switch off
    # What each side computes float32 work in, and where that is known from.
    ref_precision: PrecisionInfo = FLOAT32_DEFAULT
    target_precision: PrecisionInfo = FLOAT32_DEFAULT
    # Dataset mode: every input screened; the rest is the diagnosis of the worst input.
    dataset: DatasetSummary | None = None
    # By node name: where it comes from in the exporter's source (module, class, file:line).
    sources: Mapping[str, SourceInfo] = field(default_factory=dict)
    # Multi-step mode: every step screened in lockstep; the rest of the result is the
    # diagnosis of the first step that diverged (else the last step).
    steps: StepsSummary | None = None
    torch: TorchRefSummary | None = None  # PyTorch reference: each module against the target

    @property
    def diverged(self) -> bool:
        return self.verdict is Outcome.DIVERGED

    def culprits(self) -> list[NodeResult]:
        return [n for n in self.nodes if n.verdict is Verdict.CULPRIT]

    def top(self, k: int = 10) -> list[NodeResult]:
        """The k nodes with the largest accumulated error, worst first; against a lower
        precision, the nodes its precision explains come after the rest, so that the node
        that is wrong is not hidden among hundreds of rounded ones (a diverged tensor is one
        beyond its precision floor)."""
        scored = [n for n in self.nodes if n.accumulated is not None]
        crit = self.criterion

        def rank(n: NodeResult) -> tuple[bool, float]:
            return n.diverged, crit.badness(n.accumulated)  # type: ignore[arg-type]

        return sorted(scored, key=rank, reverse=True)[:k]

    def __repr__(self) -> str:
        """``<BisectResult diverged: first /a/Conv, culprit /a/Conv; 192 nodes>``: the
        verdict and where, not the hundreds of node rows a dataclass repr would print."""
        found = []
        if self.first_divergence is not None:
            found.append(f"first {_short(self.first_divergence.name)}")
        rc = self.root_cause
        if rc is not None and rc.nodes:
            names = ", ".join(_short(n) for n in rc.nodes[:3])
            more = f" +{len(rc.nodes) - 3} more" if len(rc.nodes) > 3 else ""
            found.append(f"{rc.kind} {names}{more}")
        elif rc is not None:
            found.append("no root cause" if rc.kind is CauseKind.NONE else str(rc.kind))
        if not found and not self.diverged:
            found.append(_passing(len(self.outputs)))
        text = str(self.verdict) + (": " + ", ".join(found) if found else "")
        if self.nodes:
            text += f"; {plural(len(self.nodes), 'node')}"
        return f"<BisectResult {text}>"

    def summary(self) -> str:
        """The few lines the terminal prints first, as plain text: the verdict, the diverged
        outputs, the first divergence and the root cause (with the target's own words)."""
        return self.summary_text().plain

    def summary_text(self) -> Text:
        """``summary()`` with the terminal's styles."""
        return Text("\n").join(_summary_lines(self))


def _short(name: str, most: int = 60) -> str:
    return name if len(name) <= most else "…" + name[-(most - 1) :]


def _passing(outputs: int) -> str:
    return f"all {outputs} outputs agree" if outputs > 1 else f"{plural(outputs, 'output')} agrees"


def _summary_lines(r: BisectResult) -> list[Text]:
    head = Text.assemble((r.target.spec, "bold"), " vs ", (r.ref.spec, "bold"), f" on {r.model}")
    if r.target_model:
        head.append(f" (the target runs {r.target_model})")
    if r.dataset is not None:
        head.append(f" with dataset {r.dataset.source}")
    checks = [
        Text.assemble(("task check", "green" if c.agrees else "yellow"), f": {c.summary()}")
        for c in r.task_checks
    ]
    said = r.dataset.lines() if r.dataset is not None else []
    dataset = [Text.assemble(("Dataset", "bold"), f": {line}") for line in said]
    dataset += _steps_lines(r)
    precision = _precision_lines(r)
    if not r.diverged:
        total = r.timings.get("total", 0.0)
        agrees = (
            within_precision(r)
            or reference_less_exact(r)
            or within_integer_steps(r)
            or f"{_passing(len(r.outputs))}: {agreement(r)}"
        )
        passing = f": {agrees} ({total:.2f}s)"
        lines = [Text.assemble(("No divergence", "green"), ": ", head, passing), *dataset]
        lines += precision + checks
        return lines + _finding_lines(r) if r.nodes else lines
    lines = [Text.assemble((headline(r), _headline_style(r)), ": ", head), *precision, *dataset]
    if r.quant is not None:  # the answer first: what to keep in float
        answer = r.quant.lines()
        cause = r.root_cause
        if r.quant.keep is None and cause is not None and not cause.nodes:
            answer.insert(0, cause.reason)  # no search (QOperator, dynamic): the verdict first
        lines += [Text.assemble(("Quantization", "bold"), f": {q}") for q in answer]
    if r.keep_fp32 is not None:  # the answer first: what to keep in float32
        k = r.keep_fp32
        lines.append(Text.assemble(("Keep in float32", "bold"), f": {k.line()}"))
        if k.nodes or k.ops:
            lines += [Text(f"  {line}") for line in (k.prepare, k.call) if line]
        lines += [Text(f"  {line}") for line in k.lines()]
    for c in r.outputs:
        if c.diverged:
            rel, mx = c.shown("rel_l2"), c.shown("max_abs")
            why = f" ({c.range_problem})" if c.range_problem else ""
            lines.append(
                Text.assemble("  output ", (c.tensor, "bold"), f": {c.status.value}, ")
                + Text(f"rel_l2={rel} max_abs={mx}{why}")
            )
    return lines + checks + _finding_lines(r)


def lowered_by_runtime(r: BisectResult) -> bool:
    """Whether the whole finding is the runtime's own lower precision: it chose it unasked,
    every node is within what that precision predicts, and no node is to blame."""
    rc = r.root_cause
    tp = r.target_precision
    precision_only = rc is not None and rc.kind is CauseKind.PRECISION and not rc.nodes
    return r.diverged and precision_only and tp.lowered and not tp.asked


def headline(r: BisectResult) -> str:
    """The verdict in a few words, the same in the terminal and every report: ``Diverged``,
    ``No divergence``, or, where the runtime lowered the precision on its own and that is
    all, what it did and whether its fp32 setting is the workaround."""
    if not r.diverged:
        return "No divergence"
    if not lowered_by_runtime(r):
        return "Diverged"
    rc = r.root_cause
    assert rc is not None
    if rc.workaround_verified:
        fix = "fp32 workaround verified"
    elif rc.workaround:
        fix = "fp32 workaround NOT verified"
    else:
        fix = "no fp32 setting known"
    name = r.target_precision.precision.value
    return f"Precision lowered by the runtime ({name}); no kernel bug; {fix}"


def _headline_style(r: BisectResult) -> str:
    return "bold yellow" if lowered_by_runtime(r) else "bold red"


def no_divergence_found(r: BisectResult) -> str:
    """The first-divergence line where no tensor is beyond its threshold."""
    if lowered_by_runtime(r):
        return f"none beyond the error {r.target_precision.precision.value} predicts"
    return "none among the probed tensors"


def agreement(r: BisectResult) -> str:
    """What the outputs agree within, with the worst one's error beside its bound."""
    scored = [c for c in r.outputs if r.criterion.key in c.metrics]
    if not scored:
        return r.criterion.agreement()
    worst = max(scored, key=r.criterion.badness)
    return r.criterion.agreement(worst, largest=len(scored) > 1)


def within_integer_steps(r: BisectResult) -> str:
    """``agrees within the int8 precision: y within what its integer inputs one quantization
    step apart make``, where one quantized model's outputs differ only so, or by such flips
    amplified (a precision cause, ``engine/quant/amplified.py``); else ""."""
    steps, rc = r.quant.steps if r.quant is not None else None, r.root_cause
    outputs = {c.tensor for c in r.outputs if c.diverged is False and c.within_precision}
    apart = [(t, why) for t, why in (steps.apart if steps else ()) if t in outputs]
    amplified = rc is not None and rc.kind is CauseKind.PRECISION
    if r.diverged or steps is None or not (apart or amplified):
        return ""
    said = rc.reason if amplified and rc else "; ".join(f"{t} {why}" for t, why in apart[:3])
    return f"agrees within the int8 precision: {said}"


def reference_less_exact(r: BisectResult) -> str:
    """``the target agrees with float64; the reference's DynamicQuantizeLSTM 'lstm' is the
    less exact side``, where float64 sided with the target (no divergence); else ""."""
    rc = r.root_cause
    if r.diverged or rc is None or rc.kind is not CauseKind.REFERENCE:
        return ""
    node = next((n for n in r.nodes if n.name in rc.nodes), None)
    where = f"{node.op_type} {node.name!r}" if node is not None else ", ".join(rc.nodes)
    return f"the target agrees with float64; the reference's {where} is the less exact side"


def within_precision(r: BisectResult) -> str:
    """``agrees within float16 precision: 234 nodes, largest output error 4.4e-4, float16
    predicts ≤ 6e-4``, where a lower precision's floors judged the outputs; else ""."""
    lowered = [c for c in r.outputs if c.within_precision]
    if not lowered or r.criterion.floors is None:
        return ""
    name = r.criterion.floors.precision.value
    worst = max(lowered, key=lambda c: c.metrics.get("rel_l2", 0.0))
    bound = r.criterion.k * (worst.precision_floor or 0.0) + r.criterion.eps
    added = set(r.matching.added_casts) if r.matching is not None else set()
    judged = [n.name for n in r.nodes if n.verdict.value in ("ok", "precision")]
    casts = sum(1 for n in judged if n in added)
    nodes = f"{plural(len(judged) - casts, 'node')}" if judged else ""
    if nodes and casts:  # the conversion's Casts are not the user's nodes: said apart
        nodes += f" (+{plural(casts, 'Cast')} the conversion inserted)"
    nodes += ", " if nodes else ""
    return (
        f"agrees within {name} precision: {nodes}largest output error "
        f"{fmt(worst.metrics.get('rel_l2'))}, {name} predicts ≤ {fmt(bound)}"
    )


def precision_phrase(r: BisectResult) -> str:
    """What each side computes in, where either is known from more than the model's types;
    else ""."""
    tp, rp = r.target_precision, r.ref_precision
    if tp.source == "default" and rp.source == "default":
        return ""
    return f"the target computes in {tp.describe()}; the reference in {rp.describe()}"


def _precision_lines(r: BisectResult) -> list[Text]:
    said = precision_phrase(r)
    return [Text.assemble(("Precision", "bold"), f": {said}")] if said else []


def _steps_lines(r: BisectResult) -> list[Text]:
    said = [("Steps", s) for s in (r.steps.lines() if r.steps is not None else [])]
    said += [("PyTorch", s) for s in (r.torch.lines() if r.torch is not None else [])]
    return [Text.assemble((head, "bold"), f": {line}") for head, line in said]


def _finding_lines(r: BisectResult) -> list[Text]:
    """The first divergence and the root cause, with the target's own words where it failed."""
    # Under "No divergence" a divergence inside the graph is said as such: it did not reach
    # the outputs (a Log of 1e-10 at -inf in float16 that the model drops later).
    label = ("First divergence" if r.diverged else INSIDE_FIRST, "bold")
    fd = r.first_divergence
    if fd is not None and fd.accumulated is not None:
        c = fd.accumulated
        numbers = f"rel_l2={c.shown('rel_l2')} max_abs={c.shown('max_abs')}"
        where = f" (#{fd.index}) tensor {fd.tensor}: {numbers} cosine={c.shown('cosine')}"
        lines = [Text.assemble(label, f": {fd.op_type} ", (fd.name, "cyan"), where)]
    elif fd is not None:
        phrase = f" (#{fd.index}): {first_divergence_phrase(fd)}"
        lines = [Text.assemble(label, f": {fd.op_type} ", (fd.name, "cyan"), phrase)]
    else:
        lines = [Text.assemble(label, f": {no_divergence_found(r)}")]
    if fd is not None and (src := shown_source(r.sources, fd.name)) is not None:
        lines.append(Text(f"  from {src}"))
    origin = nonfinite_origin(r)
    if origin is not None:
        said, where = nonfinite_phrase(origin)
        tail = f" (#{origin.index}) tensor {origin.tensor}: {where}"
        lines.append(
            Text.assemble((said, "bold"), f": {origin.op_type} ", (origin.name, "cyan"), tail)
        )
    rc = r.root_cause
    if rc is not None:
        own = r.diverged or rc.kind in (CauseKind.REFERENCE, CauseKind.PRECISION)  # not inside
        head, below = ("Root cause", "") if own else (INSIDE_CAUSE, f"; {INSIDE}")
        names = Text.assemble((", ".join(rc.nodes), "cyan"), " — ") if rc.nodes else Text()
        lines.append(
            Text.assemble((head, "bold"), " (", (str(rc.kind), "red"), f"{below}): ")
            + names
            + Text(rc.reason)
        )
        lines += [Text(f"  from {line}") for line in source_lines(r.sources, rc.nodes)]
        if rc.message:
            lines.append(Text.assemble(("The target said", "bold"), ":"))
            lines += [Text(f"  {line}" if line.strip() else "") for line in rc.message.splitlines()]
    if r.pass_bisection is not None:
        lines.append(Text.assemble(("Optimizer pass", "bold"), f": {r.pass_bisection.summary()}"))
    return lines


# What a diagnosis whose outputs agree calls what it found inside the graph.
INSIDE = "it does not reach the outputs"
INSIDE_FIRST = "Divergence inside the graph"
INSIDE_CAUSE = "At fault inside the graph"


def nonfinite_origin(r: BisectResult) -> NodeResult | None:
    """The first node, in graph order, whose output holds a NaN or Inf where the reference's
    is finite: where they first appear, which the first divergence need not be."""
    for n in sorted(r.nodes, key=lambda n: n.index):
        c = n.accumulated
        if c is not None and (c.target_nan or c.target_inf):
            return n
    return None


def nonfinite_phrase(n: NodeResult) -> tuple[str, str]:
    """``("NaN first appears", "8 of 8 values are NaN where the reference's are finite")``."""
    c = n.accumulated
    assert c is not None
    values = plural(math.prod(c.shape), "value")
    if c.target_nan and c.target_inf:
        counts = f"{c.target_nan} NaN and {c.target_inf} Inf of {values}"
        return "NaN/Inf first appear", f"{counts} where the reference's are finite"
    kind, count = ("NaN", c.target_nan) if c.target_nan else ("Inf", c.target_inf)
    are = "is" if count == 1 else "are"
    return (
        f"{kind} first appears",
        f"{count} of {values} {are} {kind} where the reference's are finite",
    )
