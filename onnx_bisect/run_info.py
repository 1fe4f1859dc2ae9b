"""What a run records besides the nodes' verdicts: the amplification chain's links, the repro
bundle, the cut search, each backend as it ran. Frozen dataclasses; ``result.BisectResult``
holds them (and ``onnx_bisect.result`` re-exports them)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from onnx_bisect.text import fmt

__all__ = ["REPRO_CHECK", "BackendInfo", "ChainLink", "ReproInfo", "SearchInfo", "chain_positions"]

# The stage of ``BisectResult.stage_runs`` that counts the repro bundle's own repro.py
# running the target's runtime in a fresh process: a run the tool did not make itself.
REPRO_CHECK = "repro check"


@dataclass(frozen=True)
class ChainLink:
    node: str
    op_type: str
    index: int
    rel_l2: float
    gain: float | None  # this node's amplification (output error ÷ worst input error)
    nonfinite: str = ""  # "NaN" or "inf": its error, where NaN/Inf sit in different places
    # Links of the whole chain left out just before this one: a long chain keeps its first
    # and last links and its largest gains (engine/chain.py), and says how many it folded.
    folded: int = 0
    # On the last link only, where the chain ends before the outputs: why it stops there.
    stop: str = ""

    @property
    def shown(self) -> str:
        return self.nonfinite or fmt(self.rel_l2)


def chain_positions(chain: tuple[ChainLink, ...] | list[ChainLink]) -> list[int]:
    """Each kept link's position in the whole chain, the folded links counted."""
    positions, at = [], -1
    for link in chain:
        at += link.folded + 1
        positions.append(at)
    return positions


@dataclass(frozen=True)
class ReproInfo:
    path: str
    kind: str  # what the bundle reproduces: "divergence" or "crash"
    nodes: tuple[str, ...]  # the bundle's nodes, in topological order
    nodes_before: int  # nodes in the whole model
    runs: int  # target runs spent minimizing (verification runs not included)
    isolated: bool  # fed the reference's tensors at its cut, not the model's own inputs
    reproduces: bool  # the written bundle was re-run in a fresh process and diverged
    message: str

    def to_dict(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "kind": self.kind,
            "nodes": list(self.nodes),
            "nodes_before": self.nodes_before,
            "nodes_after": len(self.nodes),
            "runs": self.runs,
            "isolated": self.isolated,
            "reproduces": self.reproduces,
            "message": self.message,
        }


@dataclass(frozen=True)
class SearchInfo:
    """How the cut search went: positions asked, target runs spent, whether it was monotone."""

    reason: str
    runs: int
    asked: tuple[tuple[int, bool], ...]  # cut positions asked, with their answers
    monotone: bool
    refined: bool
    transition_node: str
    pattern_windows_tried: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {
            "reason": self.reason,
            "runs": self.runs,
            "probes": [{"position": p, "diverged": d} for p, d in self.asked],
            "monotone": self.monotone,
            "refined": self.refined,
            "transition_node": self.transition_node,
            "pattern_windows_tried": self.pattern_windows_tried,
        }


@dataclass(frozen=True)
class BackendInfo:
    spec: str
    description: str
    versions: Mapping[str, str] = field(default_factory=dict)
    # Declares that every run compiles the model (``Capabilities.compiles``).
    compiles: bool = False
