"""Result types. Frozen dataclasses; pandas appears only in ``nodes_frame()``."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from onnx_bisect.curve import CurvePoint, error_curve
from onnx_bisect.metrics import Comparison, Criterion
from onnx_bisect.model import NotProbed
from onnx_bisect.transforms import TransformRecord

if TYPE_CHECKING:
    import pandas as pd

__all__ = ["BackendInfo", "BisectResult", "NodeResult", "RootCause", "SearchInfo", "Verdict"]

SCHEMA = "onnx-bisect/report/v1"
NODE_COLUMNS = (
    "index", "node", "op_type", "tensor", "verdict", "accumulated", "isolated", "amplification",
    "acc_max_abs", "acc_rel_l2", "acc_cosine", "iso_max_abs", "iso_rel_l2", "threshold",
    "noise", "status", "note",
)  # fmt: skip


class Verdict(StrEnum):
    OK = "ok"
    CULPRIT = "culprit"
    PROPAGATED = "propagated"
    PATTERN = "pattern"
    UNSUPPORTED = "unsupported"
    FAILED = "failed"
    CRASHED = "crashed"
    NOT_PROBED = "not-probed"


@dataclass(frozen=True)
class NodeResult:
    """One node: its error in the full run (accumulated) and fed reference inputs (isolated)."""

    index: int
    name: str
    op_type: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    verdict: Verdict
    accumulated: Comparison | None
    isolated: Comparison | None = None
    amplification: float | None = None
    note: str = ""

    @property
    def tensor(self) -> str | None:
        return self.accumulated.tensor if self.accumulated else None

    @property
    def accumulated_error(self) -> float | None:
        return self.accumulated.score if self.accumulated else None

    @property
    def isolated_error(self) -> float | None:
        return self.isolated.score if self.isolated else None

    @property
    def diverged(self) -> bool:
        return bool(self.accumulated and self.accumulated.diverged)

    @property
    def rel_l2(self) -> float | None:
        """Accumulated rel_l2 whatever the deciding metric: the one number comparable across
        tensors (the chain and the error curve use it); None when unknown or NaN."""
        value = self.accumulated.metrics.get("rel_l2") if self.accumulated else None
        return None if value is None or math.isnan(value) else float(value)

    def to_dict(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "node": self.name,
            "op_type": self.op_type,
            "tensor": self.tensor,
            "verdict": self.verdict.value,
            "accumulated": _comparison_dict(self.accumulated),
            "isolated": _comparison_dict(self.isolated),
            "amplification": _num(self.amplification),
            "inputs": list(self.inputs),
            "outputs": list(self.outputs),
            "note": self.note,
        }


@dataclass(frozen=True)
class RootCause:
    """``kind``: ``culprit`` (one node is wrong by itself), ``pattern`` (only a window of
    connected nodes reproduces it), ``crash`` (the target dies when the node is present), or
    ``none`` (none of these could be shown)."""

    kind: str
    nodes: tuple[str, ...]
    reason: str

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "nodes": list(self.nodes), "reason": self.reason}


@dataclass(frozen=True)
class SearchInfo:
    """How the cut search went: positions asked, target runs spent, whether it was monotone."""

    reason: str
    runs: int
    probes: tuple[tuple[int, bool], ...]
    monotone: bool
    refined: bool
    transition_node: str
    pattern_windows_tried: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {
            "reason": self.reason,
            "runs": self.runs,
            "probes": [{"position": p, "diverged": d} for p, d in self.probes],
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


@dataclass(frozen=True)
class BisectResult:
    verdict: str  # "match" or "diverged"
    model: str
    ref: BackendInfo
    target: BackendInfo
    criterion: Criterion
    strategy: str
    outputs: tuple[Comparison, ...]
    first_divergence: NodeResult | None
    root_cause: RootCause | None
    nodes: tuple[NodeResult, ...]
    not_probed: tuple[NotProbed, ...]
    inputs: Mapping[str, npt.NDArray[Any]] = field(repr=False, compare=False)
    timings: Mapping[str, float] = field(default_factory=dict)
    runs: Mapping[str, int] = field(default_factory=dict)
    notes: tuple[str, ...] = ()
    versions: Mapping[str, str] = field(default_factory=dict)
    command: str = ""
    search: SearchInfo | None = None
    chain: tuple[Any, ...] = ()  # ChainLink from the root cause towards the outputs
    repro: Any = None  # reduce.ReproInfo when a bundle was asked for
    matching: Any = None  # matching.Matching when the target ran a different model
    target_model: str = ""  # that other model
    transforms: tuple[TransformRecord, ...] = ()  # +NAME suffixes applied to either model
    task_checks: tuple[Any, ...] = ()  # topk.TopKCheck per output, when asked for

    def error_curve(self, segments: int = 24) -> tuple[CurvePoint, ...]:
        """Accumulated error along the graph, worst per segment: how the error grows."""
        return error_curve(self.nodes, segments)

    @property
    def diverged(self) -> bool:
        return self.verdict == "diverged"

    def culprits(self) -> list[NodeResult]:
        return [n for n in self.nodes if n.verdict is Verdict.CULPRIT]

    def top(self, k: int = 10) -> list[NodeResult]:
        """The k nodes with the largest accumulated error, worst first."""
        scored = [n for n in self.nodes if n.accumulated is not None]
        crit = self.criterion
        return sorted(scored, key=lambda n: crit.badness(n.accumulated), reverse=True)[:k]  # type: ignore[arg-type]

    def nodes_frame(self) -> pd.DataFrame:
        """One row per node; the columns are those of nodes.csv."""
        import pandas as pd

        return pd.DataFrame(self.node_rows(), columns=list(NODE_COLUMNS))

    def node_rows(self) -> list[dict[str, Any]]:
        rows = []
        for n in self.nodes:
            acc, iso = n.accumulated, n.isolated
            rows.append(
                {
                    "index": n.index,
                    "node": n.name,
                    "op_type": n.op_type,
                    "tensor": n.tensor,
                    "verdict": n.verdict.value,
                    "accumulated": acc.score if acc else math.nan,
                    "isolated": iso.score if iso else math.nan,
                    "amplification": n.amplification if n.amplification is not None else math.nan,
                    "acc_max_abs": acc.metrics.get("max_abs", math.nan) if acc else math.nan,
                    "acc_rel_l2": acc.metrics.get("rel_l2", math.nan) if acc else math.nan,
                    "acc_cosine": acc.metrics.get("cosine", math.nan) if acc else math.nan,
                    "iso_max_abs": iso.metrics.get("max_abs", math.nan) if iso else math.nan,
                    "iso_rel_l2": iso.metrics.get("rel_l2", math.nan) if iso else math.nan,
                    "threshold": _opt(acc.threshold) if acc else math.nan,
                    "noise": _opt(acc.noise) if acc else math.nan,
                    "status": acc.status.value if acc else "",
                    "note": n.note or (acc.reason if acc else ""),
                }
            )
        return rows

    def to_dict(self) -> dict[str, Any]:
        fd = self.first_divergence
        first = None
        if fd is not None:
            acc = fd.accumulated
            first = {
                "node": fd.name,
                "op_type": fd.op_type,
                "index": fd.index,
                "tensor": fd.tensor,
                "status": acc.status.value if acc else fd.verdict.value,
                "reason": acc.reason if acc else fd.note,
                **({k: _num(v) for k, v in acc.metrics.items()} if acc else {}),
            }
        return {
            "schema": SCHEMA,
            "verdict": self.verdict,
            "model": self.model,
            "criterion": self.criterion.describe(),
            "metric": self.criterion.key,
            "strategy": self.strategy,
            "first_divergence": first,
            "root_cause": self.root_cause.to_dict() if self.root_cause else None,
            "outputs": [_comparison_dict(c) for c in self.outputs],
            "nodes": [n.to_dict() for n in self.nodes],
            "not_probed": [vars(p) for p in self.not_probed],
            "ref": {"spec": self.ref.spec, "description": self.ref.description},
            "target": {"spec": self.target.spec, "description": self.target.description},
            "versions": dict(self.versions),
            "command": self.command,
            "runs": dict(self.runs),
            "search": self.search.to_dict() if self.search else None,
            "repro": self.repro.to_dict() if self.repro is not None else None,
            "target_model": self.target_model or None,
            "tensor_matching": self.matching.to_dict() if self.matching is not None else None,
            "transforms": [t.to_dict() for t in self.transforms],
            "task_checks": [c.to_dict() for c in self.task_checks],
            "error_curve": [p.to_dict() for p in self.error_curve()],
            "chain": [
                {
                    "node": c.node,
                    "op_type": c.op_type,
                    "index": c.index,
                    "rel_l2": _num(c.rel_l2),
                    "gain": _num(c.gain),
                }
                for c in self.chain
            ],
            "timings_s": {k: round(v, 4) for k, v in self.timings.items()},
            "inputs": {
                k: {"shape": list(v.shape), "dtype": str(v.dtype)} for k, v in self.inputs.items()
            },
            "notes": list(self.notes),
        }

    def write(
        self, out_dir: str | Path, formats: Sequence[str] = ("md", "json", "csv")
    ) -> list[Path]:
        """Write the reports and ``inputs.npz``; returns the paths written."""
        from onnx_bisect.report import write_reports

        return write_reports(self, Path(out_dir), formats)


def _opt(x: float | None) -> float:
    return math.nan if x is None else x


def _num(x: float | None) -> float | str | None:
    """JSON has no NaN or Infinity; spell them out rather than emit invalid JSON."""
    if x is None:
        return None
    if isinstance(x, float | np.floating) and not math.isfinite(x):
        return "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")
    return float(x)


def _comparison_dict(c: Comparison | None) -> dict[str, Any] | None:
    if c is None:
        return None
    return {
        "tensor": c.tensor,
        "status": c.status.value,
        "score": _num(c.score),
        "metrics": {k: _num(v) for k, v in c.metrics.items()},
        "shape": list(c.shape),
        "ref_dtype": c.ref_dtype,
        "target_dtype": c.target_dtype,
        "nonfinite_mismatch": c.nonfinite_mismatch,
        "threshold": _num(c.threshold),
        "noise": _num(c.noise),
        "reason": c.reason,
    }
