"""A small transformer-like torch model for the PyTorch-reference tests, and its exports:
``make`` is the factory ``--ref pytorch:tests/torch_models.py:make`` calls."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

# The line of Block.forward that calls the GELU: where the dynamo export's stack trace points.
ACT_LINE = "return x + s.proj(s.act(s.fc(s.norm(x))))"


class Block(nn.Module):
    def __init__(s, d: int) -> None:
        super().__init__()
        s.norm, s.fc = nn.LayerNorm(d), nn.Linear(d, 2 * d)
        s.act, s.proj = nn.GELU(), nn.Linear(2 * d, d)

    def forward(s, x: torch.Tensor) -> torch.Tensor:
        return x + s.proj(s.act(s.fc(s.norm(x))))


class Net(nn.Module):
    def __init__(s, d: int = 16) -> None:
        super().__init__()
        s.embed = nn.Linear(8, d)
        s.blocks = nn.ModuleList([Block(d) for _ in range(2)])
        s.head = nn.Linear(d, 4)

    def forward(s, x: torch.Tensor) -> torch.Tensor:
        h = s.embed(x)
        for b in s.blocks:
            h = b(h)
        return s.head(h)


def make() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """The factory: the model in training mode (as a fresh module is), with example inputs."""
    torch.manual_seed(0)
    return Net(), (torch.randn(2, 5, 8),)


def act_line() -> int:
    """The line number of ``ACT_LINE`` in this file."""
    lines = Path(__file__).read_text().splitlines()
    return next(i for i, text in enumerate(lines, 1) if text.strip() == ACT_LINE)


def wrong_gelu(x: Any, approximate: str = "none") -> Any:
    """aten.gelu translated wrong: x·sigmoid(1.5x) (the right one is near x·sigmoid(1.702x))."""
    from onnxscript import opset18 as op

    return op.Mul(x, op.Sigmoid(op.Mul(x, op.CastLike(1.5, x))))


def export(path: Path, *, dynamo: bool, wrong: bool = False) -> Path:
    """``make()``'s model exported to ``path`` (input ``x``), with the wrong GELU if asked."""
    model, example = make()
    model.eval()
    table = {torch.ops.aten.gelu.default: wrong_gelu} if wrong else None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if dynamo:
            torch.onnx.export(
                model, example, str(path), dynamo=True, input_names=["x"],
                custom_translation_table=table, verbose=False,
            )  # fmt: skip
        else:
            torch.onnx.export(model, example, str(path), dynamo=False, input_names=["x"])
    return path


def make_bn() -> nn.Module:
    """A Linear, BatchNorm1d, ReLU, Linear stack whose running statistics differ from a
    batch's: exported in training mode, its BatchNormalization uses the batch's."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 4))
    bn = m[1]
    assert isinstance(bn, nn.BatchNorm1d)
    with torch.no_grad():
        bn.running_mean.fill_(0.3)
        bn.running_var.fill_(2.0)
    return m


def export_training(path: Path) -> Path:
    """``make_bn()`` exported by the TorchScript exporter in training mode."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            make_bn().train(), (torch.randn(4, 8),), str(path), dynamo=False,
            training=torch.onnx.TrainingMode.TRAINING, input_names=["x"],
        )  # fmt: skip
    return path


def make_drifted() -> nn.Module:
    """``make()``'s model with the second block's GELU replaced by a SiLU: a module changed
    after its export, under test against the ONNX model of ``make()``."""
    model, _ = make()
    block = model.blocks[1]
    assert isinstance(block, Block)
    block.act = nn.SiLU()
    return model


def make64() -> nn.Module:
    """``make()``'s model in float64: it computes in another precision than its float32
    export."""
    model, _ = make()
    return model.double()


def make_retrained() -> nn.Module:
    """``make()``'s model whose second block's fc weights changed after its export (trained
    on): the export holds the weights captured at export time."""
    model, _ = make()
    block = model.blocks[1]
    assert isinstance(block, Block)
    with torch.no_grad():
        block.fc.weight.mul_(1.1)
    return model


class Nhwc(nn.Module):
    """A convolution on NCHW images whose export takes NHWC 0–255 images: the export's
    wrapper transposes and scales, the module does not."""

    def __init__(s) -> None:
        super().__init__()
        s.conv = nn.Conv2d(3, 4, 3)

    def forward(s, x: torch.Tensor) -> torch.Tensor:
        return s.conv(x)


def make_nchw() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """The module with its example input: a normalized NCHW image."""
    torch.manual_seed(0)
    return Nhwc(), (torch.rand(1, 3, 8, 8),)


def export_nhwc(path: Path) -> Path:
    """``make_nchw()``'s convolution exported behind a wrapper that takes NHWC 0–255 images
    (transposed and scaled to 0–1 in the graph): the ONNX inputs are not the module's."""

    class Wrapper(nn.Module):
        def __init__(s, inner: Nhwc) -> None:
            super().__init__()
            s.conv = inner.conv

        def forward(s, x: torch.Tensor) -> torch.Tensor:
            return s.conv(x.permute(0, 3, 1, 2) / 255)

    inner, _ = make_nchw()
    assert isinstance(inner, Nhwc)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            Wrapper(inner).eval(), (torch.rand(1, 8, 8, 3) * 255,), str(path), dynamo=False,
            input_names=["x"],
        )  # fmt: skip
    return path


class Attn(nn.Module):
    """Several torch ops and no submodule: hooks see only its output."""

    def forward(s, x: torch.Tensor) -> torch.Tensor:
        weights = torch.softmax(x @ x.transpose(-1, -2) / 4.0, dim=-1)
        return torch.tanh(weights @ x)


class AttnNet(nn.Module):
    def __init__(s) -> None:
        super().__init__()
        s.embed, s.attn, s.head = nn.Linear(8, 8), Attn(), nn.Linear(8, 4)

    def forward(s, x: torch.Tensor) -> torch.Tensor:
        return s.head(s.attn(s.embed(x)))


def make_attn() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    torch.manual_seed(0)
    return AttnNet().eval(), (torch.randn(2, 5, 8),)


def export_attn(path: Path) -> Path:
    """``make_attn()``'s model exported by the dynamo exporter (input ``x``)."""
    model, example = make_attn()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(model, example, str(path), dynamo=True, input_names=["x"], verbose=False)
    return path


class Scaled(nn.Module):
    """Divides by a Python float computed from the input: traced, the export bakes in the
    example input's value."""

    def __init__(s) -> None:
        super().__init__()
        s.fc = nn.Linear(8, 4)

    def forward(s, x: torch.Tensor) -> torch.Tensor:
        return s.fc(x) / float(x.abs().max())


def make_scaled() -> nn.Module:
    torch.manual_seed(0)
    return Scaled().eval()


def export_scaled(path: Path, example: torch.Tensor) -> Path:
    """``make_scaled()`` traced by the TorchScript exporter on ``example``."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(make_scaled(), (example,), str(path), dynamo=False, input_names=["x"])
    return path
