#!/usr/bin/env python3
"""A SIMULATED faulty runtime for the exec: protocol: ONNX Runtime with a planted kernel bug.

    python examples/faulty_runtime.py MODEL INPUTS OUTPUTS [--fault NODE=0.05] [--reject OP]
        [--pattern-fault NODE=F] [--hidden-fault NODE=F] [--input-fault NODE=F:T]
        [--abort-on NODE] [--sleep S]

It runs MODEL on INPUTS (.npz keyed by input name) with ONNX Runtime and writes OUTPUTS (.npz
keyed by output name), exactly as the exec: protocol asks (docs/exec-protocol.md). With
``--fault NODE=F`` every output of node NODE is multiplied by (1 + F) wherever NODE appears
(in the output's own type: float16, float64 and integer outputs too),
which is what a wrong kernel looks like from outside. With ``--reject OP`` it refuses models
containing that op type, like a runtime that lacks a kernel. Bugs that hide from a per-node
check are simulated too:

- ``--pattern-fault NODE=F``: NODE (a Mul) is wrong only when the model also computes its two
  inputs as Conv -> Sigmoid of the same Conv: a fused SiLU kernel bug, as in YOLO11x on Burn.
- ``--hidden-fault NODE=F``: NODE is wrong only when its output is not a graph output: a fusion
  bug that disappears when the tensor is observed.
- ``--abort-on NODE``: the process aborts (SIGABRT) whenever NODE is in the model.
- ``--hang-on NODE``: the process hangs whenever NODE is in the model.
- ``--fail-on NODE``: the process reports an error and exits 5 whenever NODE is in the model,
  as a compiler flag that breaks every model from the first node on does.
- ``--context-fault NODE=F:N``: NODE is wrong only in models of at least N nodes: a bug that
  needs the whole graph around it (a memory planner, say), so no small subgraph shows it.
- ``--pass-fault PASS[+PASS2]:NODE=F[:N]``: NODE is wrong only while optimizer pass PASS (and
  PASS2) is on (and, with ``:N``, only in models of at least N nodes: a fusion whose pattern
  spans the graph around it): a fusion pass bug. ``--disable A,B`` turns passes off, as a
  runtime flag would; with ``--disable {disable}`` in the exec: command and ``--passes``
  naming the passes, onnx-bisect finds which pass breaks it.
- ``--input-fault NODE=F:T``: NODE is wrong only when its first input holds a value above T
  in magnitude (max |x| > T): an input-dependent bug, like an fp16 kernel that overflows on
  bright images only, so a dataset shows it on some inputs and not others.

``--exclusive LOCKFILE`` makes it a runtime of one device: a run started while another holds
LOCKFILE fails ("device busy", exit 3), as a runtime that cannot run two models at once does.

For tests that must catch it mid-run (Ctrl-C): ``--sleep SECONDS`` makes every run that slow,
and ``--mark FILE`` appends a line per run to FILE as it starts (``<pid> <nodes> <model path>``),
so that a test can wait for a given run instead of guessing how long to sleep.

It needs only onnx, numpy and onnxruntime, so it doubles as a template for wrapping your own
runtime.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import zipfile
from collections.abc import Callable

import numpy as np
import onnx
import onnxruntime as ort
from onnx import helper


def plant_fault(model: onnx.ModelProto, node_name: str, factor: float) -> onnx.ModelProto:
    """A copy of ``model`` whose node ``node_name`` outputs (1 + factor) × the right value,
    wherever it is: in the main graph or inside an If branch or a Loop/Scan body, and in every
    iteration of a Loop onnx-bisect unrolled (``{loop}/iteration_{i}/{node_name}``), as a
    kernel bug would. Every output of the node is scaled in its own type: float16 and float64
    by a scale of that type, integers through float64 and rounded away from zero (so that a
    small integer moves too), booleans left alone; each fault node has a name of its own."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    types: dict[str, int] = {}  # inferred once the node is found: models without it cost nothing

    def elem_type(tensor: str) -> int:
        if not types:
            types.update(_elem_types(model) or {"": 0})
        return types.get(tensor, onnx.TensorProto.FLOAT)

    _plant(out.graph, node_name, factor, elem_type)
    return out


def _elem_types(model: onnx.ModelProto) -> dict[str, int]:
    """Every typed tensor's element type, subgraphs included, after type inference (an
    untyped one is treated as float32)."""
    try:
        inferred = onnx.shape_inference.infer_shapes(model)
    except Exception:  # noqa: BLE001 -- a model inference cannot read keeps float32 faults
        inferred = model
    types: dict[str, int] = {}

    def walk(graph: onnx.GraphProto) -> None:
        for v in [*graph.input, *graph.output, *graph.value_info]:
            if v.type.HasField("tensor_type") and v.type.tensor_type.elem_type:
                types[v.name] = v.type.tensor_type.elem_type
        types.update({t.name: t.data_type for t in graph.initializer})
        for node in graph.node:
            for attr in node.attribute:
                for sub in [attr.g] if attr.type == onnx.AttributeProto.GRAPH else []:
                    walk(sub)
                for sub in attr.graphs:
                    walk(sub)

    walk(inferred.graph)
    return types


def _plant(
    graph: onnx.GraphProto, node_name: str, factor: float, elem_type: Callable[[str], int]
) -> None:
    nodes = []
    for node in graph.node:
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.GRAPH:
                _plant(attr.g, node_name, factor, elem_type)
            for sub in attr.graphs:
                _plant(sub, node_name, factor, elem_type)
        nodes.append(node)
        if not _is(node.name, node_name):
            continue
        for i, name in enumerate(node.output):
            if not name:
                continue
            elem = elem_type(name)
            if elem == onnx.TensorProto.BOOL:
                continue  # a scale means nothing to a boolean
            raw = f"{name}__unfaulted"
            node.output[i] = raw
            fault = f"{node.name}__fault" + (f"_{i}" if len(node.output) > 1 else "")
            # Right after the node: a body graph must stay in topological order.
            nodes += _scaled(raw, name, fault, factor, elem)
    copies = [onnx.NodeProto() for _ in nodes]
    for copy, node in zip(copies, nodes, strict=True):
        copy.CopyFrom(node)
    del graph.node[:]
    graph.node.extend(copies)


_SAME_TYPE = (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.DOUBLE)


def _scaled(raw: str, name: str, fault: str, factor: float, elem: int) -> list[onnx.NodeProto]:
    """Nodes computing ``name`` = ``raw`` × (1 + factor) in ``raw``'s own type ``elem``."""
    scale = f"{name}__fault_scale"
    if elem in _SAME_TYPE:
        value = helper.make_tensor("v", elem, [], [1.0 + factor])
        return [
            helper.make_node("Constant", [], [scale], value=value),
            helper.make_node("Mul", [raw, scale], [name], name=fault),
        ]
    wide = f"{name}__fault_f64"
    value = helper.make_tensor("v", onnx.TensorProto.DOUBLE, [], [1.0 + factor])
    nodes = [
        helper.make_node("Cast", [raw], [wide], to=onnx.TensorProto.DOUBLE),
        helper.make_node("Constant", [], [scale], value=value),
        helper.make_node("Mul", [wide, scale], [f"{name}__fault_mul"], name=fault),
    ]
    scaled = f"{name}__fault_mul"
    if elem != onnx.TensorProto.BFLOAT16:  # an integer: rounded away from zero
        nodes += [
            helper.make_node("Abs", [scaled], [f"{name}__fault_abs"]),
            helper.make_node("Ceil", [f"{name}__fault_abs"], [f"{name}__fault_ceil"]),
            helper.make_node("Sign", [scaled], [f"{name}__fault_sign"]),
            helper.make_node(
                "Mul", [f"{name}__fault_sign", f"{name}__fault_ceil"], [f"{name}__fault_int"]
            ),
        ]
        scaled = f"{name}__fault_int"
    return [*nodes, helper.make_node("Cast", [scaled], [name], to=elem)]


def plant_input_fault(
    model: onnx.ModelProto, node_name: str, factor: float, trigger: float
) -> onnx.ModelProto:
    """A copy of ``model`` whose top-level node ``node_name`` outputs (1 + factor) × the right
    value when max |its first input| > ``trigger``, and the right value otherwise. The test is
    computed in the graph, so the fault follows the data wherever the node runs (the whole
    model, a node isolated on fed values, a repro bundle)."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    nodes: list[onnx.NodeProto] = []
    for original in out.graph.node:
        node = onnx.NodeProto()
        node.CopyFrom(original)  # the originals go when the graph's list is replaced
        nodes.append(node)
        if not _is(node.name, node_name) or not node.input:
            continue
        p = f"{node.name}__input_fault"
        nodes += [
            helper.make_node("Abs", [node.input[0]], [f"{p}_abs"]),
            helper.make_node("ReduceMax", [f"{p}_abs"], [f"{p}_max"], keepdims=0),
            _constant(f"{p}_t", trigger),
            helper.make_node("Greater", [f"{p}_max", f"{p}_t"], [f"{p}_on"]),
            helper.make_node("Cast", [f"{p}_on"], [f"{p}_onf"], to=onnx.TensorProto.FLOAT),
            _constant(f"{p}_f", factor),
            _constant(f"{p}_one", 1.0),
            helper.make_node("Mul", [f"{p}_onf", f"{p}_f"], [f"{p}_df"]),
            helper.make_node("Add", [f"{p}_one", f"{p}_df"], [f"{p}_scale"]),
        ]
        for i, name in enumerate(node.output):
            if name:
                node.output[i] = raw = f"{name}__unfaulted"
                nodes.append(helper.make_node("Mul", [raw, f"{p}_scale"], [name]))
    del out.graph.node[:]
    out.graph.node.extend(nodes)
    return out


def _constant(name: str, value: float) -> onnx.NodeProto:
    tensor = helper.make_tensor("v", onnx.TensorProto.FLOAT, [], [value])
    return helper.make_node("Constant", [], [name], value=tensor)


def _is(name: str, wanted: str) -> bool:
    head, sep, tail = name.rpartition("/iteration_")
    return name == wanted or bool(head and sep and tail.partition("/")[2] == wanted)


def silu_pattern_present(model: onnx.ModelProto, mul_name: str) -> bool:
    """True when ``mul_name`` multiplies X by Sigmoid(X) and X comes from a Conv in ``model``."""
    producer = {o: n for n in model.graph.node for o in n.output}
    mul = next((n for n in model.graph.node if n.name == mul_name), None)
    if mul is None or mul.op_type != "Mul":
        return False
    ops = {producer[i].op_type: producer[i] for i in mul.input if i in producer}
    conv, sig = ops.get("Conv"), ops.get("Sigmoid")
    return conv is not None and sig is not None and sig.input[0] in conv.output


def output_observed(model: onnx.ModelProto, node_name: str) -> bool:
    node = next((n for n in model.graph.node if n.name == node_name), None)
    outputs = {o.name for o in model.graph.output}
    return node is not None and any(o in outputs for o in node.output)


_device: object = None  # the lock file, held open (and locked) until the process ends


def _hold_device(path: str) -> bool:
    """Take the one device (an exclusive lock on ``path``), or say it is taken."""
    global _device
    import fcntl

    handle = open(path, "a")  # noqa: SIM115 -- held for the life of the process
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.close()
        return False
    _device = handle
    return True


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model")
    p.add_argument("inputs")
    p.add_argument("outputs")
    p.add_argument("--fault", action="append", default=[], help="NODE=FRACTION, e.g. conv1=0.05")
    p.add_argument("--reject", action="append", default=[], help="op type this runtime lacks")
    p.add_argument("--pattern-fault", action="append", default=[], help="MUL=F, SiLU chains only")
    p.add_argument("--hidden-fault", action="append", default=[], help="NODE=F when unobserved")
    p.add_argument("--abort-on", action="append", default=[], help="abort if NODE is present")
    p.add_argument("--hang-on", action="append", default=[], help="hang if NODE is present")
    p.add_argument("--fail-on", action="append", default=[], help="exit 5 if NODE is present")
    p.add_argument(
        "--context-fault", action="append", default=[], help="NODE=F:MIN_NODES, big graphs only"
    )
    p.add_argument(
        "--pass-fault", action="append", default=[], help="PASS[+PASS2]:NODE=F[:N], pass on only"
    )
    p.add_argument(
        "--input-fault", action="append", default=[], help="NODE=F:T, when max |input| > T"
    )
    p.add_argument("--disable", default="", help="comma-separated passes to turn off")
    p.add_argument("--sleep", type=float, default=0.0, help="seconds every run takes longer")
    p.add_argument("--mark", help="append '<pid> <nodes> <model>' to this file per run")
    p.add_argument("--exclusive", help="fail while another run holds this lock file")
    args = p.parse_args(argv)
    if args.exclusive and not _hold_device(args.exclusive):
        print("error: device busy: another run holds it", file=sys.stderr)
        return 3
    # External weights stay in their file (a hard link onnx-bisect made, which onnx.load
    # refuses): the faults rewrite nodes only, and ONNX Runtime reads the weights itself.
    model = onnx.load(args.model, load_external_data=False)
    present = {n.name for n in model.graph.node}
    if args.mark:
        with open(args.mark, "a") as f:
            f.write(f"{os.getpid()} {len(model.graph.node)} {args.model}\n")
    time.sleep(args.sleep)
    if any(name in present for name in args.abort_on):
        os.abort()
    if any(name in present for name in args.hang_on):
        time.sleep(3600)
    failing = [name for name in args.fail_on if name in present]
    if failing:
        message = f"error: buffer view byte length exceeds backing buffer at {failing[0]}"
        print(message, file=sys.stderr)
        return 5
    for node in model.graph.node:
        if node.op_type in args.reject:
            print(
                f"error: op {node.op_type} (node {node.name}) is not implemented", file=sys.stderr
            )
            return 2
    for fault in args.fault:
        name, _, frac = fault.rpartition("=")
        model = plant_fault(model, name, float(frac))
    for fault in args.pattern_fault:
        name, _, frac = fault.rpartition("=")
        if silu_pattern_present(model, name):
            model = plant_fault(model, name, float(frac))
    for fault in args.context_fault:
        name, _, spec = fault.rpartition("=")
        frac, _, min_nodes = spec.partition(":")
        if name in present and len(model.graph.node) >= int(min_nodes):
            model = plant_fault(model, name, float(frac))
    disabled = {d for d in args.disable.split(",") if d}
    for fault in args.pass_fault:
        passes, _, rest = fault.partition(":")
        name, _, spec = rest.rpartition("=")
        frac, _, min_nodes = spec.partition(":")
        big = len(model.graph.node) >= int(min_nodes or 0)
        if name in present and big and not disabled & set(passes.split("+")):
            model = plant_fault(model, name, float(frac))
    for fault in args.input_fault:
        name, _, spec = fault.rpartition("=")
        frac, _, trigger = spec.partition(":")
        model = plant_input_fault(model, name, float(frac), float(trigger))
    for fault in args.hidden_fault:
        name, _, frac = fault.rpartition("=")
        if name in present and not output_observed(model, name):
            model = plant_fault(model, name, float(frac))
    options = ort.SessionOptions()  # external data is read from the model's directory
    folder = os.path.dirname(os.path.abspath(args.model))
    options.add_session_config_entry("session.model_external_initializers_file_folder_path", folder)
    sess = ort.InferenceSession(
        model.SerializeToString(), options, providers=["CPUExecutionProvider"]
    )
    with np.load(args.inputs) as z:
        feeds = {i.name: z[i.name] for i in sess.get_inputs()}
    names = [o.name for o in sess.get_outputs()]
    values = sess.run(names, feeds)
    save_npz(args.outputs, dict(zip(names, values, strict=True)))
    return 0


def save_npz(path: str, tensors: dict[str, np.ndarray]) -> None:
    """``outputs.npz`` keyed by any tensor name: np.savez(path, **tensors) would swallow a
    tensor named ``file`` or ``allow_pickle`` (onnx_bisect.save_npz does the same)."""
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_STORED, allowZip64=True) as zf:
        for name, value in tensors.items():
            with zf.open(f"{name}.npy", "w", force_zip64=True) as f:
                np.lib.format.write_array(f, np.asarray(value), allow_pickle=False)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
