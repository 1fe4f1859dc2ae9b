"""Transformer blocks of opset 23 and later: Attention (23-25: causal, masks, a KV cache, an
external cache's ``nonpad_kv_seqlen``, grouped-query heads, softcap, sliding windows),
RMSNormalization and RotaryEmbedding.

Semantics follow the ONNX spec and its reference implementation (onnx/reference/ops); the
masks become one additive bias, so a fully masked row gives zeros rather than NaN, as the
spec asks. 16-bit inputs take their softmax in float32 (what runtimes do); under the float64
policy everything is float64.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from onnx_bisect.backends.torch.context import OpContext
from onnx_bisect.backends.torch.ops.registry import register
from onnx_bisect.backends.torch.ops.shape import need, opt

__all__: list[str] = []

Inputs = list[torch.Tensor | None]
_HALF = (torch.float16, torch.bfloat16)


def _split_heads(t: torch.Tensor, heads: int) -> torch.Tensor:
    """(batch, seq, heads * size) to (batch, heads, seq, size)."""
    b, s, hidden = t.shape
    return t.reshape(b, s, heads, hidden // heads).transpose(1, 2)


def _offset(nonpad: torch.Tensor | None, past: torch.Tensor | None, q_len: int) -> torch.Tensor:
    """Where each batch's queries sit in the key sequence: a query at index i sees keys up to
    ``i + offset`` (bottom-right aligned causality)."""
    if past is None and nonpad is not None:
        return (nonpad.reshape(-1).to(torch.int64) - q_len).reshape(-1, 1, 1, 1)
    return torch.tensor(past.shape[2] if past is not None else 0)


def _mask_bias(mask: torch.Tensor, kv_len: int, dtype: torch.dtype) -> torch.Tensor:
    """A boolean or additive mask as an additive bias, padded to ``kv_len`` keys (the padding
    masks out)."""
    if mask.dtype == torch.bool:
        mask = torch.where(mask, 0.0, -math.inf).to(dtype)
    else:
        mask = mask.to(dtype)
    pad = kv_len - mask.shape[-1]
    if pad > 0:
        mask = torch.nn.functional.pad(mask, (0, pad), value=-math.inf)
    return mask


def _bias(
    attrs: dict[str, Any],
    shape: tuple[int, int, int],  # batch, queries, keys
    mask: torch.Tensor | None,
    offset: torch.Tensor,
    nonpad: torch.Tensor | None,
    dtype: torch.dtype,
) -> torch.Tensor:
    """The additive bias (0 where a query may attend, -inf where not), broadcastable to
    (batch, heads, queries, keys)."""
    _, q_len, kv_len = shape
    device = offset.device
    bias = torch.zeros(q_len, kv_len, dtype=dtype, device=device)
    if mask is not None:
        bias = bias + _mask_bias(mask, kv_len, dtype)
    i = torch.arange(q_len, device=device).reshape(q_len, 1)
    j = torch.arange(kv_len, device=device).reshape(1, kv_len)
    diff = i + offset.to(torch.int64) - j  # how far key j lies behind query i
    allowed = torch.ones_like(diff, dtype=torch.bool)
    if int(attrs.get("is_causal", 0)):
        allowed &= diff >= 0
    left, right = int(attrs.get("left_window_size", -1)), int(attrs.get("right_window_size", -1))
    if left >= 0:
        allowed &= diff <= left
    if right >= 0:
        allowed &= -diff <= right
    if nonpad is not None:
        valid = j < nonpad.reshape(-1, 1, 1, 1).to(torch.int64)
        allowed = allowed & valid
    return bias + torch.where(allowed, 0.0, -math.inf).to(dtype)


def _scores(q: torch.Tensor, k: torch.Tensor, attrs: dict[str, Any]) -> torch.Tensor:
    scale = attrs.get("scale")
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    # sqrt(scale) on each side, as the spec's function body does: fp16 scores stay in range.
    root = math.sqrt(scale)
    return torch.matmul(q * root, (k * root).transpose(-1, -2))


def _softmax_dtype(ctx: OpContext, attrs: dict[str, Any], dtype: torch.dtype) -> torch.dtype:
    precision = attrs.get("softmax_precision")
    if precision is not None:
        return torch.promote_types(ctx.dtype(int(precision)), dtype)
    return torch.float32 if dtype in _HALF else dtype


def _attend(
    ctx: OpContext, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor,
    attrs: dict[str, Any],
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Softmax(QK^T + bias) V for 4-D heads, and the ``qk_matmul_output_mode`` tensor."""
    if q.shape[1] != k.shape[1]:  # grouped-query attention: each KV head serves a group
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    scores = _scores(q, k, attrs)
    softcap = float(attrs.get("softcap", 0.0))
    if softcap > 0:
        scores = torch.tanh(scores / softcap) * softcap
    biased = scores + bias.to(scores.dtype)
    mode = int(attrs.get("qk_matmul_output_mode", 0))
    work = _softmax_dtype(ctx, attrs, q.dtype)
    masked_row = torch.isneginf(bias.amax(dim=-1, keepdim=True))
    probs = torch.softmax(biased.to(work), dim=-1)
    probs = torch.where(masked_row, torch.zeros((), dtype=work, device=probs.device), probs)
    qk = {2: biased, 3: probs}.get(mode, scores).to(q.dtype)
    y = torch.matmul(probs, v.to(work))
    return y.to(q.dtype), qk


@register("Attention", since=23)
def attention(ctx: OpContext, x: Inputs, attrs: dict[str, Any]) -> Sequence[torch.Tensor | None]:
    q, k, v = need(x, 0), need(x, 1), need(x, 2)
    mask, past_k, past_v, nonpad = opt(x, 3), opt(x, 4), opt(x, 5), opt(x, 6)
    three_d = q.dim() == 3
    if three_d:
        q = _split_heads(q, int(attrs["q_num_heads"]))
        k = _split_heads(k, int(attrs["kv_num_heads"]))
        v = _split_heads(v, int(attrs["kv_num_heads"]))
    if past_k is not None and past_v is not None:
        k, v = torch.cat([past_k, k], dim=2), torch.cat([past_v, v], dim=2)
    shape = (q.shape[0], q.shape[2], k.shape[2])
    offset = _offset(nonpad, past_k, q.shape[2]).to(q.device)
    bias = _bias(attrs, shape, mask, offset, nonpad, torch.promote_types(q.dtype, torch.float32))
    y, qk = _attend(ctx, q, k, v, bias, attrs)
    if three_d:
        y = y.transpose(1, 2).reshape(y.shape[0], y.shape[2], -1)
    return y, k, v, qk


@register("RMSNormalization", since=23)
def rms_normalization(ctx: OpContext, x: Inputs, attrs: dict[str, Any]) -> torch.Tensor:
    data, scale = need(x, 0), need(x, 1)
    axis = int(attrs.get("axis", -1)) % data.dim()
    # stash_type names the statistics' type (1: float32); a wider input keeps its precision.
    stash = ctx.dtype(int(attrs.get("stash_type", 1)))
    w = data.to(torch.promote_types(stash, data.dtype))
    mean_square = w.square().mean(dim=list(range(axis, data.dim())), keepdim=True)
    y = w * torch.rsqrt(mean_square + float(attrs.get("epsilon", 1e-5)))
    return (y * scale.to(w.dtype)).to(data.dtype)


def _rotate(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool
) -> torch.Tensor:
    if interleaved:
        x1, x2 = x[..., 0::2], x[..., 1::2]
    else:
        x1, x2 = x.chunk(2, dim=-1)
    real, imag = cos * x1 - sin * x2, sin * x1 + cos * x2
    if interleaved:
        return torch.stack([real, imag], dim=-1).reshape(x.shape)
    return torch.cat([real, imag], dim=-1)


@register("RotaryEmbedding", since=23)
def rotary_embedding(ctx: OpContext, x: Inputs, attrs: dict[str, Any]) -> torch.Tensor:
    data, cos, sin, positions = need(x, 0), need(x, 1), need(x, 2), opt(x, 3)
    # Work in (batch, seq, heads, size): 4-D input is (batch, heads, seq, size).
    h = data.transpose(1, 2) if data.dim() == 4 else data
    if h.dim() == 3:
        h = h.reshape(h.shape[0], h.shape[1], int(attrs["num_heads"]), -1)
    dim = int(attrs.get("rotary_embedding_dim", 0)) or h.shape[-1]
    if positions is not None:
        cos, sin = cos[positions.to(torch.int64)], sin[positions.to(torch.int64)]
    cos, sin = cos.unsqueeze(2).to(h.dtype), sin.unsqueeze(2).to(h.dtype)
    rotated = _rotate(h[..., :dim], cos, sin, bool(attrs.get("interleaved", 0)))
    out = torch.cat([rotated, h[..., dim:]], dim=-1)
    return out.transpose(1, 2) if data.dim() == 4 else out.reshape(data.shape)
