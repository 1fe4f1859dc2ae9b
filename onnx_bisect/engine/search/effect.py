"""What a node's error does at the outputs, measured in two directions.

- ``injected``: the reference runs the model with the nodes' outputs replaced by the target's
  values (``target_alone``: every node run alone on the target, fed the reference's operands,
  in one run): "with only these wrong". Outputs that stay within the criterion mean the
  error is discarded downstream (a Where, a Max) or never matters: a changed Slice end that
  the shape clips anyway.
- ``repaired``: the target runs the model with the nodes' outputs fed the reference's values:
  "with only these fixed". Outputs that come back mean these nodes are the ones to fix.

Each is one run of the whole model, so the callers ask only where several suspects compete.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from onnx_bisect.compare.criterion import Comparison, Criterion
from onnx_bisect.compare.tensors import compare_tensors
from onnx_bisect.engine.measure.operands import reference_fed, reference_operands
from onnx_bisect.engine.measure.runs import timed_run
from onnx_bisect.engine.measure.store import TensorStore
from onnx_bisect.engine.session import Session
from onnx_bisect.errors import BackendError
from onnx_bisect.graph.extract import isolation_model, window_exits, window_model
from onnx_bisect.graph.view import NodeInfo

__all__ = ["Effect", "Values", "injected", "repaired", "target_alone"]

log = logging.getLogger(__name__)

Values = dict[str, npt.NDArray[Any]]


@dataclass(frozen=True)
class Effect:
    """The final outputs compared with the reference's, with ``nodes`` wrong alone
    (injected) or fixed alone (repaired)."""

    nodes: tuple[str, ...]
    outputs: Mapping[str, Comparison]

    @property
    def agrees(self) -> bool:
        return not any(c.diverged for c in self.outputs.values())

    @property
    def shows(self) -> bool:
        """Some output was compared: a repair of the nodes computing every output would agree
        by construction, which shows nothing."""
        return bool(self.outputs)

    def worst(self, crit: Criterion) -> Comparison | None:
        return max(self.outputs.values(), key=crit.badness, default=None)


def repaired(session: Session, store: TensorStore, names: Sequence[str]) -> Effect | None:
    """The target's outputs with ``names``' outputs fed the reference's values; None when the
    target cannot run that model."""
    loaded = session.loaded
    rest = [n for n in loaded.nodes if n.name not in set(names)]
    outs = _outputs_of(rest, loaded.outputs)
    if not outs:  # the repaired nodes compute every output: nothing left to show it
        return Effect(tuple(names), {})
    try:
        model, feeds = reference_fed(
            loaded, store, session.feeds, rest,
            lambda metas, constants: window_model(loaded, rest, metas, constants, outs)[:2],
        )  # fmt: skip
        got = timed_run(session.target, model, feeds, "target", session.stats)
    except BackendError as exc:
        log.debug("repair of %s failed: %s", list(names), exc)
        return None
    crit = session.crit
    return Effect(
        tuple(names), {o: compare_tensors(o, store.get(o), got.get(o), crit) for o in outs}
    )


def injected(
    session: Session, store: TensorStore, names: Sequence[str], values: Values
) -> Effect | None:
    """The reference's outputs with ``names``' outputs replaced by the target's ``values``
    for them (``target_alone``'s); None when the reference cannot run that model or a value
    is missing."""
    loaded = session.loaded
    chosen = [n for n in loaded.nodes if n.name in set(names)]
    wrong = {t: values[t] for n in chosen for t in n.outputs if t in values}
    if any(t not in values for t in window_exits(loaded, chosen)):
        return None
    rest = [n for n in loaded.nodes if n.name not in set(names)]
    outs = _outputs_of(rest, loaded.outputs)
    metas, constants = reference_operands(loaded, store, rest)
    constants = {t: v for t, v in constants.items() if t not in wrong}  # fed, not embedded
    model, fed, _ = window_model(loaded, rest, metas, constants, outs)
    used = {i.name for i in model.graph.input}
    feeds: Values = {k: v for k, v in session.feeds.items() if k in used}
    for name, tensor in fed.items():
        value = wrong.get(tensor)
        feeds[name] = loaded.as_fed(tensor, store.get(tensor) if value is None else value)
    try:
        got = timed_run(session.ref, model, feeds, "ref", session.stats)
    except BackendError as exc:
        log.debug("injection of %s failed: %s", list(names), exc)
        return None
    crit = session.crit
    compared = {o: compare_tensors(o, store.get(o), got.get(o), crit) for o in outs}
    # A suspect's own output that is a graph output is compared as the target gave it.
    for o in loaded.outputs:
        if o in wrong:
            compared[o] = compare_tensors(o, store.get(o), wrong[o], crit)
    return Effect(tuple(names), compared)


def target_alone(session: Session, store: TensorStore, nodes: Sequence[NodeInfo]) -> Values:
    """Each of ``nodes``' outputs on the target, every node fed the reference's operands (one
    run of them all), in the reference's dtypes; a tensor the target fails to give, or gives
    in another shape, is left out."""
    loaded = session.loaded
    try:
        model, feeds = reference_fed(
            loaded, store, session.feeds, nodes,
            lambda metas, constants: isolation_model(loaded, nodes, metas, constants),
        )  # fmt: skip
        got = timed_run(session.target, model, feeds, "target", session.stats)
    except BackendError as exc:
        log.debug("the suspects alone failed: %s", exc)
        return {}
    out: Values = {}
    for tensor in (t for n in nodes for t in n.outputs if t in store):
        value, ref = got.get(tensor), store.get(tensor)
        if value is not None and np.shape(value) == np.shape(ref):
            meta = loaded.fed_meta(tensor, store.meta(tensor))
            out[tensor] = np.asarray(value).astype(meta.dtype)
    return out


def _outputs_of(nodes: Sequence[NodeInfo], outputs: Sequence[str]) -> list[str]:
    produced = {o for n in nodes for o in n.outputs}
    return [o for o in outputs if o in produced]
