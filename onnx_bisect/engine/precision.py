"""The precision note: when a divergence is the target's reduced precision, not a bad kernel.

A target that computes float32 work in float16, bfloat16 or TF32 is expected to exceed fp32
rounding. The spec usually says so (``?dtype=float16``, ``?tf32=1``, ``+fp16``, OpenVINO's
``precision=``), and then even one culprit gets the note; otherwise many culprits at once
(``widespread``) are the sign.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import replace

import onnx

from onnx_bisect.backends.protocol import Backend, computes_in
from onnx_bisect.backends.registry import create_backend
from onnx_bisect.compare.precision import (
    FLOAT32_DEFAULT,
    Precision,
    PrecisionInfo,
    parse_precision,
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
    "declared_precision",
    "fp32_spec",
    "precision_notes",
    "side_precision",
    "unasked_precision",
    "unasked_precision_cause",
]


def unasked_precision(session: Session, screened: Observed) -> bool:
    """The runtime lowered the precision on its own, and that alone moves the outputs: they
    are beyond fp32 noise, within what the lower precision predicts."""
    target = session.setup.target_precision
    lowered = target.lowered and not target.asked
    return lowered and any(c.within_precision for c in screened.comparisons.values())


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
    )


def _workaround_verdict(session: Session, spec: str, screened: Observed) -> str:
    """Runs ``spec`` on the whole model and says whether it agrees with the reference at fp32
    noise (no precision floors)."""
    if spec.startswith("the "):
        return "no fp32 spec known for this target"
    try:
        backend = create_backend(spec)
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
    return "verified: it agrees with the reference at fp32 noise"


def side_precision(
    backend: Backend,
    *,
    flag: str | None = None,
    transforms: Sequence[TransformRecord] = (),
    model: LoadedModel | None = None,
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
            how = f"the target model's float tensors are {found.value}"
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


_ON = {"1", "true", "on"}
_NAMES = {"float16": "float16", "bfloat16": "bfloat16", "f16": "float16", "bf16": "bfloat16"}


def precision_notes(nodes: Sequence[NodeResult], target: BackendInfo) -> list[str]:
    """The note for a diagnosis whose culprits a precision policy explains, if any."""
    culprits = [n for n in nodes if n.verdict is Verdict.CULPRIT]
    if not culprits:
        return []
    declared = declared_precision(target)
    fp32 = fp32_spec(target.spec)
    if declared is not None:
        return [
            f"the target computes in {declared}, so errors above fp32 rounding are expected "
            f"from it; compare at fp32 (e.g. {fp32}) to test the kernels themselves"
        ]
    ops = sorted({n.op_type for n in culprits})
    if len(culprits) < 5 or len(culprits) < 0.1 * sum(1 for n in nodes if n.isolated):
        return []
    return [
        f"{len(culprits)} nodes ({', '.join(ops[:4])}) are each wrong on their own: that is "
        "usually the target computing at lower precision (bf16/fp16/TF32) rather than one bad "
        f"kernel; compare at fp32 (e.g. {fp32}) to test the kernels"
    ]


def declared_precision(target: BackendInfo) -> str | None:
    """The reduced precision the target's spec (or its description) asks for, else None."""
    runtime, *transforms = target.spec.split("+")
    if runtime.startswith(("exec:", "dump:")):
        return None  # their query strings belong to the user's command
    if any(t.strip().partition("=")[0] == "fp16" for t in transforms):
        return "float16 (the +fp16 transform)"
    query = dict(kv.partition("=")[::2] for kv in runtime.partition("?")[2].split("&") if kv)
    if query.get("dtype", "").lower() in _NAMES:
        return _NAMES[query["dtype"].lower()]
    if query.get("tf32", "").lower() in _ON:
        return "TF32"
    # OpenVINO says what it picked (bf16 by default on CPUs with AMX/AVX512-BF16).
    found = re.search(r"precision=(b?f16)\b", target.description, re.IGNORECASE)
    return _NAMES[found.group(1).lower()] if found else None


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
