"""A dynamically quantized model's scales, read from its own run.

``quantize_dynamic`` models compute each activation's scale and zero point at run time
(DynamicQuantizeLinear's second and third outputs) and multiply an int32 accumulator by the
product of two scales: those are tensors of the target model, so one run of it with them
marked as outputs gives what its integers mean. They go to the store under the target's
names (``QuantPairing.values``, for the view isolation reads), so that isolation feeds a
MatMulInteger the zero point its integers were made with.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np
import numpy.typing as npt
import onnx

from onnx_bisect.compare.quant import QParams
from onnx_bisect.engine.measure.runs import timed_run
from onnx_bisect.engine.measure.store import TensorStore
from onnx_bisect.engine.quant.pairing import QuantPairing, initializers
from onnx_bisect.engine.session import Session
from onnx_bisect.errors import BackendError
from onnx_bisect.graph.extract import with_outputs
from onnx_bisect.graph.qdq import QTensor
from onnx_bisect.graph.view import LoadedModel
from onnx_bisect.graph.weights import tensor_array

__all__ = ["with_runtime_scales"]


def with_runtime_scales(
    session: Session, target: LoadedModel, pairing: QuantPairing, store: TensorStore
) -> QuantPairing:
    """``pairing`` with its pending tensors' parameters read from one run of ``target``, and
    the scales and zero points themselves; the reference's value of each biased result before
    its bias put in ``store``."""
    if not pairing.pending:
        return pairing
    inits = initializers(target)
    biases = [b for _, b in pairing.biased.values() if b not in inits]
    names = list(
        dict.fromkeys(
            [*(t for q in pairing.pending.values() for t in (q.scale, q.zero_point) if t), *biases]
        )
    )
    try:
        model = with_outputs(target.model, names)
        values = timed_run(session.target, model, session.feeds, "target", session.stats)
    except BackendError as exc:
        return _unread(pairing, f"its run-time scale could not be read: {exc}")
    params = dict(pairing.params)
    for name, q in pairing.pending.items():
        params[name] = _params(q, values)
    own = _reference_scales(target, pairing, store, values, inits)
    isolated = {name: _params(q, {**values, **own}) for name, q in pairing.pending.items()}
    for before, (after, bias) in pairing.biased.items():
        # The float model has the biased tensor only: the value before the Add, in its terms.
        if after in store:
            value = np.asarray(store.get(after))
            b = tensor_array(inits[bias]) if bias in inits else values[bias]
            store.put(before, value - np.asarray(b, dtype=value.dtype))
    # A result before its bias pairs with the value put above: without one, with nothing.
    pairs = {k: v for k, v in pairing.pairs.items() if k not in pairing.biased or v in store}
    return replace(pairing, pairs=pairs, params=params, pending={}, values=own, isolated=isolated)


def _unread(pairing: QuantPairing, why: str) -> QuantPairing:
    """``pairing`` without the tensors whose meaning the run-time scales give: the pending
    integers, and each result before its bias (its value is computed from that run)."""
    dropped = {*pairing.pending, *pairing.biased}
    unpaired = {**pairing.unpaired, **dict.fromkeys(dropped, why)}
    pairs = {k: v for k, v in pairing.pairs.items() if k not in dropped}
    rules = {k: v for k, v in pairing.rules.items() if k not in dropped}
    return replace(pairing, pairs=pairs, rules=rules, unpaired=unpaired, pending={}, biased={})


def _reference_scales(
    target: LoadedModel,
    pairing: QuantPairing,
    store: TensorStore,
    values: dict[str, npt.NDArray[Any]],
    inits: dict[str, onnx.TensorProto],
) -> dict[str, npt.NDArray[Any]]:
    """The scales and zero points the model computes from the reference's values: what
    isolation feeds a MatMulInteger beside the reference quantized by them, and what a
    DynamicQuantizeLinear fed the reference should output. The target's own where they cannot
    be derived (a scale computed other than by DynamicQuantizeLinear and a Mul)."""
    out: dict[str, npt.NDArray[Any]] = {}
    for q in pairing.pending.values():
        producer = target.producer.get(q.scale)
        if producer is None:
            continue
        if producer.op_type == "DynamicQuantizeLinear" and pairing.pairs[q.name] in store:
            x = np.asarray(store.get(pairing.pairs[q.name]), dtype=np.float32)
            scale, zp = dynamic_scale(x)
            if scale > 0:
                out[producer.outputs[1]], out[producer.outputs[2]] = scale, zp
    for q in pairing.pending.values():
        producer = target.producer.get(q.scale)
        if producer is None or producer.op_type != "Mul" or q.scale in out:
            continue
        operands = [out.get(i, _init(inits, i)) for i in producer.inputs]
        known = [o for o in operands if o is not None]
        if len(known) == 2:
            out[q.scale] = np.asarray(np.multiply(known[0], known[1], dtype=np.float32))
    for name in {t for q in pairing.pending.values() for t in (q.scale, q.zero_point) if t}:
        if name not in out and name in values:
            out[name] = np.asarray(values[name])
    return out


def _init(inits: dict[str, onnx.TensorProto], name: str) -> npt.NDArray[Any] | None:
    return tensor_array(inits[name]) if name in inits else None


def dynamic_scale(x: npt.NDArray[np.float32]) -> tuple[npt.NDArray[Any], npt.NDArray[Any]]:
    """DynamicQuantizeLinear's scale and uint8 zero point for ``x`` (the ONNX definition):
    the range widened to hold 0, over 255 steps."""
    lo = np.minimum(np.float32(0), x.min() if x.size else np.float32(0))
    hi = np.maximum(np.float32(0), x.max() if x.size else np.float32(0))
    scale = np.float32((hi - lo) / np.float32(255))
    zp = np.rint(np.clip(-lo / scale, 0, 255)) if scale > 0 else np.float32(0)
    return np.asarray(scale, np.float32), np.asarray(zp, np.uint8)


def _params(q: QTensor, values: dict[str, npt.NDArray[Any]]) -> QParams:
    """Integers under a run-time scale: DynamicQuantizeLinear's uint8 with its zero point, or
    an int32 accumulator under the product of scales (per channel where the weights were)."""
    scale = np.asarray(values[q.scale], dtype=np.float64)
    if q.zero_point:
        raw = np.asarray(values[q.zero_point])
        zp, dtype = raw.astype(np.float64).ravel(), str(raw.dtype)
    else:
        zp, dtype = np.zeros(1), "int32"
    axis = None
    if scale.size > 1:
        # Broadcast from the right, as the Mul applying it does.
        axis = next(i for i, d in enumerate(scale.shape) if d > 1) - scale.ndim
    return QParams(scale.ravel(), zp, dtype, axis)
