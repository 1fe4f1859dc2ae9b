"""Whether a transform broke the model: the types and shapes onnx infers, strictly, before and
after it. A converter that mistypes a tensor (onnxconverter-common labels float16 the output of
a node that reads a float32 graph output) writes a model no runtime loads; without this check
that surfaced as "the target fails on Gemm", a finding about the target rather than the tool.

Weights do not matter to the check, so it runs on a skeleton: the message with every large
initializer's data left out, which stays far below protobuf's 2 GB whatever the model's size.
"""

from __future__ import annotations

import onnx

__all__ = ["broken_by", "skeleton"]

# Initializers up to this size keep their data: shape inference reads small constant
# operands (a Reshape's shape, a Slice's starts), never a weight matrix.
_KEEP_DATA = 1 << 16


def skeleton(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of ``model`` without the data of its initializers over 64 KiB (dims and types
    kept). Subgraphs and attribute tensors are kept whole: they are small in the models that
    reach 2 GB (their weights are initializers)."""
    out = onnx.ModelProto()
    graph = model.graph
    kept = onnx.GraphProto()
    for field in ("node", "input", "output", "value_info", "sparse_initializer"):
        getattr(kept, field).extend(getattr(graph, field))
    kept.name, kept.doc_string = graph.name, graph.doc_string
    for t in graph.initializer:
        if len(t.raw_data) <= _KEEP_DATA and t.ByteSize() <= _KEEP_DATA:
            kept.initializer.append(t)
        else:
            kept.initializer.add(name=t.name, data_type=t.data_type, dims=t.dims)
    for field in ("ir_version", "producer_name", "producer_version", "domain", "model_version"):
        setattr(out, field, getattr(model, field))
    out.opset_import.extend(model.opset_import)
    out.functions.extend(model.functions)
    out.graph.CopyFrom(kept)
    return out


def _strict_error(model: onnx.ModelProto) -> str:
    try:
        onnx.shape_inference.infer_shapes(model, check_type=True, strict_mode=True)
    except Exception as exc:  # onnx raises InferenceError, and ValueError for some inputs
        return " ".join(str(exc).split())
    return ""


def broken_by(before: onnx.ModelProto, after: onnx.ModelProto) -> str:
    """Why ``after`` is invalid where ``before`` was valid (onnx's strict type and shape
    inference), or "". A model onnx already rejects before the transform says nothing."""
    problem = _strict_error(skeleton(after))
    if not problem or _strict_error(skeleton(before)):
        return ""
    return problem
