"""Pass bisection: after a divergence, which of the target's optimizer passes causes it.

The target runs the whole model once with every optimization off. Still diverging, no pass is
to blame (a kernel is), and that is the finding. Agreeing, the passes that rewrite this model
are listed by the runtime itself and searched (``engine/pass_search.py``) for the smallest set
that, enabled alone, diverges; the workaround (those passes off) is run once more to show it
agrees with the reference, and the nodes the passes replaced are named where the runtime can
tell.

The passes may be the target runtime's own (ONNX Runtime, ``exec:`` with ``{disable}``) or
those of a ``+transform`` with a pass list (``+onnxoptimizer``): each configuration is then
a spec with its own model, the transform applied with a subset of the passes to the model the
target started from (``backends/transform_passes.py``). A ``torch:*?compile=`` target is
handed to torch's own bisector instead (``backends/torch/compile_bisect.py``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import onnx

from onnx_bisect.backends.passes import PassControl, supports_passes
from onnx_bisect.backends.registry import create_backend
from onnx_bisect.backends.spec import BackendSpec, parse_spec
from onnx_bisect.backends.transform_passes import TransformPasses, pass_transform
from onnx_bisect.compare.tensors import compare_tensors
from onnx_bisect.engine.observe import Observed
from onnx_bisect.engine.pass_search import find_guilty
from onnx_bisect.engine.runs import timed_run
from onnx_bisect.engine.session import Session
from onnx_bisect.errors import BackendError, ModelLoadError, OnnxBisectError, SpecError
from onnx_bisect.graph.load import load_model
from onnx_bisect.result import PassBisection, PassOutcome

__all__ = ["bisect_passes"]

log = logging.getLogger(__name__)


def bisect_passes(session: Session, screened: Observed) -> PassBisection | None:
    """The pass bisection of a diverging target (see module), or None where none applies:
    ``--bisect-passes off``, or a target without passes."""
    options = session.options
    if options.bisect_passes == "off":
        return None
    found = _transform_control(session) or _runtime_control(session)
    if found is None:
        if options.bisect_passes == "on":
            session.notes.append(
                f"--bisect-passes on: {session.setup.target_info.spec} has no optimizer passes "
                "to switch off (ONNX Runtime above opt=disable, an exec: runtime with "
                "{disable} and --passes, a +transform with a pass list, or torch compile=)"
            )
        return None
    with session.timer.stage("passes"):
        if isinstance(found, _TorchCompile):
            from onnx_bisect.engine.compile_passes import bisect_compile

            return bisect_compile(session, screened)
        return _bisect(session, screened, *found)


class _TorchCompile:
    """The target is ``torch:*?compile=``: torch's bisector, not ours, walks its passes."""


# A pass control, and the model each of its specs runs.
_Found = tuple[PassControl, Callable[[str], onnx.ModelProto]] | _TorchCompile


def _spec_of(text: str) -> BackendSpec | None:
    """A side's spec as written, None for a backend object whose spec text is its own."""
    try:
        return parse_spec(text)
    except SpecError:
        return None


def _transform_control(session: Session) -> _Found | None:
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


def _runtime_control(session: Session) -> _Found | None:
    spec = _spec_of(session.setup.target_info.spec)
    if spec is not None and spec.name == "torch" and spec.option("compile"):
        return _TorchCompile()
    control = supports_passes(session.target, tuple(session.options.passes))
    if control is None:
        return None
    model = (session.setup.target_model or session.loaded).model
    return control, lambda spec: model


def _bisect(
    session: Session,
    screened: Observed,
    control: PassControl,
    model_of: Callable[[str], onnx.ModelProto],
) -> PassBisection:
    spec = session.setup.target_info.spec
    runs = 0

    def diverges(target: str) -> bool:
        nonlocal runs
        runs += 1
        try:
            model = model_of(target)
            backend = create_backend(
                parse_spec(target).without_transforms(), timeout=session.options.timeout
            )
            out = timed_run(backend, model, session.feeds, "passes", session.stats)
        except (BackendError, ModelLoadError) as exc:  # the symptom changed: still wrong
            log.info("pass bisection: %s failed: %s", target, exc)
            return True
        return any(
            compare_tensors(name, ref, out.get(name), session.crit).diverged
            for name, ref in screened.ref_outputs.items()
        )

    off = control.all_off()
    if diverges(off):
        return PassBisection(
            PassOutcome.NOT_OPTIMIZER, spec, runs=runs,
            reason=f"{off} diverges too: {_blame_without_passes(control)}",
        )  # fmt: skip
    try:
        passes = tuple(control.passes(model_of(spec), session.feeds))
    except OnnxBisectError as exc:
        return PassBisection(PassOutcome.FAILED, spec, runs=runs, reason=str(exc))
    search = find_guilty(passes, lambda on: diverges(control.only(sorted(on), passes)))
    if not search.guilty:
        return PassBisection(
            PassOutcome.NO_PASSES, spec, passes, runs=runs,
            reason=f"{off} agrees with the reference, but no set of the {len(passes)} passes "
            "tried diverges on its own: the optimization level itself matters",
        )  # fmt: skip
    fix = control.workaround(search.guilty)
    named_in = runs  # the check of the workaround below is not part of naming the passes
    verified = not diverges(fix.spec)
    rewritten = control.rewritten(model_of(off), search.guilty)
    names = " + ".join(search.guilty)
    return PassBisection(
        PassOutcome.GUILTY,
        spec,
        passes,
        search.guilty,
        named_in,
        fix.spec,
        fix.forms,
        verified,
        rewritten,
        reason=f"{off} agrees with the reference; of the {len(passes)} passes tried, {names} "
        f"alone {'make' if len(search.guilty) > 1 else 'makes'} the target diverge",
    )


def _blame_without_passes(control: PassControl) -> str:
    if isinstance(control, TransformPasses):
        return (
            f"without +{control.transform.name} the target is still wrong, so the runtime, "
            "not the transform's passes, is to blame"
        )
    return (
        "with every optimization off the target is still wrong, so a kernel, not an "
        "optimizer pass, is to blame"
    )
