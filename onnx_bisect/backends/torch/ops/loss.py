"""Training losses: NegativeLogLikelihoodLoss and SoftmaxCrossEntropyLoss (the exporters'
form of ``torch.nn.functional.cross_entropy``).

Written from the spec rather than with ``F.nll_loss``: a target equal to ``ignore_index``
may lie outside the class range, and the ``mean`` of a weighted loss divides by the sum of
the weights that were picked.
"""

from __future__ import annotations

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
