"""Upcast a model to float64, so a reference rounds far less than the runtimes it judges.

``upcast_model`` returns a new model (the argument is never touched) in which every float32,
float16 and bfloat16 value becomes float64. It rewrites:

- initializers and sparse initializers;
- the element types of graph inputs, outputs and ``value_info``, including those nested in
  sequence, optional and map types;
- ``Constant``: ``value``, ``sparse_value``, and ``value_float``/``value_floats``, which become a
  float64 ``value`` tensor;
- ``ConstantOfShape`` ``value``, adding an explicit float64 zero where it defaults to float32;
- attributes that name a float output type: ``Cast.to``, ``dtype`` of ``EyeLike``,
  ``RandomNormal``, ``RandomUniform``, ``RandomNormalLike``, ``RandomUniformLike``,
  ``Bernoulli`` and ``SequenceEmpty``, ``output_datatype`` of the window ops and
  ``MelWeightMatrix``, ``Attention.softmax_precision`` and ``GroupNormalization.stash_type``;
  where the default is float32 (``RandomNormal``, ``RandomUniform``, ``SequenceEmpty``, the
  window ops, ``GroupNormalization``) the attribute is added (``CastLike`` needs nothing: it
  follows its second input, which is upcast);
- ``Optional.type``;
- every subgraph (``If``/``Loop``/``Scan`` bodies, any graph attribute) and the bodies of
  model-local functions, recursively.

Integer, bool and string tensors are untouched, and so are float8 and 4-bit floats: they hold
quantized data, not a compute precision. Node names, opsets, functions and metadata are kept.

Some operator inputs have no float64 form in the ONNX spec: ``Resize``/``Upsample`` scales,
``NonMaxSuppression``, the scales of ``QuantizeLinear``/``DequantizeLinear``/``QLinear*``,
``RotaryEmbedding``, ``Celu`` and a few ``ai.onnx.ml`` ops. A constant used only there stays
float32; any other value gets a ``Cast`` to float32 in front of that input, and a float output
such an op cannot produce in float64 (``DequantizeLinear.y``, ``LayerNormalization``'s ``Mean``
and ``InvStdDev``) gets a ``Cast`` to float64 after it, under a new name, so the graph stays
valid. Those ops still compute in float32. A model with none of them gains no node.

Known limits:

- ``LayerNormalization.stash_type`` and ``RMSNormalization.stash_type`` stay float: the spec
  allows no float64 stash for the former, and ``onnx.reference`` rejects any stash other than
  float for both (it computes both in the input's type, so there they run in float64).
- An attribute a model-local function reads from its call site (``to=@dtype`` in the body) is
  not rewritten; literal attributes in function bodies are.
- Ops outside the ``ai.onnx`` and ``ai.onnx.ml`` domains (``com.microsoft`` contrib ops, custom
  ops) have no schema here; their values are upcast blindly, and their kernels rarely accept
  float64.
- Runtimes implement far fewer float64 kernels than the spec allows: ONNX Runtime's CPU provider
  has no float64 ``Conv`` or ``Erf``, for example, so an upcast model is meant for
  ``onnx.reference`` (``ref?dtype=float64``), which computes with numpy.
- Initializers stored as external data must be loaded first (``onnx.load`` does); float64 doubles
  the weights, so a model over 1 GiB of float32 weights exceeds protobuf's 2 GiB limit once
  serialized (the reference evaluator takes the proto and does not serialize it).
- Random ops draw different numbers, and float64 may legitimately disagree where float32
  overflows, underflows or sits on a comparison threshold.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator, Mapping, MutableSequence
from functools import lru_cache
from typing import Any

import numpy as np
import numpy.typing as npt
import onnx
from onnx import AttributeProto, TensorProto, defs, helper, numpy_helper

from onnx_bisect.errors import ModelLoadError

__all__ = ["FLOAT_TYPES", "upcast_feeds", "upcast_model"]


FLOAT_TYPES: frozenset[int] = frozenset(
    {TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16}
)


_TYPE_STR: Mapping[int, str] = {
    TensorProto.FLOAT: "tensor(float)",
    TensorProto.FLOAT16: "tensor(float16)",
    TensorProto.BFLOAT16: "tensor(bfloat16)",
    TensorProto.DOUBLE: "tensor(double)",
}


_ALL_FLOAT_STRS = frozenset(_TYPE_STR.values())


# (attribute, whether its absence means float32). Only ai.onnx ops; the schema must list it,
# since GroupNormalization-18 has no stash_type. LayerNormalization/RMSNormalization are left
# out on purpose: see the module docstring.
_DTYPE_ATTRS: Mapping[str, tuple[str, bool]] = {
    "Cast": ("to", False),
    "EyeLike": ("dtype", False),
    "RandomNormal": ("dtype", True),
    "RandomUniform": ("dtype", True),
    "RandomNormalLike": ("dtype", False),
    "RandomUniformLike": ("dtype", False),
    "Bernoulli": ("dtype", False),
    "SequenceEmpty": ("dtype", True),
    "BlackmanWindow": ("output_datatype", True),
    "HannWindow": ("output_datatype", True),
    "HammingWindow": ("output_datatype", True),
    "MelWeightMatrix": ("output_datatype", True),
    "Attention": ("softmax_precision", False),
    "GroupNormalization": ("stash_type", True),
}


_SCHEMA_DOMAINS = frozenset({"", "ai.onnx", "ai.onnx.ml"})


def upcast_model(model: onnx.ModelProto, to: int = TensorProto.DOUBLE) -> onnx.ModelProto:
    """A copy of ``model`` computing in ``to`` (float64 by default) wherever it used a narrower
    float; see the module docstring for what is rewritten and what is not.

    ``to=TensorProto.FLOAT`` upcasts only float16 and bfloat16.
    """
    if to not in (TensorProto.DOUBLE, TensorProto.FLOAT):
        raise ValueError(
            f"upcast_model: to={to} ({TensorProto.DataType.Name(to)}) is not supported; "
            "use onnx.TensorProto.DOUBLE or onnx.TensorProto.FLOAT"
        )
    out = onnx.ModelProto()
    out.CopyFrom(model)
    rewriter = _Upcaster(to, _names(out))
    rewriter.graph(out.graph, _opsets(out.opset_import))
    for func in out.functions:
        rewriter.function(func, _opsets(itertools.chain(func.opset_import, out.opset_import)))
    return out


def upcast_feeds(
    feeds: Mapping[str, npt.NDArray[Any]], to: npt.DTypeLike = np.float64
) -> dict[str, npt.NDArray[Any]]:
    """Float32, float16 and bfloat16 arrays as ``to``; every other array is passed as is."""
    target = np.dtype(to)
    return {
        name: arr.astype(target) if _narrower_float(arr.dtype, target) else arr
        for name, arr in feeds.items()
    }


def _narrower_float(dtype: np.dtype[Any], target: np.dtype[Any]) -> bool:
    # float8 types are quantized data (ml_dtypes names them float8_*); bfloat16 is not a
    # numpy floating type, hence the name test.
    if dtype.name == "bfloat16":
        return target.itemsize > 2
    return bool(np.issubdtype(dtype, np.floating)) and dtype.itemsize < target.itemsize


class _Upcaster:
    """Rewrites graphs and functions in place; ``upcast_model`` hands it a private copy."""

    def __init__(self, to: int, taken: set[str]) -> None:
        self.to = to
        self.to_str = _TYPE_STR[to]
        self.sources = frozenset(t for t in FLOAT_TYPES if _itemsize(t) < _itemsize(to))
        self.taken = taken

    # Scopes ---------------------------------------------------------------------------------

    def graph(
        self, g: onnx.GraphProto, opsets: Mapping[str, int], outer: Mapping[str, int] | None = None
    ) -> None:
        """``outer`` holds the enclosing scopes' pinned names, which bodies may read."""
        consts = {t.name for t in g.initializer if t.data_type in self.sources}
        consts |= {
            t.values.name for t in g.sparse_initializer if t.values.data_type in self.sources
        }
        consts |= self._constant_outputs(g.node)
        pinned = {
            **(outer or {}),
            **self._pinned(consts, g.node, [o.name for o in g.output], opsets),
        }
        for i, t in enumerate(g.initializer):
            g.initializer[i].CopyFrom(self._tensor(t, pinned))
        for sp in g.sparse_initializer:
            sp.values.CopyFrom(self._tensor(sp.values, pinned))
        for vi in itertools.chain(g.input, g.output, g.value_info):
            _retype(vi.type, self.sources, pinned.get(vi.name, self.to))
        self._nodes(g.node, pinned, opsets)

    def function(self, f: onnx.FunctionProto, opsets: Mapping[str, int]) -> None:
        consts = self._constant_outputs(f.node)
        pinned = self._pinned(consts, f.node, list(f.output), opsets)
        for vi in f.value_info:
            _retype(vi.type, self.sources, pinned.get(vi.name, self.to))
        self._nodes(f.node, pinned, opsets)

    def _constant_outputs(self, nodes: Iterable[onnx.NodeProto]) -> set[str]:
        found: set[str] = set()
        for n in nodes:
            if n.op_type != "Constant" or n.domain not in ("", "ai.onnx") or not n.output:
                continue
            for a in n.attribute:
                if (
                    a.name in ("value_float", "value_floats")
                    or (a.name == "value" and a.t.data_type in self.sources)
                    or (
                        a.name == "sparse_value"
                        and a.sparse_tensor.values.data_type in self.sources
                    )
                ):
                    found.add(n.output[0])
        return found

    def _pinned(
        self,
        consts: set[str],
        nodes: Iterable[onnx.NodeProto],
        outputs: Iterable[str],
        opsets: Mapping[str, int],
    ) -> dict[str, int]:
        """Float constants every consumer of which needs a narrower float: they keep that type
        (as float32, or the slot's float type), so that no Cast is needed in front of them."""
        need: dict[str, set[int | None]] = {c: set() for c in consts}
        for name in outputs:
            if name in need:
                need[name].add(None)
        for node, index, name in _uses(nodes):
            if name in need:
                need[name].add(self._island(node, index, opsets))
        pinned: dict[str, int] = {}
        for name, types in need.items():
            if types and None not in types and len(types) == 1:
                pinned[name] = next(t for t in types if t is not None)
        return pinned

    # Nodes ----------------------------------------------------------------------------------

    def _nodes(
        self,
        nodes: MutableSequence[onnx.NodeProto],
        pinned: Mapping[str, int],
        opsets: Mapping[str, int],
    ) -> None:
        rewritten: list[onnx.NodeProto] = []
        narrowed: dict[tuple[str, int], str] = {}
        for node in nodes:
            for a in node.attribute:
                if a.type == AttributeProto.GRAPH:
                    self.graph(a.g, opsets, pinned)
                elif a.type == AttributeProto.GRAPHS:
                    for sub in a.graphs:
                        self.graph(sub, opsets, pinned)
            self._attributes(node, pinned, opsets)
            for i, name in enumerate(node.input):
                island = self._island(node, i, opsets)
                if not name or island is None or pinned.get(name) == island:
                    continue
                key = (name, island)
                if key not in narrowed:
                    narrowed[key] = self._fresh(f"{name}__{_short(island)}")
                    rewritten.append(self._cast(name, narrowed[key], island))
                node.input[i] = narrowed[key]
            rewritten.append(node)
            schema = _schema_for(node, opsets)
            if schema is not None:
                for i, name in enumerate(node.output):
                    if name and _slot_island(schema, i, False, self.sources, self.to_str):
                        narrow = self._fresh(f"{name}__narrow")
                        node.output[i] = narrow
                        rewritten.append(self._cast(narrow, name, self.to))
        del nodes[:]
        nodes.extend(rewritten)

    def _island(
        self, node: onnx.NodeProto | None, index: int, opsets: Mapping[str, int]
    ) -> int | None:
        """The narrower float type input ``index`` of ``node`` must have, or None if it takes
        ``to`` (or the schema is unknown, when it is upcast like the rest)."""
        schema = None if node is None else _schema_for(node, opsets)
        if schema is None:
            return None
        return _slot_island(schema, index, True, self.sources, self.to_str)

    def _cast(self, src: str, dst: str, to: int) -> onnx.NodeProto:
        return helper.make_node("Cast", [src], [dst], name=self._fresh(f"{dst}/Cast"), to=to)

    def _fresh(self, base: str) -> str:
        name = base
        for k in itertools.count(1):
            if name not in self.taken:
                break
            name = f"{base}_{k}"
        self.taken.add(name)
        return name

    def _attributes(
        self, node: onnx.NodeProto, pinned: Mapping[str, int], opsets: Mapping[str, int]
    ) -> None:
        default_domain = node.domain in ("", "ai.onnx")
        op = node.op_type
        if default_domain and op == "Constant":
            target = pinned.get(node.output[0]) if node.output else None
            self._constant(node, target or self.to)
        elif default_domain and op == "ConstantOfShape":
            value = next((a for a in node.attribute if a.name == "value"), None)
            if value is None and TensorProto.FLOAT in self.sources:
                node.attribute.append(
                    helper.make_attribute("value", numpy_helper.from_array(self._zeros(1), ""))
                )
            elif value is not None and value.t.data_type in self.sources:
                value.t.CopyFrom(self._convert(value.t, self.to))
        if default_domain and op in _DTYPE_ATTRS:
            self._dtype_attr(node, opsets)
        for a in node.attribute:
            if a.type == AttributeProto.TYPE_PROTO:
                _retype(a.tp, self.sources, self.to)
            elif a.type == AttributeProto.TYPE_PROTOS:
                for tp in a.type_protos:
                    _retype(tp, self.sources, self.to)

    def _constant(self, node: onnx.NodeProto, target: int) -> None:
        for i, a in enumerate(node.attribute):
            if a.name == "value" and a.t.data_type in self.sources:
                a.t.CopyFrom(self._convert(a.t, target))
            elif a.name == "sparse_value" and a.sparse_tensor.values.data_type in self.sources:
                values = a.sparse_tensor.values
                values.CopyFrom(self._convert(values, target))
            elif a.name in ("value_float", "value_floats") and target != TensorProto.FLOAT:
                data = a.f if a.name == "value_float" else list(a.floats)
                arr = np.asarray(data, dtype=helper.tensor_dtype_to_np_dtype(target))
                node.attribute[i].CopyFrom(
                    helper.make_attribute("value", numpy_helper.from_array(arr, ""))
                )

    def _dtype_attr(self, node: onnx.NodeProto, opsets: Mapping[str, int]) -> None:
        name, float_default = _DTYPE_ATTRS[node.op_type]
        schema = _schema_for(node, opsets)
        if schema is not None and name not in schema.attributes:
            return
        attr = next((a for a in node.attribute if a.name == name), None)
        if attr is None:
            if float_default and TensorProto.FLOAT in self.sources:
                node.attribute.append(helper.make_attribute(name, self.to))
        elif attr.i in self.sources:
            attr.i = self.to

    # Tensors --------------------------------------------------------------------------------

    def _tensor(self, t: TensorProto, pinned: Mapping[str, int]) -> TensorProto:
        if t.data_type not in self.sources:
            return t
        return self._convert(t, pinned.get(t.name, self.to))

    def _convert(self, t: TensorProto, elem: int) -> TensorProto:
        if t.data_type == elem:
            return t
        if t.data_location == TensorProto.EXTERNAL:
            raise ModelLoadError(
                f"initializer {t.name!r} keeps its data in an external file, so it cannot be "
                "upcast; load the model with its weights (onnx.load(path), or "
                "onnx_bisect.graph.load.load_model) before upcasting"
            )
        arr = numpy_helper.to_array(t).astype(helper.tensor_dtype_to_np_dtype(elem))
        out = numpy_helper.from_array(arr, t.name)
        out.doc_string = t.doc_string
        out.metadata_props.extend(t.metadata_props)
        return out

    def _zeros(self, n: int) -> npt.NDArray[Any]:
        return np.zeros(n, dtype=helper.tensor_dtype_to_np_dtype(self.to))


def _opsets(imports: Iterable[onnx.OperatorSetIdProto]) -> dict[str, int]:
    found: dict[str, int] = {}
    for o in imports:
        found.setdefault("" if o.domain == "ai.onnx" else o.domain, o.version)
    return found


def _schema_for(node: onnx.NodeProto, opsets: Mapping[str, int]) -> defs.OpSchema | None:
    domain = "" if node.domain == "ai.onnx" else node.domain
    if domain not in _SCHEMA_DOMAINS or domain not in opsets:
        return None
    return _schema(node.op_type, opsets[domain], domain)


@lru_cache(maxsize=1024)
def _schema(op_type: str, version: int, domain: str) -> defs.OpSchema | None:
    try:
        return defs.get_schema(op_type, version, domain)
    except defs.SchemaError:
        return None


def _slot_island(
    schema: defs.OpSchema, index: int, is_input: bool, sources: frozenset[int], to_str: str
) -> int | None:
    """For a slot that accepts only floats narrower than ``to``, the type to narrow to."""
    params = schema.inputs if is_input else schema.outputs
    if not params:
        return None
    if index < len(params):
        param = params[index]
    elif params[-1].option == defs.OpSchema.FormalParameterOption.Variadic:
        param = params[-1]
    else:
        return None
    allowed = _allowed(schema, param.type_str)
    if to_str in allowed or not allowed or not allowed <= _ALL_FLOAT_STRS:
        return None
    return next((t for t in _ISLAND_ORDER if t in sources and _TYPE_STR[t] in allowed), None)


_ISLAND_ORDER = (TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16)


def _allowed(schema: defs.OpSchema, type_str: str) -> frozenset[str]:
    for c in schema.type_constraints:
        if c.type_param_str == type_str:
            return frozenset(c.allowed_type_strs)
    return frozenset({type_str})


def _retype(tp: onnx.TypeProto, sources: frozenset[int], elem: int) -> None:
    kind = tp.WhichOneof("value")
    if kind == "tensor_type":
        if tp.tensor_type.elem_type in sources:
            tp.tensor_type.elem_type = elem
    elif kind == "sparse_tensor_type":
        if tp.sparse_tensor_type.elem_type in sources:
            tp.sparse_tensor_type.elem_type = elem
    elif kind == "sequence_type":
        _retype(tp.sequence_type.elem_type, sources, elem)
    elif kind == "optional_type":
        _retype(tp.optional_type.elem_type, sources, elem)
    elif kind == "map_type":
        _retype(tp.map_type.value_type, sources, elem)


def _uses(nodes: Iterable[onnx.NodeProto]) -> Iterator[tuple[onnx.NodeProto | None, int, str]]:
    """(consumer, input index, name) for every input, subgraphs included: a body may read an
    outer-scope constant. A subgraph output naming an outer value counts as a use by no node."""
    for node in nodes:
        for i, name in enumerate(node.input):
            yield node, i, name
        for sub in _subgraphs(node):
            yield from _uses(sub.node)
            for o in sub.output:
                yield None, -1, o.name


def _subgraphs(node: onnx.NodeProto) -> Iterator[onnx.GraphProto]:
    for a in node.attribute:
        if a.type == AttributeProto.GRAPH:
            yield a.g
        elif a.type == AttributeProto.GRAPHS:
            yield from a.graphs


def _names(model: onnx.ModelProto) -> set[str]:
    """Every node and value name, so that inserted Casts never collide with one."""
    names: set[str] = set()

    def visit(nodes: Iterable[onnx.NodeProto]) -> None:
        for n in nodes:
            names.add(n.name)
            names.update(n.input)
            names.update(n.output)
            for sub in _subgraphs(n):
                names.update(t.name for t in sub.initializer)
                names.update(v.name for v in itertools.chain(sub.input, sub.output))
                visit(sub.node)

    g = model.graph
    names.update(t.name for t in g.initializer)
    names.update(v.name for v in itertools.chain(g.input, g.output, g.value_info))
    visit(g.node)
    for f in model.functions:
        names.update(itertools.chain(f.input, f.output))
        visit(f.node)
    return names


def _itemsize(elem: int) -> int:
    return int(np.dtype(helper.tensor_dtype_to_np_dtype(elem)).itemsize)


def _short(elem: int) -> str:
    return str(TensorProto.DataType.Name(elem)).lower()
