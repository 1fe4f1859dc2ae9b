"""A test plugin: the ``+wrongopt=PASS,PASS`` transform, a pass list that mixes onnxoptimizer's
real passes with deliberately wrong ones, applied in list order. Registered through the
``onnx_bisect.transforms`` entry-point group by ``tests/test_pass_transforms.py``.

- ``scale_conv_weight`` scales the first Conv's weights by 1.01: wrong on its own.
- ``tag_conv`` marks the model and ``scale_tagged_conv`` scales the weights only when marked:
  each harmless alone, wrong together.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import onnx
from onnx import numpy_helper

from onnx_bisect.transforms.registry import TransformKind, split_passes

WRONG = ("scale_conv_weight", "tag_conv", "scale_tagged_conv")
_TAG = "wrongopt.tagged"


def _scale_first_conv(model: onnx.ModelProto) -> None:
    # Its output times 1.01, which is its weights times 1.01: a Mul after it, since
    # fuse_bn_into_conv computes the fused weights with nodes rather than an initializer.
    graph = model.graph
    index, conv = next((i, n) for i, n in enumerate(graph.node) if n.op_type == "Conv")
    out, raw, scale = conv.output[0], f"{conv.output[0]}.unscaled", f"{conv.name}.scale"
    conv.output[0] = raw
    graph.initializer.append(numpy_helper.from_array(np.array(1.01, np.float32), scale))
    mul = onnx.helper.make_node("Mul", [raw, scale], [out], name=f"{conv.name}/scale")
    graph.node.insert(index + 1, mul)


def _apply(model: onnx.ModelProto, arg: str | None, shapes: dict[str, Sequence[int]]) -> Any:
    import onnxoptimizer

    model = onnx.ModelProto.FromString(model.SerializeToString())
    for p in split_passes(arg):
        if p == "scale_conv_weight":
            _scale_first_conv(model)
        elif p == "tag_conv":
            model.metadata_props.add(key=_TAG, value="1")
        elif p == "scale_tagged_conv":
            if any(m.key == _TAG for m in model.metadata_props):
                _scale_first_conv(model)
        else:
            tagged = [(m.key, m.value) for m in model.metadata_props]
            model = onnxoptimizer.optimize(model, [p])
            del model.metadata_props[:]  # onnxoptimizer may not keep them
            for k, v in tagged:
                model.metadata_props.add(key=k, value=v)
    return model, (f"passes: {arg}",)


WRONGOPT = TransformKind(
    "onnxoptimizer", _apply, "PASS,PASS", True, "onnxoptimizer passes and wrong ones",
    passes=lambda arg: tuple(split_passes(arg)),
)  # fmt: skip
