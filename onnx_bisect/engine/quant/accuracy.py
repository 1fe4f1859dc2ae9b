"""Weight rounding told from the kernel's ``accuracy_level``: a MatMulNBits with
``accuracy_level`` 4 quantizes its activations to int8 per block as it runs, which the float
model never does, and onnxruntime's reports of wrong tokens (Qwen3-0.6B, Phi-3.5) come from
that, not from the int4 weights. When the keep-in-float set's MatMulNBits, computed as a float
MatMul of their own int4 weights (``graph/refloat.float_activations``), meet the goal, the
weights are not at fault: the answer is the quantizer with ``accuracy_level`` unset, verified
by quantizing the float model again so (no calibration needed). Otherwise the answer stays
``nodes_to_exclude``, its cause weight rounding; then, for 4-bit MatMuls, the same nodes are
quantized to 8 bits instead (RTN's ``customized_weight_config``): where that meets the goal
too, the answer is that config, the nodes' weights still quantized.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace

import onnx

from onnx_bisect.engine.quant.requantize import RequantizeError, Requantizer
from onnx_bisect.engine.session import Session
from onnx_bisect.graph.quant_settings import QuantSettings, read_settings
from onnx_bisect.graph.refloat import float_activations, integer_kernels
from onnx_bisect.graph.save import save_for_child
from onnx_bisect.graph.view import LoadedModel
from onnx_bisect.quant_result import KeepInFloat
from onnx_bisect.text import fmt

__all__ = ["accuracy_level_cause", "eight_bits"]

log = logging.getLogger(__name__)


def accuracy_level_cause(
    session: Session,
    target: LoadedModel,
    found: KeepInFloat,
    limit: float,
    measured: Callable[[onnx.ModelProto, str], float],
) -> KeepInFloat:
    """``found`` with its cause: the kernel's accuracy_level (then the answer is the
    quantizer without it) or weight rounding. Only for a weight-only model quantized with an
    accuracy_level and a set to test."""
    settings = read_settings(target.model)
    level = settings.accuracy_level
    if settings.form != "nbits" or not level or level <= 1 or not found.nodes:
        return found
    kernels = integer_kernels(target.model, session.loaded.model).kernels
    nbits = {n.name for n in target.model.graph.node if n.op_type == "MatMulNBits"}
    chosen = [kernels[n] for n in found.nodes if kernels.get(n) in nbits]
    if not chosen:
        return found
    swapped = measured(
        float_activations(target.model, chosen), "int4 weights with float activations"
    )
    if swapped > limit:
        cause = (
            f"weight rounding: their int4 weights computed with float activations (no "
            f"accuracy_level={level}) still give {found.goal.split(' ≤')[0]} {fmt(swapped)}"
        )
        return replace(found, cause=cause, float_activations=swapped)
    plain = replace(settings, accuracy_level=None)
    cause = (
        f"the MatMulNBits' accuracy_level={level} (int8 activations): their own int4 weights "
        f"with float activations give {fmt(swapped)}; quantize without it"
    )
    out = replace(found, kind="accuracy_level", cause=cause, float_activations=swapped,
                  call=plain.call(()), settings=plain.to_dict())  # fmt: skip
    try:
        after = measured(_requantizer(session, plain).model(()), "no accuracy_level")
    except RequantizeError as exc:
        log.warning("re-quantizing without accuracy_level failed: %s", exc)
        return replace(out, requantized=None, verified=swapped <= limit)
    before = found.requantized[0] if found.requantized is not None else found.before
    return replace(out, requantized=(before, after), verified=after <= limit)


def _requantizer(session: Session, settings: QuantSettings) -> Requantizer:
    ref = session.loaded
    path = ref.path if ref.path is not None and ref.path.is_file() else None
    folder = session.scratch / "requantize"
    folder.mkdir(parents=True, exist_ok=True)
    path = path or save_for_child(ref.model, folder, "float.onnx")
    return Requantizer(path, settings, None, folder)


def eight_bits(
    session: Session,
    target: LoadedModel,
    found: KeepInFloat,
    limit: float,
    measured: Callable[[onnx.ModelProto, str], float],
) -> KeepInFloat:
    """``found`` as 8-bit weights where 8 bits meet the goal (re-quantized so): kind
    ``customized_weight_config``, its call, the 8-bit model's number. Only for a 4-bit
    weight-only MatMul set kept in float."""
    settings = read_settings(target.model)
    if settings.form != "nbits" or settings.bits != 4 or found.kind != "nodes_to_exclude":
        return found
    floats = {n.name: n.op_type for n in session.loaded.model.graph.node}
    if not found.nodes or any(floats.get(n) != "MatMul" for n in found.nodes):
        return found
    try:
        after = measured(_requantizer(session, settings).model((), found.nodes), "8-bit set")
    except RequantizeError as exc:
        log.warning("re-quantizing the set to 8 bits failed: %s", exc)
        return found
    log.info("the set at 8 bits: %s %s", found.goal, fmt(after))
    if after > limit:
        return replace(found, eight_bits=after)
    config = {n: {"bits": 8} for n in found.nodes}
    call = settings.call(()).replace(
        "nodes_to_exclude=[]",
        f"algo_config=RTNWeightOnlyQuantConfig(customized_weight_config={config!r})",
    )
    return replace(found, kind="customized_weight_config", call=call, eight_bits=after,
                   alternative=found.call)  # fmt: skip
