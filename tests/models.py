"""Tiny models built with onnx.helper, and paths to the shipped example models."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

ROOT = Path(__file__).resolve().parents[1]
YOLO = ROOT / "examples" / "models" / "yolo_like.onnx"
YOLO_FUSED = ROOT / "examples" / "models" / "yolo_fused.onnx"  # BN folded: Conv->Sigmoid->Mul
TRANSFORMER = ROOT / "examples" / "models" / "transformer_block.onnx"
FAULTY_RUNTIME = ROOT / "examples" / "faulty_runtime.py"

OPSET = 18
IR = 10  # what onnxruntime 1.18+ loads


def make(
    nodes: list[onnx.NodeProto],
    inputs: list[onnx.ValueInfoProto],
    outputs: list[onnx.ValueInfoProto],
    initializers: list[onnx.TensorProto] | None = None,
) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "g", inputs, outputs, initializer=initializers or [])
    return helper.make_model(graph, ir_version=IR, opset_imports=[helper.make_opsetid("", OPSET)])


def chain(n: int = 4, width: int = 8, seed: int = 0) -> onnx.ModelProto:
    """x -> (MatMul W_i -> Tanh) * n -> y, with named nodes ``mm{i}`` and ``act{i}``."""
    rng = np.random.default_rng(seed)
    nodes, inits = [], []
    prev = "x"
    for i in range(n):
        w = numpy_helper.from_array(
            (rng.standard_normal((width, width)) / np.sqrt(width)).astype(np.float32), f"W{i}"
        )
        inits.append(w)
        nodes.append(helper.make_node("MatMul", [prev, f"W{i}"], [f"h{i}"], name=f"mm{i}"))
        out = "y" if i == n - 1 else f"a{i}"
        nodes.append(helper.make_node("Tanh", [f"h{i}"], [out], name=f"act{i}"))
        prev = out
    return make(
        nodes,
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", width])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", width])],
        inits,
    )


def residual(blocks: int = 3, width: int = 8, seed: int = 0) -> onnx.ModelProto:
    """Residual blocks: h = x + Tanh(MatMul(x, W)); the Adds carry error forward."""
    rng = np.random.default_rng(seed)
    nodes, inits = [], []
    prev = "x"
    for i in range(blocks):
        w = (rng.standard_normal((width, width)) / np.sqrt(width)).astype(np.float32)
        inits.append(numpy_helper.from_array(w, f"W{i}"))
        nodes += [
            helper.make_node("MatMul", [prev, f"W{i}"], [f"m{i}"], name=f"mm{i}"),
            helper.make_node("Tanh", [f"m{i}"], [f"t{i}"], name=f"act{i}"),
            helper.make_node("Add", [prev, f"t{i}"], [f"r{i}"], name=f"add{i}"),
        ]
        prev = f"r{i}"
    nodes.append(helper.make_node("Identity", [prev], ["y"], name="out"))
    return make(
        nodes,
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, width])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, width])],
        inits,
    )


def unsorted() -> onnx.ModelProto:
    """A valid graph stored in the wrong order: the consumer comes before its producer."""
    m = chain(2)
    nodes = list(m.graph.node)
    del m.graph.node[:]
    m.graph.node.extend(list(reversed(nodes)))
    return m


def with_if() -> onnx.ModelProto:
    """Relu, then an If whose branches hold tensors that cannot be probed."""
    then_g = helper.make_graph(
        [helper.make_node("Neg", ["r"], ["then_out"], name="neg")],
        "then",
        [],
        [helper.make_tensor_value_info("then_out", TensorProto.FLOAT, [4])],
    )
    else_g = helper.make_graph(
        [helper.make_node("Abs", ["r"], ["else_out"], name="abs")],
        "else",
        [],
        [helper.make_tensor_value_info("else_out", TensorProto.FLOAT, [4])],
    )
    nodes = [
        helper.make_node("Relu", ["x"], ["r"], name="relu"),
        helper.make_node("ReduceSum", ["r"], ["s"], name="sum", keepdims=0),
        helper.make_node("Greater", ["s", "zero"], ["c"], name="gt"),
        helper.make_node("If", ["c"], ["y"], name="branch", then_branch=then_g, else_branch=else_g),
    ]
    return make(
        nodes,
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])],
        [numpy_helper.from_array(np.array(0.0, np.float32), "zero")],
    )


def int_output() -> onnx.ModelProto:
    """x -> ArgMax -> idx (int64): integer tensors are compared exactly."""
    nodes = [helper.make_node("ArgMax", ["x"], ["idx"], name="argmax", axis=1, keepdims=0)]
    return make(
        nodes,
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 5])],
        [helper.make_tensor_value_info("idx", TensorProto.INT64, [2])],
    )


def two_inputs() -> onnx.ModelProto:
    """a[seq, 4] float, mask[seq, 4] bool -> Where(mask, a, 0)."""
    nodes = [helper.make_node("Where", ["mask", "a", "zero"], ["y"], name="where")]
    return make(
        nodes,
        [
            helper.make_tensor_value_info("a", TensorProto.FLOAT, ["seq", 4]),
            helper.make_tensor_value_info("mask", TensorProto.BOOL, ["seq", 4]),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["seq", 4])],
        [numpy_helper.from_array(np.array(0.0, np.float32), "zero")],
    )


def first_conv(model_path: Path = YOLO, skip: int = 0) -> str:
    """Name of the (skip+1)-th Conv in a model file."""
    m = onnx.load(str(model_path))
    convs = [n.name for n in m.graph.node if n.op_type == "Conv"]
    return convs[skip]


def typed_inputs() -> onnx.ModelProto:
    """One input per generated dtype, each passed through an Identity; batch-like dynamic dims."""
    specs = [
        ("f", TensorProto.FLOAT, ["batch", 3]),
        ("b", TensorProto.BOOL, ["N", 2]),
        ("i", TensorProto.INT64, ["batch_size", 5]),
        ("u", TensorProto.UINT8, [1, 4096]),
        ("s", TensorProto.INT8, [1, 4096]),
        ("h", TensorProto.FLOAT16, [2, 2]),
    ]
    return make(
        [helper.make_node("Identity", [n], [f"{n}_out"], name=f"id_{n}") for n, _, _ in specs],
        [helper.make_tensor_value_info(n, t, d) for n, t, d in specs],
        [helper.make_tensor_value_info(f"{n}_out", t, d) for n, t, d in specs],
    )


def node_named(loaded: Any, name: str) -> Any:
    """The node called ``name`` in a LoadedModel (KeyError when there is none)."""
    for n in loaded.nodes:
        if n.name == name:
            return n
    raise KeyError(name)


def write_external_mlp(
    path: Path, blocks: int = 3, width: int = 8, hidden: int = 16, seed: int = 0
) -> list[str]:
    """x -> (MatMul W_i -> Add b_i -> Relu) × blocks -> y, with every weight in ``<path>.data``.

    The weights are written straight to the file with numpy, block by block, and the model
    only points at them, so no protobuf message or test process ever holds them all: a model
    with gigabytes of weights costs a few MB of RAM to build. Nodes are ``mm{i}``, ``add{i}``
    and ``relu{i}``; returns the node names in order.
    """
    rng = np.random.default_rng(seed)
    data = path.with_name(path.name + ".data")
    nodes, inits, names = [], [], []
    dims = [width] + [hidden if i % 2 == 0 else width for i in range(blocks)]
    prev = "x"
    with data.open("wb") as f:
        for i in range(blocks):
            rows, cols = dims[i], dims[i + 1]
            inits.append(_external(f, f"W{i}", (rows, cols), data.name))
            # He-uniform, so that activations keep their size through every Relu; uniform
            # in place because normal variates take 10x longer for gigabytes.
            limit = np.float32(np.sqrt(6.0 / rows))
            step = max(1, (16 << 20) // cols)  # 64 MiB of float32 at a time
            for r in range(0, rows, step):
                block = np.empty((min(step, rows - r), cols), np.float32)
                rng.random(out=block, dtype=np.float32)
                block -= np.float32(0.5)
                block *= 2 * limit
                block.tofile(f)
            inits.append(_external(f, f"b{i}", (cols,), data.name))
            (rng.standard_normal(cols, dtype=np.float32) * np.float32(0.1)).tofile(f)
            out = "y" if i == blocks - 1 else f"a{i}"
            nodes += [
                helper.make_node("MatMul", [prev, f"W{i}"], [f"h{i}"], name=f"mm{i}"),
                helper.make_node("Add", [f"h{i}", f"b{i}"], [f"z{i}"], name=f"add{i}"),
                helper.make_node("Relu", [f"z{i}"], [out], name=f"relu{i}"),
            ]
            names += [f"mm{i}", f"add{i}", f"relu{i}"]
            prev = out
    model = make(
        nodes,
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, width])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, dims[-1]])],
        inits,
    )
    onnx.save_model(model, str(path))
    return names


def _external(f: Any, name: str, dims: tuple[int, ...], location: str) -> onnx.TensorProto:
    """A float32 tensor whose data starts at the file's current end (4 KiB aligned, so that a
    runtime may map it)."""
    pad = -f.tell() % 4096
    f.write(b"\0" * pad)
    t = onnx.TensorProto(name=name, data_type=TensorProto.FLOAT, dims=list(dims))
    t.data_location = onnx.TensorProto.EXTERNAL
    nbytes = int(np.prod(dims)) * 4
    for key, value in (("location", location), ("offset", str(f.tell())), ("length", str(nbytes))):
        t.external_data.add(key=key, value=value)
    return t


def mlp(width: int = 16, hidden: int = 32, out: int = 8, seed: int = 0) -> onnx.ModelProto:
    """x -> /fc1/MatMul -> /relu/Relu -> /fc2/MatMul -> /out/Add (bias) -> y, batch of one:
    /fc2's input grows with x, for faults that fire only on large inputs."""
    rng = np.random.default_rng(seed)
    w1 = (rng.standard_normal((width, hidden)) / 4).astype(np.float32)
    w2 = (rng.standard_normal((hidden, out)) / 4).astype(np.float32)
    bias = rng.standard_normal(out).astype(np.float32)
    nodes = [
        helper.make_node("MatMul", ["x", "W1"], ["h1"], name="/fc1/MatMul"),
        helper.make_node("Relu", ["h1"], ["h2"], name="/relu/Relu"),
        helper.make_node("MatMul", ["h2", "W2"], ["h3"], name="/fc2/MatMul"),
        helper.make_node("Add", ["h3", "b"], ["y"], name="/out/Add"),
    ]
    inits = [numpy_helper.from_array(a, n) for a, n in ((w1, "W1"), (w2, "W2"), (bias, "b"))]
    return make(
        nodes,
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, width])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, out])],
        inits,
    )


def squeeze_if_conv() -> onnx.ModelProto:
    """x[n, 4, 5] -> Relu -> If (n == 1: Squeeze axis 0; else Identity) -> Unsqueeze axis 0 ->
    Conv: PyTorch's "squeeze where the dim is 1" as silero-vad exports it. The branches give
    rank 2 and rank 3, so OpenVINO's frontend types the If's output with no rank ("[...]") and
    refuses the Conv ("The input data tensor's rank has to be known (static)"), though every
    prefix before the Conv runs (at the fed shapes the If folds) and the Conv runs alone."""
    then_g = helper.make_graph(
        [helper.make_node("Squeeze", ["h", "zero_axis"], ["squeezed"], name="squeeze")],
        "then", [], [helper.make_tensor_value_info("squeezed", TensorProto.FLOAT, [4, 5])],
    )  # fmt: skip
    else_g = helper.make_graph(
        [helper.make_node("Identity", ["h"], ["kept"], name="keep")],
        "else", [], [helper.make_tensor_value_info("kept", TensorProto.FLOAT, ["n", 4, 5])],
    )  # fmt: skip
    w = np.linspace(-1, 1, 4 * 4 * 3, dtype=np.float32).reshape(4, 4, 3)
    inits = [
        numpy_helper.from_array(w, "W"),
        numpy_helper.from_array(np.array([0], np.int64), "zero_axis"),
        numpy_helper.from_array(np.array(1, np.int64), "one"),
    ]
    nodes = [
        helper.make_node("Relu", ["x"], ["h"], name="relu"),
        helper.make_node("Shape", ["h"], ["n"], name="shape", end=1),
        helper.make_node("Equal", ["n", "one"], ["single"], name="single"),
        helper.make_node(
            "If", ["single"], ["b"], name="squeeze_if", then_branch=then_g, else_branch=else_g
        ),
        helper.make_node("Unsqueeze", ["b", "zero_axis"], ["u"], name="unsqueeze"),
        helper.make_node("Conv", ["u", "W"], ["y"], name="conv", pads=[1, 1]),
    ]
    return make(
        nodes,
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 4, 5])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 5])],
        inits,
    )
