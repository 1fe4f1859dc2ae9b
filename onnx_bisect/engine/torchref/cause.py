"""Why the first divergent module diverges: its ONNX nodes (the scope's nodes that its output
depends on) fed the module's own captured inputs and computed in float64. Different from the
module's output: the translation is wrong (``export``); the same, and the target's run of
those nodes differs from float64: the target's kernel is off (``runtime``; ``reference``
where PyTorch is the target and the ONNX model runs on the reference)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt
import onnx
from onnx import numpy_helper

from onnx_bisect.backends.protocol import Backend
from onnx_bisect.backends.registry import create_backend
from onnx_bisect.compare.criterion import Comparison, Criterion
from onnx_bisect.compare.tensors import compare_tensors
from onnx_bisect.engine.oracle.job import ORACLE
from onnx_bisect.graph.extract import window_model
from onnx_bisect.graph.view import LoadedModel, NodeInfo, TensorMeta
from onnx_bisect.result import CauseKind, RootCause

__all__ = [
    "Cause",
    "Side",
    "Window",
    "baked_constant",
    "module_cause",
    "module_window",
    "training_ops",
]

# Scalar constants of a window tried as values baked in at export time (each costs up to four
# float64 runs of the window).
BAKED_TRIES = 2

Array = npt.NDArray[Any]
# The target's values of tensors, by name: a run of the whole model marking them.
Fetch = Callable[[Sequence[str]], Mapping[str, Array]]


@dataclass(frozen=True)
class Window:
    """A module's ONNX nodes cut out, with what feeds them."""

    model: onnx.ModelProto
    nodes: tuple[str, ...]
    feeds: dict[str, Array]
    from_torch: int  # how many of the feeds are the module's captured inputs
    training: tuple[str, ...] = ()  # its nodes that compute as in training (``training_ops``)


@dataclass(frozen=True)
class Cause:
    """The root cause, with the comparisons it rests on: torch against float64 (``theirs``),
    float64 against the target (``mine``, where it came to that), and what it cost."""

    root: RootCause
    theirs: Comparison
    mine: Comparison | None
    target_runs: int  # of the cut nodes (the whole model's, for their feeds, not counted)
    from_torch: int  # feeds of the window that were the module's captured inputs
    window: Window | None = None  # the nodes cut out and their feeds (a repro bundle's)
    tensor: str = ""  # the window's output, and torch's value of it (the bundle expects it)
    expected: Array | None = None


@dataclass(frozen=True)
class Side:
    """Where PyTorch stands: the reference (the ONNX model on the target is under test) or
    the target (the module is under test against the ONNX model on the reference); for a
    float64 module, its output (``torch64``) and its float32 twin's (``twin32``)."""

    torch_is_ref: bool = True
    torch64: Array | None = None
    twin32: Array | None = None
    # Initializers standing for a module's parameter or buffer whose value differs from the
    # module's at run time: which one, and by how much (``faults.changed_weights``).
    captured: Mapping[str, str] = field(default_factory=dict)

    @property
    def onnx_role(self) -> str:
        return "target" if self.torch_is_ref else "reference"


def module_window(
    loaded: LoadedModel,
    scope: Sequence[NodeInfo],
    tensor: str,
    torch_inputs: Sequence[Array],
    graph_feeds: Mapping[str, Array],
    fetch: Fetch,
) -> Window:
    """The scope's nodes that ``tensor`` depends on, as a window with ``tensor`` its output.
    Each activation it reads from outside is the module's own input with its shape (in
    order), else the target's value (a shape, a constant computed outside the scope)."""
    nodes = _slice(scope, tensor)
    inits = {t.name for t in loaded.model.graph.initializer}
    inside = {o for n in nodes for o in n.outputs}
    read = [t for n in nodes for t in (*n.inputs, *n.implicit_inputs)]
    outside = list(dict.fromkeys(t for t in read if t and t not in inside and t not in inits))
    fetched = [t for t in outside if t not in graph_feeds]
    values = {**{t: graph_feeds[t] for t in outside if t in graph_feeds}, **fetch(fetched)}
    unused = [np.asarray(v) for v in torch_inputs]
    taken = 0
    for t in outside:
        match = next((i for i, v in enumerate(unused) if v.shape == values[t].shape), None)
        if match is not None:
            values[t], taken = _as(unused.pop(match), loaded, t), taken + 1
    meta = {t: TensorMeta(values[t].dtype, tuple(values[t].shape)) for t in outside}
    model, feed_map, _ = window_model(loaded, nodes, meta, outputs=[tensor])
    feeds = {new: values[old] for new, old in feed_map.items()}
    feeds.update({t: values[t] for t in outside if t in graph_feeds})
    names = [n.name for n in nodes]
    return Window(model, tuple(names), feeds, taken, tuple(training_ops(loaded, names)))


def _as(value: Array, loaded: LoadedModel, tensor: str) -> Array:
    """``value`` in the ONNX tensor's own dtype (torch gives float32 where ONNX says so)."""
    dtype = loaded.dtypes.get(tensor)
    return np.asarray(value).astype(dtype, copy=False) if dtype is not None else value


def _slice(scope: Sequence[NodeInfo], tensor: str) -> list[NodeInfo]:
    """The nodes of ``scope`` that ``tensor`` depends on, walking back inside the scope."""
    by_output = {o: n for n in scope for o in n.outputs}
    wanted, stack = set(), [tensor]
    while stack:
        node = by_output.get(stack.pop())
        if node is None or node.name in wanted:
            continue
        wanted.add(node.name)
        stack.extend((*node.inputs, *node.implicit_inputs))
    return [n for n in scope if n.name in wanted]


def training_ops(loaded: LoadedModel, names: Sequence[str] | None = None) -> list[str]:
    """Nodes (of ``names``, else all) that compute as in training: a BatchNormalization with
    ``training_mode=1`` (batch statistics), a Dropout whose ``training_mode`` is a constant
    true: the model was exported in training mode."""
    protos, wanted = loaded.node_protos, set(names) if names is not None else None
    found = []
    for n in loaded.nodes:
        if wanted is not None and n.name not in wanted:
            continue
        attrs = {a.name: a for a in protos[n.name].attribute}
        if n.op_type == "BatchNormalization" and "training_mode" in attrs:
            if attrs["training_mode"].i:
                found.append(f"{n.op_type} {n.name} has training_mode=1")
        elif n.op_type == "Dropout" and len(n.inputs) > 2 and _constant_true(loaded, n.inputs[2]):
            found.append(f"{n.op_type} {n.name} has training_mode=true")
    return found


def _constant_true(loaded: LoadedModel, tensor: str) -> bool:
    inits = {t.name: t for t in loaded.model.graph.initializer}
    value = None
    if tensor in inits:
        value = numpy_helper.to_array(inits[tensor])
    elif (node := loaded.producer.get(tensor)) is not None and node.op_type == "Constant":
        attrs = {a.name: a for a in loaded.node_protos[node.name].attribute}
        if "value" in attrs:
            value = numpy_helper.to_array(attrs["value"].t)
    return value is not None and bool(np.all(value))


def module_cause(
    window: Window,
    tensor: str,
    torch_output: Array,
    backend: Backend,
    crit: Criterion,
    label: str,
    side: Side = Side(),
) -> Cause:
    """The root cause of ``label``'s divergence (a module's description). ``backend`` runs
    the ONNX model: the target, or (``side.torch_is_ref`` false) the reference."""
    f64 = create_backend(ORACLE).run(window.model, window.feeds)[tensor]
    exact = np.asarray(f64, dtype=np.float64)
    theirs = compare_tensors(tensor, np.asarray(torch_output, np.float64), exact, crit)
    nodes, fed = window.nodes, window.from_torch
    if theirs.diverged:
        reason = (
            f"{label}: its ONNX nodes, fed the module's own inputs, compute something else "
            f"than torch in float64 (rel_l2={theirs.shown('rel_l2')}): the export's "
            "translation of it is wrong"
        )
        read = {t for n in window.model.graph.node for t in n.input}
        stale = [f"{t} ({side.captured[t]})" for t in side.captured if t in read]
        if stale:
            reason = (
                f"{label}: its ONNX nodes read {', '.join(stale)}, captured at export time, "
                "where the module holds other values at run time: the module changed after "
                "its export; export it again"
            )
        baked = baked_constant(window, tensor, torch_output, crit) if not stale else ""
        if baked:
            reason = f"{label}: {baked}"
        if window.training:
            reason += (
                f"; it was exported in training mode ({'; '.join(window.training)}): "
                "export the model after model.eval()"
            )
        root = RootCause(CauseKind.EXPORT, nodes, reason)
        return Cause(root, theirs, None, 0, fed, window, tensor, torch_output)
    ran = backend.run(window.model, window.feeds)[tensor]
    mine = compare_tensors(tensor, exact, np.asarray(ran, np.float64), crit)
    if mine.diverged:
        root = _kernel_off(window, tensor, label, mine, crit, side)
        return Cause(root, theirs, mine, 1, fed, window, tensor, torch_output)
    reason = (
        f"{label}: fed the module's own inputs, its ONNX nodes agree with torch in float64 "
        f"and on the {side.onnx_role}; the error comes from its inputs' accumulated error"
    )
    root = RootCause(CauseKind.NONE, nodes, reason)
    return Cause(root, theirs, mine, 1, fed, window, tensor, torch_output)


def _kernel_off(
    window: Window, tensor: str, label: str, mine: Comparison, crit: Criterion, side: Side
) -> RootCause:
    """The ONNX nodes agree with torch in float64 and the backend's run of them does not:
    its kernel is off (``runtime`` on the target, ``reference`` on the reference), unless
    the module computes in float64 and the ONNX model in float32 and the module's own float32
    twin is off as much: then float32 is what differs (an export in another precision)."""
    error = mine.shown("rel_l2")
    dtype = window.model.graph.output[0].type.tensor_type.elem_type
    if side.twin32 is not None and dtype == onnx.TensorProto.FLOAT:
        own = compare_tensors(tensor, np.asarray(side.torch64, np.float64), side.twin32, crit)
        if own.diverged:
            reason = (
                f"{label}: the module computes in float64, the ONNX model in float32, and in "
                f"float32 the module itself is off by rel_l2={own.shown('rel_l2')} (the "
                f"{side.onnx_role} by rel_l2={error}): export it after model.float(), or "
                "compare a float32 module"
            )
            return RootCause(CauseKind.EXPORT, window.nodes, reason)
    kind = CauseKind.RUNTIME if side.torch_is_ref else CauseKind.REFERENCE
    reason = (
        f"{label}: its ONNX nodes agree with torch in float64, and the {side.onnx_role}'s run "
        f"of them, fed the same inputs, does not (rel_l2={error}): the {side.onnx_role}'s "
        "kernel is off"
    )
    return RootCause(kind, window.nodes, reason)


def baked_constant(window: Window, tensor: str, torch_output: Array, crit: Criterion) -> str:
    """A scalar float constant of the window (a Constant node, an initializer, or a feed
    computed outside it) that, given another value, makes the window compute the module's
    output: a Python value captured at export time (``float(x.max())``, a size) that the
    module computes anew at run time. The value is fitted as a factor (the constant scales the
    output, or divides it) or as an offset, and each fit checked by one float64 run; "" where
    none does."""
    oracle = create_backend(ORACLE)
    want = np.asarray(torch_output, np.float64)
    now = np.asarray(oracle.run(window.model, window.feeds)[tensor], np.float64)
    if now.shape != want.shape or not np.any(now):
        return ""
    scale = float(np.vdot(want, now) / np.vdot(now, now))
    shift = float(np.mean(want - now))
    for name, value, put in _scalars(window)[:BAKED_TRIES]:
        c = float(value.reshape(()))
        tries = [c * scale, c / scale if scale else c, c + shift, c - shift]
        for v in tries:
            if not np.isfinite(v) or np.isclose(v, c):
                continue
            model, feeds = put(np.asarray(v, value.dtype).reshape(value.shape))
            got = np.asarray(oracle.run(model, feeds)[tensor], np.float64)
            if not compare_tensors(tensor, want, got, crit).diverged:
                return (
                    f"the constant {name} = {c:.6g} was captured at export time: with "
                    f"{v:.6g} in its place, its nodes compute what the module computes at run "
                    "time (a Python value, input- or shape-dependent, baked into the export)"
                )
    return ""


Put = Callable[[Array], tuple[onnx.ModelProto, dict[str, Array]]]


def _scalars(window: Window) -> list[tuple[str, Array, Put]]:
    """The window's scalar float constants, each with a way to put another value in."""
    found: list[tuple[str, Array, Put]] = []
    model = window.model
    for i, node in enumerate(model.graph.node):
        attrs = {a.name: a for a in node.attribute}
        if node.op_type == "Constant" and "value" in attrs:
            value = numpy_helper.to_array(attrs["value"].t)
            if value.size == 1 and value.dtype.kind == "f":
                found.append((node.name or node.output[0], value, _put_node(window, i)))
    for j, init in enumerate(model.graph.initializer):
        value = numpy_helper.to_array(init)
        if value.size == 1 and value.dtype.kind == "f":
            found.append((init.name, value, _put_init(window, j)))
    for name, value in window.feeds.items():
        value = np.asarray(value)
        if value.size == 1 and value.dtype.kind == "f":
            found.append((name, value, _put_feed(window, name)))
    return found


def _put_node(window: Window, i: int) -> Put:
    def write(model: onnx.ModelProto, v: Array) -> None:
        for a in model.graph.node[i].attribute:
            if a.name == "value":
                a.t.CopyFrom(numpy_helper.from_array(v, a.t.name))

    return _put_in_copy(window, write)


def _put_init(window: Window, j: int) -> Put:
    def write(model: onnx.ModelProto, v: Array) -> None:
        init = model.graph.initializer[j]
        init.CopyFrom(numpy_helper.from_array(v, init.name))

    return _put_in_copy(window, write)


def _put_in_copy(window: Window, write: Callable[[onnx.ModelProto, Array], None]) -> Put:
    """A ``Put`` that writes the value into a copy of the window's model."""

    def put(v: Array) -> tuple[onnx.ModelProto, dict[str, Array]]:
        model = onnx.ModelProto()
        model.CopyFrom(window.model)
        write(model, v)
        return model, dict(window.feeds)

    return put


def _put_feed(window: Window, name: str) -> Put:
    def put(v: Array) -> tuple[onnx.ModelProto, dict[str, Array]]:
        return window.model, {**window.feeds, name: v}

    return put
