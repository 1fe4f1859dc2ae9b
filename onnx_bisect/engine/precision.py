"""What each side computes float32 work in, and what follows from a lower precision: the
cause when a runtime lowered it unasked, and the note where no precision floors judged it.

A target that computes in float16, bfloat16 or TF32 is expected to exceed fp32 rounding.
``side_precision`` reads it from the most explicit word (``--target-precision``, a transform,
a float16 model file, what the backend says: ``Backend.computes_in``), not from spec text.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import numpy as np
import onnx

from onnx_bisect.backends.protocol import Backend, computes_in
from onnx_bisect.backends.registry import create_like
from onnx_bisect.compare.noise import fp32_noise
from onnx_bisect.compare.precision import (
    FLOAT32_DEFAULT,
    Precision,
    PrecisionInfo,
    parse_precision,
    round_to,
)
from onnx_bisect.compare.tensors import compare_tensors
from onnx_bisect.engine.measure.observe import Observed
from onnx_bisect.engine.measure.runs import timed_run
from onnx_bisect.engine.session import Session
from onnx_bisect.errors import OnnxBisectError
from onnx_bisect.graph.view import LoadedModel
from onnx_bisect.result import BackendInfo, CauseKind, NodeResult, RootCause, Verdict, target_arg
from onnx_bisect.text import fmt
from onnx_bisect.transforms.registry import TransformRecord

__all__ = [
    "fp32_spec",
    "precision_notes",
    "side_precision",
    "unasked_precision",
    "unasked_precision_cause",
    "with_input_rounding",
]


def unasked_precision(session: Session, screened: Observed) -> bool:
    """The runtime lowered the precision on its own, and that alone moves the outputs: they
    are beyond fp32 noise, within what the lower precision predicts."""
    target = session.setup.target_precision
    lowered = target.lowered and not target.asked
    return lowered and any(c.within_precision for c in screened.comparisons.values())


_VERIFIED = "verified"


def unasked_precision_cause(session: Session, screened: Observed) -> RootCause:
    """The cause when the runtime chose a lower precision unasked: its setting, and the fp32
    spec run on the whole model to show that it is the workaround."""
    target = session.setup.target_precision
    spec = fp32_spec(session.setup.target_info.spec)
    verdict = _workaround_verdict(session, spec, screened)
    within = [c for c in screened.comparisons.values() if c.within_precision]
    worst = max(within, key=lambda c: c.metrics.get("rel_l2", 0.0))
    name = target.precision.value
    return RootCause(
        CauseKind.PRECISION,
        (),
        f"the target computes in {name} without being asked ({target.how}); every final "
        f"output is within the error {name} predicts (largest rel_l2 "
        f"{fmt(worst.metrics.get('rel_l2'))}, {name} floor {fmt(worst.precision_floor)}). "
        f"Workaround: {target_arg(spec)} ({verdict})",
        workaround="" if spec.startswith("the ") else spec,
        workaround_verified=verdict.startswith(_VERIFIED),
    )


def _workaround_verdict(session: Session, spec: str, screened: Observed) -> str:
    """Runs ``spec`` on the whole model and says whether it agrees with the reference at fp32
    noise (no precision floors)."""
    if spec.startswith("the "):
        return "no fp32 spec known for this target"
    try:
        backend = create_like(spec, session.setup.target)
        other = session.setup.target_model or session.loaded
        out = timed_run(backend, other.model, session.feeds, "workaround", session.stats)
    except OnnxBisectError as exc:
        return f"NOT verified: it fails ({exc})"
    crit = replace(session.crit, floors=None)
    diverged = [
        name
        for name, ref in screened.ref_outputs.items()
        if compare_tensors(name, ref, out.get(name), crit).diverged
    ]
    if diverged:
        return f"NOT verified: {', '.join(diverged[:3])} still diverge at fp32 noise"
    return f"{_VERIFIED}: it agrees with the reference at fp32 noise"


def side_precision(
    backend: Backend,
    *,
    flag: str | None = None,
    transforms: Sequence[TransformRecord] = (),
    model: LoadedModel | None = None,
    whose: str = "the target model's",
) -> PrecisionInfo:
    """What one side computes float32 work in, from the most explicit word first: the user's
    ``--target-precision``, a transform that lowers the model, a model file whose float
    tensors are mostly float16/bfloat16, what the runtime says; else the model's own types."""
    if flag is not None:
        return PrecisionInfo(parse_precision(flag), "declared", "--target-precision", True)
    for record in transforms:
        if record.text.partition("=")[0] == "fp16":
            how = f"the +{record.text} transform"
            return PrecisionInfo(Precision.FLOAT16, "declared", how, True)
    if model is not None:
        found = _model_precision(model.model)
        if found is not None:
            how = f"{whose} float tensors are {found.value}"
            return PrecisionInfo(found, "declared", how, True)
    return computes_in(backend) or FLOAT32_DEFAULT


_LOW_TYPES = {
    onnx.TensorProto.FLOAT16: Precision.FLOAT16,
    onnx.TensorProto.BFLOAT16: Precision.BFLOAT16,
}


def _model_precision(model: onnx.ModelProto) -> Precision | None:
    """float16 or bfloat16 when most of a model's float values (weights and typed
    intermediates) are of that type."""
    graph = model.graph
    types = [t.data_type for t in graph.initializer]
    types += [v.type.tensor_type.elem_type for v in graph.value_info]
    floats = [t for t in types if t in (onnx.TensorProto.FLOAT, *_LOW_TYPES)]
    for elem, precision in _LOW_TYPES.items():
        if floats and floats.count(elem) > len(floats) / 2:
            return precision
    return None


def precision_notes(
    nodes: Sequence[NodeResult], target: BackendInfo, precision: PrecisionInfo, *, floors: bool
) -> list[str]:
    """The note for a diagnosis whose culprits a precision policy likely explains, if any:
    where no precision floors judged them (a fixed threshold, no torch), a declared lower
    precision explains even one culprit, and many culprits at once suggest an undeclared one."""
    culprits = [n for n in nodes if n.verdict is Verdict.CULPRIT]
    if not culprits or floors:
        return []
    fp32 = fp32_spec(target.spec)
    if precision.lowered:
        return [
            f"the target computes in {precision.precision.value} ({precision.how}), so errors "
            f"above fp32 rounding are expected from it; compare at fp32 (e.g. {fp32}) to test "
            "the kernels themselves"
        ]
    ops = sorted({n.op_type for n in culprits})
    if len(culprits) < 5 or len(culprits) < 0.1 * sum(1 for n in nodes if n.isolated):
        return []
    return [
        f"{len(culprits)} nodes ({', '.join(ops[:4])}) are each wrong on their own: that is "
        "usually the target computing at lower precision (bf16/fp16/TF32) rather than one bad "
        f"kernel; compare at fp32 (e.g. {fp32}) to test the kernels"
    ]


def fp32_spec(target_spec: str) -> str:
    """The target's spec asking for strict float32, for the precision note."""
    runtime = target_spec.split("+", 1)[0]
    if runtime != target_spec and not runtime.startswith(("exec:", "dump:")):
        return runtime  # a +fp16-style transform made the precision: drop it
    name, _, query = runtime.partition("?")
    if name == "mps" or name.startswith("torch"):
        kept = [kv for kv in query.split("&") if kv and not kv.startswith(("dtype=", "tf32="))]
        if name.startswith("torch:cuda"):
            kept.append("tf32=0")
        return name + ("?" + "&".join(kept) if kept else "")
    if name.startswith("openvino"):
        return f"{name}?precision=f32"
    return "the target's fp32 setting"


def with_input_rounding(session: Session, screened: Observed) -> Observed:
    """Under a declared lower precision, the outputs' floors raised to what rounding the model
    inputs to that precision alone does to them (one reference run on rounded inputs), and the
    outputs judged again. A float16 model casts its inputs first; a dynamic-int8 model then
    flips integer steps the twin's floor does not count (zoo G3: voicefilter-lite-int8's
    f_adapt 1.3e-3 past a floor of 2.9e-4, all of it the inputs' rounding)."""
    crit, setup = session.crit, session.setup
    floors = crit.floors
    if floors is None or not screened.diverged or not setup.target_precision.lowered:
        return screened
    floats = {k for k, v in session.feeds.items() if np.issubdtype(v.dtype, np.floating)}
    if not floats:
        return screened
    feeds = {
        k: round_to(v, floors.precision).astype(v.dtype) if k in floats else v
        for k, v in session.feeds.items()
    }
    try:
        moved = timed_run(session.ref, session.loaded.model, feeds, "ref", session.stats)
    except OnnxBisectError:
        return screened
    raised = dict(floors.accumulated)
    said = []
    for name, ref in screened.ref_outputs.items():
        effect = fp32_noise(np.asarray(ref), np.asarray(moved.get(name, ref)))
        if effect is not None and effect > raised.get(name, 0.0):
            raised[name] = effect
            said.append(f"{name} {fmt(effect)}")
    if not said:
        return screened
    session.crit = replace(crit, floors=replace(floors, accumulated=raised))
    session.notes.append(
        f"the outputs' {floors.precision.value} floors count the inputs' own rounding to "
        f"{floors.precision.value} (the reference run on rounded inputs moves "
        f"{', '.join(said[:3])}{' …' if len(said) > 3 else ''}), more than the faithful "
        "twin's floor for them"
    )
    comparisons = {
        name: compare_tensors(
            name, screened.ref_outputs[name], screened.target_outputs[name], session.crit
        )
        if name in screened.ref_outputs and name in screened.target_outputs
        else c
        for name, c in screened.comparisons.items()
    }
    return replace(screened, comparisons=comparisons)
