"""A faithful lower precision, simulated in float32: operands rounded to the precision before
each node, results rounded after it (TF32: MatMul, Gemm and Conv operands only).

That is what a correct float16 or bfloat16 kernel computes (its accumulation in float32, as
cuBLAS, oneDNN and ONNX Runtime's fp16 kernels do) and what TF32 tensor cores compute, so the
error of this run against float64 is the error the precision itself predicts. Integer and
bool tensors pass unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["MATMUL_OPS", "Rounding", "round_tensor"]

# The ops whose operands TF32 rounds (tensor-core contractions).
MATMUL_OPS = frozenset({"MatMul", "Gemm", "Conv", "ConvTranspose", "Einsum"})

_LOW = {"float16": torch.float16, "bfloat16": torch.bfloat16}


def round_tensor(tensor: torch.Tensor, precision: str) -> torch.Tensor:
    """``tensor`` rounded to nearest in ``precision``, kept in its own (float32) dtype."""
    if not tensor.dtype.is_floating_point:
        return tensor
    if precision in _LOW:
        return tensor.to(_LOW[precision]).to(tensor.dtype)
    if precision == "tf32" and tensor.dtype == torch.float32:
        bits = tensor.contiguous().view(torch.int32)
        # Round half to even on the 13 mantissa bits TF32 drops; Inf/NaN pass unchanged.
        bias = 0xFFF + ((bits >> 13) & 1)
        rounded = ((bits + bias) >> 13) << 13
        return torch.where(torch.isfinite(tensor), rounded.view(torch.float32), tensor)
    return tensor


class Rounding:
    """Where a faithful ``precision`` rounds: every floating operand and result for float16
    and bfloat16; the operands of ``MATMUL_OPS`` for TF32."""

    def __init__(self, precision: str) -> None:
        self.precision = precision

    def _applies(self, op_type: str) -> bool:
        return self.precision != "tf32" or op_type in MATMUL_OPS

    def operands(
        self, op_type: str, values: Sequence[torch.Tensor | None]
    ) -> list[torch.Tensor | None]:
        if not self._applies(op_type):
            return list(values)
        return [None if v is None else round_tensor(v, self.precision) for v in values]

    def results(
        self, op_type: str, values: Sequence[torch.Tensor | None]
    ) -> list[torch.Tensor | None]:
        if self.precision == "tf32":
            return list(values)  # TF32 keeps float32 results
        return [None if v is None else round_tensor(v, self.precision) for v in values]
