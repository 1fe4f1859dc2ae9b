"""The search: screen, scan, isolate, and the verdicts they imply.

The verdict logic (``judge``) is pure: it sees comparisons and node wiring, never ONNX. Graph
surgery comes from ``model``, running from ``run``.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import replace

from onnx_bisect.compare.criterion import Comparison, Criterion, Status
from onnx_bisect.compare.precision import DATA_MOVEMENT, format_of
from onnx_bisect.compare.tensors import compare_tensors
from onnx_bisect.engine.found import Found
from onnx_bisect.engine.measure.isolate import IsolationFailure
from onnx_bisect.engine.measure.observe import Observed
from onnx_bisect.graph.view import LoadedModel, NodeInfo
from onnx_bisect.result import (
    CauseKind,
    NodeResult,
    RootCause,
    Verdict,
)
from onnx_bisect.text import plural

__all__ = [
    "carried_constants",
    "culprit_cause",
    "dump_verdicts",
    "first_divergence",
    "judge",
    "mark_pattern",
    "observer_problem",
    "reference_is_off",
    "reference_off_note",
    "root_cause",
]


def judge(
    loaded: LoadedModel,
    accumulated: Mapping[str, Comparison],
    isolated: Mapping[str, dict[str, Comparison] | IsolationFailure],
    crit: Criterion,
) -> list[NodeResult]:
    """Per-node verdicts from the accumulated and isolated comparisons."""
    results: list[NodeResult] = []
    for n in loaded.nodes:
        acc = _worst([accumulated[t] for t in n.outputs if t in accumulated], crit)
        if n.name in loaded.constant_nodes:
            results.append(_constant(n, acc))
            continue
        iso_entry = isolated.get(n.name)
        iso: Comparison | None = None
        note = ""
        if isinstance(iso_entry, IsolationFailure):
            if iso_entry.crashed:
                verdict = Verdict.CRASHED
            else:
                verdict = Verdict.UNSUPPORTED if iso_entry.unsupported else Verdict.FAILED
            note = f"target could not run this node alone: {iso_entry.message}"
        else:
            iso = _worst(list(iso_entry.values()), crit) if iso_entry else None
            verdict = _verdict(n, acc, iso, crit)
        # Where an error starts, output ÷ input error only measures the inputs' rounding.
        starts = verdict in _STARTS
        amplification = None if starts else _amplification(n, acc, accumulated)
        results.append(
            NodeResult.of(n, verdict, acc, isolated=iso, amplification=amplification, note=note)
        )
    return results


# Verdicts of a node where an error starts.
_STARTS = (Verdict.CULPRIT, Verdict.RANGE, Verdict.REFERENCE_OFF)


def _verdict(
    node: NodeInfo, acc: Comparison | None, iso: Comparison | None, crit: Criterion
) -> Verdict:
    """A computed node's verdict from its worst accumulated and isolated comparisons."""
    if iso is not None and iso.diverged:
        if iso.reference_off:
            return Verdict.REFERENCE_OFF
        if iso.range_problem:
            return Verdict.RANGE
        if not _moved_exactly(node, iso, crit):
            return Verdict.CULPRIT
    if acc is not None and acc.diverged:
        return Verdict.PROPAGATED
    if acc is None and iso is None:
        return Verdict.NOT_PROBED
    compared = [c for c in (acc, iso) if c is not None]
    if crit.floors is not None and any(c.within_precision or c.diverged for c in compared):
        return Verdict.PRECISION
    if any(c.within_precision for c in compared):  # integers one quantization step apart
        return Verdict.PRECISION
    return Verdict.OK


def _moved_exactly(node: NodeInfo, iso: Comparison, crit: Criterion) -> bool:
    """A data-movement node whose isolated error is no more than one rounding to the target's
    precision: it carried its inputs' values, which the precision rounded once."""
    if crit.floors is None or node.op_type not in DATA_MOVEMENT:
        return False
    unit = format_of(crit.floors.precision).unit
    return iso.metrics.get("rel_l2", math.inf) <= unit * 1.01


def _constant(node: NodeInfo, acc: Comparison | None) -> NodeResult:
    """A Constant, or arithmetic on initializers alone: it computes nothing from the inputs,
    so it is never a culprit. A different value is a changed parameter; a different shape or
    dtype (() against (0,), a runtime that folded the node away) cannot be compared."""
    if acc is None or not acc.diverged:
        verdict = Verdict.NOT_PROBED if acc is None else Verdict.OK
        return NodeResult.of(node, verdict, acc)
    if acc.status in (Status.SHAPE, Status.DTYPE, Status.MISSING):
        note = f"not comparable: {acc.reason or acc.status.value} (a constant)"
        return NodeResult.of(node, Verdict.NOT_COMPARABLE, acc, note=note)
    note = f"the target holds a different value of this constant ({acc.reason})"
    return NodeResult.of(node, Verdict.PARAMETER, acc, note=note)


def _worst(comparisons: Sequence[Comparison], crit: Criterion) -> Comparison | None:
    if not comparisons:
        return None
    return max(comparisons, key=crit.badness)


def _amplification(
    node: NodeInfo, acc: Comparison | None, accumulated: Mapping[str, Comparison]
) -> float | None:
    """Output error ÷ worst input error, both as rel_l2: how much this node grows the error."""
    if acc is None or "rel_l2" not in acc.metrics:
        return None
    known = [accumulated[t] for t in node.inputs if t in accumulated]
    if acc.nonfinite or any(c.nonfinite for c in known):
        return None  # a NaN or Inf error has no ratio (rel_l2 leaves those values out)
    ins = [c.metrics.get("rel_l2", 0.0) for c in known]
    worst_in = max((x for x in ins if x == x), default=0.0)
    out = acc.metrics["rel_l2"]
    if worst_in < _ONE_ROUNDING or out != out:
        # An input error below one float32 rounding (a masked score's -3.4e38 swamps its
        # norm) is not an error this node could grow: the ratio would read x1e38.
        return None
    return out / worst_in


# float32's unit roundoff: a relative error below it is the input's own representation.
_ONE_ROUNDING = 2.0**-24


# Verdicts that are not where a computation parts ways: a changed constant is reported as a
# parameter, and an incomparable one is not a divergence at all.
_NOT_COMPUTED = (Verdict.PARAMETER, Verdict.NOT_COMPARABLE, Verdict.HARMLESS)


def first_divergence(nodes: Sequence[NodeResult]) -> NodeResult | None:
    return next((n for n in nodes if n.diverged and n.verdict not in _NOT_COMPUTED), None)


def culprit_cause(node: NodeResult) -> RootCause:
    iso = node.isolated
    why = (iso.reason or iso.status.value) if iso is not None else "isolated"
    if node.verdict is Verdict.REFERENCE_OFF:
        return RootCause(
            CauseKind.REFERENCE,
            (node.name,),
            f"{node.op_type} {node.name!r}: fed the same inputs, the target agrees with float64 "
            f"and the reference does not ({why}); the reference backend is the side to fix",
        )
    if node.verdict is Verdict.RANGE:
        return RootCause(
            CauseKind.RANGE,
            (node.name,),
            f"{node.op_type} {node.name!r}, fed the reference's inputs: {why}",
        )
    return RootCause(
        CauseKind.CULPRIT,
        (node.name,),
        f"{node.op_type} {node.name!r} diverges on its own when fed the reference's inputs ({why})",
    )


def root_cause(
    nodes: Sequence[NodeResult],
    first: NodeResult | None,
    own_constants: Collection[str] = (),
) -> RootCause | None:
    """The earliest range problem (Inf or NaN first), else the earliest culprit (or node where
    the reference is off); else a changed parameter;
    when nothing is wrong on its own, say so plainly.

    ``own_constants``: the constant tensors isolation fed from the target's own model (two
    models): a culprit computed from a changed one is a changed parameter, not a kernel."""
    culprit = min((n for n in nodes if n.verdict in _STARTS), key=_start_rank, default=None)
    changed = [n for n in nodes if n.verdict is Verdict.PARAMETER]
    if culprit is not None and culprit.isolated is not None:
        read = _changed_ancestors(nodes, culprit, set(own_constants))
        if not read or culprit.verdict is Verdict.REFERENCE_OFF:
            cause = culprit_cause(culprit)
            if changed:  # e.g. an optimizer that moved a changed Constant into an initializer
                names = ", ".join(n.name for n in changed[:3])
                cause = replace(
                    cause,
                    reason=f"{cause.reason}; the target also holds changed constants ({names}): "
                    "if the node computes from them, the parameter and not the kernel differs",
                )
            return cause
        return _parameter_cause(read, f"; {culprit.op_type} {culprit.name!r} computes from it")
    if changed and first is not None:
        carried = carried_constants(nodes)
        return _parameter_cause([n for n in changed if n.name not in carried] or changed, "")
    if first is None:
        return RootCause(
            CauseKind.NONE,
            (),
            "the final outputs diverge but no probed tensor does: marking intermediates as "
            "outputs changes the target's result (a fusion is likely involved)",
        )
    failed = [n.name for n in nodes if n.verdict in (Verdict.UNSUPPORTED, Verdict.FAILED)]
    extra = f"; the target could not run {', '.join(failed[:3])} alone" if failed else ""
    return RootCause(
        CauseKind.NONE,
        (),
        "no single node diverges when fed the reference's inputs: the error comes from a "
        "pattern of nodes or from accumulated rounding" + extra,
    )


def carried_constants(nodes: Sequence[NodeResult]) -> set[str]:
    """The changed constants computed from another changed constant (a Concat of LSTM biases,
    then the Unsqueeze that shapes them): their change is the first one's, carried on. Fed
    the reference's operands they agree, so they are neither a cause of their own nor, when
    measured alone, harmless: the change they carry is not."""
    changed = {o for n in nodes if n.verdict is Verdict.PARAMETER for o in n.outputs}
    return {
        n.name
        for n in nodes
        if n.verdict is Verdict.PARAMETER and any(t in changed for t in n.inputs)
    }


def _start_rank(node: NodeResult) -> tuple[int, int]:
    """An Inf or NaN, then any range problem (flush, overflow), before a finite deviation
    (issue 33: a float16 Conv's accumulation error named before the GlobalAveragePool whose
    sum overflows to Inf); graph order among equals."""
    if node.verdict is Verdict.RANGE:
        iso = node.isolated
        return (0 if iso is not None and (iso.target_inf or iso.target_nan) else 1, node.index)
    return (2, node.index)


def _changed_ancestors(
    nodes: Sequence[NodeResult], node: NodeResult, constants: set[str]
) -> list[NodeResult]:
    """The changed constants that ``node`` reads through constant arithmetic alone."""
    producer = {o: n for n in nodes for o in n.outputs}
    found: dict[str, NodeResult] = {}
    todo, seen = [t for t in node.inputs if t in constants], set()
    while todo:
        tensor = todo.pop()
        source = producer.get(tensor)
        if tensor in seen or source is None:
            continue
        seen.add(tensor)
        if source.verdict is Verdict.PARAMETER:
            found[source.name] = source
        todo += [t for t in source.inputs if t in constants]
    return list(found.values())


def _parameter_cause(changed: Sequence[NodeResult], reader: str) -> RootCause:
    names = ", ".join(n.name for n in changed[:3]) + (" ..." if len(changed) > 3 else "")
    why = changed[0].accumulated.reason if changed[0].accumulated else ""
    return RootCause(
        CauseKind.PARAMETER,
        tuple(n.name for n in changed),
        f"{plural(len(changed), 'constant')} {'holds' if len(changed) == 1 else 'hold'} "
        f"different values on the target ({names}: {why}"
        f"{reader}): a transform or the target's precision changed the parameter, not a kernel",
    )


def dump_verdicts(
    loaded: LoadedModel, accumulated: Mapping[str, Comparison], crit: Criterion
) -> tuple[list[NodeResult], NodeResult | None, RootCause | None]:
    """Verdicts from accumulated errors alone: a divergent node with clean inputs is the
    culprit as far as a dump can tell."""
    nodes = judge(loaded, accumulated, {}, crit)
    diverged = {t for t, c in accumulated.items() if c.diverged}
    derived = []
    for n in nodes:
        if n.verdict in _NOT_COMPUTED:
            derived.append(n)
            continue
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
            CauseKind.CULPRIT,
            (culprit.name,),
            f"{culprit.op_type} {culprit.name!r}: its inputs match the reference and its output "
            "does not (derived from a dump, which cannot be isolated; a fusion ending at this "
            "node is as likely as a kernel bug)",
        )
    elif first is not None:
        cause = RootCause(
            CauseKind.NONE, (), "the dump diverges, but no node with clean inputs does"
        )
    return derived, first, cause


def observer_problem(plain: Observed, instrumented: Observed, crit: Criterion) -> str:
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
            f"output, {', '.join(changed[:3])} {'differs' if len(changed) == 1 else 'differ'} "
            "from the plain run (a fusion is likely "
            "involved)"
        )
    if plain.diverged and not instrumented.diverged:
        return (
            "instrumentation changes the target's result: the plain run diverges but the run "
            "with every tensor marked as an output does not (likely a fusion the markers break)"
        )
    return ""


def mark_pattern(
    nodes: Sequence[NodeResult], first: NodeResult, window: Sequence[NodeInfo], worst: Comparison
) -> tuple[list[NodeResult], NodeResult, RootCause]:
    """Verdicts once a window reproduces what no node does alone: the first divergence and the
    window's divergent nodes become ``pattern``, and the window is the root cause."""
    names = tuple(n.name for n in window)
    ops = " -> ".join(n.op_type for n in window)
    cause = RootCause(
        CauseKind.PATTERN,
        names,
        f"no node diverges alone, but the window {ops} ({plural(len(names), 'node')}) does when "
        f"fed the reference's inputs ({worst.reason or worst.status.value}): a pattern or "
        "fusion bug",
    )
    inside = set(names)
    note = f"pattern window: {', '.join(names)}"
    marked = [
        replace(n, verdict=Verdict.PATTERN, note=note)
        if n.name == first.name or (n.name in inside and n.diverged)
        else n
        for n in nodes
    ]
    return marked, next(n for n in marked if n.name == first.name), cause


def reference_is_off(screened: Observed, found: Found) -> bool:
    """Whether float64 sides with the target: the root cause is a node where the reference is
    the side that is off, and every diverged output is one where the target is within the
    oracle's fp32 noise of float64 and the reference is not. The target then did not
    diverge; the reference's kernel is the less exact one."""
    cause = found.cause
    if cause is None or cause.kind is not CauseKind.REFERENCE:
        return False
    diverged = [c for c in screened.comparisons.values() if c.diverged]
    return bool(diverged) and (
        all(c.reference_off for c in diverged) or not _target_faults(found.nodes)
    )


def _target_faults(nodes: Sequence[NodeResult]) -> list[NodeResult]:
    """The nodes at fault on the target's side. With none (every node fed the reference's
    inputs agrees, or is within its precision), outputs that diverge carry the reference's
    own kernel error and one-step integer flips, which the model amplifies (zoo G9,
    tashkeel-bilstm on OpenVINO: ONNX Runtime's DynamicQuantizeLSTM 0.5% off float64, the
    attention's DynamicQuantizeLinear a step apart on 1.3e-3 of its values, 6% at the logits
    after the Softmax). Then too the target is not the one that diverged."""
    return [n for n in nodes if n.verdict in _TARGET_FAULTS]


# Verdicts that put a node of the target's at fault (or leave it unknown: a node it fails).
_TARGET_FAULTS = (
    Verdict.CULPRIT,
    Verdict.RANGE,
    Verdict.PARAMETER,
    Verdict.PATTERN,
    Verdict.UNSUPPORTED,
    Verdict.FAILED,
    Verdict.CRASHED,
)


def reference_off_note(found: Found, screened: Observed | None = None) -> str:
    """The answer when ``reference_is_off``: which side, which node of the reference's; where
    the outputs themselves are not closer to float64 on the target, that the model amplified
    the reference's error."""
    assert found.cause is not None
    node = next((n for n in found.nodes if n.name in found.cause.nodes), None)
    where = f"{node.op_type} {node.name!r}" if node is not None else ", ".join(found.cause.nodes)
    diverged = [c for c in screened.comparisons.values() if c.diverged] if screened else []
    if any(not c.reference_off for c in diverged):
        return (
            f"the target agrees with float64 and the reference does not at {where}, and no "
            "node of the target's diverges on its own: the outputs differ by that error and "
            "by steps within the model's precision (integer steps that flip by one), which "
            "the model amplifies (a Softmax), so the target is not called diverged"
        )
    return (
        f"the target agrees with float64 and the reference does not: the reference's kernel "
        f"of {where} is the less exact side, so the target is not called diverged"
    )
