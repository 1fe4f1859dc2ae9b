"""Quantized tensors in real units, and the error one quantization adds (pure).

A quantized tensor ``q`` stands for the float value ``(q - zero_point) * scale``. Comparing it
with its float counterpart means dequantizing it first; feeding a quantized node the
reference's values means quantizing them with the model's own scale. The error a tensor's
quantization alone adds is its round trip on the float values (what onnxruntime's
``qdq_loss_debug`` measures). Uniform rounding at step ``s`` has an expected error of
``s / sqrt(12)`` per value: that is the floor, so rounding as designed reads as ``rounding``
and a clipped range, or a scale too coarse for the values (one shared with a wider tensor),
stands out.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import numpy as np
import numpy.typing as npt

__all__ = [
    "COARSE_LEVELS",
    "QParams",
    "QuantError",
    "QuantKind",
    "channel_errors",
    "channel_rel_l2",
    "dequantize",
    "mean_channel_rel_l2",
    "quant_error",
    "quantize",
]

# A tensor whose values span fewer steps of its scale than this has lost its range: 4 bits'
# worth of the 8 the format has (YOLOv8n's class scores under the boxes' scale span 0.8).
COARSE_LEVELS = 16.0
# More of the values outside the representable range than this is clipping, not an outlier.
CLIPPED_FRACTION = 0.01
# Rounding explains an error up to this many times its expected value (a tensor's error is
# a sample of the rounding's, and per-channel scales vary).
ROUNDING_SLACK = 2.0


@dataclass(frozen=True)
class QParams:
    """How a quantized tensor maps to real values: ``scale`` and ``zero_point`` per tensor
    (size 1) or per channel along ``axis``; ``dtype`` the integer type's numpy name."""

    scale: npt.NDArray[np.float64]
    zero_point: npt.NDArray[np.float64]
    dtype: str
    axis: int | None = None

    @property
    def qrange(self) -> tuple[int, int]:
        info = np.iinfo(np.dtype(self.dtype))
        return int(info.min), int(info.max)

    def _shaped(self, a: npt.NDArray[np.float64], ndim: int) -> npt.NDArray[np.float64]:
        if a.size == 1 or self.axis is None:
            return a.reshape(()) if a.size == 1 else a
        shape = [1] * ndim
        shape[self.axis % ndim] = a.size
        return a.reshape(shape)

    def describe(self) -> str:
        s = self.scale
        scale = f"{float(s.flat[0]):.4g}" if s.size == 1 else f"{s.min():.3g}–{s.max():.3g}"
        return f"{self.dtype} scale {scale}" + ("" if s.size == 1 else " per channel")


def dequantize(q: npt.NDArray[Any], p: QParams) -> npt.NDArray[np.float64]:
    """The real values a quantized tensor stands for (float64)."""
    x = np.asarray(q, dtype=np.float64)
    return (x - p._shaped(p.zero_point, x.ndim)) * p._shaped(p.scale, x.ndim)


def quantize(x: npt.NDArray[Any], p: QParams) -> npt.NDArray[Any]:
    """``x`` quantized as QuantizeLinear does: round half to even, saturate."""
    v = np.asarray(x, dtype=np.float64)
    lo, hi = p.qrange
    q = np.rint(v / p._shaped(p.scale, v.ndim)) + p._shaped(p.zero_point, v.ndim)
    return np.clip(q, lo, hi).astype(np.dtype(p.dtype))


class QuantKind(StrEnum):
    """``rounding``: within the uniform rounding of its scale, as designed; ``clipped``:
    values beyond the range the scale can hold; ``coarse``: the values span too few steps of
    the scale (it was set for a wider tensor); ``shared``: one scale over inputs of a Concat
    or Add of which some span a few steps of it (a detector's scores beside its boxes);
    ``excess``: more error than rounding explains."""

    ROUNDING = "rounding"
    CLIPPED = "clipped"
    COARSE = "coarse"
    SHARED = "shared scale"
    EXCESS = "excess"


@dataclass(frozen=True)
class QuantError:
    """One tensor's quantization round trip on the float values."""

    rel_l2: float
    sqnr_db: float
    clipped: float  # fraction of values outside the scale's range
    levels: float  # steps of the scale the values span
    floor: float  # expected rel_l2 of uniform rounding at this scale
    clip_share: float = 0.0  # the share of the squared error the clipped values make

    @property
    def kind(self) -> QuantKind:
        over = self.rel_l2 > ROUNDING_SLACK * self.floor
        if self.clipped > CLIPPED_FRACTION or (over and self.clip_share > 0.5):
            return QuantKind.CLIPPED
        if self.levels < COARSE_LEVELS and self.rel_l2 > 0.0:
            return QuantKind.COARSE
        if self.rel_l2 <= ROUNDING_SLACK * self.floor:
            return QuantKind.ROUNDING
        return QuantKind.EXCESS

    @property
    def as_designed(self) -> bool:
        return self.kind is QuantKind.ROUNDING

    def to_dict(self) -> dict[str, Any]:
        return {
            "rel_l2": self.rel_l2,
            "sqnr_db": self.sqnr_db,
            "clipped": self.clipped,
            "levels": self.levels,
            "floor": self.floor,
            "kind": self.kind.value,
        }


def quant_error(x: npt.NDArray[Any], p: QParams) -> QuantError:
    """The error quantizing ``x`` with ``p`` and back adds, and what rounding predicts."""
    v = np.asarray(x, dtype=np.float64)
    diff = (v - dequantize(quantize(v, p), p)).ravel()
    err = math.sqrt(_squares(diff))
    norm = math.sqrt(_squares(v.ravel()))
    lo, hi = p.qrange
    if p.scale.size == 1:  # per tensor: scalars, no tensor-sized broadcasts
        s, z = float(p.scale[0]), float(p.zero_point[0])
        outside = ((v < (lo - z - 0.5) * s) | (v > (hi - z + 0.5) * s)).ravel()
        out = int(np.count_nonzero(outside))
        inside_steps, mean_step = (v.size - out) * s * s, s
    else:
        scale = np.broadcast_to(p._shaped(p.scale, v.ndim), v.shape)
        zp = np.broadcast_to(p._shaped(p.zero_point, v.ndim), v.shape)
        outside = ((v < (lo - zp - 0.5) * scale) | (v > (hi - zp + 0.5) * scale)).ravel()
        out = int(np.count_nonzero(outside))
        inside = scale.ravel()[~outside]
        inside_steps, mean_step = _squares(inside), float(np.mean(scale))
    clip_err = _squares(diff[outside]) if out else 0.0
    spread = float(v.max() - v.min()) if v.size else 0.0
    tiny = np.finfo(np.float64).tiny
    return QuantError(
        rel_l2=err / max(norm, tiny),
        sqnr_db=20.0 * math.log10(max(norm, tiny) / max(err, tiny)),
        clipped=out / v.size if v.size else 0.0,
        levels=spread / mean_step if v.size else 0.0,
        floor=math.sqrt(inside_steps / 12.0) / max(norm, tiny),
        clip_share=clip_err / max(err * err, tiny),
    )


def _squares(a: npt.NDArray[np.float64]) -> float:
    """The sum of squares on the calling thread: ``np.linalg.norm``'s BLAS threads contend
    with the runtimes' on a busy machine (YOLOv8n's table: 0.46 of its 0.84 s)."""
    return float(np.einsum("i,i->", a, a)) if a.size else 0.0


def channel_rel_l2(ref: npt.NDArray[Any], target: npt.NDArray[Any]) -> float:
    """The worst rel_l2 over an output's channels (axis 1): a detector's class scores lost
    under its boxes' scale leave the whole output's rel_l2 small (YOLOv8n: 0.015 with every
    score zeroed), not their channels'."""
    errors = channel_errors(ref, target)
    return float(np.max(errors)) if errors.size else 0.0


def mean_channel_rel_l2(ref: npt.NDArray[Any], target: npt.NDArray[Any]) -> float:
    """The mean over an output's channels of each one's rel_l2, capped at 1 (a channel lost
    altogether): how much of the output quantization took, each channel on its own scale, so
    that a few channels of tiny values rounded coarsely by design do not outweigh the rest."""
    errors = channel_errors(ref, target)
    return float(np.mean(np.minimum(errors, 1.0))) if errors.size else 0.0


def channel_errors(ref: npt.NDArray[Any], target: npt.NDArray[Any]) -> npt.NDArray[np.float64]:
    """Each channel's (axis 1) rel_l2; inf everywhere when the shapes differ. A channel of
    zeros is measured against a millionth of the output's typical channel norm."""
    r = np.asarray(ref, dtype=np.float64)
    t = np.asarray(target, dtype=np.float64)
    if r.shape != t.shape:
        return np.array([math.inf])
    if r.ndim < 2:
        r, t = r.reshape(1, -1), t.reshape(1, -1)
    r2 = np.moveaxis(r, 1, 0).reshape(r.shape[1], -1)
    t2 = np.moveaxis(t, 1, 0).reshape(t.shape[1], -1)
    err = np.linalg.norm(r2 - t2, axis=1)
    norm = np.linalg.norm(r2, axis=1)
    typical = float(np.linalg.norm(r2)) / math.sqrt(r2.shape[0]) if r2.size else 0.0
    denom = np.maximum(norm, max(1e-6 * typical, np.finfo(np.float64).tiny))
    return np.asarray(err / denom, dtype=np.float64)
