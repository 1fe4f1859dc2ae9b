"""Training: the losses NegativeLogLikelihoodLoss and SoftmaxCrossEntropyLoss (the exporters'
form of ``torch.nn.functional.cross_entropy``), and the preview training domain's optimizer
steps Momentum, Adagrad and Adam.

The losses are written from the spec rather than with ``F.nll_loss``: a target equal to
``ignore_index`` may lie outside the class range, and the ``mean`` of a weighted loss
divides by the sum of the weights that were picked. An optimizer node updates several
tensors at once: its inputs are R, T, then the Xs, the Gs and each state in turn.
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


def _nll(
    log_prob: torch.Tensor, target: torch.Tensor, weight: torch.Tensor | None,
    attrs: dict[str, Any],
) -> torch.Tensor:  # fmt: skip
    t = target.to(torch.int64)
    ignore = attrs.get("ignore_index")
    ignored = t == int(ignore) if ignore is not None else torch.zeros_like(t, dtype=torch.bool)
    safe = torch.where(ignored, 0, t).clamp(0, log_prob.shape[1] - 1)
    picked = -log_prob.gather(1, safe.unsqueeze(1)).squeeze(1)
    w = torch.ones_like(picked) if weight is None else weight.to(picked.dtype)[safe]
    w = torch.where(ignored, 0, w)
    loss = picked * w
    reduction = str(attrs.get("reduction", "mean"))
    if reduction == "none":
        return loss
    if reduction == "sum":
        return loss.sum()
    return loss.sum() / w.sum()


@register("NegativeLogLikelihoodLoss", since=12)
def negative_log_likelihood_loss(ctx: OpContext, x: Inputs, attrs: dict[str, Any]) -> torch.Tensor:
    return _nll(need(x, 0), need(x, 1), opt(x, 2), attrs)


@register("SoftmaxCrossEntropyLoss", since=12)
def softmax_cross_entropy_loss(
    ctx: OpContext, x: Inputs, attrs: dict[str, Any]
) -> Sequence[torch.Tensor]:
    scores = need(x, 0)
    log_prob = torch.log_softmax(scores, dim=1)
    return _nll(log_prob, need(x, 1), opt(x, 2), attrs).to(scores.dtype), log_prob


_TRAINING = "ai.onnx.preview.training"


def _groups(x: Inputs, states: int) -> tuple[float, int, list[list[torch.Tensor]]]:
    """R, T and, per optimized tensor, [X, G, *states]."""
    rate, step = float(need(x, 0).reshape(-1)[0]), int(need(x, 1).reshape(-1)[0])
    n = (len(x) - 2) // (2 + states)
    return rate, step, [[need(x, 2 + j * n + i) for j in range(2 + states)] for i in range(n)]


def _outputs(updated: Sequence[tuple[torch.Tensor, ...]]) -> list[torch.Tensor]:
    """All new Xs, then all of each new state, as the node lists its outputs."""
    return [u[k] for k in range(len(updated[0])) for u in updated]


@register("Momentum", since=1, domain=_TRAINING)
def momentum(ctx: OpContext, x: Inputs, attrs: dict[str, Any]) -> list[torch.Tensor]:
    rate, step, groups = _groups(x, 1)
    alpha, beta = float(attrs["alpha"]), float(attrs["beta"])
    norm, nesterov = float(attrs["norm_coefficient"]), attrs.get("mode") == "nesterov"
    updated = []
    for w, g, v in groups:
        g = norm * w + g
        v_new = alpha * v + (beta if step > 0 else 1.0) * g
        w_new = w - rate * (g + alpha * v_new if nesterov else v_new)
        updated.append((w_new, v_new))
    return _outputs(updated)


@register("Adagrad", since=1, domain=_TRAINING)
def adagrad(ctx: OpContext, x: Inputs, attrs: dict[str, Any]) -> list[torch.Tensor]:
    rate, step, groups = _groups(x, 1)
    rate = rate / (1 + step * float(attrs.get("decay_factor", 0.0)))
    eps, norm = float(attrs.get("epsilon", 1e-6)), float(attrs.get("norm_coefficient", 0.0))
    updated = []
    for w, g, h in groups:
        g = norm * w + g
        h_new = h + g * g
        updated.append((w - rate * g / (torch.sqrt(h_new) + eps), h_new))
    return _outputs(updated)


@register("Adam", since=1, domain=_TRAINING)
def adam(ctx: OpContext, x: Inputs, attrs: dict[str, Any]) -> list[torch.Tensor]:
    rate, step, groups = _groups(x, 2)
    alpha, beta = float(attrs.get("alpha", 0.9)), float(attrs.get("beta", 0.999))
    eps, norm = float(attrs.get("epsilon", 1e-6)), float(attrs.get("norm_coefficient", 0.0))
    post = float(attrs.get("norm_coefficient_post", 0.0))
    if step > 0:  # bias correction of both moments, folded into the rate
        rate = rate * math.sqrt(1 - beta**step) / (1 - alpha**step)
    updated = []
    for w, g, v, h in groups:
        g = norm * w + g
        v_new = alpha * v + (1 - alpha) * g
        h_new = beta * h + (1 - beta) * g * g
        w_new = (1 - post) * (w - rate * v_new / (torch.sqrt(h_new) + eps))
        updated.append((w_new, v_new, h_new))
    return _outputs(updated)
