"""The smallest set of nodes to keep in float: ddmin over the quantized nodes (the pass
search's machinery, ``engine/passes/search.py``), each subset tried by running the target
model with that subset's Q/DQ removed (``graph/unquantize.py``), until the outputs meet the
goal. The set found is run once more to verify it; each node alone gives the sensitivity."""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

import numpy.typing as npt
import onnx

from onnx_bisect.compare.quant import channel_rel_l2
from onnx_bisect.compare.topk import topk_checks
from onnx_bisect.engine.measure.runs import timed_run
from onnx_bisect.engine.passes.search import find_guilty
from onnx_bisect.engine.session import Session
from onnx_bisect.errors import BackendError
from onnx_bisect.graph.unquantize import is_qdq, keep_in_float, quantized_nodes
from onnx_bisect.graph.view import LoadedModel, NodeInfo
from onnx_bisect.quant_result import KeepInFloat, Sensitivity
from onnx_bisect.text import plural

__all__ = ["DEFAULT_QUANT_GOAL", "search_keep_in_float"]

log = logging.getLogger(__name__)

# The worst output channel's rel_l2 a quantized model may keep (int8 rounding of a
# well-scaled network's outputs is ~1e-2).
DEFAULT_QUANT_GOAL = 0.05
# Runs the ddmin may spend (each builds a session of the whole model) before the smallest set
# seen to meet the goal is taken.
SEARCH_RUNS = 64
# Each node alone costs a run: the sensitivity table covers the kept set, the nodes the
# per-tensor table flags, then the rest in graph order, up to this many.
SENSITIVITY_MAX = 32

Tensors = Mapping[str, npt.NDArray[Any]]


class _OutOfRuns(Exception):
    """The search's run budget is spent."""


class _Trials:
    """Runs the target model with a set of nodes in float and measures the goal's number;
    remembers the smallest set that met the goal, and stops the search at ``budget`` runs."""

    def __init__(self, run: Callable[[Collection[str]], float], limit: float) -> None:
        self.run, self.limit = run, limit
        self.runs = 0
        self.budget: int | None = None
        self.best: tuple[str, ...] | None = None

    def error(self, keep: Collection[str]) -> float:
        if self.budget is not None and self.runs >= self.budget:
            raise _OutOfRuns
        self.runs += 1
        value = self.run(keep)
        if value <= self.limit and (self.best is None or len(keep) < len(self.best)):
            self.best = tuple(keep)
        return value

    def meets(self, keep: Collection[str]) -> bool:
        return self.error(keep) <= self.limit


def search_keep_in_float(
    session: Session, target: LoadedModel, model_path: str | None, suspects: Sequence[str] = ()
) -> tuple[KeepInFloat | None, tuple[Sensitivity, ...]]:
    """The keep-in-float set and the per-node sensitivity, most sensitive first (``suspects``
    measured first); None when the model has no quantized node (QOperator and dynamic forms:
    the search needs QDQ)."""
    candidates = quantized_nodes(target)
    if not candidates or not is_qdq(target):
        return None, ()
    ref_model = session.loaded
    reference = timed_run(session.ref, ref_model.model, session.feeds, "ref", session.stats)
    ref_out = {o: reference[o] for o in ref_model.outputs}
    weights = _float_weights(ref_model, target, candidates)
    dropped = _dropped_activations(ref_model, target)
    measure, goal_text = _goal(session, ref_out)
    limit = session.options.quant_goal

    def run(keep: Collection[str]) -> float:
        model = keep_in_float(target, keep, weights, dropped)
        try:
            out = timed_run(session.target, model, session.feeds, "target", session.stats)
        except BackendError as exc:
            log.info("keeping %s in float failed: %s", sorted(keep), exc)
            return float("inf")
        value = measure(_by_reference_names(ref_model, target, out))
        value = value if value == value else float("inf")  # NaN: far from the goal
        log.info("%d node(s) in float: %s %.4g", len(keep), goal_text, value)
        return value

    trials = _Trials(run, limit)
    with session.timer.stage("keep in float"):
        before, every = trials.error(()), trials.error(candidates)
        keep: tuple[str, ...] = ()
        note = ""
        if before <= limit:
            note = f"the quantized model meets the goal ({goal_text} ≤ {limit:g}) as it is"
        elif every > limit:
            note = (
                f"even with every quantized node in float the goal is missed ({goal_text} "
                f"{every:.3g} > {limit:g}): the models differ by more than quantization"
            )
        else:
            keep, note = _search(candidates, [n for n in suspects if n in candidates], trials)
        trials.budget = None
        after = trials.error(keep) if keep else before
        path = ""
        if keep and model_path:
            onnx.save(keep_in_float(target, keep, weights, dropped), model_path)
            path = model_path
        order = [n for n in dict.fromkeys([*keep, *suspects, *candidates]) if n in candidates]
        measured = (Sensitivity(n, trials.error({n})) for n in order[:SENSITIVITY_MAX])
        sensitivity = tuple(sorted(measured, key=lambda s: s.error))
    found = KeepInFloat(
        keep, f"{goal_text} ≤ {limit:g}", before, after, after <= limit, trials.runs, path, note
    )
    return found, sensitivity


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


def _goal(session: Session, ref_out: Tensors) -> tuple[Callable[[Tensors], float], str]:
    """The number the goal bounds: 1 − the worst top-1 agreement with ``--topk``, else the
    worst output channel's rel_l2."""
    specs = list(session.options.topk_specs())
    if specs:

        def disagreement(out: Tensors) -> float:
            checks = topk_checks(specs, ref_out, out)
            return 1.0 - min((c.top1_agreement for c in checks), default=1.0)

        return disagreement, "top-1 disagreement"

    def worst(out: Tensors) -> float:
        return max(channel_rel_l2(v, out[k]) if k in out else float("inf")
                   for k, v in ref_out.items())  # fmt: skip

    return worst, "worst output channel rel_l2"


def _by_reference_names(ref: LoadedModel, target: LoadedModel, out: Tensors) -> dict[str, Any]:
    """The target's outputs under the float model's names (by position where they differ)."""
    return {r: out[t] for r, t in zip(ref.outputs, target.outputs, strict=False) if t in out}


def _float_weights(
    ref: LoadedModel, target: LoadedModel, candidates: Collection[str]
) -> dict[tuple[str, int], onnx.TensorProto]:
    """For each candidate's dequantized weight, the float model's initializer at the same
    node (same name and op) and input: what keeping the node in float computes with."""
    by_name = {n.name: n for n in ref.nodes}
    inits = {t.name: t for t in ref.model.graph.initializer}
    taken = set(target.initializers) | set(target.probes)
    out: dict[tuple[str, int], onnx.TensorProto] = {}
    for t in target.nodes:
        r = by_name.get(t.name)
        if t.name not in candidates or r is None or r.op_type != t.op_type:
            continue
        for i, name in enumerate(r.inputs):
            if name not in inits or i >= len(t.inputs):
                continue
            w = onnx.TensorProto()
            w.CopyFrom(inits[name])
            if name in taken:
                w.name = f"{name}__float"
            out[(t.name, i)] = w
    return out


_ACTIVATIONS = frozenset({"Relu", "Clip"})


def _dropped_activations(
    ref: LoadedModel, target: LoadedModel
) -> dict[str, tuple[onnx.NodeProto, list[onnx.TensorProto]]]:
    """Target tensor -> the float model's Relu/Clip that onnxruntime's quantizer dropped after
    it (the QuantizeLinear's range clamps instead), with the Clip's bound initializers: a
    node kept in float must apply it. Two shapes: the tensor took the activation's output
    name (a QDQ Conv writing ``r1``, the float model's Relu output), or the activation read
    it and is gone."""
    names = {n.name for n in target.nodes}
    inits = {t.name: t for t in ref.model.graph.initializer}
    readers: dict[str, list[NodeInfo]] = {}
    for n in ref.nodes:
        for i in n.inputs:
            readers.setdefault(i, []).append(n)
    out: dict[str, tuple[onnx.NodeProto, list[onnx.TensorProto]]] = {}
    for t in target.nodes:
        for o in t.outputs:
            act = ref.producer.get(o)
            if act is None or act.op_type not in _ACTIVATIONS or act.op_type == t.op_type:
                lone = readers.get(o, [])
                act = lone[0] if len(lone) == 1 else None
                if act is None or act.op_type not in _ACTIVATIONS or act.name in names:
                    continue
            bounds = [inits[b] for b in act.inputs[1:] if b in inits]
            out[o] = (ref.node_protos[act.name], bounds)
    return out
