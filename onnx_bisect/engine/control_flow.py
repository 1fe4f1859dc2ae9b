"""Diagnosing inside control flow: taken If branches inlined and Loops unrolled, when the
symptom survives it.

The reference's run decides each If's condition and each Loop's iteration count for this
input; ``graph/inline.py`` puts the taken branch in place of the If, ``graph/unroll.py`` that
many copies of the body in place of the Loop (up to ``--unroll-max`` iterations; a Loop that
runs more stays whole, and a note says so). Control flow nested in what was inlined is at the
top after that, and is decided the same way, up to ``MAX_DEPTH`` rounds. The diagnosis uses
the inlined model only when the target still diverges or fails on it: a runtime that fails on
the branch *not* taken (tract analyses both) would otherwise look fine, so then the original
model is kept and a note says why.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import numpy.typing as npt
import onnx

from onnx_bisect.engine.diagnose import Screened, screen_session
from onnx_bisect.engine.measure.runs import timed_run
from onnx_bisect.engine.session import Session, Setup
from onnx_bisect.errors import BackendError
from onnx_bisect.graph.extract import with_outputs
from onnx_bisect.graph.inline import InlinedIf, inline_branches, top_level_ifs
from onnx_bisect.graph.load import load_model
from onnx_bisect.graph.unroll import (
    ScanPlan,
    UnrolledLoop,
    scan_plan,
    top_level_loops,
    top_level_scans,
    unroll_loops,
    unroll_scans,
)
from onnx_bisect.graph.weights import tensor_array
from onnx_bisect.text import plural

__all__ = ["MAX_DEPTH", "with_control_flow_inlined"]

log = logging.getLogger(__name__)

MAX_DEPTH = 8  # rounds of nesting; deeper control flow stays whole

Values = dict[str, npt.NDArray[Any]]


@dataclass
class _Inlined:
    """What the rounds did: the model, the Ifs and Loops replaced, and what stayed whole."""

    model: onnx.ModelProto
    ifs: list[InlinedIf] = field(default_factory=list)
    loops: list[UnrolledLoop] = field(default_factory=list)
    whole: dict[str, str] = field(default_factory=dict)  # Loop name -> why it stayed whole


def with_control_flow_inlined(
    session: Session, reopen: Callable[[Setup], Session]
) -> tuple[Session, Screened | None]:
    """``session``, or one over the model with its control flow inlined (see module), with the
    screen's outcome on it where one was taken (``diagnose`` need not screen again)."""
    setup = session.setup
    model = setup.loaded.model
    flow = top_level_ifs(model) or top_level_loops(model) or top_level_scans(model)
    if setup.target_model is not None or not flow:
        return session, None  # two models pair tensors by name; inlining would break that
    done = _inline(session)
    session.notes.extend(done.whole.values())
    if not (done.ifs or done.loops):
        return session, None
    taken = _describe(session, done)
    screened = screen_session(session)
    symptom = _symptom(screened)
    if symptom is None:
        session.notes.append(f"for these inputs {taken}")
        return session, screened
    loaded = replace(load_model(done.model), path=setup.loaded.path)
    note = f"for these inputs {taken}; they were inlined so that their nodes are probed"
    candidate = reopen(replace(setup, loaded=loaded, notes=(*setup.notes, note)))
    candidate_screened = screen_session(candidate)
    if _symptom(candidate_screened) == symptom:
        candidate.notes.extend(n for n in done.whole.values() if n not in candidate.notes)
        return candidate, candidate_screened
    session.notes.append(
        f"for these inputs {taken}; inlined, the target no longer {symptom}, so the problem "
        "needs the control-flow node itself (a branch not taken, or how the runtime handles "
        "control flow), and it is diagnosed whole"
    )
    return session, screened


def _inline(session: Session) -> _Inlined:
    """Rounds of deciding the top-level Ifs and Loops on the reference and inlining them."""
    unroll_max = session.setup.options.unroll_max
    done = _Inlined(session.loaded.model)
    for _ in range(MAX_DEPTH):
        ifs = top_level_ifs(done.model)
        loops = {k: v for k, v in top_level_loops(done.model).items() if k not in done.whole}
        scans = {k: v for k, v in top_level_scans(done.model).items() if k not in done.whole}
        conditions = _if_conditions(session, done.model, ifs) if ifs else {}
        counts = _loop_counts(session, done.model, loops, unroll_max, done.whole)
        plans = _scan_plans(session, done.model, scans, unroll_max, done.whole)
        if not conditions and not counts and not plans:
            break
        done.model, inlined = inline_branches(done.model, conditions)
        done.model, unrolled = unroll_loops(done.model, counts)
        done.model, scanned = unroll_scans(done.model, plans)
        done.ifs += inlined
        done.loops += unrolled + scanned
    return done


def _if_conditions(
    session: Session, model: onnx.ModelProto, ifs: dict[str, str]
) -> dict[str, bool]:
    """Each If's condition as the reference computes it; Ifs it cannot decide are left out."""
    values = _reference_values(session, model, sorted(set(ifs.values())))
    return {
        node: bool(v.reshape(()))
        for node, c in ifs.items()
        if (v := values.get(c)) is not None and v.size == 1
    }


def _loop_counts(
    session: Session,
    model: onnx.ModelProto,
    loops: dict[str, onnx.NodeProto],
    unroll_max: int,
    whole: dict[str, str],
) -> dict[str, int]:
    """How many iterations each Loop runs for these inputs, counted on the reference: the
    trip count and the first condition, then each iteration's condition on a trial unrolling
    of one iteration more than ``unroll_max``. Loops that run more, or cannot be counted, go
    to ``whole`` with the reason."""
    if not loops:
        return {}
    names = [n for node in loops.values() for n in node.input[:2] if n]
    given = _reference_values(session, model, sorted(set(names)))
    trial: dict[str, int] = {}
    counts: dict[str, int] = {}
    for name, node in loops.items():
        trip = given.get(node.input[0]) if node.input[0] else None
        cond = given.get(node.input[1]) if len(node.input) > 1 and node.input[1] else None
        if (node.input[0] and trip is None) or (
            len(node.input) > 1 and node.input[1] and cond is None
        ):
            whole[name] = (
                f"Loop {name!r}: the reference did not give its trip count or condition, "
                "so it is diagnosed whole"
            )
            continue
        if cond is not None and not bool(cond.reshape(())):
            trial[name] = 0
            continue
        limit = unroll_max + 1
        trial[name] = limit if trip is None else min(int(trip.reshape(())), limit)
        if trip is not None and _counts_itself(node):
            if trial[name] > unroll_max:  # a for-loop: its trip count is its iterations
                whole[name] = _too_many(name, unroll_max)
                del trial[name]
            else:
                counts[name] = trial.pop(name)
    if not trial:
        return counts
        return {}
    unrolled_model, unrolled = unroll_loops(model, {k: v for k, v in trial.items() if v > 0})
    conds = sorted({c for u in unrolled for c in u.conditions})
    ran = _reference_values(session, unrolled_model, conds) if conds else {}
    for name, n in trial.items():
        u = next((u for u in unrolled if u.node == name), None)
        if u is None:
            counts[name] = n  # not run at all; a Loop with scan outputs stays whole below
            continue
        flags = [ran.get(c) for c in u.conditions]
        if any(f is None for f in flags):
            whole[name] = (
                f"Loop {name!r}: its iterations could not be counted on the reference, so "
                "it is diagnosed whole"
            )
            continue
        stop = next(
            (i + 1 for i, f in enumerate(flags) if f is not None and not bool(f.reshape(()))), n
        )
        if stop > unroll_max:
            whole[name] = _too_many(name, unroll_max)
            continue
        counts[name] = stop
    return counts


def _scan_plans(
    session: Session,
    model: onnx.ModelProto,
    scans: dict[str, onnx.NodeProto],
    unroll_max: int,
    whole: dict[str, str],
) -> dict[str, ScanPlan]:
    """Each Scan's plan for these inputs, from the reference's values of its scan inputs (the
    sequence length, the ranks) and of its scan outputs (their ranks)."""
    if not scans:
        return {}
    wanted = []
    for node in scans.values():
        m = _scan_inputs(node)
        wanted += [*node.input[len(node.input) - m :], *node.output[len(node.input) - m :]]
    values = _reference_values(session, model, sorted({w for w in wanted if w}))
    plans = {}
    for name, node in scans.items():
        m = _scan_inputs(node)
        n = len(node.input) - m
        sources = [values.get(t) for t in node.input[n:]]
        results = [values.get(t) if t else np.zeros(1) for t in node.output[n:]]
        if any(v is None for v in (*sources, *results)):
            whole[name] = (
                f"Scan {name!r}: the reference did not give its inputs, so it is diagnosed whole"
            )
            continue
        plan = scan_plan(
            node,
            [v.ndim for v in sources if v is not None],
            [v.ndim for v in results if v is not None],
            0,
        )
        first = sources[0]
        length = 0 if first is None else int(first.shape[plan.input_axes[0]])
        if length > unroll_max:
            whole[name] = (
                f"Scan {name!r} runs {length} iterations, more than {unroll_max} "
                "(--unroll-max), so it is diagnosed whole"
            )
            continue
        plans[name] = replace(plan, iterations=length)
    return plans


def _scan_inputs(scan: onnx.NodeProto) -> int:
    return next(int(a.i) for a in scan.attribute if a.name == "num_scan_inputs")


def _counts_itself(loop: onnx.NodeProto) -> bool:
    """Whether the body passes its condition through unchanged: then the trip count alone
    decides how many iterations run."""
    body = next((a.g for a in loop.attribute if a.name == "body"), None)
    if body is None:
        return False
    cond_in, cond_out = body.input[1].name, body.output[0].name
    producer = next((n for n in body.node if cond_out in n.output), None)
    if producer is None:
        return bool(cond_out == cond_in)
    return bool(producer.op_type == "Identity" and producer.input[0] == cond_in)


def _too_many(name: str, unroll_max: int) -> str:
    return (
        f"Loop {name!r} runs more than {unroll_max} iterations (--unroll-max), so it is "
        "diagnosed whole"
    )


def _reference_values(session: Session, model: onnx.ModelProto, names: Sequence[str]) -> Values:
    """The reference's values of ``names`` in ``model``: initializers and feeds as they are,
    the rest from one run; what it cannot compute is left out."""
    inits = {t.name: t for t in model.graph.initializer}
    out: Values = {}
    computed = []
    for name in names:
        if name in inits:
            out[name] = tensor_array(inits[name])
        elif name in session.feeds:
            out[name] = np.asarray(session.feeds[name])
        else:
            computed.append(name)
    if computed:
        try:
            run = timed_run(
                session.ref, with_outputs(model, computed), session.feeds, "ref", session.stats
            )
        except (BackendError, KeyError) as exc:
            log.info("control-flow values could not be computed: %s", exc)
            return out
        out.update({k: np.asarray(v) for k, v in run.items() if k in computed})
    return out


def _symptom(screened: Screened) -> str | None:
    """How the target went wrong on the plain run: "diverges", "fails", or None."""
    if isinstance(screened, BackendError):
        return "fails"
    return "diverges" if screened.diverged else None


def _describe(session: Session, done: _Inlined) -> str:
    """Which branch each If of the original graph took and how many iterations each Loop ran;
    nested ones counted, not listed."""
    model = session.loaded.model
    outer = set(top_level_ifs(model)) | set(top_level_loops(model)) | set(top_level_scans(model))
    parts = [f"If {i.node!r} took its {i.branch}" for i in done.ifs if i.node in outer]
    kinds = {
        **dict.fromkeys(top_level_loops(model), "Loop"),
        **dict.fromkeys(top_level_scans(model), "Scan"),
    }
    parts += [
        f"{kinds[u.node]} {u.node!r} ran {plural(u.iterations, 'iteration')}"
        for u in done.loops
        if u.node in outer
    ]
    nested_ifs = sum(i.node not in outer for i in done.ifs)
    nested_loops = sum(u.node not in outer for u in done.loops)
    nested = [
        plural(n, *kind)
        for n, kind in ((nested_ifs, ("If",)), (nested_loops, ("Loop/Scan", "Loops/Scans")))
        if n
    ]
    text = "; ".join(parts)
    if nested:
        were = "was" if nested_ifs + nested_loops == 1 else "were"
        text += f" ({' and '.join(nested)} nested in them {were} decided too)"
    nodes = sum(i.nodes for i in done.ifs) + sum(u.nodes for u in done.loops)
    return text + f", {plural(nodes, 'node')} inlined in all"
