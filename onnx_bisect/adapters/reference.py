"""``ref``: the ONNX reference evaluator, slow but written from the spec."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy.typing as npt
import onnx

from onnx_bisect.adapters.base import BackendBase, BackendSpec, Tensors

__all__ = ["ReferenceBackend"]


class ReferenceBackend(BackendBase):
    def __init__(self, spec: BackendSpec) -> None:
        super().__init__(spec)
        spec.check_options([])

    def _run(self, model: onnx.ModelProto, feeds: Mapping[str, npt.NDArray[Any]]) -> Tensors:
        from onnx.reference import ReferenceEvaluator

        evaluator = ReferenceEvaluator(model)
        names = [o.name for o in model.graph.output]
        wanted = set(evaluator.input_names)
        values = evaluator.run(names, {k: v for k, v in feeds.items() if k in wanted})
        return dict(zip(names, values, strict=True))

    def describe(self) -> str:
        return f"onnx.reference.ReferenceEvaluator (onnx {onnx.__version__})"

    def versions(self) -> dict[str, str]:
        return {"onnx": onnx.__version__}
