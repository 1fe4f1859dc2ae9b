"""``+fp16``: onnxconverter-common's conversion, and the repair of its Cast labels."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import onnx

__all__ = []


_FLOAT, _FLOAT16 = onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16


def fp16(model: onnx.ModelProto, arg: str | None, shapes: dict[str, Sequence[int]]) -> Any:
    from onnxconverter_common import float16

    # keep_io_types: the inputs stay float32, so the same feeds serve both models. The child
    # inferred the shapes on the message without its weights (``infer_shapes`` in the
    # registry): the converter's own inference serializes the whole model, past 2 GB in vain.
    converted = float16.convert_float_to_float16(
        model, keep_io_types=True, disable_shape_infer=True
    )
    repaired = _repair_fp16_casts(converted)
    notes = (
        (f"repaired {repaired} Cast(to=FLOAT) output(s) the converter mislabelled as float16",)
        if repaired
        else ()
    )
    return converted, notes


def _repair_fp16_casts(model: onnx.ModelProto) -> int:
    """onnxconverter-common keeps a model's own ``Cast(to=FLOAT)`` but labels its output float16
    (YOLOv8n's anchor arithmetic: ORT refuses to load the result). The Cast keeps computing
    float32, as in the original; readers the converter moved to float16 get an explicit Cast.
    Returns the number of Casts repaired."""
    graph = model.graph
    infos = {v.name: v for v in graph.value_info}
    outputs = {o.name for o in graph.output}
    readers: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        for name in node.input:
            readers.setdefault(name, []).append(node)
    repaired = 0
    new_nodes: list[onnx.NodeProto] = []
    for node in graph.node:
        new_nodes.append(node)
        if node.op_type != "Cast" or _cast_to(node) != _FLOAT:
            continue
        out = node.output[0]
        info = infos.get(out)
        if info is None or info.type.tensor_type.elem_type != _FLOAT16:
            continue
        info.type.tensor_type.elem_type = _FLOAT
        repaired += 1
        half = f"{out}fp16"
        moved = [r for r in readers.get(out, []) if r.op_type != "Cast"]
        if moved and out not in outputs:
            cast = onnx.helper.make_node(
                "Cast", [out], [half], name=f"{node.name}fp16", to=_FLOAT16
            )
            new_nodes.append(cast)
            shape = info.type.tensor_type.shape if info.type.tensor_type.HasField("shape") else None
            dims = [d.dim_value or d.dim_param or None for d in shape.dim] if shape else None
            graph.value_info.append(onnx.helper.make_tensor_value_info(half, _FLOAT16, dims))
            for r in moved:
                r.input[:] = [half if i == out else i for i in r.input]
    del graph.node[:]
    graph.node.extend(new_nodes)
    return repaired


def _cast_to(node: onnx.NodeProto) -> int | None:
    return next((a.i for a in node.attribute if a.name == "to"), None)
