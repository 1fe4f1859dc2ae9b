"""A quantized target model's tensors paired with the float model's, in real units.

An integer tensor is compared after dequantizing it with its own scale and zero point; fed
to a node in isolation, the reference's float value is quantized with the same parameters
(feeding float into a uint8 input is an invalid graph). Each pair carries the rule that made
it, and each quantized tensor without one the reason. A dynamic model's scales are tensors of
its own: those pairs wait in ``pending`` until its run gives them (``runtime.py``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import numpy.typing as npt
import onnx

from onnx_bisect.compare.quant import QParams, dequantize, quantize
from onnx_bisect.graph.match import Matching
from onnx_bisect.graph.qdq import QTensor, QuantGraph, read_quantized
from onnx_bisect.graph.view import LoadedModel
from onnx_bisect.graph.weights import tensor_array

__all__ = ["initializers", "integer_steps", "QuantPairing", "pair_quantized", "qparams"]


@dataclass(frozen=True)
class QuantPairing:
    """``pairs``: quantized target tensor -> the float model's tensor it stands for (those
    the name matching did not already pair); ``params``: how to read each integer tensor in
    real units; ``rules`` and ``unpaired`` for the report."""

    pairs: dict[str, str]
    params: dict[str, QParams]
    rules: dict[str, str]
    unpaired: dict[str, str]
    tensors: dict[str, QTensor]
    # Paired tensors whose scale and zero point the model computes (dynamic quantization).
    pending: dict[str, QTensor] = field(default_factory=dict)
    # Float tensors holding integers (an accumulator's Cast): dequantized to compare, fed
    # the quantized reference in their own float type.
    floats: frozenset[str] = frozenset()
    # A dynamic chain's scaled result before its bias Add -> (that Add's output, the bias).
    biased: dict[str, tuple[str, str]] = field(default_factory=dict)
    # The run-time scales and zero points, by the target's names: isolation's operands.
    values: dict[str, npt.NDArray[Any]] = field(default_factory=dict)
    # Their parameters as the model computes them from the reference's values, which
    # isolation feeds: a node's isolated integers are read under these.
    isolated: dict[str, QParams] = field(default_factory=dict)

    def for_isolation(self) -> QuantPairing:
        """The pairing isolation reads its outputs with (``isolated``'s parameters)."""
        if not self.isolated:
            return self
        return replace(self, params={**self.params, **self.isolated})

    @property
    def rule_counts(self) -> dict[str, int]:
        return dict(Counter(self.rules.values()))

    def real(self, name: str, value: npt.NDArray[Any] | None, like: np.dtype[Any]) -> Any:
        """The target's value of ``name`` in real units, in the reference's dtype."""
        p = self.params.get(name)
        if value is None or p is None:
            return value
        return dequantize(value, p).astype(like)

    def fed(self, name: str, ref_value: npt.NDArray[Any]) -> npt.NDArray[Any]:
        """The reference's value as the target's node reads it: quantized where it is."""
        p = self.params.get(name)
        return ref_value if p is None else quantize(ref_value, p)

    def dtype(self, name: str) -> np.dtype[Any] | None:
        p = self.params.get(name)
        return None if p is None or name in self.floats else np.dtype(p.dtype)


def initializers(model: LoadedModel) -> dict[str, onnx.TensorProto]:
    return {t.name: t for t in model.model.graph.initializer}


def qparams(
    model: LoadedModel, q: QTensor, inits: Mapping[str, onnx.TensorProto] | None = None
) -> QParams | None:
    """The scale and zero point as arrays, from the model's initializers (``inits``: them
    by name, given by a caller asking for many tensors)."""
    inits = inits if inits is not None else initializers(model)
    if q.scale not in inits or (q.zero_point is not None and q.zero_point not in inits):
        return None
    scale = np.asarray(tensor_array(inits[q.scale]), dtype=np.float64).ravel()
    if q.zero_point is None:
        zp, dtype = np.zeros(1), "uint8"
    else:
        raw = tensor_array(inits[q.zero_point])
        zp, dtype = np.asarray(raw, dtype=np.float64).ravel(), str(raw.dtype)
    if not np.issubdtype(np.dtype(dtype), np.integer):
        return None  # float8 and the like: not an integer grid
    axis = q.axis if scale.size > 1 else None
    return QParams(scale, zp, dtype, 1 if scale.size > 1 and axis is None else axis)


def integer_steps(model: LoadedModel) -> dict[str, QParams]:
    """Each integer tensor of a quantized model computed at run time -> its scale and zero
    point: how one model's integers compare across two backends, in real units."""
    graph = read_quantized(model)
    inits = initializers(model)
    out: dict[str, QParams] = {}
    for name, q in graph.tensors.items():
        p = qparams(model, q, inits) if q.integer else None
        if p is not None:
            out[name] = p
    # A DequantizeLinear's output holds the same grid in floats: as far apart in steps.
    for n in model.nodes:
        if n.op_type == "DequantizeLinear" and n.inputs and n.inputs[0] in out:
            out[n.outputs[0]] = out[n.inputs[0]]
    return out


def pair_quantized(ref: LoadedModel, target: LoadedModel, matching: Matching) -> QuantPairing:
    """Pair every quantized tensor of ``target`` with the float model's tensor it stands for,
    or say why not."""
    graph, inits = read_quantized(target), initializers(target)
    known = set(ref.probes) | set(ref.inputs)
    pairs: dict[str, str] = {}
    params: dict[str, QParams] = {}
    rules: dict[str, str] = {}
    unpaired = dict(graph.unpaired)
    pending: dict[str, QTensor] = {}
    results = _results(graph, known, matching)
    for name, q in graph.tensors.items():
        source = q.stands_for
        counterpart = None
        if source is not None and q.rule == "onnxruntime's name":
            counterpart = _fused(ref, target, source) if source in known else None
        elif source in results:
            counterpart = results[source]
        elif source is not None:
            counterpart = source if source in known else matching.pairs.get(source)
        if counterpart is None:
            why = "no float tensor named after it" if source is None else f"stands for {source}"
            unpaired[name] = why + ", which the float model does not have"
            continue
        if q.runtime:
            pending[name] = q
        elif q.integer:
            p = qparams(target, q, inits)
            if p is None:
                unpaired[name] = "its scale or zero point is not an initializer"
                continue
            params[name] = p
        pairs[name] = counterpart
        rules[name] = matching_rule(name, counterpart, matching) or q.rule
    for name in matching.excluded:
        if name not in pairs and _same_on_dequantized(ref, target, name, matching.pairs):
            pairs[name], rules[name] = name, "same name, dequantized operands"
    for result, counterpart in results.items():
        if result not in pairs and matching.pairs.get(result) != counterpart:
            pairs[result], rules[result] = counterpart, "dynamic chain's float result"
    floats = frozenset(n for n, q in pending.items() if target.dtypes.get(n) == np.float32)
    biased = {r: v for r, v in graph.biased.items() if r in results}
    return QuantPairing(pairs, params, rules, unpaired, graph.tensors, pending, floats, biased)


def _results(graph: QuantGraph, known: set[str], matching: Matching) -> dict[str, str]:
    """A dynamic chain's float results -> the float tensor each stands for: the float op's
    output of the same name, and before a bias Add, the store's value of it less the bias
    (kept under the target's own name)."""
    out: dict[str, str] = {}
    for name in graph.results:
        counterpart = name if name in known else matching.pairs.get(name)
        if counterpart is not None:
            out[name] = counterpart
    for before, (after, _) in graph.biased.items():
        if after in out:
            out[before] = before
    return out


def _same_on_dequantized(
    ref: LoadedModel, target: LoadedModel, name: str, known: dict[str, str]
) -> bool:
    """Whether the target's ``name`` is made by the same op from what the float model's
    ``name`` is made from, read through DequantizeLinear (a QDQ model's Conv reads
    ``W_DequantizeLinear_Output`` of ``W_quantized`` where the float model's reads ``W``):
    the name matching excludes it for its changed inputs, yet it holds the same tensor."""
    t, r = target.producer.get(name), ref.producer.get(name)
    if t is None or r is None or t.op_type != r.op_type or len(t.inputs) != len(r.inputs):
        return False
    return all(
        _dequantized_name(target, i, known) == j for i, j in zip(t.inputs, r.inputs, strict=True)
    )


def _dequantized_name(target: LoadedModel, tensor: str, known: dict[str, str]) -> str:
    producer = target.producer.get(tensor)
    if producer is None or producer.op_type != "DequantizeLinear":
        return known.get(tensor, tensor)
    src = producer.inputs[0]
    q = target.producer.get(src)
    if q is not None and q.op_type == "QuantizeLinear":
        return known.get(q.inputs[0], q.inputs[0])
    for suffix in ("_quantized",):
        if src.endswith(suffix):
            return src[: -len(suffix)]
    return known.get(tensor, tensor)


# Activations onnxruntime fuses into the op before them (QLinearConv writes Relu(Conv)).
_FUSED = frozenset({"Relu", "Clip"})


def _fused(ref: LoadedModel, target: LoadedModel, source: str) -> str:
    """What a QOperator tensor named after ``source`` holds: ``source``, or the output of the
    lone Relu/Clip reading it in the float model when the quantized model lost that node."""
    readers = [n for n in ref.nodes if source in n.inputs]
    names = {n.name for n in target.nodes}
    if len(readers) == 1 and readers[0].op_type in _FUSED:
        r = readers[0]
        if r.name not in names and f"{r.name}_quant" not in names:
            return r.outputs[0]
    return source


def matching_rule(name: str, counterpart: str, matching: Matching) -> str | None:
    """The name matching's rule when it paired the tensor itself (a DequantizeLinear's output
    read by a node kept by name)."""
    if matching.pairs.get(name) != counterpart:
        return None
    return "same name" if name == counterpart else "kept reader"
