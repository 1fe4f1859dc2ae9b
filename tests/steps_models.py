"""Multi-step models for tests/test_steps.py, and a runtime whose fault starts at a step.

``export_gpt2``: a GPT-2-shaped decoder from a transformers config (random weights), exported
with its KV cache under Hugging Face names (torch and transformers imported when called).

``kv_decoder``: a one-layer, one-head decoder with Hugging Face names (``input_ids``,
``attention_mask``, ``past_key_values.0.key/value`` in; ``logits``, ``present.0.key/value``
out), its attention scores computed by ``/attn/qk/MatMul``. ``streaming``: a model with four
explicit caches (``c0..c3`` in, ``n0..n3`` out) and a per-chunk input ``x``.

``StepFault`` (a plugin adapter: ``tests/steps_models.py:StepFault?node=N&when=...``) is ONNX
Runtime with node N's output scaled by 1.05 only once a condition on that node's own tensors
holds: the attention length (the last dim of its output) reaching ``length``, or its first
input's largest value above ``above``. Being written into the graph, the fault follows the
node into every model the search cuts, as a kernel bug would.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from onnx_bisect import BackendBase, BackendSpec
from onnx_bisect.backends.registry import create_backend

IR, OPSET = 9, 17
Arr = np.ndarray[Any, Any]
ATTENTION = "/attn/qk/MatMul"
PAST = "past_key_values.0"


def _init(name: str, a: np.ndarray[Any, Any]) -> TensorProto:
    return numpy_helper.from_array(np.asarray(a), name)


def kv_decoder(
    vocab: int = 16, d: int = 8, seed: int = 0, tie: bool = False
) -> onnx.ModelProto:
    """``tie``: tokens 3 and 7 get logits 100 and 100.01 on top of the rest: float32 tells
    them apart, float16 (a step of 0.0625 at 100) does not."""
    rng = np.random.default_rng(seed)
    f = np.float32
    bias = np.zeros(vocab, f)
    w_out = rng.normal(0, 0.5, (d, vocab)).astype(f)
    if tie:
        bias[3], bias[7] = 100.0, 100.01
        w_out[:, 7] = w_out[:, 3]
    inits = [
        _init("E", rng.normal(0, 1, (vocab, d)).astype(f)),
        _init("Wq", rng.normal(0, 0.5, (d, d)).astype(f)),
        _init("Wk", rng.normal(0, 0.5, (d, d)).astype(f)),
        _init("Wv", rng.normal(0, 0.5, (d, d)).astype(f)),
        _init("Wo", rng.normal(0, 0.5, (d, d)).astype(f)),
        _init("Wout", w_out),
        _init("bout", bias),
        _init("scale", np.array(1 / np.sqrt(d), f)),
        _init("one", np.array(1.0, f)),
        _init("neg", np.array(-1e4, f)),
        _init("ax1", np.array([1], np.int64)),
        _init("ax12", np.array([1, 2], np.int64)),
    ]
    n = helper.make_node
    nodes = [
        n("Gather", ["E", "input_ids"], ["emb"], name="/embed/Gather"),
        n("MatMul", ["emb", "Wq"], ["q"], name="/attn/q/MatMul"),
        n("MatMul", ["emb", "Wk"], ["k"], name="/attn/k/MatMul"),
        n("MatMul", ["emb", "Wv"], ["v"], name="/attn/v/MatMul"),
        n("Unsqueeze", ["q", "ax1"], ["q4"], name="/attn/q/Unsqueeze"),
        n("Unsqueeze", ["k", "ax1"], ["k4"], name="/attn/k/Unsqueeze"),
        n("Unsqueeze", ["v", "ax1"], ["v4"], name="/attn/v/Unsqueeze"),
        n("Concat", [f"{PAST}.key", "k4"], ["present.0.key"], axis=2, name="/attn/k/Concat"),
        n("Concat", [f"{PAST}.value", "v4"], ["present.0.value"], axis=2, name="/attn/v/Concat"),
        n("Transpose", ["present.0.key"], ["kt"], perm=[0, 1, 3, 2], name="/attn/k/Transpose"),
        n("MatMul", ["q4", "kt"], ["scores"], name=ATTENTION),
        n("Mul", ["scores", "scale"], ["scaled"], name="/attn/scale/Mul"),
        n("Cast", ["attention_mask"], ["maskf"], to=TensorProto.FLOAT, name="/mask/Cast"),
        n("Sub", ["one", "maskf"], ["masked"], name="/mask/Sub"),
        n("Mul", ["masked", "neg"], ["maskadd"], name="/mask/Mul"),
        n("Unsqueeze", ["maskadd", "ax12"], ["mask4"], name="/mask/Unsqueeze"),
        n("Add", ["scaled", "mask4"], ["biased"], name="/attn/mask/Add"),
        n("Softmax", ["biased"], ["probs"], axis=-1, name="/attn/Softmax"),
        n("MatMul", ["probs", "present.0.value"], ["ctx4"], name="/attn/pv/MatMul"),
        n("Squeeze", ["ctx4", "ax1"], ["ctx"], name="/attn/Squeeze"),
        n("MatMul", ["ctx", "Wo"], ["proj"], name="/attn/o/MatMul"),
        n("Add", ["emb", "proj"], ["h"], name="/residual/Add"),
        n("MatMul", ["h", "Wout"], ["raw_logits"], name="/lm_head/MatMul"),
        n("Add", ["raw_logits", "bout"], ["logits"], name="/lm_head/Add"),
    ]
    cache, grown = ["batch", 1, "past", d], ["batch", 1, "total", d]
    graph = helper.make_graph(
        nodes,
        "kv_decoder",
        [
            helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "seq"]),
            helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["batch", "total"]),
            helper.make_tensor_value_info("past_key_values.0.key", TensorProto.FLOAT, cache),
            helper.make_tensor_value_info("past_key_values.0.value", TensorProto.FLOAT, cache),
        ],
        [
            helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", "seq", vocab]),
            helper.make_tensor_value_info("present.0.key", TensorProto.FLOAT, grown),
            helper.make_tensor_value_info("present.0.value", TensorProto.FLOAT, grown),
        ],
        inits,
    )
    model = helper.make_model(graph, ir_version=IR, opset_imports=[helper.make_opsetid("", OPSET)])
    onnx.checker.check_model(model, full_check=True)
    return model


def streaming(size: int = 4, seed: int = 0) -> onnx.ModelProto:
    """``x`` (a chunk) and caches ``c0..c3`` in; ``y`` and the next caches ``n0..n3`` out."""
    rng = np.random.default_rng(seed)
    f = np.float32
    n = helper.make_node
    inits = [_init("w", rng.normal(0, 1, (size,)).astype(f))]
    nodes = [n("Mul", ["x", "w"], ["xw"], name="/in/Mul")]
    prev = "xw"
    for i in range(4):
        inits.append(_init(f"a{i}", rng.normal(0, 0.5, (size,)).astype(f)))
        nodes += [
            n("Mul", [f"c{i}", f"a{i}"], [f"ca{i}"], name=f"/cell{i}/Mul"),
            n("Add", [prev, f"ca{i}"], [f"s{i}"], name=f"/cell{i}/Add"),
            n("Tanh", [f"s{i}"], [f"n{i}"], name=f"/cell{i}/Tanh"),
        ]
        prev = f"n{i}"
    nodes.append(n("Add", [prev, "x"], ["y"], name="/out/Add"))
    vi = helper.make_tensor_value_info
    graph = helper.make_graph(
        nodes,
        "streaming",
        [vi("x", TensorProto.FLOAT, [1, size])]
        + [vi(f"c{i}", TensorProto.FLOAT, [1, size]) for i in range(4)],
        [vi("y", TensorProto.FLOAT, [1, size])]
        + [vi(f"n{i}", TensorProto.FLOAT, [1, size]) for i in range(4)],
        inits,
    )
    model = helper.make_model(graph, ir_version=IR, opset_imports=[helper.make_opsetid("", OPSET)])
    onnx.checker.check_model(model, full_check=True)
    return model


def _const(name: str, dtype: int, dims: list[int], value: float) -> onnx.NodeProto:
    return helper.make_node(
        "Constant", [], [name], value=helper.make_tensor("", dtype, dims, [value])
    )


def plant_when(
    model: onnx.ModelProto, node_name: str, *, length: int | None, above: float | None
) -> onnx.ModelProto:
    """``node_name``'s outputs × (1 + 0.05 · condition), the condition computed in the graph
    from the node's own tensors."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    nodes: list[onnx.NodeProto] = []
    n = helper.make_node
    for node in out.graph.node:
        nodes.append(node)
        if node.name != node_name:
            continue
        y = node.output[0]
        raw, p = f"{y}__unfaulted", f"{node_name}__when"
        node.output[0] = raw
        if length is not None:
            nodes += [
                n("Shape", [raw], [f"{p}/shape"], start=-1),
                _const(f"{p}/bound", TensorProto.INT64, [1], length),
                n("GreaterOrEqual", [f"{p}/shape", f"{p}/bound"], [f"{p}/on"]),
            ]
        else:
            nodes += [
                n("ReduceMax", [node.input[0]], [f"{p}/max"], keepdims=0),
                _const(f"{p}/bound", TensorProto.FLOAT, [], above or 0.0),
                n("Greater", [f"{p}/max", f"{p}/bound"], [f"{p}/on"]),
            ]
        nodes += [
            n("Cast", [f"{p}/on"], [f"{p}/onf"], to=TensorProto.FLOAT),
            _const(f"{p}/k", TensorProto.FLOAT, [], 0.05),
            n("Mul", [f"{p}/onf", f"{p}/k"], [f"{p}/d"]),
            _const(f"{p}/one", TensorProto.FLOAT, [], 1.0),
            n("Add", [f"{p}/d", f"{p}/one"], [f"{p}/factor"]),
            n("Mul", [raw, f"{p}/factor"], [y], name=f"{node_name}__fault"),
        ]
    del out.graph.node[:]
    out.graph.node.extend(nodes)
    return out


class StepFault(BackendBase):
    """ONNX Runtime with a fault that starts at a step (see the module's docstring)."""

    def __init__(self, spec: BackendSpec) -> None:
        super().__init__(spec)
        spec.check_options(["node", "length", "above"])
        self.node = spec.option("node") or ATTENTION
        length, above = spec.option("length"), spec.option("above")
        self.length = int(length) if length else None
        self.above = float(above) if above else None
        self.inner = create_backend("cpu")

    def _run(self, model: onnx.ModelProto, feeds: Mapping[str, Arr]) -> dict[str, Arr]:
        planted = plant_when(model, self.node, length=self.length, above=self.above)
        return dict(self.inner.run(planted, feeds))


def export_gpt2(path: Path, layers: int) -> str:
    """The decoder at ``path``; returns layer 1's (or 0's) attention-score MatMul."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.cache_utils import DynamicCache

    cfg = GPT2Config(n_layer=layers, n_embd=64, n_head=4, vocab_size=1000, n_positions=128)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(cfg).eval()

    class WithCache(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.m = model

        def forward(self, input_ids: Any, attention_mask: Any, *past: Any) -> Any:
            cache = DynamicCache()
            for i in range(layers):
                cache.update(past[2 * i], past[2 * i + 1], i)
            out = self.m(
                input_ids=input_ids,
                attention_mask=attention_mask,
                past_key_values=cache,
                use_cache=True,
            )
            kv = out.past_key_values
            flat = [t for layer in kv.layers for t in (layer.keys, layer.values)]
            return (out.logits, *flat)

    kinds = [f"{i}.{kv}" for i in range(layers) for kv in ("key", "value")]
    inputs = ["input_ids", "attention_mask", *(f"past_key_values.{k}" for k in kinds)]
    outputs = ["logits", *(f"present.{k}" for k in kinds)]
    axes: dict[str, dict[int, str]] = {
        "input_ids": {0: "batch", 1: "seq"},
        "attention_mask": {0: "batch", 1: "total"},
        "logits": {0: "batch", 1: "seq"},
    }
    axes |= {n: {0: "batch", 2: "past"} for n in inputs[2:]}
    axes |= {n: {0: "batch", 2: "total"} for n in outputs[1:]}
    past = [torch.randn(1, 4, 3, 16) for _ in kinds]
    example = (torch.tensor([[5]]), torch.ones(1, 4, dtype=torch.int64), *past)
    torch.onnx.export(
        WithCache(),
        example,
        str(path),
        input_names=inputs,
        output_names=outputs,
        dynamic_axes=axes,
        opset_version=17,
        dynamo=False,
    )
    return f"/m/transformer/h.{min(1, layers - 1)}/attn/MatMul"
