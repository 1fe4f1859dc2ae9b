"""Diagnosing inside If branches: the taken branch inlined when the symptom survives it.

The reference's run decides each If's condition for this input; ``graph/inline.py`` puts the
taken branch in place of the If, and the inlined model's own Ifs (nested ones, now at the top)
are decided the same way, up to ``MAX_DEPTH`` rounds. The diagnosis uses the inlined model only
when the target still diverges or fails on it: a runtime that fails on the branch *not* taken
(tract analyses both) would otherwise look fine, so then the original model is kept and a note
says why.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace

import numpy as np
import onnx

from onnx_bisect.engine.diagnose import Screened, screen_session
from onnx_bisect.engine.runs import timed_run
from onnx_bisect.engine.session import Session, Setup
from onnx_bisect.errors import BackendError
from onnx_bisect.graph.extract import with_outputs
from onnx_bisect.graph.inline import InlinedIf, inline_branches, top_level_ifs
from onnx_bisect.graph.load import load_model
from onnx_bisect.text import plural

__all__ = ["MAX_DEPTH", "with_branches_inlined"]

log = logging.getLogger(__name__)

MAX_DEPTH = 8  # rounds of nesting; deeper Ifs stay whole


def with_branches_inlined(
    session: Session, reopen: Callable[[Setup], Session]
) -> tuple[Session, Screened | None]:
    """``session``, or one over the model with its taken If branches inlined (see module),
    with the screen's outcome on it where one was taken (``diagnose`` need not screen again)."""
    setup = session.setup
    if setup.target_model is not None or not top_level_ifs(setup.loaded.model):
        return session, None  # two models pair tensors by name; inlining would break that
    model, inlined = _inline_taken(session)
    if not inlined:
        return session, None
    taken = _describe(session, inlined)
    screened = screen_session(session)
    symptom = _symptom(screened)
    if symptom is None:
        session.notes.append(f"for these inputs {taken}")
        return session, screened
    loaded = load_model(model)
    loaded = replace(loaded, path=setup.loaded.path)
    note = (
        f"for these inputs {taken}; the taken branches were inlined so that their nodes are probed"
    )
    candidate = reopen(replace(setup, loaded=loaded, notes=(*setup.notes, note)))
    candidate_screened = screen_session(candidate)
    if _symptom(candidate_screened) == symptom:
        return candidate, candidate_screened
    session.notes.append(
        f"for these inputs {taken}; with the taken branches inlined the target no longer "
        f"{symptom}, so the problem needs the If itself (a branch not taken, or how the runtime "
        "handles control flow), and the If is diagnosed whole"
    )
    return session, screened


def _inline_taken(session: Session) -> tuple[onnx.ModelProto, list[InlinedIf]]:
    """The model with every If the reference can decide replaced by its taken branch."""
    model = session.loaded.model
    done: list[InlinedIf] = []
    for _ in range(MAX_DEPTH):
        ifs = top_level_ifs(model)
        if not ifs:
            break
        conditions = _reference_conditions(session, model, ifs)
        if not conditions:
            break
        model, inlined = inline_branches(model, conditions)
        done += inlined
    return model, done


def _reference_conditions(
    session: Session, model: onnx.ModelProto, ifs: dict[str, str]
) -> dict[str, bool]:
    """Each If's condition as the reference computes it; Ifs it cannot decide are left out."""
    names = sorted(set(ifs.values()))
    try:
        values = timed_run(
            session.ref, with_outputs(model, names), session.feeds, "ref", session.stats
        )
    except BackendError as exc:
        log.info("If conditions could not be computed: %s", exc)
        return {}
    out = {}
    for node, cond in ifs.items():
        value = values.get(cond)
        if value is not None and np.asarray(value).size == 1:
            out[node] = bool(np.asarray(value).reshape(()))
    return out


def _symptom(screened: Screened) -> str | None:
    """How the target went wrong on the plain run: "diverges", "fails", or None."""
    if isinstance(screened, BackendError):
        return "fails"
    return "diverges" if screened.diverged else None


def _describe(session: Session, inlined: list[InlinedIf]) -> str:
    """Which branch each If of the original graph took; nested ones counted, not listed."""
    outer = set(top_level_ifs(session.loaded.model))
    named = [f"If {i.node!r} took its {i.branch}" for i in inlined if i.node in outer]
    nested = len(inlined) - len(named)
    text = "; ".join(named)
    if nested:
        were = "was" if nested == 1 else "were"
        text += f" ({plural(nested, 'If')} nested in the taken branches {were} decided too)"
    return text + f", {plural(sum(i.nodes for i in inlined), 'node')} inlined in all"
