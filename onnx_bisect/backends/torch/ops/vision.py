"""Vision operators: GridSample, AffineGrid, NonMaxSuppression, Col2Im and CenterCropPad.

GridSample and AffineGrid are torch's own ``grid_sample``/``affine_grid`` (the same
normalized-coordinate conventions as ONNX). NonMaxSuppression is greedy per batch and class
as the spec says: candidates above ``score_threshold`` by descending score (the lower box
index first on ties), a box kept unless its IoU with a kept one exceeds ``iou_threshold``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from onnx_bisect.backends.torch.context import OpContext
from onnx_bisect.backends.torch.ops.registry import register
from onnx_bisect.backends.torch.ops.shape import axis_of, ints, need, opt

__all__: list[str] = []

Inputs = list[torch.Tensor | None]

_GRID_MODES = {"linear": "bilinear", "bilinear": "bilinear", "nearest": "nearest",
               "cubic": "bicubic", "bicubic": "bicubic"}  # fmt: skip


@register("GridSample", since=16)
def grid_sample(ctx: OpContext, x: Inputs, attrs: dict[str, Any]) -> torch.Tensor:
    data, grid = need(x, 0), need(x, 1)
    mode = _GRID_MODES[str(attrs.get("mode", "linear" if ctx.opset >= 20 else "bilinear"))]
    padding = str(attrs.get("padding_mode", "zeros"))
    work = data.to(torch.promote_types(data.dtype, torch.float32))
    return F.grid_sample(
        work, grid.to(work.dtype), mode=mode, padding_mode=padding,
        align_corners=bool(attrs.get("align_corners", 0)),
    ).to(data.dtype)  # fmt: skip


@register("AffineGrid", since=20)
def affine_grid(ctx: OpContext, x: Inputs, attrs: dict[str, Any]) -> torch.Tensor:
    theta, size = need(x, 0), ints(need(x, 1))
    work = theta.to(torch.promote_types(theta.dtype, torch.float32))
    grid = F.affine_grid(work, size, align_corners=bool(attrs.get("align_corners", 0)))
    return grid.to(theta.dtype)


def _corners(boxes: torch.Tensor, center: bool) -> torch.Tensor:
    """Boxes as (y1, x1, y2, x2) with y1 <= y2 and x1 <= x2."""
    if center:  # (x_center, y_center, width, height)
        cx, cy, w, h = boxes.unbind(-1)
        return torch.stack([cy - h / 2, cx - w / 2, cy + h / 2, cx + w / 2], dim=-1)
    y1, x1, y2, x2 = boxes.unbind(-1)
    return torch.stack([y1.minimum(y2), x1.minimum(x2), y1.maximum(y2), x1.maximum(x2)], -1)


def _iou(b: torch.Tensor) -> torch.Tensor:
    """Pairwise intersection over union of (y1, x1, y2, x2) boxes; 0 where undefined."""
    lo = torch.maximum(b[:, None, :2], b[None, :, :2])
    hi = torch.minimum(b[:, None, 2:], b[None, :, 2:])
    inter = (hi - lo).clamp(min=0).prod(-1)
    area = (b[:, 2:] - b[:, :2]).prod(-1)
    union = area[:, None] + area[None, :] - inter
    ok = (inter > 0) & (area[:, None] > 0) & (area[None, :] > 0) & (union > 0)
    return torch.where(ok, inter / torch.where(ok, union, 1), 0)


def _greedy(
    iou: torch.Tensor, scores: torch.Tensor, keep: int, limits: tuple[float, float | None]
) -> list[int]:
    iou_threshold, score_threshold = limits
    order = sorted(range(scores.shape[0]), key=lambda i: (-float(scores[i]), i))
    if score_threshold is not None:
        order = [i for i in order if float(scores[i]) > score_threshold]
    kept: list[int] = []
    for i in order:
        if len(kept) >= keep:
            break
        if all(float(iou[i, j]) <= iou_threshold for j in kept):
            kept.append(i)
    return kept


@register("NonMaxSuppression", since=10)
def non_max_suppression(ctx: OpContext, x: Inputs, attrs: dict[str, Any]) -> torch.Tensor:
    boxes, scores = need(x, 0), need(x, 1)
    keep_t, iou_t, score_t = opt(x, 2), opt(x, 3), opt(x, 4)
    keep = max(ints(keep_t)[0], 0) if keep_t is not None and keep_t.numel() else 0
    iou_threshold = float(iou_t.reshape(-1)[0]) if iou_t is not None and iou_t.numel() else 0.0
    score_threshold = (
        float(score_t.reshape(-1)[0]) if score_t is not None and score_t.numel() else None
    )
    corners = _corners(boxes.to(torch.float64), bool(attrs.get("center_point_box", 0)))
    rows = []
    for b in range(boxes.shape[0]):
        iou = _iou(corners[b])
        for c in range(scores.shape[1]):
            kept = _greedy(iou, scores[b, c], keep, (iou_threshold, score_threshold))
            rows += [(b, c, i) for i in kept]
    return torch.tensor(rows, dtype=torch.int64).reshape(-1, 3)


def _col2im_index(
    image: list[int], block: list[int], attrs: dict[str, Any]
) -> tuple[torch.Tensor, list[int]]:
    """For each (kernel offset, block position) pair, its flat index in the padded image."""
    n = len(image)
    pads = [int(p) for p in attrs.get("pads", [0] * 2 * n)]
    dil = [int(d) for d in attrs.get("dilations", [1] * n)]
    stride = [int(s) for s in attrs.get("strides", [1] * n)]
    padded = [image[i] + pads[i] + pads[i + n] for i in range(n)]
    count = [(padded[i] - dil[i] * (block[i] - 1) - 1) // stride[i] + 1 for i in range(n)]
    k = torch.cartesian_prod(*[torch.arange(b) for b in block]).reshape(-1, n)
    pos = torch.cartesian_prod(*[torch.arange(c) for c in count]).reshape(-1, n)
    at = k[:, None, :] * torch.tensor(dil) + pos[None, :, :] * torch.tensor(stride)
    flat = torch.zeros(at.shape[:2], dtype=torch.int64)
    for i in range(n):
        flat = flat * padded[i] + at[..., i]
    return flat.reshape(-1), padded


@register("Col2Im", since=18)
def col2im(ctx: OpContext, x: Inputs, attrs: dict[str, Any]) -> torch.Tensor:
    """The sum of every column's block at its place in the image (the inverse of Im2Col)."""
    data, image, block = need(x, 0), ints(need(x, 1)), ints(need(x, 2))
    n = len(image)
    flat, padded = _col2im_index(image, block, attrs)
    batch, rows = data.shape[0], data.shape[1]
    channels = rows // max(1, int(torch.tensor(block).prod()))
    cols = data.reshape(batch, channels, -1)
    size = int(torch.tensor(padded).prod())
    out = torch.zeros(batch, channels, size, dtype=data.dtype, device=data.device)
    out.index_add_(2, flat.to(data.device), cols)
    out = out.reshape(batch, channels, *padded)
    pads = [int(p) for p in attrs.get("pads", [0] * 2 * n)]
    crop = tuple(slice(pads[i], pads[i] + image[i]) for i in range(n))
    return out[(slice(None), slice(None), *crop)]


@register("CenterCropPad", since=18)
def center_crop_pad(ctx: OpContext, x: Inputs, attrs: dict[str, Any]) -> torch.Tensor:
    data, shape = need(x, 0), ints(need(x, 1))
    axes = [axis_of(int(a), data.dim()) for a in attrs.get("axes", range(data.dim()))]
    out_shape = list(data.shape)
    src, dst = [slice(None)] * data.dim(), [slice(None)] * data.dim()
    for axis, size in zip(axes, shape, strict=True):
        have = data.shape[axis]
        out_shape[axis] = size
        if size < have:  # crop: the extra goes to the end when it is odd
            start = (have - size) // 2
            src[axis] = slice(start, start + size)
        else:  # pad: likewise
            start = (size - have) // 2
            dst[axis] = slice(start, start + have)
    out = torch.zeros(out_shape, dtype=data.dtype, device=data.device)
    out[tuple(dst)] = data[tuple(src)]
    return out
