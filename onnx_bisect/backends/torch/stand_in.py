"""Stand-ins: a node the torch backend cannot compute, computed another way, alone.

The float64 oracle must give every node a value: one operator torch lacks (or whose
translation here fails) used to cost the whole oracle, and ``--threshold auto`` then fell back
to a fixed 1e-3 for every tensor of the model. With ``fallback=1`` such a node is computed by

1. ``onnx.reference``, the node alone in a one-node model, fed the operands as torch holds
   them (float64 under the oracle's policy): a float64 value, written from the spec;
2. else ONNX Runtime, the node alone, its float operands cast to float32 (it has few float64
   kernels, and contrib ops such as com.microsoft's only there): a value, but not a float64
   one (``StandIn.exact`` False), which the oracle says and leaves out of the noise floors.

The rest of the graph stays on torch. Which nodes ran so, how and why, is kept per node
(``Program.stand_ins``) for the report.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import onnx
import torch
from onnx import helper

from onnx_bisect.backends.torch.context import OpContext, to_numpy
from onnx_bisect.backends.torch.ops.registry import OpFn
from onnx_bisect.errors import BackendError

__all__ = ["StandIn", "stand_in"]


@dataclass(frozen=True)
class StandIn:
    """How one node was computed without torch's translation, and why."""

    node: str
    op_type: str
    outputs: tuple[str, ...]
    why: str  # what torch's side said
    how: str  # "onnx.reference" or "ONNX Runtime in float32"
    exact: bool  # computed at the operands' precision (onnx.reference), not in float32

    def describe(self) -> str:
        return f"{self.op_type} {self.node!r} computed alone by {self.how} ({self.why})"


def stand_in(
    node: onnx.NodeProto, opsets: Mapping[str, int], why: str, used: dict[str, StandIn]
) -> OpFn:
    """An ``OpFn`` computing ``node`` alone without torch's translation of it; each call records
    in ``used`` (by node name) how it was computed."""
    tried: dict[str, Any] = {}

    def op(ctx: OpContext, x: list[torch.Tensor | None], attrs: dict[str, Any]) -> Any:
        arrays = [None if t is None else to_numpy(t) for t in x]
        outputs = tuple(o for o in node.output if o)
        try:
            values = _reference(node, opsets, arrays, tried)
            how, exact = "onnx.reference", True
        except Exception as ref_exc:  # noqa: BLE001 - any failure hands over to the next way
            try:
                values = _onnxruntime(node, opsets, arrays, tried)
            except Exception as ort_exc:  # noqa: BLE001
                raise BackendError(
                    f"node {node.name!r} ({node.op_type}): {why}; onnx.reference alone: "
                    f"{_short(ref_exc)}; ONNX Runtime alone: {_short(ort_exc)}",
                    node=node.name,
                ) from ort_exc
            how, exact = "ONNX Runtime in float32", False
        used[node.name] = StandIn(node.name, node.op_type, outputs, why, how, exact)
        # Under the oracle's policy a float32 result (ONNX Runtime's) becomes float64 again;
        # the one-node model declares the named outputs only: back to the node's positions.
        made = iter(values)
        return [None if not name else _as_tensor(ctx, next(made, None)) for name in node.output]

    return op


def _as_tensor(ctx: OpContext, value: Any) -> torch.Tensor | None:
    return None if value is None else ctx.tensor(np.asarray(value))


def _short(exc: BaseException) -> str:
    return " ".join(str(exc).split())[:200] or type(exc).__name__


def _one_node(
    node: onnx.NodeProto,
    opsets: Mapping[str, int],
    arrays: Sequence[npt.NDArray[Any] | None],
) -> onnx.ModelProto:
    """``node`` alone, its inputs typed as ``arrays`` are (unknown shapes)."""
    inputs, seen = [], set()
    for name, array in zip(node.input, arrays, strict=False):
        if name and array is not None and name not in seen:
            seen.add(name)
            elem = helper.np_dtype_to_tensor_dtype(array.dtype)
            inputs.append(helper.make_tensor_value_info(name, elem, None))
    outputs = [helper.make_empty_tensor_value_info(o) for o in node.output if o]
    graph = helper.make_graph([node], "stand_in", inputs, outputs)
    imports = [helper.make_opsetid(d, v) for d, v in opsets.items()]
    model = helper.make_model(graph, opset_imports=imports)
    model.ir_version = min(model.ir_version, 10)  # ONNX Runtime reads IR 10 and older
    return model


def _feeds(
    node: onnx.NodeProto, arrays: Sequence[npt.NDArray[Any] | None]
) -> dict[str, npt.NDArray[Any]]:
    return {n: a for n, a in zip(node.input, arrays, strict=False) if n and a is not None}


def _reference(
    node: onnx.NodeProto,
    opsets: Mapping[str, int],
    arrays: Sequence[npt.NDArray[Any] | None],
    tried: dict[str, Any],
) -> list[npt.NDArray[Any] | None]:
    from onnx.reference import ReferenceEvaluator

    from onnx_bisect.backends.reference_ops import NEW_OPS

    key = ",".join(str(a.dtype) if a is not None else "-" for a in arrays)
    evaluator = tried.get(key)
    if evaluator is None:
        evaluator = tried[key] = ReferenceEvaluator(
            _one_node(node, opsets, arrays), new_ops=NEW_OPS
        )
    with np.errstate(all="ignore"):
        out = evaluator.run(None, _feeds(node, arrays))
    return [np.asarray(v) if v is not None else None for v in out]


def _onnxruntime(
    node: onnx.NodeProto,
    opsets: Mapping[str, int],
    arrays: Sequence[npt.NDArray[Any] | None],
    tried: dict[str, Any],
) -> list[npt.NDArray[Any] | None]:
    import onnxruntime as ort

    narrowed = [
        a.astype(np.float32) if a is not None and a.dtype == np.float64 else a for a in arrays
    ]
    key = "ort:" + ",".join(str(a.dtype) if a is not None else "-" for a in narrowed)
    session = tried.get(key)
    if session is None:  # one session per node and operand types, not per run
        options = ort.SessionOptions()
        options.log_severity_level = 3
        model = _one_node(node, opsets, narrowed)
        session = tried[key] = ort.InferenceSession(
            model.SerializeToString(), options, providers=["CPUExecutionProvider"]
        )
    out = session.run(None, _feeds(node, narrowed))
    return [np.asarray(v) for v in out]
