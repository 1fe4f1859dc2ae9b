"""Conv -> BatchNormalization models for onnxoptimizer's ``fuse_bn_into_conv`` (issue #178).

Usage::

    python examples/bn_fusion.py OUTDIR [--seed N]

Writes ``conv_bn.onnx`` (Conv weights in initializers) and ``conv_bn_constant.onnx`` (Conv
weights from Constant nodes) and, if onnxoptimizer is installed, ``*.optimized.onnx`` copies made
with ``onnxoptimizer.optimize(model, ["fuse_bn_into_conv"])``; prints what the pass changed and
how far ``logits`` moved on onnxruntime CPU.

The models
----------
Input ``images`` [1, 3, 32, 32]. Four stages ``stem``, ``stage1``, ``stage2``, ``stage3``, each
``{s}/conv`` -> ``{s}/conv_out`` -> ``{s}/bn`` -> ``{s}/bn_out`` -> ``{s}/relu`` (``{s}/relu_out``)
or ``{s}/sigmoid`` + ``{s}/silu`` (SiLU, ``{s}/silu_out``). Weights ``{s}/conv.weight`` are
initializers or outputs of Constant nodes ``{s}/conv.weight_const``; only ``stage2/conv`` has a
bias (``stage2/conv.bias``). BN parameters ``{s}/bn.scale|bias|mean|var``: scale U[0.5, 1.5],
bias and mean U[-0.5, 0.5], var U[0.5, 2], epsilon 1e-5 (1e-3 in stage3). Head ``head/gap`` ->
``head/flatten`` (output ``features`` [1, 32]) -> ``head/fc`` (Gemm, output ``logits`` [1, 10]).
Opset 13, IR 8, numpy seed 0: the same bytes on every build.

What onnxoptimizer 0.4.2 does (observed with onnxruntime 1.31.1 CPU)
--------------------------------------------------------------------
* It fuses every BN (BatchNormalization 4 -> 0), Conv bias or not, weights from initializers or
  Constant nodes, at opsets 11 to 18. It computes no numbers: it writes the folding into the
  graph as ten unnamed nodes per BN (Cast, Add, Sqrt, Div, Unsqueeze, Mul for the new weight;
  Cast, Sub, Mul, Add for the new bias) feeding the Conv, so 17 -> 53 nodes. These are the
  issue's "redundant nodes"; no onnxoptimizer pass removes them (onnxsim's constant folding
  does: 13 nodes). A Conv without a bias first gets a zero bias initializer, so both kinds of
  Conv get the same ten nodes. "A Conv with a bias is skipped" is not reproduced: the BN is kept
  only when the bias is not a constant initializer (e.g. also listed as a graph input).
* Names: each Conv keeps its output name, which now holds the post-BN value. ``stem/conv_out``
  is rel_l2 0.54 from the original ``stem/conv_out`` and 1.3e-7 from the original ``stem/bn_out``
  (0.54 to 0.64 vs 1e-7 to 4e-7 over the four stages). The ``{s}/bn_out`` names disappear. Fused
  weights and BN parameters get generated names (``47``, ``_v_48``); only ``head/fc.*`` keep
  theirs. A tool matching tensors by name must not compare ``{s}/conv_out`` across the pair.
* Constant-node weights: each weight is copied into a new initializer and the Constant nodes
  ``{s}/conv.weight_const`` stay behind, unread (4 dead nodes; 38397 -> 72362 bytes).
  onnxruntime drops them with a warning; onnxoptimizer's ``eliminate_deadend`` removes them.
* Numbers: ``logits`` max_abs 6.0e-8, rel_l2 1.05e-7 with onnxruntime graph optimizations off
  (worst of 500 random inputs 3.6e-7; top-1 never differs); bit-identical with onnxruntime's
  default optimizations, which fold Conv+BN in the original too. That folding moves the
  original's own logits as much (up to 5.1e-7). Rounding only, no real divergence.
* Not fused, correctly: a Conv output with a second reader (``side_branch=True``) or that is a
  graph output keeps its BN (3 of 4 fused), outputs unchanged. When the BN output is a graph
  output the Conv takes over that name (``stage2/conv`` writes ``stage2/bn_out``;
  ``stage2/conv_out`` is gone), so graph outputs keep name and meaning.
* A real bug, a crash rather than wrong numbers: BN parameters given by Constant nodes with a
  ``value_floats`` attribute (not ``value``) make ``onnxoptimizer.optimize`` segfault. With
  ``value`` they fuse, and those Constant nodes too are left dead.

So in these models the pass changes graph size and names, not results; the detection-metric
differences reported in the issue are not reproduced here.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, cast

import numpy as np
import numpy.typing as npt
import onnx
from onnx import TensorProto, helper, numpy_helper

OPSET = 13
IR_VERSION = 8  # loadable by onnxruntime 1.18 .. 1.31
INPUT = "images"
INPUT_SHAPE = (1, 3, 32, 32)
LOGITS = "logits"
FEATURES = "features"
SIDE_OUTPUT = "stage1_conv_mean"
NUM_CLASSES = 10
PASS = "fuse_bn_into_conv"

Array = npt.NDArray[np.float32]
WeightSource = Literal["initializer", "constant"]
Activation = Literal["relu", "silu"]


@dataclass(frozen=True)
class Stage:
    """One Conv -> BatchNormalization -> activation block."""

    name: str
    out_channels: int
    stride: int
    act: Activation
    conv_bias: bool  # the issue says the pass skips Convs that have a bias: it does not
    epsilon: float = 1e-5


STAGES = (
    Stage("stem", 8, 1, "relu", conv_bias=False),
    Stage("stage1", 16, 2, "silu", conv_bias=False),
    Stage("stage2", 16, 1, "relu", conv_bias=True),
    Stage("stage3", 32, 2, "silu", conv_bias=False, epsilon=1e-3),  # YOLO-style epsilon
)


class _Graph:
    """Collects nodes and initializers; Conv weights become initializers or Constant nodes."""

    def __init__(self, weight: WeightSource) -> None:
        self.weight = weight
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []

    def node(
        self, op: str, name: str, inputs: Sequence[str], outputs: Sequence[str], **attrs: Any
    ) -> str:
        """Add a node with an explicit name; return its first output."""
        self.nodes.append(helper.make_node(op, list(inputs), list(outputs), name=name, **attrs))
        return outputs[0]

    def init(self, name: str, array: Array) -> str:
        """Add an initializer; return its name, so calls can sit inside a node's input list."""
        self.initializers.append(numpy_helper.from_array(array, name))
        return name

    def conv_weight(self, scope: str, array: Array) -> str:
        """The Conv weight: an initializer, or (issue #178's second case) a Constant node."""
        name = f"{scope}/conv.weight"
        if self.weight == "initializer":
            return self.init(name, array)
        tensor = numpy_helper.from_array(array, name)
        return self.node("Constant", f"{scope}/conv.weight_const", [], [name], value=tensor)


def _bn_params(rng: np.random.Generator, c: int) -> dict[str, Array]:
    """Realistic eval-mode statistics, far enough from identity that a lost BN would show."""
    return {
        "scale": rng.uniform(0.5, 1.5, c).astype(np.float32),
        "bias": rng.uniform(-0.5, 0.5, c).astype(np.float32),
        "mean": rng.uniform(-0.5, 0.5, c).astype(np.float32),
        "var": rng.uniform(0.5, 2.0, c).astype(np.float32),
    }


def _stage(g: _Graph, rng: np.random.Generator, stage: Stage, x: str, cin: int) -> str:
    """Conv (bias only if ``stage.conv_bias``) -> BatchNormalization -> Relu or SiLU."""
    s = stage.name
    fan_in = cin * 9
    w = (rng.standard_normal((stage.out_channels, cin, 3, 3)) * np.sqrt(2 / fan_in)).astype(
        np.float32
    )
    conv_in = [x, g.conv_weight(s, w)]
    if stage.conv_bias:
        b = rng.uniform(-0.2, 0.2, stage.out_channels).astype(np.float32)
        conv_in.append(g.init(f"{s}/conv.bias", b))
    conv_out = g.node(
        "Conv",
        f"{s}/conv",
        conv_in,
        [f"{s}/conv_out"],
        kernel_shape=[3, 3],
        pads=[1, 1, 1, 1],
        strides=[stage.stride, stage.stride],
    )
    bn = _bn_params(rng, stage.out_channels)
    bn_in = [conv_out] + [g.init(f"{s}/bn.{k}", v) for k, v in bn.items()]
    bn_out = g.node("BatchNormalization", f"{s}/bn", bn_in, [f"{s}/bn_out"], epsilon=stage.epsilon)
    if stage.act == "relu":
        return g.node("Relu", f"{s}/relu", [bn_out], [f"{s}/relu_out"])
    sig = g.node("Sigmoid", f"{s}/sigmoid", [bn_out], [f"{s}/sigmoid_out"])
    return g.node("Mul", f"{s}/silu", [bn_out, sig], [f"{s}/silu_out"])


def _side_branch(g: _Graph, conv_out: str) -> str:
    """A second consumer of a Conv output: per-channel mean of the *pre-BN* values."""
    gap = g.node("GlobalAveragePool", "stage1/side_gap", [conv_out], ["stage1/side_gap_out"])
    return g.node("Flatten", "stage1/side_flatten", [gap], [SIDE_OUTPUT], axis=1)


def conv_bn_model(
    weight: WeightSource = "initializer",
    *,
    opset: int = OPSET,
    side_branch: bool = False,
    extra_outputs: Sequence[str] = (),
    seed: int = 0,
) -> onnx.ModelProto:
    """A small CNN classifier made of Conv -> BN -> act stages and a GAP -> Gemm head.

    ``weight`` picks where Conv weights live (initializers, or Constant nodes). ``side_branch``
    gives ``stage1/conv_out`` a second consumer (a pooled side output ``stage1_conv_mean``), and
    ``extra_outputs`` exposes internal tensors (e.g. ``stage2/bn_out``) as graph outputs: the two
    situations in which folding a BN into its Conv would change what a graph output means.
    """
    rng = np.random.default_rng(seed)
    g = _Graph(weight)
    x, cin = INPUT, INPUT_SHAPE[1]
    for stage in STAGES:
        x = _stage(g, rng, stage, x, cin)
        cin = stage.out_channels
    outputs = [
        helper.make_tensor_value_info(LOGITS, TensorProto.FLOAT, [1, NUM_CLASSES]),
        helper.make_tensor_value_info(FEATURES, TensorProto.FLOAT, [1, cin]),
    ]
    if side_branch:
        _side_branch(g, "stage1/conv_out")
        side_channels = STAGES[1].out_channels
        outputs.append(
            helper.make_tensor_value_info(SIDE_OUTPUT, TensorProto.FLOAT, [1, side_channels])
        )
    gap = g.node("GlobalAveragePool", "head/gap", [x], ["head/gap_out"])
    feats = g.node("Flatten", "head/flatten", [gap], [FEATURES], axis=1)
    fc_w = (rng.standard_normal((NUM_CLASSES, cin)) / np.sqrt(cin)).astype(np.float32)
    fc_b = rng.uniform(-0.1, 0.1, NUM_CLASSES).astype(np.float32)
    g.node(
        "Gemm",
        "head/fc",
        [feats, g.init("head/fc.weight", fc_w), g.init("head/fc.bias", fc_b)],
        [LOGITS],
        transB=1,
    )
    graph = helper.make_graph(
        g.nodes,
        f"conv_bn_{weight}",
        [helper.make_tensor_value_info(INPUT, TensorProto.FLOAT, list(INPUT_SHAPE))],
        outputs,
        initializer=g.initializers,
    )
    model = helper.make_model(
        graph,
        ir_version=IR_VERSION,
        opset_imports=[helper.make_opsetid("", opset)],
        producer_name="onnx-bisect examples/bn_fusion.py",
    )
    if extra_outputs:
        inferred = onnx.shape_inference.infer_shapes(model, strict_mode=True).graph.value_info
        types = {v.name: v for v in inferred}
        model.graph.output.extend(types[name] for name in extra_outputs)
    onnx.checker.check_model(model, full_check=True)
    return model


def fuse_bn(model: onnx.ModelProto) -> onnx.ModelProto:
    """Run only onnxoptimizer's ``fuse_bn_into_conv`` pass, as in issue #178."""
    import onnxoptimizer

    return cast(onnx.ModelProto, onnxoptimizer.optimize(model, [PASS]))


def op_counts(model: onnx.ModelProto) -> Counter[str]:
    """Node count per op type: what the pass removed and what it added shows in the difference."""
    return Counter(n.op_type for n in model.graph.node)


def random_feed(seed: int = 0) -> dict[str, Array]:
    """A seeded standard-normal ``images``: the same input for both models of a pair."""
    return {INPUT: np.random.default_rng(seed).standard_normal(INPUT_SHAPE).astype(np.float32)}


def run(
    model: onnx.ModelProto,
    feed: dict[str, Array],
    tensors: Sequence[str] = (),
    ort_optimizations: bool = True,
) -> dict[str, Array]:
    """Graph outputs plus the named internal ``tensors``, on onnxruntime CPU.

    ``ort_optimizations=False`` turns off onnxruntime's own graph rewrites (it folds Conv+BN by
    itself), so the two models are compared as written.
    """
    import onnxruntime as ort

    m = onnx.ModelProto()
    m.CopyFrom(model)
    have = {o.name for o in m.graph.output}
    m.graph.output.extend(
        helper.make_tensor_value_info(t, TensorProto.FLOAT, None) for t in tensors if t not in have
    )
    opts = ort.SessionOptions()
    opts.log_severity_level = 3  # the dead Constant nodes of the optimized copy warn otherwise
    if not ort_optimizations:
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(m.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    return dict(zip(names, sess.run(names, feed), strict=True))


def rel_l2(a: Array, b: Array) -> float:
    """||a - b|| / ||a|| in float64, ``a`` being the original: the project's default metric."""
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    return float(np.linalg.norm(a64 - b64)) / max(float(np.linalg.norm(a64)), 1e-30)


def max_abs(a: Array, b: Array) -> float:
    """Largest elementwise difference, in float64 so the metric adds no rounding of its own."""
    return float(np.max(np.abs(a.astype(np.float64) - b.astype(np.float64))))


def bn_after_conv(model: onnx.ModelProto) -> dict[str, str]:
    """Conv output name -> output name of the BatchNormalization that reads it."""
    conv_outs = {n.output[0] for n in model.graph.node if n.op_type == "Conv"}
    return {
        n.input[0]: n.output[0]
        for n in model.graph.node
        if n.op_type == "BatchNormalization" and n.input[0] in conv_outs
    }


def dead_nodes(model: onnx.ModelProto) -> list[str]:
    """Nodes none of whose outputs is read by a node or is a graph output."""
    used = {i for n in model.graph.node for i in n.input} | {o.name for o in model.graph.output}
    return [n.name for n in model.graph.node if not any(o in used for o in n.output)]


def renamed_meanings(original: onnx.ModelProto, optimized: onnx.ModelProto) -> dict[str, str]:
    """Conv outputs whose name survived fusion but which now hold the folded BN's value.

    Maps the kept name (e.g. ``stem/conv_out``) to the original tensor whose value it now holds
    (``stem/bn_out``): a tool matching tensors by name across the two models must not compare
    these two under the same name.
    """
    before = bn_after_conv(original)
    still = bn_after_conv(optimized)
    conv_outs = {n.output[0] for n in optimized.graph.node if n.op_type == "Conv"}
    return {c: b for c, b in before.items() if c in conv_outs and c not in still}


@dataclass(frozen=True)
class PairReport:
    """What ``fuse_bn_into_conv`` did to one model, structurally and numerically."""

    name: str
    ops_before: Counter[str]
    ops_after: Counter[str]
    logits_max_abs: float  # onnxruntime graph optimizations off: the graphs as written
    logits_rel_l2: float
    logits_max_abs_ort_opt: float  # onnxruntime defaults (it folds Conv+BN itself)
    logits_rel_l2_ort_opt: float
    bytes_before: int
    bytes_after: int
    dead: list[str]  # nodes of the optimized copy whose outputs nobody reads
    initializers_kept: list[str]  # initializer names present in both models
    renamed: dict[str, str]  # kept Conv output name -> original tensor whose value it now holds
    renamed_check: dict[str, tuple[float, float]]  # name -> (rel_l2 vs same name, vs new meaning)

    def lines(self) -> list[str]:
        before, after = self.ops_before, self.ops_after
        added = after - before
        removed = before - after
        out = [
            f"{self.name}: nodes {before.total()} -> {after.total()}; "
            f"BatchNormalization {before['BatchNormalization']} -> {after['BatchNormalization']}",
            "  removed: " + (_fmt_counts(removed) or "-"),
            "  added:   " + (_fmt_counts(added) or "-"),
            f"  dead nodes left behind: {', '.join(self.dead) or '-'}",
            f"  serialized size: {self.bytes_before} -> {self.bytes_after} bytes; initializers "
            f"still under their own name: {', '.join(self.initializers_kept) or '-'}",
            f"  {LOGITS} (ORT CPU, graph optimizations off): max_abs {self.logits_max_abs:.3g}"
            f"  rel_l2 {self.logits_rel_l2:.3g}",
            f"  {LOGITS} (ORT CPU, default optimizations):  max_abs "
            f"{self.logits_max_abs_ort_opt:.3g}  rel_l2 {self.logits_rel_l2_ort_opt:.3g}",
        ]
        for kept, meaning in self.renamed.items():
            same, new = self.renamed_check[kept]
            out.append(
                f"  kept name, new meaning: {kept} now holds {meaning} "
                f"(rel_l2 vs original {kept} {same:.3g}, vs original {meaning} {new:.2g})"
            )
        return out


def _fmt_counts(c: Counter[str]) -> str:
    """``Add 8, Cast 8``: op counts in a stable (sorted) order for the printed summary."""
    return ", ".join(f"{op} {n}" for op, n in sorted(c.items()))


def compare(
    name: str, original: onnx.ModelProto, optimized: onnx.ModelProto, seed: int = 0
) -> PairReport:
    """Structural diff, ``logits`` difference, and a numeric check of each kept-name tensor."""
    feed = random_feed(seed)
    raw = [run(m, feed, ort_optimizations=False)[LOGITS] for m in (original, optimized)]
    opt = [run(m, feed)[LOGITS] for m in (original, optimized)]
    renamed = renamed_meanings(original, optimized)
    # Exposing internal tensors stops onnxruntime fusing Conv+BN in the original, which is what
    # we want here: the original's Conv output must really be the pre-BN value.
    ref = run(original, feed, [*renamed, *renamed.values()], ort_optimizations=False)
    new = run(optimized, feed, list(renamed), ort_optimizations=False)
    inits_after = {i.name for i in optimized.graph.initializer}
    check = {k: (rel_l2(ref[k], new[k]), rel_l2(ref[v], new[k])) for k, v in renamed.items()}
    return PairReport(
        name,
        op_counts(original),
        op_counts(optimized),
        max_abs(*raw),
        rel_l2(*raw),
        max_abs(*opt),
        rel_l2(*opt),
        original.ByteSize(),
        optimized.ByteSize(),
        dead_nodes(optimized),
        sorted({i.name for i in original.graph.initializer} & inits_after),
        renamed,
        check,
    )


def _optimizer_available() -> bool:
    """onnxoptimizer is an optional extra; without it only the unoptimized models are written."""
    try:
        import onnxoptimizer  # noqa: F401
    except ImportError:
        return False
    return True


def main(argv: Sequence[str] | None = None) -> int:
    """Write the models (and optimized copies) to OUTDIR and print what the pass changed."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("outdir", type=Path, help="where to write the .onnx files")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random input")
    args = parser.parse_args(argv)
    out: Path = args.outdir
    out.mkdir(parents=True, exist_ok=True)
    have_optimizer = _optimizer_available()
    if not have_optimizer:
        print("onnxoptimizer is not installed: writing the unoptimized models only")
    variants: tuple[tuple[str, WeightSource], ...] = (
        ("conv_bn", "initializer"),
        ("conv_bn_constant", "constant"),
    )
    for stem, weight in variants:
        model = conv_bn_model(weight)
        onnx.save(model, str(out / f"{stem}.onnx"))
        print(f"wrote {out / f'{stem}.onnx'} ({len(model.graph.node)} nodes)")
        if not have_optimizer:
            continue
        optimized = fuse_bn(model)
        onnx.save(optimized, str(out / f"{stem}.optimized.onnx"))
        print(f"wrote {out / f'{stem}.optimized.onnx'}")
        print(
            "\n".join(
                compare(
                    f"{stem}.onnx -> {stem}.optimized.onnx", model, optimized, args.seed
                ).lines()
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
