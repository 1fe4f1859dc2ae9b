"""Vision operators: GridSample, AffineGrid, NonMaxSuppression, Col2Im, CenterCropPad,
RoiAlign and DeformConv.

GridSample and AffineGrid are torch's own ``grid_sample``/``affine_grid`` (the same
normalized-coordinate conventions as ONNX). NonMaxSuppression is greedy per batch and class
as the spec says: candidates above ``score_threshold`` by descending score (the lower box
index first on ties), a box kept unless its IoU with a kept one exceeds ``iou_threshold``.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from onnx_bisect.backends.torch.context import OpContext
from onnx_bisect.backends.torch.ops.registry import register
from onnx_bisect.backends.torch.ops.shape import axis_of, ints, need, opt
from onnx_bisect.errors import BackendError

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
    # On the host in float64: a greedy loop of scalar decisions (and MPS has no float64).
    corners = _corners(boxes.cpu().to(torch.float64), bool(attrs.get("center_point_box", 0)))
    scores = scores.cpu()
    rows = []
    for b in range(boxes.shape[0]):
        iou = _iou(corners[b])
        for c in range(scores.shape[1]):
            kept = _greedy(iou, scores[b, c], keep, (iou_threshold, score_threshold))
            rows += [(b, c, i) for i in kept]
    return torch.tensor(rows, dtype=torch.int64, device=boxes.device).reshape(-1, 3)


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


def _axis_samples(
    start: float, size: float, bins: int, grid: int, limit: int
) -> tuple[torch.Tensor, ...]:
    """Along one axis of a RoiAlign box: the sample points' low and high pixel, their
    weights, and whether each lies on the image (ONNX Runtime's rules at the borders)."""
    step = size / bins
    at = torch.arange(bins * grid, dtype=torch.float64)
    pos = start + (at // grid) * step + (at % grid + 0.5) * step / grid
    valid = (pos >= -1.0) & (pos <= limit)
    pos = pos.clamp(min=0)
    low = pos.floor().to(torch.int64)
    edge = low >= limit - 1
    low = torch.where(edge, limit - 1, low)
    high = torch.where(edge, limit - 1, low + 1)
    pos = torch.where(edge, low.to(pos.dtype), pos)
    frac = pos - low
    return low, high, 1 - frac, frac, valid


def _roi(
    image: torch.Tensor, box: list[float], attrs: dict[str, Any], ctx_half: bool
) -> torch.Tensor:
    out_h, out_w = int(attrs.get("output_height", 1)), int(attrs.get("output_width", 1))
    scale, ratio = float(attrs.get("spatial_scale", 1.0)), int(attrs.get("sampling_ratio", 0))
    offset = 0.5 if ctx_half else 0.0
    x1, y1, x2, y2 = (v * scale - offset for v in box)
    w, h = x2 - x1, y2 - y1
    if not ctx_half:
        w, h = max(w, 1.0), max(h, 1.0)
    grid_h = ratio if ratio > 0 else math.ceil(h / out_h)
    grid_w = ratio if ratio > 0 else math.ceil(w / out_w)
    ylo, yhi, ywl, ywh, yok = _axis_samples(y1, h, out_h, grid_h, image.shape[1])
    xlo, xhi, xwl, xwh, xok = _axis_samples(x1, w, out_w, grid_w, image.shape[2])

    def on_image(t: torch.Tensor) -> torch.Tensor:  # host-side tables to the image's device
        return t.to(image.dtype).to(image.device)

    ok = on_image(yok[:, None] & xok[None, :])
    corners = [
        image[:, ya.to(image.device)][:, :, xa.to(image.device)]
        * on_image(wy[:, None] * wx[None, :])
        * ok
        for ya, wy in ((ylo, ywl), (yhi, ywh))
        for xa, wx in ((xlo, xwl), (xhi, xwh))
    ]  # each (C, out_h * grid_h, out_w * grid_w)
    c = image.shape[0]
    if str(attrs.get("mode", "avg")) == "max":
        best = torch.stack(corners).amax(0).reshape(c, out_h, grid_h, out_w, grid_w)
        return best.amax(dim=(2, 4))
    total = sum(corners[1:], corners[0]).reshape(c, out_h, grid_h, out_w, grid_w)
    return total.sum(dim=(2, 4)) / max(grid_h * grid_w, 1)


@register("RoiAlign", since=10)
def roi_align(ctx: OpContext, x: Inputs, attrs: dict[str, Any]) -> torch.Tensor:
    data, rois, batch = need(x, 0), need(x, 1), need(x, 2)
    default = "half_pixel" if ctx.opset >= 16 else "output_half_pixel"
    half = str(attrs.get("coordinate_transformation_mode", default)) == "half_pixel"
    work = data.to(torch.promote_types(data.dtype, torch.float32))
    outs = [
        _roi(work[int(b)], [float(v) for v in box], attrs, half)
        for box, b in zip(rois.tolist(), batch.reshape(-1).tolist(), strict=True)
    ]
    out_h, out_w = int(attrs.get("output_height", 1)), int(attrs.get("output_width", 1))
    if not outs:
        return data.new_zeros(0, data.shape[1], out_h, out_w)
    return torch.stack(outs).to(data.dtype)


def _deform_columns(
    data: torch.Tensor,
    offset: torch.Tensor,
    mask: torch.Tensor | None,
    attrs: dict[str, Any],
    kernel: list[int],
) -> torch.Tensor:
    """Each input channel sampled (bilinearly, zeros outside) at each kernel tap's offset
    position for each output pixel: (n, channels, kh, kw, oh, ow), times the mask."""
    n, c, ih, iw = data.shape
    kh, kw = kernel
    oh, ow = offset.shape[2:]
    groups = int(attrs.get("offset_group", 1))
    sh, sw = [int(s) for s in attrs.get("strides", [1, 1])]
    dh, dw = [int(d) for d in attrs.get("dilations", [1, 1])]
    ph, pw = [int(p) for p in attrs.get("pads", [0, 0, 0, 0])][:2]
    off = offset.reshape(n, groups, kh, kw, 2, oh, ow)
    base_y = (torch.arange(kh) * dh)[:, None, None, None] + (torch.arange(oh) * sh - ph)[
        None, None, :, None
    ]
    base_x = (torch.arange(kw) * dw)[None, :, None, None] + (torch.arange(ow) * sw - pw)[
        None, None, None, :
    ]
    y = base_y.to(off.dtype).to(off.device) + off[:, :, :, :, 0]  # (n, g, kh, kw, oh, ow)
    xx = base_x.to(off.dtype).to(off.device) + off[:, :, :, :, 1]
    grid = torch.stack([xx / (iw - 1) * 2 - 1, y / (ih - 1) * 2 - 1], dim=-1)
    cols = []
    for g, part in enumerate(data.chunk(groups, dim=1)):
        flat = grid[:, g].reshape(n, kh * kw * oh, ow, 2).to(part.dtype)
        sampled = F.grid_sample(
            part, flat, mode="bilinear", padding_mode="zeros", align_corners=True
        )
        sampled = sampled.reshape(n, part.shape[1], kh, kw, oh, ow)
        if mask is not None:
            sampled = sampled * mask.reshape(n, groups, 1, kh, kw, oh, ow)[:, g].to(part.dtype)
        cols.append(sampled)
    return torch.cat(cols, dim=1)


@register("DeformConv", since=19)
def deform_conv(ctx: OpContext, x: Inputs, attrs: dict[str, Any]) -> torch.Tensor:
    data, weight, offset, bias, mask = need(x, 0), need(x, 1), need(x, 2), opt(x, 3), opt(x, 4)
    if data.dim() != 4:
        raise BackendError("DeformConv is supported for 2-D images only")
    work = data.to(torch.promote_types(data.dtype, torch.float32))
    kernel = [int(k) for k in attrs.get("kernel_shape", weight.shape[2:])]
    cols = _deform_columns(work, offset.to(work.dtype), mask, attrs, kernel)
    groups = int(attrs.get("group", 1))
    n, c = cols.shape[:2]
    oc = weight.shape[0]
    cols = cols.reshape(n, groups, c // groups, *cols.shape[2:])
    w = weight.to(work.dtype).reshape(groups, oc // groups, *weight.shape[1:])
    out = torch.einsum("ngcklij,gockl->ngoij", cols, w).reshape(n, oc, *cols.shape[-2:])
    if bias is not None:
        out = out + bias.to(work.dtype).reshape(1, -1, 1, 1)
    return out.to(data.dtype)
