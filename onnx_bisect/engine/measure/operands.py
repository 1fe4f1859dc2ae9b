"""The reference's tensors as operands of a cut subgraph: what is fed, what is embedded."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
import onnx

from onnx_bisect.engine.measure.store import TensorStore
from onnx_bisect.graph.view import LoadedModel, NodeInfo, TensorMeta

__all__ = ["is_constant", "reference_fed", "reference_operands"]


# Integer tensors this small are shapes, axes and indices: values the graph treats as constants.
_SMALL_INT = 64


def reference_fed(
    loaded: LoadedModel,
    store: TensorStore,
    feeds: Mapping[str, npt.NDArray[Any]],
    nodes: Sequence[NodeInfo],
    cut: Callable[
        [Mapping[str, TensorMeta], Mapping[str, npt.NDArray[Any]]],
        tuple[onnx.ModelProto, dict[str, str]],
    ],
) -> tuple[onnx.ModelProto, dict[str, npt.NDArray[Any]]]:
    """``nodes`` cut out of ``loaded`` by ``cut`` (an isolation or window model), with the
    feeds that give it the reference's operands: the model inputs it reads, and for every tensor
    cut off the reference's value in the model's own dtype. ``cut`` gets the fed tensors' types
    and the small constants to embed; it returns the model and its feed map."""
    metas, constants = reference_operands(loaded, store, nodes)
    model, fed = cut(metas, constants)
    used = {i.name for i in model.graph.input}
    out = {k: v for k, v in feeds.items() if k in used}
    out.update({name: loaded.as_fed(t, store.get(t)) for name, t in fed.items()})
    return model, out


def reference_operands(
    loaded: LoadedModel, store: TensorStore, nodes: Sequence[NodeInfo]
) -> tuple[dict[str, TensorMeta], dict[str, npt.NDArray[Any]]]:
    """Types of the reference tensors ``nodes`` read and write, and the values to embed as
    constants, both in the model's own dtypes (a float64 reference must still feed a float32
    kernel). Only these nodes' tensors: typing the whole store per batch made isolation
    quadratic in the node count."""
    touched = dict.fromkeys(t for n in nodes for t in (*n.inputs, *n.implicit_inputs, *n.outputs))
    metas = {t: loaded.fed_meta(t, store.meta(t)) for t in touched if t in store}
    needed = [t for n in nodes for t in n.inputs]
    constants = {t: loaded.as_fed(t, store.get(t)) for t in needed if is_constant(t, loaded, store)}
    return metas, constants


def is_constant(tensor: str, loaded: LoadedModel, store: TensorStore) -> bool:
    if tensor not in store:
        return False
    producer = loaded.producer.get(tensor)
    if producer is not None and producer.op_type == "Constant":
        return True
    meta = store.meta(tensor)
    small = int(np.prod(meta.shape, dtype=np.int64)) <= _SMALL_INT
    # A small float tensor computed from initializers alone (a Resize's scales and roi, cast
    # to float32 by a converter) is the model's constant too: fed as an input, tract cannot
    # size the Resize ("Neither sizes nor scales makes sense") and every isolation of it failed.
    return small and (not np.issubdtype(meta.dtype, np.floating) or tensor in loaded.constants)
