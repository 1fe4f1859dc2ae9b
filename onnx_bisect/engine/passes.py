"""Pass bisection: after a divergence, which of the target's optimizer passes causes it.

The target runs the whole model once with every optimization off. Still diverging, no pass is
to blame (a kernel is), and that is the finding. Agreeing, the passes that rewrite this model
are listed by the runtime itself and searched (``engine/pass_search.py``) for the smallest set
that, enabled alone, diverges; the workaround (those passes off) is run once more to show it
agrees with the reference, and the nodes the passes replaced are named where the runtime can
tell.
"""

from __future__ import annotations

import logging

from onnx_bisect.backends.passes import PassControl, supports_passes
from onnx_bisect.backends.registry import create_backend
from onnx_bisect.compare.tensors import compare_tensors
from onnx_bisect.engine.observe import Observed
from onnx_bisect.engine.pass_search import find_guilty
from onnx_bisect.engine.runs import timed_run
from onnx_bisect.engine.session import Session
from onnx_bisect.errors import BackendError, OnnxBisectError
from onnx_bisect.result import PassBisection, PassOutcome

__all__ = ["bisect_passes"]

log = logging.getLogger(__name__)


def bisect_passes(session: Session, screened: Observed) -> PassBisection | None:
    """The pass bisection of a diverging target (see module), or None where none applies:
    ``--bisect-passes off``, or a target without passes."""
    options = session.options
    if options.bisect_passes == "off":
        return None
    control = supports_passes(session.target, tuple(options.passes))
    if control is None:
        if options.bisect_passes == "on":
            session.notes.append(
                f"--bisect-passes on: {session.setup.target_info.spec} has no optimizer passes "
                "to switch off (ONNX Runtime above opt=disable, or an exec: runtime with "
                "{disable} and --passes)"
            )
        return None
    with session.timer.stage("passes"):
        return _bisect(session, screened, control)


def _bisect(session: Session, screened: Observed, control: PassControl) -> PassBisection:
    spec = session.setup.target_info.spec
    model = (session.setup.target_model or session.loaded).model
    runs = 0

    def diverges(target: str) -> bool:
        nonlocal runs
        runs += 1
        backend = create_backend(target, timeout=session.options.timeout)
        try:
            out = timed_run(backend, model, session.feeds, "passes", session.stats)
        except BackendError as exc:  # the symptom changed; count it as still wrong
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
            reason=f"{off} diverges too: with every optimization off the target is still wrong, "
            "so a kernel, not an optimizer pass, is to blame",
        )  # fmt: skip
    try:
        passes = tuple(control.passes(model, session.feeds))
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
    rewritten = control.rewritten(model, search.guilty)
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
