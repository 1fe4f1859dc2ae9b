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

from dataclasses import dataclass
from typing import Any

from onnx_bisect.model import LoadedModel

__all__ = ["Matching", "match_tensors"]


@dataclass(frozen=True)
class Matching:
    matched: tuple[str, ...]  # in the target model's topological order
    excluded: dict[str, str]  # name -> why the same name does not mean the same tensor
    only_ref: tuple[str, ...]
    only_target: tuple[str, ...]

    def to_dict(self) -> dict[str, Any]:
        return {
            "matched": len(self.matched),
            "excluded": [{"tensor": t, "reason": r} for t, r in self.excluded.items()],
            "only_in_reference_model": len(self.only_ref),
            "only_in_target_model": len(self.only_target),
        }

    def summary(self) -> str:
        return (
            f"tensors matched by name: {len(self.matched)}; excluded (same name, different "
            f"meaning): {len(self.excluded)}; only in the reference model: {len(self.only_ref)};"
            f" only in the target model: {len(self.only_target)}"
        )


def match_tensors(ref: LoadedModel, target: LoadedModel) -> Matching:
    ref_producer, tgt_producer = ref.producer, target.producer
    alias = _aliases(ref, target)
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
        elif r.op_type != t.op_type:
            excluded[name] = f"made by {r.op_type} in the reference model, {t.op_type} here"
        elif [alias.get(i, i) for i in t.inputs] != list(r.inputs):
            excluded[name] = (
                f"{t.op_type} reads ({', '.join(t.inputs)}) here but ({', '.join(r.inputs)}) "
                "in the reference model"
            )
        else:
            matched.append(name)
    shared = set(matched) | set(excluded)
    return Matching(
        tuple(matched),
        excluded,
        tuple(n for n in ref.probes if n not in shared),
        tuple(n for n in target.probes if n not in shared),
    )


def _aliases(ref: LoadedModel, target: LoadedModel) -> dict[str, str]:
    """Target tensor -> the reference tensor it stands for, from nodes kept by name and op."""
    by_name = {n.name: n for n in ref.nodes}
    alias: dict[str, str] = {}
    ambiguous: set[str] = set()
    for t in target.nodes:
        r = by_name.get(t.name)
        if r is None or r.op_type != t.op_type or len(r.inputs) != len(t.inputs):
            continue
        for mine, theirs in zip(t.inputs, r.inputs, strict=True):
            if mine == theirs or mine in target.initializers or theirs in ref.initializers:
                continue
            if alias.get(mine, theirs) != theirs:
                ambiguous.add(mine)
            alias[mine] = theirs
    return {k: v for k, v in alias.items() if k not in ambiguous}
