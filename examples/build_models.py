"""Build the two small example ONNX models that ship with onnx-bisect.

Usage::

    python examples/build_models.py [--out DIR]

Writes ``yolo_like.onnx``, ``yolo_fused.onnx`` and ``transformer_block.onnx`` into ``DIR`` (default:
``examples/models`` next to this script), then checks each one: ``onnx.checker`` with
``full_check=True``, unique non-empty node names, topological order, and onnxruntime vs.
torch at batch 1 (and batch 2, to exercise the dynamic ``batch`` dimension).

Models
------
``yolo_like.onnx``
    A YOLOv8n-style detector in miniature. Input ``images`` ``[batch, 3, 160, 160]``,
    output ``output0`` ``[batch, 4 + 8, 500]`` (box distances from a DFL head plus
    8 sigmoid class scores; 500 anchors = 20x20 + 10x10). Contains Conv-BN-SiLU blocks with
    SiLU written as ``x * sigmoid(x)`` (Sigmoid followed by Mul in the graph), separate
    BatchNormalization nodes, C2f blocks (Split, residual bottlenecks, Concat), an SPPF block
    (three chained MaxPool k5 s1 p2 plus Concat), a nearest Resize upsample and Concat
    (two-scale FPN) and a detection head with a DFL part (Reshape to ``[b, 4, 16, anchors]``,
    Transpose, Softmax over the 16 bins, 1x1 Conv with ``arange(16)`` weights).

``yolo_fused.onnx``
    The same detector with BatchNormalization folded into the Conv weights
    (``TrainingMode.EVAL``), as deployed detectors ship: every SiLU reads straight from its
    Conv, so the graph holds the Conv -> Sigmoid -> Mul chain of the YOLO11x bug report.

``transformer_block.onnx``
    One pre-norm transformer block. Input ``x`` ``[batch, 64, 16]`` laid out as
    ``[batch, channels, seq]``; the graph first Transposes to ``[batch, seq, channels]`` and
    then applies LayerNormalization (LayerNorm right after a dimension swap, which a fusion
    backend once got wrong), followed by hand-written 4-head self-attention (separate Q/K/V
    MatMuls, scaled dot product, Softmax), residual Add, a second LayerNormalization, an MLP
    with erf-based GELU, residual Add, and a Transpose back. Output ``y`` ``[batch, 64, 16]``.

Exporter choice
---------------
Both models are exported with the legacy TorchScript exporter
(``torch.onnx.export(..., dynamo=False)``) at opset 18, with
``training=TrainingMode.PRESERVE`` on a model in eval mode. The dynamo exporter (the
default in torch 2.13) was tried first and was worse for this purpose:

* its default ``optimize=True`` pass folds every BatchNormalization into the preceding
  Conv, so the graph has no BN nodes to bisect over;
* it names nodes ``node_Conv_481``, ``node_sigmoid``, ``node_mul_9``, which say nothing
  about where in the model a node sits;
* with ``optimize=False`` it keeps BN but adds Expand/CastLike/SplitToSequence/SequenceAt
  noise, and every node carries metadata with stack traces that hold absolute source paths.

The TorchScript exporter gives scope-derived names (``/stem/conv/Conv``,
``/c2f1/m.0/Add``, ``/attn/q/MatMul``) of the kind real YOLOv8 exports have, emits only
standard ops, and, with ``TrainingMode.PRESERVE``, keeps BatchNormalization as separate
inference-mode nodes (``TrainingMode.EVAL`` would fold them into the Conv weights).
Dynamic reshapes (batch size read at run time) come out as Shape/Gather/Unsqueeze/Concat
chains and small Constant nodes, as in typical exported models.

Reproducibility
---------------
Weights come from ``torch.manual_seed(0)`` plus a fixed ``torch.Generator`` for the
normalization parameters. BatchNorm affine parameters are randomized and the running
mean/var are calibrated on a few random batches (see ``calibrate_batchnorm``), so BN is far
from the identity and the detector output is not flat. The saved files have doc strings and
metadata stripped, so running this script twice gives byte-identical files
(``--check-reproducible`` exports each model twice in-process and compares the bytes).

This script is for development only; it needs torch, which onnx-bisect itself does not.
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import io
import math
import sys
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import torch
from torch import nn

OPSET = 18
NUM_CLASSES = 8
REG_MAX = 16
IMAGE_SIZE = 160
SEED = 0
NORM_SEED = 1
CALIBRATION_BATCHES = 4
ATOL = 1e-4
MAX_BYTES = 1_500_000


# --------------------------------------------------------------------------- yolo_like


def silu(x: torch.Tensor) -> torch.Tensor:
    """SiLU written out so that it exports as Sigmoid followed by Mul."""
    return x * torch.sigmoid(x)


class ConvBnSiLU(nn.Module):
    """Conv2d (no bias) -> BatchNorm2d -> SiLU, the basic YOLOv8 block."""

    def __init__(self, c_in: int, c_out: int, k: int = 1, s: int = 1) -> None:
        super().__init__()
        self.conv = nn.Conv2d(c_in, c_out, k, s, k // 2, bias=False)
        self.bn = nn.BatchNorm2d(c_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return silu(self.bn(self.conv(x)))


class Bottleneck(nn.Module):
    """Two 3x3 ConvBnSiLU with an optional residual Add."""

    def __init__(self, c: int, shortcut: bool = True) -> None:
        super().__init__()
        self.cv1 = ConvBnSiLU(c, c, 3)
        self.cv2 = ConvBnSiLU(c, c, 3)
        self.shortcut = shortcut

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.cv2(self.cv1(x))
        return x + y if self.shortcut else y


class C2f(nn.Module):
    """YOLOv8 C2f: 1x1 conv, Split in two, chained bottlenecks, Concat, 1x1 conv."""

    def __init__(self, c_in: int, c_out: int, n: int = 1, shortcut: bool = True) -> None:
        super().__init__()
        self.c = c_out // 2
        self.cv1 = ConvBnSiLU(c_in, 2 * self.c, 1)
        self.cv2 = ConvBnSiLU((2 + n) * self.c, c_out, 1)
        self.m = nn.ModuleList(Bottleneck(self.c, shortcut) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ys = list(self.cv1(x).split((self.c, self.c), 1))
        for block in self.m:
            ys.append(block(ys[-1]))
        return self.cv2(torch.cat(ys, 1))


class SPPF(nn.Module):
    """Spatial pyramid pooling (fast): three chained MaxPool k5 s1 p2, then Concat."""

    def __init__(self, c_in: int, c_out: int) -> None:
        super().__init__()
        c_mid = c_in // 2
        self.cv1 = ConvBnSiLU(c_in, c_mid, 1)
        self.cv2 = ConvBnSiLU(c_mid * 4, c_out, 1)
        self.m = nn.MaxPool2d(kernel_size=5, stride=1, padding=2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.cv1(x)
        y1 = self.m(x)
        y2 = self.m(y1)
        y3 = self.m(y2)
        return self.cv2(torch.cat((x, y1, y2, y3), 1))


class DFL(nn.Module):
    """Distribution focal loss decoding: softmax over bins, expectation via 1x1 conv."""

    def __init__(self, bins: int = REG_MAX) -> None:
        super().__init__()
        self.bins = bins
        self.conv = nn.Conv2d(bins, 1, 1, bias=False).requires_grad_(False)
        with torch.no_grad():
            self.conv.weight.copy_(torch.arange(bins, dtype=torch.float32).view(1, bins, 1, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, _, a = x.shape
        y = x.view(b, 4, self.bins, a).transpose(2, 1).softmax(1)
        return self.conv(y).view(b, 4, a)


class Detect(nn.Module):
    """Decoupled YOLOv8-style head over two scales: box (DFL) and class (Sigmoid) branches."""

    def __init__(self, num_classes: int, channels: Sequence[int]) -> None:
        super().__init__()
        self.num_classes = num_classes
        self.num_outputs = num_classes + 4 * REG_MAX
        c_box, c_cls = 32, 16
        self.cv2 = nn.ModuleList(
            nn.Sequential(
                ConvBnSiLU(c, c_box, 3),
                ConvBnSiLU(c_box, c_box, 3),
                nn.Conv2d(c_box, 4 * REG_MAX, 1),
            )
            for c in channels
        )
        self.cv3 = nn.ModuleList(
            nn.Sequential(
                ConvBnSiLU(c, c_cls, 3),
                ConvBnSiLU(c_cls, c_cls, 3),
                nn.Conv2d(c_cls, num_classes, 1),
            )
            for c in channels
        )
        self.dfl = DFL(REG_MAX)

    def forward(self, feats: list[torch.Tensor]) -> torch.Tensor:
        outs = [
            torch.cat((box(x), cls(x)), 1)
            for x, box, cls in zip(feats, self.cv2, self.cv3, strict=True)
        ]
        b = outs[0].shape[0]
        y = torch.cat([o.view(b, self.num_outputs, -1) for o in outs], 2)
        box, cls = y.split((4 * REG_MAX, self.num_classes), 1)
        return torch.cat((self.dfl(box), cls.sigmoid()), 1)


class YoloLike(nn.Module):
    """Miniature YOLOv8n: stride-16/32 backbone, SPPF, one FPN merge, two-scale head."""

    def __init__(self, num_classes: int = NUM_CLASSES) -> None:
        super().__init__()
        self.stem = ConvBnSiLU(3, 8, 3, 2)  # 80x80
        self.down1 = ConvBnSiLU(8, 16, 3, 2)  # 40x40
        self.c2f1 = C2f(16, 16)
        self.down2 = ConvBnSiLU(16, 32, 3, 2)  # 20x20
        self.c2f2 = C2f(32, 32)
        self.down3 = ConvBnSiLU(32, 64, 3, 2)  # 10x10
        self.c2f3 = C2f(64, 64)
        self.sppf = SPPF(64, 64)
        self.up = nn.Upsample(scale_factor=2, mode="nearest")
        self.c2f_fpn = C2f(64 + 32, 32)
        self.detect = Detect(num_classes, (32, 64))

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.c2f1(self.down1(self.stem(images)))
        p3 = self.c2f2(self.down2(x))
        p4 = self.sppf(self.c2f3(self.down3(p3)))
        n3 = self.c2f_fpn(torch.cat((self.up(p4), p3), 1))
        return self.detect([n3, p4])


# --------------------------------------------------------------------------- transformer


class SelfAttention(nn.Module):
    """Multi-head self-attention from plain ops: Q/K/V MatMuls, scaled scores, Softmax."""

    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.scale = 1.0 / math.sqrt(self.head_dim)
        self.q = nn.Linear(dim, dim)
        self.k = nn.Linear(dim, dim)
        self.v = nn.Linear(dim, dim)
        self.o = nn.Linear(dim, dim)

    def _heads(self, t: torch.Tensor, b: int, n: int) -> torch.Tensor:
        return t.reshape(b, n, self.num_heads, self.head_dim).transpose(1, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, c = x.shape
        q = self._heads(self.q(x), b, n)
        k = self._heads(self.k(x), b, n)
        v = self._heads(self.v(x), b, n)
        attn = torch.softmax(torch.matmul(q, k.transpose(-2, -1)) * self.scale, dim=-1)
        out = torch.matmul(attn, v).transpose(1, 2).reshape(b, n, c)
        return self.o(out)


class TransformerBlock(nn.Module):
    """Pre-norm block on [batch, channels, seq] input: Transpose, LN, MHSA, LN, MLP, Transpose."""

    def __init__(self, dim: int = 64, num_heads: int = 4, mlp_ratio: int = 4) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = SelfAttention(dim, num_heads)
        self.ln2 = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, dim * mlp_ratio)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(dim * mlp_ratio, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.transpose(1, 2)  # [b, c, s] -> [b, s, c]
        x = x + self.attn(self.ln1(x))
        x = x + self.fc2(self.act(self.fc1(self.ln2(x))))
        return x.transpose(1, 2)  # back to [b, c, s]


# --------------------------------------------------------------------------- building


@dataclass(frozen=True)
class Spec:
    """What to build and how to name its single input and output."""

    filename: str
    input_name: str
    output_name: str
    input_shape: tuple[int, ...]  # first dimension is the dynamic "batch"
    # BatchNorm folded into the Conv weights, as deployed detectors ship: Conv -> Sigmoid -> Mul.
    fold_bn: bool = False


YOLO = Spec("yolo_like.onnx", "images", "output0", (1, 3, IMAGE_SIZE, IMAGE_SIZE))
YOLO_FUSED = Spec("yolo_fused.onnx", "images", "output0", (1, 3, IMAGE_SIZE, IMAGE_SIZE), True)
TRANSFORMER = Spec("transformer_block.onnx", "x", "y", (1, 64, 16))


@torch.no_grad()
def randomize_norms(model: nn.Module, gen: torch.Generator) -> None:
    """Give BatchNorm/LayerNorm non-trivial affine parameters."""
    for module in model.modules():
        if isinstance(module, nn.BatchNorm2d):
            n = module.num_features
            module.weight.copy_(torch.rand(n, generator=gen) * 0.5 + 0.75)
            module.bias.copy_(torch.randn(n, generator=gen) * 0.2)
        elif isinstance(module, nn.LayerNorm):
            shape = module.normalized_shape
            module.weight.copy_(1.0 + torch.randn(shape, generator=gen) * 0.1)
            module.bias.copy_(torch.randn(shape, generator=gen) * 0.1)


@torch.no_grad()
def calibrate_batchnorm(model: nn.Module, spec: Spec, gen: torch.Generator) -> None:
    """Set BN running mean/var from a few random batches, as a trained model would have them.

    With the default running stats (0 and 1) BatchNorm would be nearly the identity and the
    activations would shrink layer by layer, leaving the head output almost constant (box
    values around 7.5, class scores around 0.5). Calibrated stats keep every layer
    well-scaled, so the output varies and a divergence anywhere shows up downstream.

    Calibration runs in float64 and the stats are then cast to float32, so CPU-dependent
    last-bit differences in the convolutions cannot change the saved bytes.
    """
    bns = [m for m in model.modules() if isinstance(m, nn.BatchNorm2d)]
    if not bns:
        return
    for bn in bns:
        bn.reset_running_stats()
        bn.momentum = None  # cumulative average over the calibration batches
    model.double().train()
    for _ in range(CALIBRATION_BATCHES):
        model(torch.randn((4, *spec.input_shape[1:]), generator=gen, dtype=torch.float64))
    model.float().eval()
    for bn in bns:
        bn.momentum = 0.1


def build_torch_model(spec: Spec) -> nn.Module:
    """Construct the torch model for ``spec`` with deterministic weights, in eval mode."""
    torch.manual_seed(SEED)
    model: nn.Module = TransformerBlock() if spec is TRANSFORMER else YoloLike()
    gen = torch.Generator().manual_seed(NORM_SEED)
    randomize_norms(model, gen)
    calibrate_batchnorm(model, spec, gen)
    return model.eval()


def export_onnx(model: nn.Module, spec: Spec) -> onnx.ModelProto:
    """Export with the TorchScript exporter, keeping BatchNormalization nodes unfused."""
    example = torch.randn(spec.input_shape, generator=torch.Generator().manual_seed(SEED))
    buf = io.BytesIO()
    with warnings.catch_warnings():
        # The legacy exporter is deprecated, and warns about constant folding under PRESERVE,
        # which is harmless here because the model is in eval mode.
        warnings.simplefilter("ignore")
        torch.onnx.export(
            model,
            (example,),
            buf,
            input_names=[spec.input_name],
            output_names=[spec.output_name],
            opset_version=OPSET,
            dynamo=False,
            dynamic_axes={spec.input_name: {0: "batch"}, spec.output_name: {0: "batch"}},
            training=torch.onnx.TrainingMode.EVAL
            if spec.fold_bn
            else torch.onnx.TrainingMode.PRESERVE,
            do_constant_folding=True,
            export_params=True,
        )
    proto = onnx.load_model_from_string(buf.getvalue())
    with torch.no_grad():
        pin_output_shape(proto, tuple(model(example).shape))
    return proto


def pin_output_shape(model: onnx.ModelProto, shape: tuple[int, ...]) -> None:
    """Replace exporter-generated symbolic dims (e.g. ``Concatoutput0_dim_2``) after batch.

    The anchor count of ``output0`` comes out of a runtime-computed Reshape, so the exporter
    cannot name it statically; the graph output should still say ``[batch, 12, 500]``.
    """
    (output,) = model.graph.output
    dims = output.type.tensor_type.shape.dim
    assert len(dims) == len(shape), f"{output.name}: rank {len(dims)} != {len(shape)}"
    for dim, size in zip(dims[1:], shape[1:], strict=True):
        if dim.HasField("dim_param") or dim.dim_value != size:
            dim.Clear()
            dim.dim_value = size


def sanitize(model: onnx.ModelProto) -> onnx.ModelProto:
    """Strip doc strings and metadata; make sure every node has a unique, non-empty name."""
    model.doc_string = ""
    del model.metadata_props[:]
    graph = model.graph
    graph.doc_string = ""
    del graph.metadata_props[:]
    for value in [*graph.input, *graph.output, *graph.value_info]:
        value.doc_string = ""
        del value.metadata_props[:]
    for init in graph.initializer:
        init.doc_string = ""
    seen: set[str] = set()
    for index, node in enumerate(graph.node):
        node.doc_string = ""
        del node.metadata_props[:]
        if not node.name:
            node.name = f"{node.op_type}_{index}"
        if node.name in seen:
            raise ValueError(f"duplicate node name {node.name!r}")
        seen.add(node.name)
    return model


def check_structure(model: onnx.ModelProto, spec: Spec) -> None:
    """Check names, topological order, dynamic batch and self-containedness."""
    graph = model.graph
    names = [n.name for n in graph.node]
    assert all(names), "every node needs a name"
    assert len(set(names)) == len(names), "node names must be unique"
    available = {i.name for i in graph.input} | {i.name for i in graph.initializer}
    for node in graph.node:
        missing = [t for t in node.input if t and t not in available]
        assert not missing, f"{node.name} consumes {missing} before they are produced"
        available.update(node.output)
    for values, name in ((graph.input, spec.input_name), (graph.output, spec.output_name)):
        assert [v.name for v in values] == [name], f"expected single tensor {name!r}"
        first_dim = values[0].type.tensor_type.shape.dim[0]
        assert first_dim.dim_param == "batch", f"{name}: first dim must be dim_param 'batch'"
    for init in graph.initializer:
        assert init.data_location != onnx.TensorProto.EXTERNAL, f"{init.name} is external"


def compare_with_ort(model_bytes: bytes, torch_model: nn.Module, spec: Spec) -> float:
    """Run onnxruntime and torch on random input (batch 1 and 2); return the batch-1 diff."""
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    session = ort.InferenceSession(
        model_bytes, sess_options=options, providers=["CPUExecutionProvider"]
    )
    diffs: dict[int, float] = {}
    for batch in (1, 2):
        gen = torch.Generator().manual_seed(SEED + batch)
        x = torch.randn((batch, *spec.input_shape[1:]), generator=gen)
        with torch.no_grad():
            expected = torch_model(x).numpy()
        (got,) = session.run([spec.output_name], {spec.input_name: x.numpy()})
        assert got.shape == expected.shape, f"shape {got.shape} != {expected.shape}"
        diffs[batch] = float(np.max(np.abs(got - expected)))
        print(
            f"  batch={batch}: output {tuple(got.shape)}, range [{got.min():.3g}, {got.max():.3g}],"
            f" ORT vs torch max abs diff {diffs[batch]:.3g}"
        )
    worst = max(diffs.values())
    assert worst < ATOL, f"ORT and torch differ by {worst} (limit {ATOL})"
    return diffs[1]


def describe(model: onnx.ModelProto, size: int) -> None:
    """Print node count, op histogram, I/O signature and file size."""

    def sig(v: onnx.ValueInfoProto) -> str:
        dims = [d.dim_param or str(d.dim_value) for d in v.type.tensor_type.shape.dim]
        return f"{v.name}[{', '.join(dims)}]"

    graph = model.graph
    hist = collections.Counter(n.op_type for n in graph.node)
    print(f"  inputs: {', '.join(sig(v) for v in graph.input)}")
    print(f"  outputs: {', '.join(sig(v) for v in graph.output)}")
    print(f"  opset {model.opset_import[0].version}, {size:,} bytes, {len(graph.node)} nodes")
    for op, count in sorted(hist.items(), key=lambda kv: (-kv[1], kv[0])):
        print(f"    {op:<20} {count}")


def build(spec: Spec) -> tuple[bytes, nn.Module]:
    """Build, export and sanitize one model; return the serialized bytes and the torch model."""
    torch_model = build_torch_model(spec)
    proto = sanitize(export_onnx(torch_model, spec))
    return proto.SerializeToString(), torch_model


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument(
        "--out",
        type=Path,
        default=Path(__file__).resolve().parent / "models",
        help="output directory (default: examples/models)",
    )
    parser.add_argument(
        "--check-reproducible",
        action="store_true",
        help="export each model a second time and require byte-identical output",
    )
    args = parser.parse_args(argv)
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)

    for spec in (YOLO, YOLO_FUSED, TRANSFORMER):
        data, torch_model = build(spec)
        path = out / spec.filename
        path.write_bytes(data)
        print(f"{path.name}: sha256 {hashlib.sha256(data).hexdigest()[:16]}")

        model = onnx.load_model_from_string(data)
        onnx.checker.check_model(model, full_check=True)
        check_structure(model, spec)
        describe(model, len(data))
        compare_with_ort(data, torch_model, spec)
        assert len(data) < MAX_BYTES, f"{path.name} is {len(data)} bytes"

        if args.check_reproducible:
            again, _ = build(spec)
            same = again == data
            print(f"  reproducible (second export byte-identical): {same}")
            if not same:
                return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
