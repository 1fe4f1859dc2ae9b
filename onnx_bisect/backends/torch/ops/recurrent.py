"""Blocks with a carried state, from LLM decoding (opset 24-28): LinearAttention (linear,
gated, delta and gated-delta rules), CausalConvWithState, TensorScatter (KV-cache writes),
and the preview domain's FlexAttention (score and probability modifier subgraphs).

The recurrences run in float32, as the spec's reference does, or in float64 under the
oracle's policy; outputs go back to the inputs' types.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from onnx_bisect.backends.torch.context import OpContext
from onnx_bisect.backends.torch.ops.registry import register
from onnx_bisect.backends.torch.ops.shape import axis_of, need, opt
from onnx_bisect.errors import BackendError

__all__: list[str] = []

Inputs = list[torch.Tensor | None]


def _work(t: torch.Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _heads(t: torch.Tensor, heads: int, dtype: torch.dtype) -> torch.Tensor:
    """(batch, time, heads * size) to (batch, heads, time, size)."""
    b, n, hidden = t.shape
    return t.reshape(b, n, heads, hidden // heads).transpose(1, 2).to(dtype)


def _per_step(t: torch.Tensor | None, heads: int, dtype: torch.dtype) -> torch.Tensor | None:
    """decay or beta, (batch, time, heads or heads * size) to (batch, heads, time, 1 or size)."""
    if t is None:
        return None
    b, n, last = t.shape
    per_head = last in (heads, 1)
    return t.reshape(b, n, last if per_head else heads, -1).transpose(1, 2).to(dtype)


@register("LinearAttention", since=27)
def linear_attention(ctx: OpContext, x: Inputs, attrs: dict[str, Any]) -> Sequence[torch.Tensor]:
    q_heads, kv_heads = int(attrs["q_num_heads"]), int(attrs["kv_num_heads"])
    query, past = need(x, 0), opt(x, 3)
    work = _work(query)
    q = _heads(query, q_heads, work)
    k, v = _heads(need(x, 1), kv_heads, work), _heads(need(x, 2), kv_heads, work)
    decay, beta = _per_step(opt(x, 4), kv_heads, work), _per_step(opt(x, 5), kv_heads, work)
    b, d_k, d_v = q.shape[0], q.shape[-1], v.shape[-1]
    if past is None:
        state = torch.zeros(b, kv_heads, d_k, d_v, dtype=work, device=query.device)
    else:
        state = past.to(work)
    scale = float(attrs.get("scale", 0.0)) or 1 / math.sqrt(d_k)
    outputs = []
    for i in range(q.shape[2]):
        if decay is not None:  # gated: the state fades by exp(decay) per step
            state = state * torch.exp(decay[:, :, i, :]).unsqueeze(-1)
        v_t = v[:, :, i, :]
        if beta is not None:  # delta rule: write only what the state does not yet recall
            recalled = torch.einsum("bhdm,bhd->bhm", state, k[:, :, i, :])
            v_t = beta[:, :, i, :] * (v_t - recalled)
        state = state + k[:, :, i, :, None] * v_t[:, :, None, :]
        read = state.repeat_interleave(q_heads // kv_heads, dim=1)
        outputs.append(scale * torch.einsum("bhd,bhdm->bhm", q[:, :, i, :], read))
    y = torch.stack(outputs, dim=2).transpose(1, 2).reshape(b, q.shape[2], -1)
    return y.to(query.dtype), state.to(query.dtype if past is None else past.dtype)


@register("CausalConvWithState", since=27)
def causal_conv_with_state(
    ctx: OpContext, x: Inputs, attrs: dict[str, Any]
) -> Sequence[torch.Tensor]:
    data, weight, bias, past = need(x, 0), need(x, 1), opt(x, 2), opt(x, 3)
    channels, k = data.shape[1], weight.shape[2]
    if past is None:
        past = torch.zeros(data.shape[0], channels, k - 1, dtype=data.dtype, device=data.device)
    padded = torch.cat([past.to(data.dtype), data], dim=2)
    work = _work(data)
    out = F.conv1d(padded.to(work), weight.to(work), None if bias is None else bias.to(work),
                   groups=channels)  # fmt: skip
    if str(attrs.get("activation", "none")) in ("silu", "swish"):
        out = F.silu(out)
    return out.to(data.dtype), padded[:, :, padded.shape[2] - (k - 1) :]


@register("TensorScatter", since=24)
def tensor_scatter(ctx: OpContext, x: Inputs, attrs: dict[str, Any]) -> torch.Tensor:
    """``update`` written into each batch's cache at its write index, along ``axis``."""
    cache, update, where = need(x, 0), need(x, 1), opt(x, 2)
    axis = axis_of(int(attrs.get("axis", -2)), cache.dim())
    size, n = cache.shape[axis], update.shape[axis]
    batch = cache.shape[0]
    if where is None:
        start = torch.zeros(batch, dtype=torch.int64, device=cache.device)
    else:
        start = where.to(torch.int64)
    positions = start.reshape(-1, 1) + torch.arange(n, device=start.device)  # (batch, n)
    if str(attrs.get("mode", "linear")) == "circular":
        positions = positions % size
    if axis == 0:
        raise BackendError("TensorScatter writes along a sequence axis, not the batch axis")
    shape = [batch] + [1] * (cache.dim() - 1)
    shape[axis] = n
    index = positions.reshape(shape).expand(update.shape).to(cache.device)
    return cache.scatter(axis, index, update.to(cache.dtype))


def _modified(ctx: OpContext, attrs: dict[str, Any], name: str, t: torch.Tensor) -> torch.Tensor:
    graph = attrs.get(name)
    if graph is None:
        return t
    out = ctx.run_graph(graph, [t])[0]
    assert out is not None
    return out


@register("FlexAttention", since=1, domain="ai.onnx.preview")
def flex_attention(ctx: OpContext, x: Inputs, attrs: dict[str, Any]) -> torch.Tensor:
    q, k, v = need(x, 0), need(x, 1), need(x, 2)
    precision = attrs.get("softmax_precision")
    work = ctx.dtype(int(precision)) if precision is not None else _work(q)
    if q.shape[1] != k.shape[1]:  # grouped-query attention
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    scale = attrs.get("scale")
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    scores = torch.matmul(q.to(work), k.to(work).transpose(-1, -2)) * scale
    probs = torch.softmax(_modified(ctx, attrs, "score_mod", scores), dim=-1)
    probs = _modified(ctx, attrs, "prob_mod", probs)
    return torch.matmul(probs, v.to(work)).to(q.dtype)
