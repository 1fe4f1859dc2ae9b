"""One quantized model on two backends: its integer tensors compared in steps of their scales,
and what one-step flips of a kernel's integer inputs can make of its outputs.

A static model's scales are initializers (``pairing.integer_steps``). A dynamic model's
(``quantize_dynamic``: DynamicQuantizeLinear → MatMulInteger → Cast → Mul) are computed at run
time, so one reference run with them marked reads them. Two backends whose float inputs to a
DynamicQuantizeLinear differ at the fp32 level (one Erf's last bits) round a few elements to
the neighbouring integer: one step, which is the int8 precision, not a divergence. The
MatMulInteger reading those integers then differs by up to ``Σ_k |B[k, j] - zero_point|`` in
column ``j`` (every input of a row one step off), and its Cast and the Mul by the scales by
that times the product of scales (``Criterion.quant_bounds``). Those bounds hold in the
accumulated comparisons (the screen, the scan, windows), where the inputs may have flipped,
not in isolation, where the kernel is fed the reference's own integers and any difference is
its own.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from onnx_bisect.compare.criterion import Comparison
from onnx_bisect.compare.quant import QParams
from onnx_bisect.engine.measure.runs import timed_run
from onnx_bisect.engine.quant.pairing import initializers, integer_steps
from onnx_bisect.engine.session import Session
from onnx_bisect.errors import BackendError
from onnx_bisect.graph.extract import with_outputs
from onnx_bisect.graph.qdq import dynamic_chain, read_quantized
from onnx_bisect.graph.view import LoadedModel
from onnx_bisect.graph.weights import tensor_array
from onnx_bisect.quant_result import IntegerSteps, QuantReport

__all__ = ["GRIDS", "IntegerGrids", "integer_grids", "one_model_report"]

# Where ``open_session`` keeps the grids in ``Session.prepared``, for the result's report.
GRIDS = "integer_grids"

Bounds = dict[str, npt.NDArray[np.float64]]


@dataclass(frozen=True)
class IntegerGrids:
    """The integer tensors' grids (static and run-time scales) and the bounds one-step input
    flips put on accumulators and their float results; ``note`` says what could not be read."""

    params: dict[str, QParams] = field(default_factory=dict)
    bounds: Bounds = field(default_factory=dict)
    runtime: tuple[str, ...] = ()  # the tensors whose scales came from the reference's run
    note: str = ""


def integer_grids(session: Session) -> IntegerGrids:
    """``IntegerGrids`` of the session's (one) quantized model; one reference run when the
    model computes scales at run time."""
    loaded = session.loaded
    params = integer_steps(loaded)
    graph = read_quantized(loaded)
    pending = {n: q for n, q in graph.tensors.items() if q.runtime and q.integer}
    if not pending:
        return IntegerGrids(params)
    names = {t for q in pending.values() for t in (q.scale, q.zero_point) if t}
    chains = _chains(loaded)
    names |= {scales for _, (_, scales, _) in chains.items()}
    try:
        marked = with_outputs(loaded.model, sorted(names))
        values = timed_run(session.setup.ref, marked, session.feeds, "ref", session.stats)
    except BackendError as exc:
        return IntegerGrids(params, note=f"run-time scales not read ({exc}): compared exactly")
    runtime = []
    for name, q in pending.items():
        if q.scale in values and name not in params and _quantizes(loaded, name):
            zp = values.get(q.zero_point) if q.zero_point else None
            params[name] = _params(values[q.scale], zp)
            runtime.append(name)
    bounds = _bounds(loaded, chains, params, values)
    for name in _bias_integers(loaded, chains):  # rounded from a run-time scale: one step
        params.setdefault(name, QParams(np.ones(1), np.zeros(1), "int32"))
    return IntegerGrids(params, bounds, tuple(runtime))


def _bias_integers(loaded: LoadedModel, chains: Mapping[str, Chain]) -> list[str]:
    """A ConvInteger's bias as quantize_dynamic makes it at run time (bias ÷ the product of
    scales -> Floor -> Cast -> Reshape, added to the accumulator): the integer tensors and
    the Floor's, which a scale one ulp apart moves by one whole step here and there."""
    names: list[str] = []
    for acc, (after, _, _) in chains.items():
        if len(after) < 2:
            continue
        add = loaded.producer.get(after[0])
        tensor = next((t for t in add.inputs if t != acc), "") if add is not None else ""
        while tensor:
            node = loaded.producer.get(tensor)
            if node is None or node.op_type not in ("Reshape", "Cast", "Floor"):
                break
            names.append(tensor)
            tensor = node.inputs[0]
    return names


def _quantizes(loaded: LoadedModel, name: str) -> bool:
    """Whether ``name`` is a DynamicQuantizeLinear's integer output (an accumulator's grid is
    not one step per element: its bound is in ``_bounds``)."""
    node = loaded.producer.get(name)
    return node is not None and node.op_type == "DynamicQuantizeLinear"


def _params(scale: npt.NDArray[Any], zero: npt.NDArray[Any] | None) -> QParams:
    s = np.asarray(scale, np.float64).ravel()
    if zero is None:
        return QParams(s, np.zeros(1), "uint8")
    z = np.asarray(zero)
    return QParams(s, np.asarray(z, np.float64).ravel(), str(z.dtype))


# An integer kernel's accumulator -> the integer tensors after it (a ConvInteger's bias Add)
# and its Cast, the product of scales, the float result.
Chain = tuple[tuple[str, ...], str, str]


def _chains(loaded: LoadedModel) -> dict[str, Chain]:
    """Each MatMulInteger's or ConvInteger's accumulator and what turns it back into floats
    (``Chain``): quantize_dynamic adds a ConvInteger's bias, quantized with the run-time
    scale, to the accumulator before the Cast."""
    out: dict[str, Chain] = {}
    for n in loaded.nodes:
        if n.op_type not in ("MatMulInteger", "ConvInteger") or not n.outputs:
            continue
        acc, after = n.outputs[0], tuple[str, ...]()
        readers = loaded.readers.get(acc, ())
        if n.op_type == "ConvInteger" and len(readers) == 1 and readers[0].op_type == "Add":
            after = (readers[0].outputs[0],)
        chain = dynamic_chain(loaded.readers, after[-1] if after else acc)
        if chain is not None:
            out[acc] = ((*after, chain[0]), chain[1], chain[2])
    return out


def _bounds(
    loaded: LoadedModel,
    chains: Mapping[str, Chain],
    params: Mapping[str, QParams],
    values: Mapping[str, npt.NDArray[Any]],
) -> Bounds:
    """Per accumulator, the integer tensors after it and its float result, where the
    MatMulInteger or ConvInteger reads a gridded integer A and a weight B: the largest
    difference one step of every A element makes, per output column (a ConvInteger's: per
    output channel, shaped to broadcast over its output, one more for its bias, which the
    run-time scale quantizes too)."""
    inits = initializers(loaded)
    out: Bounds = {}
    for acc, (after, scales, result) in chains.items():
        node = loaded.producer[acc]
        a, b = node.inputs[0], node.inputs[1]
        if a not in params or b not in inits:
            continue  # only flips of a gridded input against fixed weights are bounded
        spread = _spread(node.op_type, node.inputs, inits)
        if spread is None or scales not in values:
            continue
        out[acc] = spread
        if len(after) > 1:  # the bias, quantized with a scale one ulp apart: one more step
            spread = spread + 1.0
        out.update(dict.fromkeys(after, spread))
        factor = np.asarray(values[scales], np.float64).reshape(-1)
        if factor.size not in (1, spread.size):
            factor = np.max(factor, keepdims=True)
        out[result] = spread * factor.reshape(spread.shape if factor.size > 1 else (1,))
        biased = _bias_added(loaded, result)
        if biased:  # a constant added moves nothing: the same bound
            out[biased] = out[result]
    return out


def _bias_added(loaded: LoadedModel, result: str) -> str:
    """The output of the Add that adds a constant (quantize_dynamic's float bias of a
    ConvInteger, reshaped) to ``result``, its only reader; "" where there is none."""
    readers = loaded.readers.get(result, ())
    if len(readers) != 1 or readers[0].op_type != "Add" or len(readers[0].inputs) != 2:
        return ""
    other = next((t for t in readers[0].inputs if t != result), "")
    fixed = set(loaded.initializers) | set(loaded.constants)
    return readers[0].outputs[0] if other in fixed else ""


def _spread(
    op: str, inputs: Sequence[str], inits: Mapping[str, Any]
) -> npt.NDArray[np.float64] | None:
    """Σ |B - zero point| over what one output element reads, in accumulator units: per
    column of a MatMulInteger's (N,), per output channel of a ConvInteger's, as (M, 1, ...)."""
    w = np.asarray(tensor_array(inits[inputs[1]]), np.float64)
    zero = inputs[3] if len(inputs) > 3 and inputs[3] else ""
    if zero and zero not in inits:
        return None
    z = np.asarray(tensor_array(inits[zero]), np.float64).reshape(-1) if zero else np.zeros(1)
    spread: npt.NDArray[np.float64]
    if op == "MatMulInteger":
        if w.ndim != 2:
            return None
        spread = np.sum(np.abs(w - z), axis=0)
        return spread
    if w.ndim < 3 or z.size not in (1, w.shape[0]):
        return None
    w = w - z.reshape((-1,) + (1,) * (w.ndim - 1))
    spread = np.sum(np.abs(w), axis=tuple(range(1, w.ndim)))
    return spread.reshape((-1,) + (1,) * (w.ndim - 2))


def one_model_report(grids: IntegerGrids, compared: Sequence[Comparison]) -> QuantReport:
    """report.json's ``quantization`` for one quantized model on two backends: how its
    integers were compared, and the ``compared`` tensors found within the int8 precision."""
    gridded = set(grids.params) | set(grids.bounds)
    apart: dict[str, str] = {}
    for c in compared:
        if c.tensor in gridded and c.within_precision and c.tensor not in apart:
            apart[c.tensor] = c.reason
    steps = IntegerSteps(len(grids.params), len(grids.runtime), len(grids.bounds),
                         tuple(apart.items()))  # fmt: skip
    rules = dict(Counter("run-time scale" if n in grids.runtime else "initializer scale"
                         for n in grids.params))  # fmt: skip
    if grids.bounds:
        rules["bound of one-step input flips"] = len(grids.bounds)
    return QuantReport(rules, {}, (), steps=steps)
