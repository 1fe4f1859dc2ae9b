"""Matching the tensors of two different models (original vs optimized) by name.

A name is only a promise: an optimizer may keep a name and change what it holds. onnxoptimizer's
``fuse_bn_into_conv`` keeps ``conv_out`` but makes the Conv compute the post-BatchNorm value.
Nodes that keep their name and op type say which tensors correspond: where such a node reads
``a`` in the target model and ``b`` in the reference model, ``a`` holds what ``b`` holds. A shared
name is trusted when its producers have the same op type and read corresponding inputs; a name
whose readers show it now holds another tensor's value, or whose producer changed, is excluded,
with the reason.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from onnx_bisect.graph.view import LoadedModel, NodeInfo

__all__ = ["Matching", "match_tensors"]


@dataclass(frozen=True)
class Matching:
    matched: tuple[str, ...]  # in the target model's topological order
    excluded: dict[str, str]  # name -> why the same name does not mean the same tensor
    only_ref: tuple[str, ...]
    only_target: tuple[str, ...]
    # target tensor -> the reference tensor it is compared with: the matched names, plus
    # renamed or re-meant tensors whose counterpart the kept nodes around them reveal
    pairs: dict[str, str] = field(default_factory=dict)
    # The target model's Casts that the reference model lacks: a conversion's (+fp16), not
    # the user's nodes, so that a count of the user's nodes can leave them out.
    added_casts: tuple[str, ...] = ()

    @property
    def paired(self) -> dict[str, str]:
        """The pairs that are not a shared name."""
        return {t: r for t, r in self.pairs.items() if t != r}

    def to_dict(self) -> dict[str, Any]:
        return {
            "matched": len(self.matched),
            "excluded": [{"tensor": t, "reason": r} for t, r in self.excluded.items()],
            "only_in_reference_model": len(self.only_ref),
            "only_in_target_model": len(self.only_target),
            "paired_by_position": [{"target": t, "reference": r} for t, r in self.paired.items()],
        }

    def summary(self) -> str:
        return (
            f"tensors matched by name: {len(self.matched)}; excluded (same name, different "
            f"meaning): {len(self.excluded)}; only in the reference model: {len(self.only_ref)};"
            f" only in the target model: {len(self.only_target)}; compared with a renamed "
            f"counterpart: {len(self.paired)}"
        )


def match_tensors(ref: LoadedModel, target: LoadedModel) -> Matching:
    ref_producer, tgt_producer = ref.producer, target.producer
    alias, confirmed = _aliases(ref, target)
    ref_names = {n.name for n in ref.nodes}
    matched: list[str] = []
    excluded: dict[str, str] = {}
    for name in target.probes:
        r, t = ref_producer.get(name), tgt_producer.get(name)
        if r is None or t is None:
            continue
        held = alias.get(name, name)
        if held != name:
            excluded[name] = (
                f"the name was kept, but its readers read {held} in the reference model: it "
                f"holds {held}'s value"
            )
        elif _recast(t, ref_names) and alias.get(t.inputs[0], t.inputs[0]) == name:
            # A Cast the transform inserted (fp16 keep_io_types) re-types the same value.
            matched.append(name)
        elif name in confirmed:
            # Kept readers read it in both models: whatever now makes it (a fused node), the
            # name still holds what they consume.
            matched.append(name)
        elif r.op_type != t.op_type:
            excluded[name] = f"made by {r.op_type} in the reference model, {t.op_type} here"
        elif [alias.get(i, i) for i in t.inputs] != list(r.inputs):
            excluded[name] = (
                f"{t.op_type} reads ({', '.join(t.inputs)}) here but ({', '.join(r.inputs)}) "
                "in the reference model"
            )
        else:
            matched.append(name)
    known, matched_set = set(ref.probes), set(matched)
    pairs = {
        name: name if name in matched_set else alias[name]
        for name in target.probes
        if name in matched_set or (alias.get(name, name) != name and alias[name] in known)
    }
    for name in excluded.keys() & pairs.keys():
        excluded[name] += f"; compared with {pairs[name]} instead"
    shared = set(matched) | set(excluded)
    return Matching(
        tuple(matched),
        excluded,
        tuple(n for n in ref.probes if n not in shared),
        tuple(n for n in target.probes if n not in shared),
        pairs,
        tuple(n.name for n in target.nodes if n.op_type == "Cast" and n.name not in ref_names),
    )


def _aliases(ref: LoadedModel, target: LoadedModel) -> tuple[dict[str, str], set[str]]:
    """Target tensor -> the reference tensor it stands for, from nodes kept by name and op;
    and the names such nodes read under the same name in both models (confirmed)."""
    by_name = {n.name: n for n in ref.nodes}
    alias: dict[str, str] = {}
    confirmed: set[str] = set()
    ambiguous: set[str] = set()
    # Parameters are not evidence: a fused node reads rewritten weights by design.
    ref_const = ref.initializers | set(ref.constants)
    ref_tensors = set(ref.probes)
    tgt_const = target.initializers | set(target.constants)

    def note(mine: str, theirs: str) -> None:
        if alias.get(mine, theirs) != theirs:
            ambiguous.add(mine)
        alias[mine] = theirs

    for t in target.nodes:
        r = by_name.get(t.name)
        if r is None or r.op_type != t.op_type or len(r.inputs) != len(t.inputs):
            continue
        for mine, theirs in zip(t.inputs, r.inputs, strict=True):
            if mine in tgt_const or theirs in ref_const:
                continue
            if mine == theirs:
                confirmed.add(mine)  # a kept reader reads it under the same name in both
            else:
                note(mine, theirs)
        if len(r.outputs) == len(t.outputs) and t.inputs:
            # A kept node whose output was renamed still computes the same tensor. Not for
            # Constants: exporters number their outputs globally, so a name there says nothing.
            for mine, theirs in zip(t.outputs, r.outputs, strict=True):
                # A name the reference model gives another tensor is that tensor: a fused
                # Conv+Relu writes the Relu's output (a quantizer's pre-processing fuses so).
                if mine != theirs and mine not in ref_tensors:
                    note(mine, theirs)
    # Readers that disagree about what a name holds leave it unexplained.
    ambiguous |= confirmed & set(alias)
    return (
        {k: v for k, v in alias.items() if k not in ambiguous},
        confirmed - ambiguous,
    )


def _recast(node: NodeInfo, ref_names: set[str]) -> bool:
    """A Cast or Identity that the reference model does not have: a value passed through."""
    return node.op_type in ("Cast", "Identity") and node.name not in ref_names
