"""The smallest set of nodes to keep in float: ddmin over the quantized nodes (the pass
search's machinery, ``engine/passes/search.py``), each subset tried by running the target
model with that subset's Q/DQ removed (``graph/unquantize.py``), or, in a QOperator or
dynamic model, its integer kernels put back in float (``graph/refloat.py``), until the
outputs meet the goal. The set found is run once more to verify it; each node alone gives
the sensitivity."""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy.typing as npt
import onnx

from onnx_bisect.compare.goal import QuantGoal
from onnx_bisect.compare.quant import channel_rel_l2, mean_channel_rel_l2
from onnx_bisect.compare.topk import topk_checks
from onnx_bisect.engine.measure.goals import goal_runs
from onnx_bisect.engine.passes.search import find_guilty
from onnx_bisect.engine.quant.accuracy import accuracy_level_cause, eight_bits
from onnx_bisect.engine.quant.verify import requantized
from onnx_bisect.engine.session import Session
from onnx_bisect.errors import BackendError
from onnx_bisect.graph.qdq_plan import QDQPlan
from onnx_bisect.graph.refloat import integer_kernels, restore_float
from onnx_bisect.graph.unquantize import Unquantizer, is_qdq
from onnx_bisect.graph.view import LoadedModel
from onnx_bisect.quant_result import InputFigure, KeepInFloat, Sensitivity
from onnx_bisect.text import fmt, plural

__all__ = ["RECOVER", "search_keep_in_float"]

log = logging.getLogger(__name__)

# Without --quant-goal the goal is relative to the model's own quantization loss: keep in
# float the few nodes that recover this share of it (the mean output channel's rel_l2 between
# the quantized model and the same model all in float). What rounding spreads over the whole
# network no small set recovers: that model is within its quantization error.
RECOVER = 0.8
# A node stands out when keeping it alone in float recovers this share of the loss.
STAND_OUT = 0.25
# What a small set must recover for the loss to be more than the network's rounding.
WITHIN = 0.5
# The most nodes an answer may name: more is the network's rounding, not a few nodes' fault.
SMALL_SET = 8
# Runs the ddmin may spend (each builds a session of the whole model) before the smallest set
# seen to meet the goal is taken.
SEARCH_RUNS = 64
# Each node alone costs a run: the sensitivity table covers the kept set, the nodes the
# per-tensor table flags, then the rest in graph order, up to this many.
SENSITIVITY_MAX = 32

Tensors = Mapping[str, npt.NDArray[Any]]
# One input's figure from the reference's outputs and the target's (under the float names).
_Figure = Callable[[Tensors, Tensors], float]


class _OutOfRuns(Exception):
    """The search's run budget is spent."""


class _Trials:
    """Runs the target model with a set of nodes in float and measures the goal's number;
    remembers the smallest set that met the goal, and stops the search at ``budget`` runs."""

    def __init__(
        self,
        run: Callable[[Collection[str]], float],
        limit: float,
        key: Callable[[Collection[str]], Hashable] = frozenset,
    ) -> None:
        self.run, self.limit, self.key = run, limit, key
        self.seen: dict[Hashable, float] = {}
        self.runs = 0
        self.budget: int | None = None
        self.best: tuple[str, ...] | None = None

    def error(self, keep: Collection[str]) -> float:
        key = self.key(keep)
        value = self.seen.get(key)
        if value is None:
            if self.budget is not None and self.runs >= self.budget:
                raise _OutOfRuns
            self.runs += 1
            value = self.seen[key] = self.run(keep)
        if value <= self.limit and (self.best is None or len(keep) < len(self.best)):
            self.best = tuple(keep)
        return value

    def meets(self, keep: Collection[str]) -> bool:
        return self.error(keep) <= self.limit


def search_keep_in_float(
    session: Session,
    target: LoadedModel,
    model_path: str | None,
    suspects: Sequence[str] = (),
    ranked: Sequence[str] = (),
) -> tuple[KeepInFloat | None, tuple[Sensitivity, ...]]:
    """The keep-in-float set and the per-node sensitivity, most sensitive first (``suspects``,
    what the per-tensor table and the verdicts flag, measured first, then ``ranked``, then the
    rest in graph order); None when the model has no node that can be kept in float. Nodes
    are the float model's, as ``nodes_to_exclude`` takes them."""
    ref_model = session.loaded
    patcher = _patcher(ref_model, target)
    candidates, patch, alias = patcher.candidates, patcher.patch, patcher.alias
    if not candidates:
        return None, ()
    inputs = goal_runs(session)
    inputs.references()
    goal = session.options.goal()
    figure, loss, goal_text, name = _goal(session, goal, len(inputs.feeds))
    per_input: dict[Hashable, list[float]] = {}

    def run(keep: Collection[str]) -> float:
        figures: list[float] = []
        value = measured(patch(keep), f"{len(keep)} node(s) in float", figures)
        per_input[patcher.key(keep)] = figures
        return value

    def measured(model: onnx.ModelProto, what: str, figures: list[float] | None = None) -> float:
        try:
            got = inputs.figures(
                model, lambda r, o: figure(r, _by_reference_names(ref_model, target, o))
            )
        except BackendError as exc:
            log.info("%s failed: %s", what, exc)
            return float("inf")
        if figures is not None:
            figures += got
        value = max((loss(f) for f in got), default=float("inf"))
        value = value if value == value else float("inf")  # NaN: far from the goal
        log.info("%s: %s %.4g", what, goal_text, value)
        return value

    limit = goal.limit if goal is not None else float("inf")
    trials = _Trials(run, limit, patcher.key)
    named = [alias.get(n, n) for n in suspects]
    # A flagged node's output keeps its pair while a quantized reader marks it: the readers
    # are suspects with it.
    named += [p for n in named for p in sorted(patcher.partners.get(n, ()))]
    suspects = [n for n in dict.fromkeys(named) if n in candidates]
    ranked = [alias.get(n, n) for n in ranked]
    order = [n for n in dict.fromkeys([*suspects, *ranked, *candidates]) if n in candidates]
    with session.timer.stage("keep in float"):
        before, every = trials.error(()), trials.error(candidates)
        if goal is None:
            keep, note, sensitivity, goal_text = _relative(
                trials, order, suspects, before, every, goal_text
            )
        else:
            keep, note = _absolute(trials, candidates, suspects, before, every, goal_text)
            order = [n for n in dict.fromkeys([*keep, *order])]
            sensitivity = _sensitivity(trials, order)
            goal_text = f"{goal_text} ≤ {limit:g}"
        trials.budget = None
        after = trials.error(keep) if keep else before
        path = ""
        if keep and model_path:
            onnx.save(patch(keep), model_path)
            path = model_path
    if patcher.note:
        note = f"{note + '; ' if note else ''}{patcher.note}"
    figures = _per_input(
        inputs.labels, per_input, patcher.key, keep, lambda f: loss(f) <= trials.limit
    )
    found = KeepInFloat(
        keep, goal_text, before, after, after <= trials.limit, trials.runs, path, note,
        per_input=figures, figure=name,
    )  # fmt: skip
    if keep:
        with session.timer.stage("re-quantize"):
            found = requantized(session, target, found, trials.limit, measured)
            found = accuracy_level_cause(session, target, found, trials.limit, measured)
            found = eight_bits(session, target, found, trials.limit, measured)
    return found, sensitivity


def _per_input(
    labels: Sequence[str],
    measured: Mapping[Hashable, list[float]],
    key: Callable[[Collection[str]], Hashable],
    keep: Collection[str],
    meets: Callable[[float], bool],
) -> tuple[InputFigure, ...]:
    """Each input's figure as quantized and with the set in float, where all were measured;
    ``meets``: whether one input's figure is within the goal."""
    before, after = measured.get(key(())), measured.get(key(keep)) if keep else None
    if (
        before is None
        or len(before) != len(labels)
        or (after is not None and len(after) != len(labels))
    ):
        return ()

    def met(i: int) -> bool:
        return meets(before[i] if after is None else after[i])

    return tuple(
        InputFigure(label, before[i], None if after is None else after[i], met(i))
        for i, label in enumerate(labels)
    )


@dataclass(frozen=True)
class _Patcher:
    """The nodes that can be kept in float (the float model's names); the target with a set
    of them in float; a key equal for two sets that give the same model (a node kept in float
    between quantized neighbours changes nothing: they keep its pairs); what the answer's
    note says (integer kernels that cannot be put back in float); each integer kernel's float
    name (what the table and verdicts name it by); each node -> the nodes that must be kept
    in float with it for its outputs to lose their pairs."""

    candidates: tuple[str, ...]
    patch: Callable[[Collection[str]], onnx.ModelProto]
    key: Callable[[Collection[str]], Hashable]
    note: str = ""
    alias: Mapping[str, str] = field(default_factory=dict)
    partners: Mapping[str, frozenset[str]] = field(default_factory=dict)


def _patcher(ref: LoadedModel, target: LoadedModel) -> _Patcher:
    if is_qdq(target):
        rules = Unquantizer(target, ref)
        unmatched = rules.unmatched()
        if unmatched:
            log.info("the quantizer's rules pair %d tensors the target does not: %s",
                     len(unmatched), ", ".join(unmatched[:5]))  # fmt: skip
        return _Patcher(
            rules.candidates, rules.model, lambda keep: rules.plan(keep).key,
            partners=_partners(ref, rules.base),
        )  # fmt: skip
    found = integer_kernels(target.model, ref.model)
    kernels = found.kernels

    def patch(keep: Collection[str]) -> onnx.ModelProto:
        return restore_float(target.model, {kernels[n]: n for n in keep}, ref.model)

    skipped = ""
    if found.skipped:
        shown = "; ".join(f"{k}: {why}" for k, why in list(found.skipped.items())[:3])
        skipped = f"{plural(len(found.skipped), 'integer kernel')} kept quantized ({shown})"
    alias = {v: k for k, v in kernels.items()}
    return _Patcher(tuple(kernels), patch, frozenset, skipped, alias)


def _partners(ref: LoadedModel, plan: QDQPlan) -> dict[str, frozenset[str]]:
    """Each node -> the other nodes marking what it writes: the quantized readers that keep
    a pair on its output while they stay quantized."""
    out: dict[str, set[str]] = {}
    for tensor, nodes in plan.markers.items():
        maker = ref.producer.get(tensor)
        if maker is not None and maker.name in plan.removed:  # the dropped Relu's producer
            maker = ref.producer.get(plan.removed[maker.name])
        if maker is not None and maker.name in nodes:
            out.setdefault(maker.name, set()).update(nodes - {maker.name} - set(plan.removed))
    return {n: frozenset(v) for n, v in out.items()}


def _sensitivity(trials: _Trials, order: Sequence[str]) -> tuple[Sensitivity, ...]:
    measured = (Sensitivity(n, trials.error({n})) for n in order[:SENSITIVITY_MAX])
    return tuple(sorted(measured, key=lambda s: s.error))


def _absolute(
    trials: _Trials,
    candidates: Sequence[str],
    suspects: Sequence[str],
    before: float,
    every: float,
    goal_text: str,
) -> tuple[tuple[str, ...], str]:
    """The user's --quant-goal: ddmin over every quantized node, flagged ones first."""
    limit = trials.limit
    if before <= limit:
        return (), f"the quantized model meets the goal ({goal_text} ≤ {limit:g}) as it is"
    if every > limit:
        return (), (
            f"even with every quantized node in float the goal is missed ({goal_text} "
            f"{every:.3g} > {limit:g}): the models differ by more than quantization"
        )
    return _search(candidates, suspects, trials)


def _relative(
    trials: _Trials,
    order: Sequence[str],
    suspects: Sequence[str],
    before: float,
    every: float,
    goal_text: str,
) -> tuple[tuple[str, ...], str, tuple[Sensitivity, ...], str]:
    """The default goal: recover RECOVER of the quantization loss (``before`` -> ``every``)
    with at most SMALL_SET nodes, chosen among the nodes the per-tensor table and the verdicts
    flag with those that alone recover STAND_OUT of it, else among the most sensitive; when
    no small set recovers WITHIN of it, the model is within its quantization error. Either
    way short of the goal, the best small set is said with its measured effect."""
    loss = before - every
    trials.limit = every + (1.0 - RECOVER) * loss
    text = (
        f"{goal_text} ≤ {fmt(trials.limit)} ({RECOVER:.0%} of the quantization loss "
        f"recovered: {fmt(before)} quantized, {fmt(every)} all in float)"
    )
    if not loss > 0.0:
        note = (
            f"keeping every quantized node in float does not lower the {goal_text} "
            f"({fmt(before)} -> {fmt(every)}): the models differ by more than quantization"
        )
        return (), note, (), text
    sensitivity = _sensitivity(trials, order)
    standing = [s.node for s in sensitivity if before - s.error >= STAND_OUT * loss]
    helpful = [s.node for s in sensitivity[:SMALL_SET] if s.error < before]
    tried: list[tuple[float, tuple[str, ...]]] = [(s.error, (s.node,)) for s in sensitivity[:1]]
    # The flagged and standing-out nodes first, then the most sensitive ones together.
    for pool in dict.fromkeys([tuple(dict.fromkeys([*suspects, *standing])), tuple(helpful)]):
        if not pool:
            continue
        if trials.meets(pool):
            keep, note = _search(pool, pool, trials)
            if len(keep) <= SMALL_SET:
                return keep, note, sensitivity, text
        tried.append((trials.error(pool[:SMALL_SET]), pool[:SMALL_SET]))
    effect, shown = min(tried, default=(before, ()))
    # No small set recovers half the loss: the rounding is spread over the network.
    within = before - effect < WITHIN * loss
    note = (
        f"{'within its quantization error: ' if within else ''}no set of at most {SMALL_SET} "
        f"nodes recovers {RECOVER:.0%} of the loss ({len(suspects)} flagged by the per-tensor "
        f"table or the verdicts, {len(standing)} of {len(sensitivity)} measured alone stand "
        f"out){_SPREAD if within else ''}"
    )
    if shown and effect < before:  # a set that lowers nothing is no help to show
        note += (
            f". Best small set found: nodes_to_exclude={list(shown)!r}, {goal_text} "
            f"{fmt(before)} -> {fmt(effect)}"
        )
    return (), note, sensitivity, text


_SPREAD = "; the loss is the network's rounding as a whole"


def _search(
    candidates: Sequence[str], suspects: Sequence[str], trials: _Trials
) -> tuple[tuple[str, ...], str]:
    """ddmin over the nodes the per-tensor table points at when keeping them all meets the
    goal (a few runs on a model of hundreds of quantized nodes), else over every node; at
    most SEARCH_RUNS runs, after which the smallest set seen to meet the goal is the answer,
    said to be not minimal."""
    trials.budget = trials.runs + SEARCH_RUNS
    try:
        within = list(suspects) if suspects and trials.meets(suspects) else list(candidates)
        return find_guilty(within, trials.meets).guilty, ""
    except _OutOfRuns:
        best = trials.best or tuple(candidates)
        return best, (
            f"the search stopped after {SEARCH_RUNS} runs: {plural(len(best), 'node')} meet the "
            "goal, perhaps not the fewest (raise --quant-goal, or give --topk for a task "
            "check, to make it easier)"
        )


def _goal(
    session: Session, goal: QuantGoal | None, inputs: int
) -> tuple[_Figure, Callable[[float], float], str, str]:
    """One input's figure, the number the goal bounds from it (the worst input's decides),
    the goal in words and the figure's name. A task goal (``top1:logits@last>=1``): its own
    figure, bounded as 1 − agreement or the error. Else with ``--topk``: the worst top-1
    agreement, bounded as 1 − it; with a number: the worst output channel's rel_l2; with
    none: the mean output channel's, worst output."""
    on = "" if inputs == 1 else f" (worst of {inputs} inputs)"
    if goal is not None and goal.task:
        text = ("1 − " if goal.metric == "top1" else "") + goal.figure_name + on
        return goal.figure, goal.loss, text, goal.figure_name
    specs = list(session.options.topk_specs())
    if specs:

        def agreement(ref: Tensors, out: Tensors) -> float:
            checks = topk_checks(specs, ref, out)
            return min((c.top1_agreement for c in checks), default=1.0)

        return agreement, lambda f: 1.0 - f, f"top-1 disagreement{on}", "top-1 agreement"
    per_output = channel_rel_l2 if goal is not None else mean_channel_rel_l2
    name = "worst output channel rel_l2" if goal is not None else "mean output channel rel_l2"

    def error(ref: Tensors, out: Tensors) -> float:
        return max(per_output(v, out[k]) if k in out else float("inf")
                   for k, v in ref.items())  # fmt: skip

    return error, lambda f: f, f"{name}{on}", name


def _by_reference_names(ref: LoadedModel, target: LoadedModel, out: Tensors) -> dict[str, Any]:
    """The target's outputs under the float model's names (by position where they differ)."""
    return {r: out[t] for r, t in zip(ref.outputs, target.outputs, strict=False) if t in out}
