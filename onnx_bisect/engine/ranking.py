"""Among several nodes at fault, the one that matters (issue 33).

A lower-precision target often shows one defect in many places (tinygrad's float16 Sigmoid
flushes in six Sigmoids of YOLOv8n, of which one zeroes the output), or a kernel error beside
a changed constant nobody reads where it counts. The earliest in graph order is then the wrong
answer. Where 2 to ``MAX_SUSPECTS`` suspects compete (culprits, range problems, changed
constants), each is measured at the outputs:

1. with only it wrong (``injected``: its target values put in the reference run): a suspect
   whose error leaves the outputs within the criterion is ``harmless`` (a Where that discards
   it, a flush the model rounds away), unless the harmless ones together do change them;
2. the rest are ranked: an Inf or NaN first, then by their measured effect, a range problem
   before a finite deviation;
3. with only it fixed (``repaired``: the reference's values fed there on the target): the
   first whose repair brings the outputs back is the root cause, verified; else the set of
   them that does, smallest found by dropping each in turn.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import replace

from onnx_bisect.compare.criterion import Comparison
from onnx_bisect.engine.judge import (
    carried_constants,
    culprit_cause,
    first_divergence,
    root_cause,
)
from onnx_bisect.engine.measure.store import TensorStore
from onnx_bisect.engine.search.effect import Effect, Values, injected, repaired, target_alone
from onnx_bisect.engine.session import Session
from onnx_bisect.result import CauseKind, NodeResult, RootCause, Verdict
from onnx_bisect.text import plural

__all__ = ["MAX_ALONE", "MAX_SUSPECTS", "rank_suspects"]

# Suspects are measured where there are 2 to MAX_SUSPECTS of them; the MAX_ALONE first are
# each repaired alone (one target run of the whole model each), then all together.
MAX_SUSPECTS = 8
MAX_ALONE = 3

_SUSPECTS = (Verdict.CULPRIT, Verdict.RANGE, Verdict.PARAMETER)
_STARTS = (Verdict.CULPRIT, Verdict.RANGE)

Settled = tuple[list[NodeResult], NodeResult | None, RootCause | None]
# An unrolled iteration's part of a node's name (graph/unroll.py: {loop}/iteration_{i}/{node}).
_ITERATION = re.compile(r"/iteration_\d+/")


def rank_suspects(
    session: Session,
    store: TensorStore,
    nodes: Sequence[NodeResult],
    first: NodeResult | None,
    cause: RootCause | None,
) -> Settled:
    """The verdicts, first divergence and root cause once competing suspects are measured;
    unchanged where there is no competition (one culprit: no extra run)."""
    carried = carried_constants(nodes)
    suspects = sorted(
        (n for n in nodes if n.verdict in _SUSPECTS and n.name not in carried), key=_static_rank
    )
    changed = any(n.verdict is Verdict.PARAMETER for n in suspects)
    # An unrolled Loop's or Scan's copies of one body node are one suspect: the body node is
    # wrong in every iteration, and the earliest copy names it.
    one = len({_ITERATION.sub("", n.name) for n in suspects}) < 2
    if one and not changed or len(suspects) > MAX_SUSPECTS:
        # Many at once is a precision or a criterion, not bugs to tell apart (every Conv at
        # atol 0): the static rank (an Inf, then a range problem, first) stands.
        return list(nodes), first, cause
    with session.timer.stage("rank"):
        values = target_alone(session, store, [session.loaded.nodes[n.index] for n in suspects])
        effects = {n.name: injected(session, store, [n.name], values) for n in suspects}
        harmless = _harmless(session, store, suspects, effects, values)
        marked = [_marked(n, effects.get(n.name), n.name in harmless, session) for n in nodes]
        first = _first_past_harmless(marked) if harmless else first_divergence(marked)
        cause = root_cause(marked, first)
        starts = [n for n in marked if n.verdict in _STARTS and n.name in effects]
        if len(starts) < 2 and not harmless:
            return marked, first, cause
        ranked = sorted(starts, key=lambda n: _measured_rank(n, effects.get(n.name), session))
        if not ranked or cause is None or cause.kind not in (CauseKind.CULPRIT, CauseKind.RANGE):
            return marked, first, cause
        cause = _verified(session, store, ranked, effects, cause)
        harmless_text = _harmless_text(marked, effects, session)
        return marked, first, replace(cause, reason=cause.reason + harmless_text)


def _harmless_text(
    nodes: Sequence[NodeResult], effects: dict[str, Effect | None], session: Session
) -> str:
    """``; harmless: a (y rel_l2 1e-05), b (...) (with only each wrong, the outputs stay
    within the criterion)``: each with its measured effect."""
    names = [n.name for n in nodes if n.verdict is Verdict.HARMLESS]
    if not names:
        return ""

    def said(name: str) -> str:
        effect = effects.get(name)
        return f"{name} ({_effect_text(effect.worst(session.crit) if effect else None)})"

    more = f" and {len(names) - 5} more" if len(names) > 5 else ""
    shown = ", ".join(said(n) for n in names[:5]) + more
    return (
        f"; {plural(len(names), 'other node')} at fault but harmless: {shown} (with only each "
        "wrong, the outputs stay within the criterion)"
    )


def _first_past_harmless(nodes: Sequence[NodeResult]) -> NodeResult | None:
    """The first divergence whose error is not only a harmless node's carried on (a SiLU's Mul
    after a harmless Sigmoid flush diverges as much, and matters as little)."""
    producer = {o: n for n in nodes for o in n.outputs}
    carried: set[str] = set()  # tensors whose error comes from harmless nodes alone
    for n in nodes:
        ins = [producer[t] for t in n.inputs if t in producer and producer[t].diverged]
        only = bool(ins) and all(t in carried for p in ins for t in p.outputs)
        if n.verdict is Verdict.HARMLESS or (n.verdict is Verdict.PROPAGATED and only):
            carried.update(n.outputs)
    kept = [n for n in nodes if not set(n.outputs) <= carried]
    return first_divergence(kept)


def _harmless(
    session: Session,
    store: TensorStore,
    suspects: Sequence[NodeResult],
    effects: dict[str, Effect | None],
    values: Values,
) -> set[str]:
    """The suspects whose error, alone and all together, leaves the outputs within the
    criterion."""
    alone = [n.name for n in suspects if (e := effects[n.name]) is not None and e.agrees]
    if len(alone) > 1:
        together = injected(session, store, alone, values)
        if together is None or not together.agrees:
            return set()  # each is small, together they count: accumulated error, not noise
    return set(alone)


def _marked(
    node: NodeResult, effect: Effect | None, harmless: bool, session: Session
) -> NodeResult:
    if effect is None:
        return node
    worst = effect.worst(session.crit)
    said = _effect_text(worst)
    if harmless:
        was = node.note or (node.isolated.reason if node.isolated else "") or str(node.verdict)
        note = (
            f"harmless: its target values ({was}), put in the reference run, leave the outputs "
            f"within the criterion ({said}): discarded or outweighed downstream"
        )
        return replace(node, verdict=Verdict.HARMLESS, note=note)
    note = f"with only its target values wrong, the outputs: {said}"
    return replace(node, note=f"{node.note}; {note}" if node.note else note)


def _effect_text(worst: Comparison | None) -> str:
    """The worst output's rel_l2, or why it diverges: a flush that zeroes half of YOLOv8n's
    scores is a rel_l2 of 8e-8 beside boxes of 320, and diverges by the range test."""
    if worst is None:
        return "no output compared"
    if worst.diverged and worst.reason:
        return f"{worst.tensor} diverges: {worst.reason}"
    return f"{worst.tensor} rel_l2 {worst.shown('rel_l2')}"


def _verified(
    session: Session,
    store: TensorStore,
    ranked: Sequence[NodeResult],
    effects: dict[str, Effect | None],
    cause: RootCause,
) -> RootCause:
    """The first ranked suspect whose repair alone brings the outputs back, else the smallest
    set found that does; the others named with their measured effect."""
    for node in ranked[:MAX_ALONE]:
        fixed = repaired(session, store, [node.name])
        if fixed is not None and fixed.shows and fixed.agrees:
            base = culprit_cause(node)
            reason = (
                f"{base.reason}; fed the reference's values there, the target's outputs agree "
                f"(verified){_others(ranked, [node.name], effects, session)}"
            )
            return replace(base, reason=reason)
    names = [n.name for n in ranked]
    fixed = repaired(session, store, names)
    if fixed is not None and not fixed.shows:
        return cause  # they compute every output: a repair there proves nothing
    if fixed is None:
        return replace(
            cause,
            reason=f"{cause.reason}; NOT verified: the target could not run the model with the "
            "reference's values fed at the nodes at fault",
        )
    if not fixed.agrees:
        still = _effect_text(fixed.worst(session.crit))
        return replace(
            cause,
            reason=f"{cause.reason}; NOT verified: fed the reference's values at every node at "
            f"fault, the target's outputs still diverge ({still})",
        )
    for name in reversed([n.name for n in ranked]):
        fewer = [n for n in names if n != name]
        again = repaired(session, store, fewer) if fewer else None
        if again is not None and again.shows and again.agrees:
            names = fewer
    chosen = [n for n in ranked if n.name in names]
    kind = CauseKind.RANGE if all(n.verdict is Verdict.RANGE for n in chosen) else CauseKind.CULPRIT
    each = "; ".join(culprit_cause(n).reason for n in chosen[:3])
    return RootCause(
        kind,
        tuple(names),
        f"{plural(len(names), 'node')} at fault together: fed the reference's values at all of "
        f"them, the target's outputs agree (verified), at any one alone they do not ({each})"
        + _others(ranked, names, effects, session),
    )


def _others(
    ranked: Sequence[NodeResult],
    chosen: Sequence[str],
    effects: dict[str, Effect | None],
    session: Session,
) -> str:
    others = [n for n in ranked if n.name not in chosen]
    if not others:
        return ""
    said = []
    for n in others[:3]:
        effect = effects.get(n.name)
        worst = effect.worst(session.crit) if effect is not None else None
        said.append(f"{n.name} ({n.verdict}; with only it wrong, {_effect_text(worst)})")
    more = f" and {len(others) - 3} more" if len(others) > 3 else ""
    return f"; also at fault: {', '.join(said)}{more}"


def _static_rank(node: NodeResult) -> tuple[int, int]:
    """Inf or NaN first, then range problems, culprits, changed constants; graph order."""
    return (_group(node), node.index)


def _group(node: NodeResult) -> int:
    if node.verdict is Verdict.RANGE:
        iso = node.isolated
        return 0 if iso is not None and (iso.target_inf or iso.target_nan) else 1
    return 2 if node.verdict is Verdict.CULPRIT else 3


def _measured_rank(
    node: NodeResult, effect: Effect | None, session: Session
) -> tuple[int, float, int, int]:
    """An Inf or NaN at the outputs first, then the largest effect at the outputs, then the
    static rank."""
    worst = effect.worst(session.crit) if effect is not None else None
    nonfinite = 0 if worst is not None and worst.nonfinite else 1
    size = worst.metrics.get("rel_l2", 0.0) if worst is not None else 0.0
    size = size if math.isfinite(size) else math.inf
    return (nonfinite, -size, _group(node), node.index)
