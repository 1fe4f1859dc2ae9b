"""Inside a module that hooks cannot see into (a module whose forward calls several torch ops
and no submodule): a dynamo export's ``pkg.torch.onnx.fx_node`` metadata names, on every
ONNX node, the FX node (one torch op) it stands for; the module captured with
``torch.export`` and run by an FX interpreter gives each FX node's value and its inputs' values.
Each op's value is compared with the last tensor of its ONNX nodes of the same shape, in
topological order; the first that diverges narrows the culprit to that op's nodes. Ops whose
value has no such tensor are counted as unmapped."""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy.typing as npt
import onnx

from onnx_bisect.compare.criterion import Comparison
from onnx_bisect.graph.view import LoadedModel, NodeInfo

__all__ = ["FX_NODE", "FxValues", "Narrowed", "capture_fx", "fx_groups", "narrow"]

Array = npt.NDArray[Any]
FX_NODE = "pkg.torch.onnx.fx_node"
# "%gelu : [num_users=1] = call_function[target=torch.ops.aten.gelu.default](...)"
_FX = re.compile(r"^%(\S+) :.*?target=(?:torch\.ops\.)?([\w.]+)")


@dataclass(frozen=True)
class FxValues:
    """Each FX node's value by name, the names of the activations it reads (parameters and
    constants left out: the ONNX model holds those), and the op it calls."""

    values: dict[str, Array] = field(default_factory=dict)
    inputs: dict[str, list[str]] = field(default_factory=dict)
    ops: dict[str, str] = field(default_factory=dict)


def fx_groups(loaded: LoadedModel, scope: Sequence[NodeInfo]) -> dict[str, list[NodeInfo]]:
    """The nodes of ``scope`` by the FX node their metadata names, in topological order."""
    protos = loaded.node_protos
    groups: dict[str, list[NodeInfo]] = {}
    for n in scope:
        name = _fx_name(protos[n.name])
        if name is not None:
            groups.setdefault(name, []).append(n)
    return groups


def _fx_name(proto: onnx.NodeProto) -> str | None:
    for p in proto.metadata_props:
        if p.key == FX_NODE:
            m = _FX.match(p.value)
            return m[1] if m else None
    return None


def capture_fx(module: Any, args: Sequence[Any], kwargs: Mapping[str, Any]) -> FxValues:
    """``module`` exported by ``torch.export`` and run by an FX interpreter on the inputs,
    every op's tensor value kept (the unlifted module keeps the exporter's node names)."""
    import torch

    program = torch.export.export(module, tuple(args), dict(kwargs))
    graph_module = program.module()
    got = FxValues()

    class Recorder(torch.fx.Interpreter):
        def run_node(self, n: torch.fx.Node) -> Any:
            out = super().run_node(n)
            if isinstance(out, torch.Tensor) and n.op == "call_function":
                got.values[n.name] = out.detach().cpu().numpy().copy()
                got.inputs[n.name] = [a.name for a in n.all_input_nodes if a.op != "get_attr"]
                got.ops[n.name] = str(n.target)
            elif isinstance(out, torch.Tensor) and n.op == "placeholder":
                got.values[n.name] = out.detach().cpu().numpy().copy()
            return out

    # The unlifted module's placeholders are the user's inputs flattened in its in_spec's
    # order: the positional ones, then the keywords in the order forward names them.
    flat = torch.utils._pytree.tree_leaves((tuple(args), dict(kwargs)))
    if kwargs:
        order = list(inspect.signature(module.forward).parameters)
        flat = [*args, *(kwargs[k] for k in order if k in kwargs)]
    with torch.no_grad():
        Recorder(graph_module).run(*flat)
    return got


@dataclass(frozen=True)
class OpValue:
    """One op mapped: its FX name and target, its ONNX nodes, the tensor standing for its
    value, and that value against the ONNX backend's."""

    op: str
    target: str
    nodes: tuple[NodeInfo, ...]
    tensor: str
    comparison: Comparison


@dataclass(frozen=True)
class Narrowed:
    """The ops of a module mapped (in topological order), how many were not, and the first
    that diverges."""

    mapped: tuple[OpValue, ...]
    unmapped: int
    first: OpValue | None


def narrow(
    groups: Mapping[str, list[NodeInfo]],
    fx: FxValues,
    onnx_values: Callable[[Sequence[str]], Mapping[str, Array]],
    compare: Callable[[str, Array, Array], Comparison],
) -> Narrowed:
    """Each op of ``groups`` that ``fx`` has a value of, mapped to the last tensor of its
    nodes with that value's shape (``onnx_values`` runs the ONNX model for them), compared
    (``compare(tensor, torch_value, onnx_value)``)."""
    wanted = {
        op: [t for n in reversed(nodes) for t in n.outputs if t] for op, nodes in groups.items()
    }
    ran = onnx_values(list(dict.fromkeys(t for ts in wanted.values() for t in ts)))
    mapped, unmapped = [], 0
    for op, tensors in wanted.items():
        value = fx.values.get(op)
        tensor = next(
            (t for t in tensors if value is not None and t in ran and ran[t].shape == value.shape),
            None,
        )
        if value is None or tensor is None:
            unmapped += 1
            continue
        found = compare(tensor, value, ran[tensor])
        mapped.append(OpValue(op, fx.ops.get(op, ""), tuple(groups[op]), tensor, found))
    first = next((m for m in mapped if m.comparison.diverged), None)
    return Narrowed(tuple(mapped), unmapped, first)
