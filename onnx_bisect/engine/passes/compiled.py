"""Pass bisection of a ``torch:*?compile=`` target: torch's bisector names the backend, the
subsystem and its n-th application; we add the eager check before it and the workaround's
check after it, as for any pass bisection (``engine/passes/bisection.py``)."""

from __future__ import annotations

from onnx_bisect.backends.passes import spec_with_options
from onnx_bisect.backends.protocol import Tensors
from onnx_bisect.backends.registry import create_backend
from onnx_bisect.backends.spec import parse_spec
from onnx_bisect.backends.torch.backend import TorchBackend
from onnx_bisect.backends.torch.compile_bisect import (
    BACKEND_ORDER,
    CompileFinding,
    bisect_compiler,
    fallback_compiler,
)
from onnx_bisect.compare.tensors import compare_tensors
from onnx_bisect.engine.measure.observe import Observed
from onnx_bisect.engine.measure.runs import timed_run
from onnx_bisect.engine.session import Session
from onnx_bisect.errors import BackendError
from onnx_bisect.result import PassBisection, PassOutcome

__all__ = ["bisect_compile"]

# ConfigChange's config_name -> the module whose field it flips.
_CONFIG_MODULES = {
    "inductor": "torch._inductor.config",
    "aot_eager_decomp_partition": "torch._functorch.config",
}


def bisect_compile(session: Session, screened: Observed) -> PassBisection:
    text = session.setup.target_info.spec
    spec = parse_spec(text).without_transforms()
    model = (session.setup.target_model or session.loaded).model
    runs = 0

    def diverged(out: Tensors) -> bool:
        return any(
            compare_tensors(name, ref, out.get(name), session.crit).diverged
            for name, ref in screened.ref_outputs.items()
        )

    def diverges(target: str) -> bool:
        nonlocal runs
        runs += 1
        try:
            backend = create_backend(target, timeout=session.options.timeout)
            out = timed_run(backend, model, session.feeds, "passes", session.stats)
        except BackendError:
            return True
        return diverged(out)

    eager = spec_with_options(spec, compile=None)
    if diverges(eager):
        return PassBisection(
            PassOutcome.NOT_OPTIMIZER, text, runs=runs,
            reason=f"{eager} diverges too: without torch.compile the target is still wrong, "
            "so an eager kernel, not the compiler, is to blame",
        )  # fmt: skip
    finding = bisect_compiler(TorchBackend(spec), model, session.feeds, diverged)
    if finding is None:
        return PassBisection(
            PassOutcome.NO_PASSES, text, BACKEND_ORDER, runs=runs,
            reason="torch's compiler bisector found every compile backend agreeing: the "
            "divergence did not reproduce under it",
        )  # fmt: skip
    runs += finding.runs
    named_in = runs
    fallback = fallback_compiler(finding.backend)
    fix = spec_with_options(spec, compile=fallback)
    verified = not diverges(fix)
    return PassBisection(
        PassOutcome.GUILTY,
        text,
        BACKEND_ORDER,
        (_guilty(finding),),
        named_in,
        fix,
        _forms(finding, fallback),
        verified,
        reason=_reason(finding, eager),
        details=_details(finding),
    )


def _guilty(f: CompileFinding) -> str:
    return f"{f.backend}/{f.subsystem}" if f.subsystem else f.backend


def _details(f: CompileFinding) -> tuple[tuple[str, str], ...]:
    rows = [("backend", f.backend)]
    if f.subsystem:
        rows.append(("subsystem", f.subsystem))
    if f.config:
        module, field, value = f.config
        rows.append(("config", f"{_CONFIG_MODULES.get(module, module)}.{field} = {value}"))
    if f.application is not None:
        rows.append(("application", str(f.application)))
    if f.debug_info:
        rows.append(("debug info", f.debug_info))
    return tuple(rows)


def _reason(f: CompileFinding, eager: str) -> str:
    where = f"the {f.backend} backend"
    if f.config:
        return (
            f"{eager} agrees; torch's bisector finds {where} wrong unless {f.subsystem} is flipped"
        )
    if f.subsystem:
        nth = f" (application {f.application})" if f.application is not None else ""
        return f"{eager} agrees; torch's bisector finds {where} wrong, in its {f.subsystem}{nth}"
    return f"{eager} agrees; torch's bisector finds {where} wrong, no subsystem narrower"


def _forms(f: CompileFinding, fallback: str | None) -> tuple[tuple[str, str], ...]:
    forms = [("Python", f"torch.compile(model, backend={fallback!r})" if fallback else "model")]
    if f.config:
        module, field, value = f.config
        forms.append(
            ("Python (config)", f"{_CONFIG_MODULES.get(module, module)}.{field} = {value}")
        )
    return tuple(forms)
