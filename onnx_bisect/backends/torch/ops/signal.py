"""Signal processing: DFT (17, 20), STFT, the Hann, Hamming and Blackman windows, and
MelWeightMatrix.

ONNX carries complex numbers as a trailing axis of size 2 (real, imaginary; size 1: real
input). The transforms run through ``torch.fft`` in complex64, or complex128 for float64
tensors (the oracle); 16-bit inputs are transformed in float32 and cast back.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from onnx_bisect.backends.torch.context import OpContext
from onnx_bisect.backends.torch.ops.registry import register
from onnx_bisect.backends.torch.ops.shape import axis_of, ints, need, opt

__all__: list[str] = []

Inputs = list[torch.Tensor | None]


def _work(t: torch.Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _complex(x: torch.Tensor) -> torch.Tensor:
    """ONNX's [..., 1 or 2] layout as a complex tensor without the trailing axis."""
    w = x.to(_work(x))
    if w.shape[-1] == 1:
        return torch.complex(w[..., 0], torch.zeros_like(w[..., 0]))
    return torch.complex(w[..., 0], w[..., 1])


def _pairs(z: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.stack([z.real, z.imag], dim=-1).to(dtype)


def _dft(
    x: torch.Tensor, length: int | None, axis: int, inverse: bool, onesided: bool
) -> torch.Tensor:
    z = _complex(x)
    if inverse and onesided:  # a one-sided spectrum back to the real signal
        n = length or 2 * (z.shape[axis] - 1)
        real: torch.Tensor = torch.fft.irfft(z, n=n, dim=axis)
        return real.unsqueeze(-1).to(x.dtype)
    n = length or z.shape[axis]
    out = torch.fft.ifft(z, n=n, dim=axis) if inverse else torch.fft.fft(z, n=n, dim=axis)
    if onesided:
        out = out.narrow(axis, 0, out.shape[axis] // 2 + 1)
    return _pairs(out, x.dtype)


@register("DFT", since=17, until=17)
def dft_17(ctx: OpContext, x: Inputs, attrs: dict[str, Any]) -> torch.Tensor:
    data, length = need(x, 0), opt(x, 1)
    axis = axis_of(int(attrs.get("axis", 1)), data.dim())
    n = ints(length)[0] if length is not None else None
    inverse, onesided = bool(attrs.get("inverse", 0)), bool(attrs.get("onesided", 0))
    return _dft(data, n, axis, inverse, onesided)


@register("DFT", since=20)
def dft(ctx: OpContext, x: Inputs, attrs: dict[str, Any]) -> torch.Tensor:
    data, length, axis_t = need(x, 0), opt(x, 1), opt(x, 2)
    axis = axis_of(ints(axis_t)[0] if axis_t is not None else -2, data.dim())
    n = ints(length)[0] if length is not None and length.numel() else None
    inverse, onesided = bool(attrs.get("inverse", 0)), bool(attrs.get("onesided", 0))
    return _dft(data, n, axis, inverse, onesided)


@register("STFT", since=17)
def stft(ctx: OpContext, x: Inputs, attrs: dict[str, Any]) -> torch.Tensor:
    signal, step = need(x, 0), ints(need(x, 1))[0]
    window, length_t = opt(x, 2), opt(x, 3)
    if signal.dim() == 2:
        # [batch, samples]: a real signal without its trailing axis, which ONNX Runtime
        # accepts and exporters write.
        signal = signal.unsqueeze(-1)
    if length_t is not None:
        length = ints(length_t)[0]
    elif window is not None:
        length = window.shape[0]
    else:
        length = signal.shape[1]  # the spec's default: one frame of the whole signal
    # A frame is the window's length; the spec's reference zero-pads it to ``frame_length``
    # for the DFT, and counts frames by ``frame_length``.
    width = window.shape[0] if window is not None else length
    count = 1 + (signal.shape[1] - length) // step
    z = _complex(signal)  # (batch, samples)
    starts = torch.arange(count, device=z.device) * step
    taken = starts[:, None] + torch.arange(width, device=z.device)[None, :]
    inside = taken < z.shape[1]  # the last frame may run past the signal: zeros there
    frames = z[:, taken.clamp(max=z.shape[1] - 1)] * inside  # (batch, frames, width)
    if window is not None:
        frames = frames * window.to(frames.real.dtype)
    spectrum = torch.fft.fft(frames, n=length, dim=-1)
    if int(attrs.get("onesided", 1)):
        spectrum = spectrum[..., : length // 2 + 1]
    return _pairs(spectrum, signal.dtype)


def _window(terms: tuple[float, ...]) -> Any:
    """A generalized cosine window: sum_k (-1)^k terms[k] cos(2 pi k n / N)."""

    def op(ctx: OpContext, x: Inputs, attrs: dict[str, Any]) -> torch.Tensor:
        size = ints(need(x, 0))[0]
        periods = size if int(attrs.get("periodic", 1)) else size - 1
        n = torch.arange(size, dtype=torch.float64)
        out = torch.zeros(size, dtype=torch.float64)
        for k, a in enumerate(terms):
            out = out + (-1) ** k * a * torch.cos(2 * math.pi * k * n / periods)
        return out.to(ctx.dtype(int(attrs.get("output_datatype", 1)))).to(ctx.device)

    return op


register("HannWindow", since=17)(_window((0.5, 0.5)))
register("HammingWindow", since=17)(_window((25 / 46, 21 / 46)))
register("BlackmanWindow", since=17)(_window((0.42, 0.5, 0.08)))


def _mel_edges(bins: int, dft_length: int, rate: int, low: float, high: float) -> list[int]:
    """The spectrogram bin of each triangle's edge: ``bins + 2`` points evenly spaced in mel
    (the spec's reference spaces them by (high - low) / (bins + 2)), back in hertz, floored
    to a bin."""
    low_mel = 2595 * math.log10(1 + low / 700)
    high_mel = 2595 * math.log10(1 + high / 700)
    step = (high_mel - low_mel) / (bins + 2)
    hertz = [700 * (10 ** ((i * step + low_mel) / 2595) - 1) for i in range(bins + 2)]
    return [int(((dft_length + 1) * h) // rate) for h in hertz]


@register("MelWeightMatrix", since=17)
def mel_weight_matrix(ctx: OpContext, x: Inputs, attrs: dict[str, Any]) -> torch.Tensor:
    bins, dft_length, rate = (ints(need(x, i))[0] for i in range(3))
    low, high = (float(need(x, i).reshape(-1)[0]) for i in (3, 4))
    edges = _mel_edges(bins, dft_length, rate, low, high)
    out = torch.zeros(dft_length // 2 + 1, bins, dtype=torch.float64)
    for i in range(bins):
        left, center, right = edges[i : i + 3]
        if center == left:
            out[center, i] = 1
        else:
            for j in range(left, center + 1):
                out[j, i] = (j - left) / (center - left)
        for j in range(center, right):
            out[j, i] = (right - j) / (right - center)
    return out.to(ctx.dtype(int(attrs.get("output_datatype", 1)))).to(ctx.device)
