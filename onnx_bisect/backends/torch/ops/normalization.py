"""Normalizations: BatchNormalization, InstanceNormalization, LayerNormalization,
GroupNormalization, LRN, LpNormalization, MeanVarianceNormalization, and Dropout (whose
inference form is the identity).

Statistics of 16-bit floats are computed in float32 (LayerNormalization's ``stash_type``
asks for it; the others are as precise as the runtimes that fuse them), then cast back.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from onnx_bisect.backends.torch.context import OpContext
from onnx_bisect.backends.torch.ops.registry import OpFn, register
from onnx_bisect.backends.torch.ops.shape import need
from onnx_bisect.errors import BackendError

__all__: list[str] = []

_HALF = (torch.float16, torch.bfloat16)


def _work(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.float32) if t.dtype in _HALF else t


def _per_channel(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A per-channel parameter shaped to broadcast over (N, C, D1, ...)."""
    # BatchNormalization 1-7 with spatial=0 has per-activation (C, D1, ...) parameters.
    if t.dim() == like.dim() - 1 and t.dim() > 1:
        return t.unsqueeze(0).to(like.dtype)
    return t.reshape(-1, *[1] * (like.dim() - 2)).to(like.dtype)


def _batch_stats(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    dims = [0, *range(2, x.dim())]
    var, mean = torch.var_mean(x, dim=dims, correction=0)
    return mean, var


def _batch_norm(x: list[torch.Tensor | None], attrs: dict[str, Any], training: bool) -> Any:
    data, scale, bias, mean, var = x[:5]
    assert data is not None and scale is not None and bias is not None
    assert mean is not None and var is not None
    eps = float(attrs.get("epsilon", 1e-5))
    w = _work(data)
    if training:
        batch_mean, batch_var = _batch_stats(w)
        use_mean, use_var = batch_mean, batch_var
    else:
        use_mean, use_var = mean, var
    m, v = _per_channel(use_mean, w), _per_channel(use_var, w)
    y = (w - m) / torch.sqrt(v + eps) * _per_channel(scale, w) + _per_channel(bias, w)
    y = y.to(data.dtype)
    if not training:
        return y, mean, var
    momentum = float(attrs.get("momentum", 0.9))
    running_mean = mean * momentum + batch_mean.to(mean.dtype) * (1 - momentum)
    running_var = var * momentum + batch_var.to(var.dtype) * (1 - momentum)
    return y, running_mean, running_var


@register("BatchNormalization", since=1, until=9)
def batch_norm_legacy(
    ctx: OpContext, x: list[torch.Tensor | None], attrs: dict[str, Any]
) -> Sequence[torch.Tensor | None]:
    # Always inference statistics: `is_test` (1-6) and the training outputs are what an
    # exporter leaves behind, and runtimes run these models in inference mode. The extra
    # outputs repeat the given statistics.
    y, mean, var = _batch_norm(x, attrs, training=False)
    return y, mean, var, mean, var


@register("BatchNormalization", since=14)
def batch_norm(
    ctx: OpContext, x: list[torch.Tensor | None], attrs: dict[str, Any]
) -> Sequence[torch.Tensor | None]:
    training = bool(attrs.get("training_mode", 0))
    y, running_mean, running_var = _batch_norm(x, attrs, training)
    return (y, running_mean, running_var) if training else (y,)


@register("InstanceNormalization", since=1)
def instance_norm(
    ctx: OpContext, x: list[torch.Tensor | None], attrs: dict[str, Any]
) -> torch.Tensor:
    data, scale, bias = x[:3]
    assert data is not None and scale is not None and bias is not None
    w = _work(data)
    var, mean = torch.var_mean(w, dim=list(range(2, w.dim())), keepdim=True, correction=0)
    y = (w - mean) / torch.sqrt(var + float(attrs.get("epsilon", 1e-5)))
    return (y * _per_channel(scale, w) + _per_channel(bias, w)).to(data.dtype)


@register("LayerNormalization", since=17)
def layer_norm(
    ctx: OpContext, x: list[torch.Tensor | None], attrs: dict[str, Any]
) -> Sequence[torch.Tensor]:
    data, scale = x[0], x[1]
    bias = x[2] if len(x) > 2 else None
    assert data is not None and scale is not None
    rank = data.dim()
    axis = int(attrs.get("axis", -1)) % rank
    # stash_type names the statistics' type (1: float32); a wider input keeps its precision.
    stash = ctx.dtype(int(attrs.get("stash_type", 1)))
    w = data.to(torch.promote_types(stash, data.dtype))
    var, mean = torch.var_mean(w, dim=list(range(axis, rank)), keepdim=True, correction=0)
    inv_std = torch.rsqrt(var + float(attrs.get("epsilon", 1e-5)))
    y = (w - mean) * inv_std * scale.to(w.dtype)
    if bias is not None:
        y = y + bias.to(w.dtype)
    return y.to(data.dtype), mean.to(stash), inv_std.to(stash)


def _group_norm(per_channel_scale: bool) -> OpFn:
    def op(ctx: OpContext, x: list[torch.Tensor | None], attrs: dict[str, Any]) -> torch.Tensor:
        data, scale, bias = x[:3]
        assert data is not None and scale is not None and bias is not None
        groups = int(attrs["num_groups"])
        n, c = data.shape[0], data.shape[1]
        w = _work(data)
        grouped = w.reshape(n, groups, -1)
        var, mean = torch.var_mean(grouped, dim=-1, keepdim=True, correction=0)
        eps = float(attrs.get("epsilon", 1e-5))
        y = ((grouped - mean) / torch.sqrt(var + eps)).reshape(w.shape)
        if not per_channel_scale:
            # GroupNormalization-18: one scale and bias per group, shared by its channels.
            scale = scale.repeat_interleave(c // groups)
            bias = bias.repeat_interleave(c // groups)
        return (y * _per_channel(scale, w) + _per_channel(bias, w)).to(data.dtype)

    return op


register("GroupNormalization", since=18, until=18)(_group_norm(per_channel_scale=False))
register("GroupNormalization", since=21)(_group_norm(per_channel_scale=True))


@register("LRN", since=1)
def lrn(ctx: OpContext, x: list[torch.Tensor | None], attrs: dict[str, Any]) -> torch.Tensor:
    data = need(x, 0)
    size = int(attrs["size"])
    alpha = float(attrs.get("alpha", 1e-4))
    beta = float(attrs.get("beta", 0.75))
    bias = float(attrs.get("bias", 1.0))
    w = _work(data)
    c = w.shape[1]
    # ONNX's window over channels is [c - floor((size-1)/2), c + ceil((size-1)/2)]; torch's
    # local_response_norm centres an even window the other way.
    before = (size - 1) // 2
    squares = (w * w).movedim(1, -1)
    squares = torch.nn.functional.pad(squares, (before, size - 1 - before)).movedim(-1, 1)
    total = sum(squares.narrow(1, i, c) for i in range(size))
    assert isinstance(total, torch.Tensor)
    return (w / (bias + alpha / size * total).pow(beta)).to(data.dtype)


@register("LpNormalization", since=1)
def lp_normalization(
    ctx: OpContext, x: list[torch.Tensor | None], attrs: dict[str, Any]
) -> torch.Tensor:
    data = need(x, 0)
    p = int(attrs.get("p", 2))
    axis = int(attrs.get("axis", -1))
    w = _work(data)
    if p == 1:
        norm = w.abs().sum(dim=axis, keepdim=True)
    elif p == 2:
        norm = (w * w).sum(dim=axis, keepdim=True).sqrt()
    else:
        raise BackendError(f"LpNormalization with p={p} is not supported (only 1 and 2)")
    # A zero norm gives zeros, not 0/0.
    y = torch.where(norm == 0, torch.zeros_like(w), w / norm)
    return y.to(data.dtype)


@register("MeanVarianceNormalization", since=9)
def mean_variance_normalization(
    ctx: OpContext, x: list[torch.Tensor | None], attrs: dict[str, Any]
) -> torch.Tensor:
    data = need(x, 0)
    axes = [int(a) for a in attrs.get("axes", [0, 2, 3])]
    w = _work(data)
    mean = w.mean(dim=axes, keepdim=True)
    # ONNX's function body: sqrt(E[x^2] - E[x]^2), then + 1e-9 outside the root.
    std = torch.sqrt((w * w).mean(dim=axes, keepdim=True) - mean * mean)
    return ((w - mean) / (std + 1e-9)).to(data.dtype)


def _dropout_legacy(bool_mask: bool) -> OpFn:
    def op(
        ctx: OpContext, x: list[torch.Tensor | None], attrs: dict[str, Any]
    ) -> Sequence[torch.Tensor]:
        data = x[0]
        assert data is not None
        # Before 12 there is no training switch a runtime honours: inference, the identity.
        mask = torch.ones_like(data, dtype=torch.bool if bool_mask else data.dtype)
        return data, mask

    return op


register("Dropout", since=1, until=9)(_dropout_legacy(bool_mask=False))
register("Dropout", since=10, until=11)(_dropout_legacy(bool_mask=True))


@register("Dropout", since=12)
def dropout(
    ctx: OpContext, x: list[torch.Tensor | None], attrs: dict[str, Any]
) -> Sequence[torch.Tensor]:
    data = need(x, 0)
    ratio_t = x[1] if len(x) > 1 else None
    training_t = x[2] if len(x) > 2 else None
    training = training_t is not None and bool(training_t.reshape(-1)[0].item())
    ratio = float(ratio_t.reshape(-1)[0].item()) if ratio_t is not None else 0.5
    if training and ratio != 0.0:
        # Random masks cannot match another runtime's: comparing them would mislead.
        raise BackendError("Dropout in training mode (random masks) is not supported")
    return data, torch.ones_like(data, dtype=torch.bool)
