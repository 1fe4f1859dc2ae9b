"""Corrections to ``onnx.reference``: operators it computes wrongly, passed as ``new_ops``.

``new_ops`` replaces an operator by class name at every opset, so each correction reads the
opset of the graph it runs in and hands the versions it does not correct back to upstream.
``CORRECTIONS`` names them for ``ReferenceBackend.describe()``.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import numpy.typing as npt
import onnx
from onnx.reference.op_run import OpRun
from onnx.reference.ops import load_op

__all__ = ["CORRECTIONS", "NEW_OPS", "BatchNormalization", "Erf"]

CORRECTIONS = (
    "BatchNormalization 9-13 inference formula (onnx PR #8442)",
    "Erf at full precision (upstream rounds to float32)",
)


class BatchNormalization(OpRun):
    # Why: upstream runs opsets 9-13 in training mode (momentum always has its default, so
    # batch statistics replace input_mean/input_var) and fails at opsets 6-8 (onnx PR #8442).
    op_domain = ""

    def __init__(
        self, onnx_node: onnx.NodeProto, run_params: dict[str, Any], schema: Any = None
    ) -> None:
        version = run_params["opsets"][""]
        # The schema of the graph's opset, so attribute defaults (is_test) are its own.
        schema = schema or onnx.defs.get_schema("BatchNormalization", version, "")
        super().__init__(onnx_node, run_params, schema)
        self.version = version
        # Opset 14+ is right upstream, training_mode=1 included.
        self.upstream = (
            load_op("", "BatchNormalization", version)(onnx_node, run_params)
            if version >= 14
            else None
        )

    def _run(self, *inputs: npt.NDArray[Any], **attrs: Any) -> tuple[npt.NDArray[Any], ...]:
        if self.upstream is not None:
            return self.upstream._run(*inputs, **attrs)  # type: ignore[no-any-return]
        if (self.version < 7 and not attrs["is_test"]) or any(self.onnx_node.output[1:]):
            raise NotImplementedError(
                f"training-mode BatchNormalization at opset {self.version} (is_test=0 or "
                "running/saved statistics as outputs) is not supported; only inference is"
            )
        return (_inference(*inputs, epsilon=attrs["epsilon"]),)


def _inference(
    x: npt.NDArray[Any],
    scale: npt.NDArray[Any],
    bias: npt.NDArray[Any],
    mean: npt.NDArray[Any],
    var: npt.NDArray[Any],
    *,
    epsilon: float,
) -> npt.NDArray[Any]:
    """``(x - mean) / sqrt(var + epsilon) * scale + B``; the parameters are per channel (C) or,
    with spatial=0 before opset 9, per activation (C x D1 x ... x Dn)."""

    def lift(p: npt.NDArray[Any]) -> npt.NDArray[Any]:
        return p.reshape((1, *p.shape) + (1,) * (x.ndim - 1 - p.ndim))

    y = (x - lift(mean)) / np.sqrt(lift(var) + epsilon) * lift(scale) + lift(bias)
    return np.asarray(y, dtype=x.dtype)


class Erf(OpRun):
    # Why: upstream vectorizes math.erf with otypes=["f"], rounding every value to float32, so
    # ref?dtype=float64 carried float32 error through Erf (GELU).
    op_domain = ""

    def _run(self, x: npt.NDArray[Any]) -> tuple[npt.NDArray[Any]]:
        return (np.vectorize(math.erf, otypes=[np.float64])(x).astype(x.dtype),)


NEW_OPS: list[type[OpRun]] = [BatchNormalization, Erf]
