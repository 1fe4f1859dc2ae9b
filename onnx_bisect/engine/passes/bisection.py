"""Pass bisection: after a divergence, which of the target's optimizer passes causes it.

It runs on the subgraph around the root cause where the target diverges there (fed the
reference's values, ``engine/passes/scope.py``), else on the whole model. The target runs it once
with every optimization off. Still diverging, no pass is to blame (a kernel is), and that is
the finding. Agreeing, the passes that rewrite it are listed by the runtime itself and searched
(``engine/passes/search.py``) for the smallest set that, enabled alone, diverges; a guilty pass
made of rules (ONNX Runtime's rule-based transformers) is searched rule by rule in turn. The
workaround (those passes off) is run once more, on the whole model, to show it agrees with the
reference; one found on a subgraph that does not is searched again on the whole model. The
nodes the passes replaced in the whole model are named where the runtime can tell.

The passes may be the target runtime's own (ONNX Runtime, ``exec:`` with ``{disable}``) or
those of a ``+transform`` with a pass list (``+onnxoptimizer``): each configuration is then
a spec with its own model, the transform applied with a subset of the passes to the model the
target started from (``backends/transform_passes.py``). A ``torch:*?compile=`` target is
handed to torch's own bisector instead (``backends/torch/compile_bisect.py``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, replace

import onnx

from onnx_bisect.backends.passes import PassControl, supports_passes
from onnx_bisect.backends.registry import create_backend
from onnx_bisect.backends.spec import BackendSpec, parse_spec
from onnx_bisect.backends.transform_passes import TransformPasses, pass_transform
from onnx_bisect.compare.tensors import compare_tensors
from onnx_bisect.engine.found import Found
from onnx_bisect.engine.measure.observe import Observed
from onnx_bisect.engine.measure.runs import timed_run
from onnx_bisect.engine.passes.scope import Scope, model_scope, subgraph_scope
from onnx_bisect.engine.passes.search import find_guilty
from onnx_bisect.engine.session import Session
from onnx_bisect.errors import BackendError, ModelLoadError, OnnxBisectError, SpecError
from onnx_bisect.graph.load import load_model
from onnx_bisect.result import CauseKind, PassBisection, PassOutcome, PassScope
from onnx_bisect.text import plural

__all__ = ["bisect_passes"]

log = logging.getLogger(__name__)


def bisect_passes(
    session: Session, screened: Observed, found: Found | None = None
) -> PassBisection | None:
    """The pass bisection of a diverging target (see module), or None where none applies:
    ``--bisect-passes off``, or a target without passes. ``found``: what localization found,
    whose subgraph around the root cause is searched first where it shows the pass bug."""
    options = session.options
    if options.bisect_passes == "off":
        return None
    control = _transform_control(session) or _runtime_control(session)
    if control is None:
        if options.bisect_passes == "on":
            session.notes.append(
                f"--bisect-passes on: {session.setup.target_info.spec} has no optimizer passes "
                "to switch off (ONNX Runtime above opt=disable, an exec: runtime with "
                "{disable} and --passes, a +transform with a pass list, or torch compile=)"
            )
        return None
    with session.timer.stage("passes"):
        if isinstance(control, _TorchCompile):
            from onnx_bisect.engine.passes.compiled import bisect_compile

            return bisect_compile(session, screened)
        return _bisect(session, screened, *control, found)


class _TorchCompile:
    """The target is ``torch:*?compile=``: torch's bisector, not ours, walks its passes."""


# A pass control, and the model each of its specs runs.
_Control = tuple[PassControl, Callable[[str], onnx.ModelProto]] | _TorchCompile


def _spec_of(text: str) -> BackendSpec | None:
    """A side's spec as written, None for a backend object whose spec text is its own."""
    try:
        return parse_spec(text)
    except SpecError:
        return None


def _transform_control(session: Session) -> _Control | None:
    setup = session.setup
    spec = _spec_of(setup.target_info.spec)
    index = pass_transform(spec) if spec is not None and setup.target_from_spec else None
    if spec is None or index is None:
        return None
    options, ref = session.options, _spec_of(setup.ref_info.spec)
    if options.target_model is not None:
        source = load_model(options.target_model).model
    elif ref is None or not ref.transforms:
        source = session.loaded.model
    else:  # the model before the reference's transforms is not kept
        session.notes.append(
            f"pass bisection of +{spec.transforms[index]} needs a reference without "
            "+transforms (or --target-model)"
        )
        return None
    shapes = {k: v.shape for k, v in session.feeds.items()}
    done = setup.target_model.model if setup.target_model else None
    control = TransformPasses(spec, index, source, shapes, done)
    return control, control.model


def _runtime_control(session: Session) -> _Control | None:
    spec = _spec_of(session.setup.target_info.spec)
    if spec is not None and spec.name == "torch" and spec.option("compile"):
        return _TorchCompile()
    control = supports_passes(session.target, tuple(session.options.passes))
    if control is None:
        return None
    model = (session.setup.target_model or session.loaded).model
    return control, lambda spec: model


class _Runs:
    """Target runs of the pass bisection, counted: does a spec diverge on a scope?"""

    def __init__(self, session: Session) -> None:
        self.session, self.count = session, 0

    def diverges(self, target: str, scope: Scope) -> bool:
        self.count += 1
        session = self.session
        try:
            model = scope.model_of(target)
            backend = create_backend(
                parse_spec(target).without_transforms(), timeout=session.options.timeout
            )
            out = timed_run(backend, model, scope.feeds, "passes", session.stats)
        except (BackendError, ModelLoadError) as exc:  # the symptom changed: still wrong
            log.info("pass bisection: %s failed: %s", target, exc)
            return True
        return any(
            compare_tensors(name, ref, out.get(name), session.crit).diverged
            for name, ref in scope.expected.items()
        )


@dataclass(frozen=True)
class _Named:
    """What a search on one scope named, or (``guilty`` empty) why it named nothing."""

    outcome: PassOutcome
    passes: tuple[str, ...]
    guilty: tuple[str, ...] = ()
    reason: str = ""
    parts_of: str = ""
    parts: tuple[str, ...] = ()


def _bisect(
    session: Session,
    screened: Observed,
    control: PassControl,
    model_of: Callable[[str], onnx.ModelProto],
    found: Found | None,
) -> PassBisection:
    """The localized subgraph first, the whole model when it does not show the pass bug or its
    answer does not fix the whole model (``engine/passes/scope.py``)."""
    spec, off, runs = session.setup.target_info.spec, control.all_off(), _Runs(session)
    whole = model_scope(session, screened, model_of)
    note = ""  # a transform's passes run on the whole model it rewrites
    if not isinstance(control, TransformPasses):
        sub, note = subgraph_scope(session, found, spec, runs.diverges)
        if sub is not None and runs.diverges(off, sub):
            return PassBisection(
                PassOutcome.NOT_OPTIMIZER, spec, runs=runs.count,
                reason=f"{_said(off)} diverges too on the subgraph around the root cause, fed the "
                f"reference's values: {_blame_without_passes(control, found)}",
                scope=PassScope.SUBGRAPH, scope_nodes=sub.nodes,
            )  # fmt: skip
        if sub is not None:
            named = _name(runs, control, spec, sub)
            if named.guilty:
                result = _conclude(runs, control, named, sub, whole, "")
                if result is not None:
                    return result
                off_there = ", ".join(named.guilty)
                note = f"the workaround found on the subgraph ({off_there} off) still diverges"
            else:
                note = f"on the subgraph around the root cause, {named.reason}"
    if runs.diverges(off, whole):
        return PassBisection(
            PassOutcome.NOT_OPTIMIZER, spec, runs=runs.count,
            reason=f"{_said(off)} diverges too: {_blame_without_passes(control, found)}",
            scope_nodes=whole.nodes, scope_note=note,
        )  # fmt: skip
    named = _name(runs, control, spec, whole)
    if not named.guilty:
        return PassBisection(
            named.outcome, spec, named.passes, runs=runs.count,
            reason=named.reason if named.outcome is PassOutcome.FAILED
            else f"{_said(off)} agrees with the reference, but {named.reason}: the optimization "
            "level itself matters",
            scope_nodes=whole.nodes, scope_note=note,
        )  # fmt: skip
    result = _conclude(runs, control, named, whole, whole, note)
    assert result is not None  # only a subgraph's answer is dropped
    return result


def _name(runs: _Runs, control: PassControl, spec: str, scope: Scope) -> _Named:
    """The smallest set of the passes that rewrite ``scope`` that diverges alone there, a
    guilty pass made of rules narrowed down to its rules."""
    try:
        passes = tuple(control.passes(scope.model_of(spec), scope.feeds))
    except OnnxBisectError as exc:
        return _Named(PassOutcome.FAILED, (), reason=str(exc))
    search = find_guilty(passes, lambda on: runs.diverges(control.only(sorted(on), passes), scope))
    if not search.guilty:
        why = f"no set of the {plural(len(passes), 'pass', 'passes')} tried diverges on its own"
        return _Named(PassOutcome.NO_PASSES, passes, reason=why)
    names = " + ".join(search.guilty)
    reason = (
        f"of the {plural(len(passes), 'pass', 'passes')} tried, {names} alone "
        f"{'make' if len(search.guilty) > 1 else 'makes'} the target diverge"
    )
    named = _Named(PassOutcome.GUILTY, passes, search.guilty, reason)
    for guilty in search.guilty:
        parts = control.parts(guilty, scope.model_of(spec))
        if parts is not None:  # the first guilty pass made of rules is narrowed down
            return _narrow(runs, control, scope, named, guilty, tuple(parts))
    return named


def _narrow(
    runs: _Runs,
    control: PassControl,
    scope: Scope,
    named: _Named,
    composite: str,
    parts: tuple[str, ...],
) -> _Named:
    """``composite``'s rules searched with the other guilty passes on: the guilty rules replace
    it where some diverge alone."""
    if not parts:
        why = (
            f"; {composite} is made of rules, but switching off none of the rule names known "
            "for it changes this graph, so it is named whole"
        )
        return replace(named, reason=named.reason + why, parts_of=composite)
    among = (*named.passes, *parts)
    search = find_guilty(
        parts, lambda on: runs.diverges(control.only([*named.guilty, *on], among), scope)
    )
    which = f"; of {composite}'s rules, {', '.join(parts)} change this graph"
    if len(parts) == 1:
        which = f"; of {composite}'s rules, {parts[0]} changes this graph"
    if not search.guilty:
        why = f"{which}, and {'it does not' if len(parts) == 1 else 'none does'} alone"
        return replace(named, reason=named.reason + why, parts_of=composite, parts=parts)
    guilty = tuple(p for g in named.guilty for p in (search.guilty if g == composite else (g,)))
    rules = " + ".join(search.guilty)
    makes = "make" if len(search.guilty) > 1 else "makes"
    why = f"{which}, and {rules} alone {makes} it diverge"
    return replace(named, guilty=guilty, reason=named.reason + why, parts_of=composite, parts=parts)


def _conclude(
    runs: _Runs, control: PassControl, named: _Named, scope: Scope, whole: Scope, note: str
) -> PassBisection | None:
    """The workaround for what ``named`` names, run on the whole model, and what it rewrote;
    None where it was named on a subgraph and still diverges on the whole model."""
    spec, off = runs.session.setup.target_info.spec, control.all_off()
    fix = control.workaround(named.guilty)
    named_in = runs.count  # the check of the workaround below is not part of naming the passes
    verified = not runs.diverges(fix.spec, whole)
    if not verified and scope.kind is PassScope.SUBGRAPH:
        return None
    rewritten = control.rewritten(whole.model_of(off), named.guilty)
    on_it = " on it" if scope.kind is PassScope.SUBGRAPH else ""
    return PassBisection(
        PassOutcome.GUILTY,
        spec,
        named.passes,
        named.guilty,
        named_in,
        fix.spec,
        fix.forms,
        verified,
        rewritten,
        reason=f"{_said(off)} agrees with the reference{on_it}; {named.reason}",
        scope=scope.kind,
        scope_nodes=scope.nodes,
        scope_note=note,
        parts_of=named.parts_of,
        parts=named.parts,
    )


def _said(off: str) -> str:
    """The optimizations-off spec in a sentence; in words where it is a whole command line."""
    return off if len(off) <= 60 else "the target with every optimization off"


def _blame_without_passes(control: PassControl, found: Found | None) -> str:
    cause = found.cause if found is not None else None
    if cause is not None and cause.kind is CauseKind.PARAMETER:
        # A constant that differs in the model the target runs: no kernel computed it wrongly.
        which = ", ".join(cause.nodes[:3])
        return f"the changed constant ({which}), not an optimizer pass or a kernel, is to blame"
    if isinstance(control, TransformPasses):
        return (
            f"without +{control.transform.name} the target is still wrong, so the runtime, "
            "not the transform's passes, is to blame"
        )
    return (
        "with every optimization off the target is still wrong, so a kernel, not an "
        "optimizer pass, is to blame"
    )
