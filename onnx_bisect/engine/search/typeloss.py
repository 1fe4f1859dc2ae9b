"""Where the target's static typing of the graph before a failing node loses a tensor's rank
or type: the node to name when the failing node runs alone, fed the reference's values.

OpenVINO refuses a Conv of silero-vad ("The input data tensor's rank has to be known
(static)") though the Conv runs alone: its input comes from an If whose branch outputs carry
no shape, and OpenVINO's frontend types that If's output with no rank ("[...]"), where the
reference computes a tensor of rank 2. Every prefix before the Conv runs, with the right
values, so no run shows it (``typecheck`` checks what runs hand back); the target's own view
of the prefix does (``backends/static_view.py``). From the failing node the search walks
back along the tensors the target types otherwise than the reference's values are, to the
first node whose output is typed wrong while its inputs are typed right: that node is where
the rank (or the element type) is lost.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import numpy.typing as npt
import onnx
from onnx import helper

from onnx_bisect.backends.static_view import StaticType, static_types
from onnx_bisect.engine.measure.operands import reference_fed
from onnx_bisect.engine.measure.runs import timed_run
from onnx_bisect.engine.measure.store import TensorStore
from onnx_bisect.engine.session import Session
from onnx_bisect.errors import BackendCrash, BackendError
from onnx_bisect.graph.extract import isolation_model, prefix_model, retyped_input
from onnx_bisect.graph.view import LoadedModel, NodeInfo, TensorMeta

__all__ = ["TypeLoss", "lost_type", "type_loss", "walk_loss"]


@dataclass(frozen=True)
class TypeLoss:
    """``node``'s output ``tensor`` is typed wrong by the target before it runs (``words``
    say how), though every input of ``node`` is typed right; ``path``: the nodes from ``node``
    to the failing node's input, along the tensors typed wrong; ``read``: the tensor typed
    wrong that the failing node reads. ``confirmed``: how the failing node alone, that input
    declared as the target types it, failed too ("" where that check does not apply)."""

    node: NodeInfo
    tensor: str
    words: str
    path: tuple[NodeInfo, ...]
    read: str
    confirmed: str = ""


def type_loss(
    session: Session, loaded: LoadedModel, failing: NodeInfo, store: TensorStore
) -> TypeLoss | None:
    """Where the target loses the rank or type of a tensor ``failing`` reads, from its static
    view of the graph before ``failing`` (one read of that prefix, every tensor ``failing``
    depends on marked); None where the target has no such view, reads no such prefix, or
    types every input of ``failing`` as the reference's values are."""
    cone = loaded.ancestors(failing.index) - {failing.index}
    read = {t for i in (*cone, failing.index) for t in _reads(loaded.nodes[i])}
    tensors = [o for i in sorted(cone) for o in loaded.nodes[i].outputs if o in read]
    if not tensors:
        return None
    model = prefix_model(loaded, failing.index, store.metas, outputs=tensors)
    try:
        view = static_types(session.target, model, session.feeds)
    except BackendError:  # the target cannot read it: it says nothing of the types
        return None
    if not view:
        return None

    def lost(tensor: str) -> str | None:
        seen, meta = view.get(tensor), store.metas.get(tensor)
        if seen is None or meta is None:
            return None
        node = loaded.producer[tensor]
        subject = f"{node.op_type} {node.name!r} output {tensor!r}"
        return lost_type(seen, loaded.dtypes.get(tensor, meta.dtype), meta.shape, subject)

    loss = walk_loss(loaded, failing, lost)
    if loss is None:
        return None
    seen, meta = view[loss.read], store.metas[loss.read]
    dtype = loaded.dtypes.get(loss.read, meta.dtype)
    other = seen.dtype if seen.dtype is not None and _other_dtype(seen.dtype, dtype) else None
    if seen.shape is not None and other is None:
        return loss  # another rank or size: no value of the reference's fits it, not checked
    # The failing node alone, its input declared as the target types it (no rank, or another
    # element type): failing there too shows that is what it fails on; running, it is not.
    typed = _Declared(other or dtype, None if seen.shape is None else meta.shape)
    said = _fails_typed(session, loaded, store, failing, loss.read, typed)
    return replace(loss, confirmed=said) if said else None


def walk_loss(
    loaded: LoadedModel, failing: NodeInfo, lost: Callable[[str], str | None]
) -> TypeLoss | None:
    """From the tensors ``failing`` reads, back along those ``lost`` says are typed wrong, to
    the first node whose inputs are all typed right; None where ``failing`` reads none typed
    wrong. Pure: ``lost`` holds every fact of the target."""
    found = _first_lost(loaded, failing, lost)
    if found is None:
        return None
    path: list[NodeInfo] = []
    tensor, words = found
    while True:
        node = loaded.producer[tensor]
        path.append(node)
        before = _first_lost(loaded, node, lost)
        if before is None:
            return TypeLoss(node, tensor, words, tuple(reversed(path)), found[0])
        tensor, words = before


@dataclass(frozen=True)
class _Declared:
    """How an input is declared: its element type, its shape (None: no rank)."""

    dtype: np.dtype[Any]
    shape: tuple[int, ...] | None


def _fails_typed(
    session: Session,
    loaded: LoadedModel,
    store: TensorStore,
    node: NodeInfo,
    tensor: str,
    typed: _Declared,
) -> str:
    """The target's error on ``node`` alone, fed the reference's inputs with ``tensor``
    declared (and fed) as ``typed`` says; "" where it runs, or where ``tensor`` is embedded
    rather than fed (a small integer operand)."""
    names: dict[str, str] = {}

    def cut(
        metas: Mapping[str, TensorMeta], constants: Mapping[str, npt.NDArray[Any]]
    ) -> tuple[onnx.ModelProto, dict[str, str]]:
        model, fed = isolation_model(loaded, [node], metas, constants)
        names.update(fed)
        return model, fed

    model, inputs = reference_fed(loaded, store, session.feeds, [node], cut)
    name = next((k for k, t in names.items() if t == tensor), None)
    if name is None:
        return ""
    inputs[name] = inputs[name].astype(typed.dtype)
    elem = helper.np_dtype_to_tensor_dtype(typed.dtype)
    model = retyped_input(model, name, elem, typed.shape)
    try:
        timed_run(session.target, model, inputs, "target", session.stats)
    except BackendCrash:
        return ""
    except BackendError as exc:
        return exc.full.removeprefix("target failed: ")
    return ""


def _first_lost(
    loaded: LoadedModel, node: NodeInfo, lost: Callable[[str], str | None]
) -> tuple[str, str] | None:
    """The first tensor a node of the graph produced that ``node`` reads typed wrong."""
    for t in _reads(node):
        if t in loaded.producer and (words := lost(t)) is not None:
            return t, words
    return None


def _reads(node: NodeInfo) -> tuple[str, ...]:
    return tuple(t for t in dict.fromkeys((*node.inputs, *node.implicit_inputs)) if t)


def lost_type(
    seen: StaticType, dtype: np.dtype[Any], shape: tuple[int, ...], subject: str
) -> str | None:
    """How the target's static type ``seen`` of ``subject`` differs from a value of ``dtype``
    and ``shape`` (the model's type, the reference's shape), in words that follow "the
    target"; None where it fits. Unknown sizes fit any; an unknown rank does not. As for
    values (``typecheck``), integer widths are not counted, nor one element typed as a scalar
    or the other way round."""
    want = f"rank {len(shape)} {_shape(shape)}"
    if seen.dtype is not None and _other_dtype(seen.dtype, dtype):
        return f"types {subject} as {seen.dtype} ({seen.said}) where the model says {dtype}"
    if seen.shape is None:
        return (
            f"loses the rank of {subject}: it types it {seen.said} where the reference's value "
            f"has {want}"
        )
    if len(seen.shape) != len(shape):
        if None not in seen.shape and np.prod([d or 0 for d in seen.shape]) == np.prod(shape) == 1:
            return None
        return f"types {subject} as {seen.said} where the reference's value has {want}"
    if any(d is not None and d != s for d, s in zip(seen.shape, shape, strict=True)):
        return f"types {subject} as {seen.said} where the reference's value has {want}"
    return None


def _other_dtype(seen: np.dtype[Any], dtype: np.dtype[Any]) -> bool:
    """Another element type, integer widths apart (a runtime may hold int64 as int32)."""
    return seen != dtype and "f" in (seen.kind, dtype.kind)


def _shape(dims: tuple[int, ...]) -> str:
    return "(" + ", ".join(str(d) for d in dims) + ")"
