"""``+fp16``: onnxconverter-common's conversion, with what must stay float32 kept there.

onnxconverter-common 1.16's ``convert_float_to_float16(keep_io_types=True)`` writes models no
runtime loads on many real exports (a model's own ``Cast(to=FLOAT)`` labelled float16, a graph
output read inside the graph, an initializer shared with a blocked node, a ConstantOfShape
without ``value``), refuses a model already in float16, and gives DequantizeLinear or
DynamicQuantizeLinear float16 operands. Rather than rewrite its output, the transform passes
the converter a block list (``node_block_list``, ``op_block_list``): what the answer then
prints is a call the user can paste, and it gives exactly the model that was judged.

- A model whose float tensors are mostly float16 already is judged as it is (no conversion).
- Quantized models: the quantization ops, the integer kernels, and the Cast and Mul that apply
  the float scales to an integer accumulator stay float32 (``quantized_blocks``).
- Every model: each ``Cast(to=FLOAT)`` of the model's own stays float32, since the converter
  keeps its ``to`` but labels its output float16. Then, while onnx's strict type inference
  rejects the converted model, the node it names joins the block list (its producers, when it
  is in the list already) and the model is converted again (``valid_conversion``).
"""

from __future__ import annotations

import copy
import json
import re
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

import onnx

from onnx_bisect.errors import ModelLoadError
from onnx_bisect.transforms.validity import broken_by, resort, unchecked

__all__ = [
    "BLOCKS_KEY",
    "NAME_NODES",
    "BlockList",
    "already_low",
    "base_blocks",
    "blocks_of",
    "convert",
    "fp16",
    "names_given",
    "valid_conversion",
]

_FLOAT, _FLOAT16 = onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16
# Where the converted model records the block list it was converted with, for the
# keep-in-fp32 search (``engine/fp16keep.py``), which converts again with more nodes.
BLOCKS_KEY = "onnx_bisect.fp16.blocks"
# Conversions tried before the transform gives up on a model the converter keeps breaking.
_TRIES = 64

# Quantization ops: their float operands are scales (float32 by the spec or the kernel) and
# their arithmetic is integer; float16 breaks them or means nothing for them.
_QUANT_OPS = frozenset(
    {
        "QuantizeLinear", "DequantizeLinear", "DynamicQuantizeLinear", "MatMulInteger",
        "ConvInteger", "QGemm", "QAttention", "DynamicQuantizeMatMul", "MatMulIntegerToFloat",
        "DynamicQuantizeLSTM", "QEmbedLayerNormalization", "MatMulNBits", "GatherBlockQuantized",
    }
)  # fmt: skip
# Integer accumulators whose float value is a Cast and Muls by scales away (dynamic int8).
_ACCUMULATORS = frozenset({"MatMulInteger", "ConvInteger"})


@dataclass(frozen=True)
class BlockList:
    """What stays float32 in a conversion: node names (``node_block_list``), op types added
    to the converter's default ``op_block_list``, and why, one line per reason."""

    nodes: tuple[str, ...] = ()
    ops: tuple[str, ...] = ()
    reasons: tuple[str, ...] = ()
    # The model holds float16 tensors already: the converter's check must be turned off.
    mixed: bool = False

    def plus(self, nodes: Sequence[str] = (), ops: Sequence[str] = (), why: str = "") -> BlockList:
        return replace(
            self,
            nodes=tuple(dict.fromkeys([*self.nodes, *nodes])),
            ops=tuple(dict.fromkeys([*self.ops, *ops])),
            reasons=(*self.reasons, why) if why else self.reasons,
        )

    def call(self) -> str:
        """The converter call that writes the model judged, to paste."""
        args = ["model", "keep_io_types=True"]
        if self.nodes:
            args.append(f"node_block_list={list(self.nodes)!r}")
        if self.ops:
            args.append(f"op_block_list=float16.DEFAULT_OP_BLOCK_LIST + {list(self.ops)!r}")
        if self.mixed:
            args.append("check_fp16_ready=False")
        return f"float16.convert_float_to_float16({', '.join(args)})"

    def to_json(self) -> str:
        return json.dumps({"nodes": list(self.nodes), "ops": list(self.ops), "mixed": self.mixed})


# The line that gives a model's unnamed nodes the names onnx-bisect gave them (``graph/load.py``
# names them on load), so that a block list naming one means the same node in the user's file.
NAME_NODES = "from onnx_bisect.graph.load import name_nodes; name_nodes(model.graph, [])"


def names_given(names: Sequence[str], graph: onnx.GraphProto) -> bool:
    """Whether any of ``names`` is one onnx-bisect gave an unnamed node (``{op_type}_{i}``)."""
    ops = {n.name: n.op_type for n in graph.node}
    return any(n in ops and re.fullmatch(rf"{re.escape(ops[n])}_\d+(__\d+)?", n) for n in names)


def blocks_of(model: onnx.ModelProto) -> BlockList | None:
    """The block list a ``+fp16`` conversion recorded on ``model``, if any."""
    for prop in model.metadata_props:
        if prop.key == BLOCKS_KEY:
            data = json.loads(prop.value)
            return BlockList(tuple(data["nodes"]), tuple(data["ops"]), (), bool(data["mixed"]))
    return None


def already_low(model: onnx.ModelProto) -> int:
    """The share, in percent, of a model's float values (initializers and typed tensors) that
    are float16; 0 when it has none."""
    graph = model.graph
    types = [t.data_type for t in graph.initializer]
    types += [v.type.tensor_type.elem_type for v in (*graph.value_info, *graph.input)]
    floats = [t for t in types if t in (_FLOAT, _FLOAT16)]
    return round(100 * floats.count(_FLOAT16) / len(floats)) if floats else 0


def fp16(model: onnx.ModelProto, arg: str | None, shapes: dict[str, Sequence[int]]) -> Any:
    share = already_low(model)
    if share > 50:
        # The converter refuses it ("already converted"); the user asked how the model runs
        # in float16, and it does so as it is.
        return model, (
            f"the model is already float16 ({share}% of its float tensors): not converted, "
            "judged at its own float16 precision",
        )
    converted, blocks = valid_conversion(model, base_blocks(model))
    converted.metadata_props.add(key=BLOCKS_KEY, value=blocks.to_json())
    # The call only where it differs from the plain one: then it is what the user pastes.
    call = blocks.call()
    if names_given(blocks.nodes, model.graph):
        call = f"{NAME_NODES}; {call}"
    notes = [*blocks.reasons, f"converted as {call}"] if blocks.reasons else []
    return converted, tuple(notes)


def base_blocks(model: onnx.ModelProto) -> BlockList:
    """What stays float32 before onnx is asked: a quantized model's integer parts and each
    ``Cast(to=FLOAT)`` of the model's own."""
    from onnxconverter_common import float16

    blocks = quantized_blocks(model)
    casts = [
        n.name
        for n in _nodes(model.graph)
        if _is_float_cast(n) and n.name and n.name not in blocks.nodes
    ]
    if casts:
        blocks = blocks.plus(casts, why=_CAST_WHY.format(n=len(casts)))
    return replace(blocks, mixed=bool(float16.check_if_fp16_ready(model.graph)))


_CAST_WHY = (
    "kept in float32: {n} Cast(to=FLOAT) node(s) of the model's own (the converter keeps their "
    "float32 output but labels it float16)"
)


def convert(model: onnx.ModelProto, blocks: BlockList) -> onnx.ModelProto:
    """onnxconverter-common's float16 copy of ``model`` with ``blocks`` kept in float32; the
    caller's model is not touched (the converter rewrites its argument)."""
    from onnxconverter_common import float16

    # The caller inferred the shapes on the message without its weights (the registry's
    # ``infer_shapes``): the converter's own inference serializes the whole model, past 2 GB
    # in vain.
    with warnings.catch_warnings():
        # One UserWarning per weight value it clamps to ±1e4 or ±1e-7: thousands of lines on a
        # real model, printed by the keep-in-fp32 search's conversions in the tool's process.
        warnings.simplefilter("ignore", UserWarning)
        return float16.convert_float_to_float16(  # type: ignore[no-any-return]
            copy.deepcopy(model),
            keep_io_types=True,
            disable_shape_infer=True,
            op_block_list=[*float16.DEFAULT_OP_BLOCK_LIST, *blocks.ops],
            node_block_list=list(blocks.nodes),
            check_fp16_ready=not blocks.mixed,
        )


_NODE = re.compile(r"node name: ([^)]*)\)")


def valid_conversion(
    model: onnx.ModelProto, blocks: BlockList
) -> tuple[onnx.ModelProto, BlockList]:
    """The conversion with ``blocks`` and, while onnx rejects it, the node onnx names kept in
    float32 too (or its producers, when it is kept already): the model and the final list."""
    for _ in range(_TRIES):
        converted = convert(model, blocks)
        problem = broken_by(model, converted)
        if not problem:
            return _in_order(model, converted), blocks
        named = _NODE.findall(problem)
        name = named[-1].strip() if named else ""
        more = _to_block(model, blocks, name)
        if not more:
            raise ModelLoadError(
                f"onnxconverter-common wrote an invalid model, and keeping "
                f"{name or 'the node onnx names'} in float32 does not help: {problem[:240]}"
            )
        nodes, ops = more
        why = f"kept in float32: {', '.join(nodes or ops)} (the converter's float16 model " \
            f"fails onnx type inference at {name}: {_reason(problem)})"  # fmt: skip
        blocks = blocks.plus(nodes, ops, why)
    raise ModelLoadError(
        f"onnxconverter-common wrote an invalid model after {_TRIES} block lists: {problem[:240]}"
    )


def _in_order(model: onnx.ModelProto, converted: onnx.ModelProto) -> onnx.ModelProto:
    """``converted`` with every graph's nodes in topological order, checked by onnx's full
    checker. The converter's own sort ignores the names a subgraph reads from the outer
    scope: it put an If before the node whose output the If's branch reads (silero-vad's
    nested Ifs, zoo G1), a model no runtime loads, which was then "the target failing"."""
    resort(converted.graph)
    problem = unchecked(model, converted)
    if problem:
        raise ModelLoadError(
            f"onnxconverter-common wrote an invalid model (onnx's checker, after the nodes were "
            f"put in topological order): {problem[:240]}; the converter's problem, not the "
            "target's"
        )
    return converted


def _reason(problem: str) -> str:
    """onnx's message without the node prefixes that nest it (Loop -> body node)."""
    tail = problem.rsplit("):", 1)[-1].strip()
    return tail[:160]


def _to_block(
    model: onnx.ModelProto, blocks: BlockList, name: str
) -> tuple[list[str], list[str]] | None:
    """What to keep in float32 next for a failure at node ``name``: the node; its unblocked
    producers (a Constant inside a Loop body whose float16 value reaches a kept node); its op
    type where it has no name; None when nothing is left to try."""
    found = _find(model.graph, name) if name else None
    if found is None:
        return None
    node, graph = found
    if node.name not in blocks.nodes and node.op_type not in blocks.ops:
        return ([node.name], []) if node.name else ([], [node.op_type])
    producers = {o: n for n in graph.node for o in n.output}
    upstream = [producers[i] for i in node.input if i in producers]
    fresh = [p.name for p in upstream if p.name and p.name not in blocks.nodes]
    return (fresh, []) if fresh else None


def _find(graph: onnx.GraphProto, name: str) -> tuple[onnx.NodeProto, onnx.GraphProto] | None:
    for node in graph.node:
        if node.name == name:
            return node, graph
        for sub in _subgraphs(node):
            found = _find(sub, name)
            if found is not None:
                return found
    return None


def _subgraphs(node: onnx.NodeProto) -> Iterator[onnx.GraphProto]:
    for attr in node.attribute:
        if attr.HasField("g"):
            yield attr.g
        yield from attr.graphs


def _nodes(graph: onnx.GraphProto) -> Iterator[onnx.NodeProto]:
    """Every node, in subgraphs too."""
    for node in graph.node:
        yield node
        for sub in _subgraphs(node):
            yield from _nodes(sub)


def _is_float_cast(node: onnx.NodeProto) -> bool:
    return node.op_type == "Cast" and any(a.name == "to" and a.i == _FLOAT for a in node.attribute)


def quantized_blocks(model: onnx.ModelProto) -> BlockList:
    """A quantized model's integer parts kept in float32: the quantization op types, and the
    nodes that turn an integer accumulator into float (its Cast and the Muls by the scales,
    whose products exceed float16: 127 x 127 x K)."""
    nodes = list(_nodes(model.graph))
    ops = sorted({n.op_type for n in nodes if _quantization_op(n)})
    if not ops:
        return BlockList()
    scaled = {o for n in nodes if n.op_type in _ACCUMULATORS for o in n.output}
    scaled |= {n.output[1] for n in nodes if n.op_type == "DynamicQuantizeLinear"}
    chain: list[str] = []
    for node in nodes:  # topological: a Mul of two scales comes before the Mul it feeds
        if node.op_type in ("Cast", "Mul") and scaled.intersection(node.input) and node.name:
            chain.append(node.name)
            scaled.update(node.output)
    blocks = BlockList().plus(
        ops=ops, why=f"kept in float32: the quantization ops ({', '.join(ops)})"
    )
    if chain:
        blocks = blocks.plus(
            chain,
            why=f"kept in float32: {', '.join(chain[:6])}{' ...' if len(chain) > 6 else ''} "
            "(the Cast and Mul that scale an integer accumulator to float)",
        )
    return blocks


def _quantization_op(node: onnx.NodeProto) -> bool:
    return node.op_type in _QUANT_OPS or node.op_type.startswith("QLinear")
