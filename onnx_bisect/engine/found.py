"""``Found``: what a strategy concluded, before it becomes a ``BisectResult``."""

from __future__ import annotations

from dataclasses import dataclass

from onnx_bisect.engine.measure.store import TensorStore
from onnx_bisect.graph.match import Matching
from onnx_bisect.graph.view import LoadedModel
from onnx_bisect.quant_result import QuantReport
from onnx_bisect.result import ChainLink, NodeResult, RootCause, SearchInfo

__all__ = ["Found"]


@dataclass(frozen=True)
class Found:
    """Per-node verdicts, the first divergence and the root cause, and how they were reached.

    ``store`` holds the reference's values under the names of ``cut_from``, the model a repro
    bundle is cut from (the target's model in two-model mode).
    """

    strategy: str
    nodes: tuple[NodeResult, ...]
    first: NodeResult | None
    cause: RootCause | None
    search: SearchInfo | None = None
    chain: tuple[ChainLink, ...] = ()
    matching: Matching | None = None
    store: TensorStore | None = None
    cut_from: LoadedModel | None = None
    quant: QuantReport | None = None  # a quantized target model's analysis
    # Nodes the target already failed on alone, fed the reference's inputs (the failure
    # search's check): a bundle of one of them is not run again before repro.py checks it.
    failed_alone: tuple[str, ...] = ()
    # Nodes the target ran alone, fed the reference's inputs, though every prefix that holds
    # them fails (the failure search's check): the failure needs their ancestors, so a bundle
    # of one alone, or of it with nodes after it, is not run.
    ran_alone: tuple[str, ...] = ()
    # The nodes a repro bundle starts from where not the root cause's alone: the node that
    # loses a tensor's rank, the path of that tensor and the node that fails on it.
    bundle_from: tuple[str, ...] = ()
    # Tensors a bundle must not mark as outputs: a crash that needs them unobserved (a fusion
    # through them, search/hidden.py) runs once they are marked.
    unmarked: tuple[str, ...] = ()
