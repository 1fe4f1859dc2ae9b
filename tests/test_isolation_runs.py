"""What isolation costs in target runs: a batch the target cannot run is split, not run node
by node; where the runtime's message names the node, that node goes alone and the rest runs
on; a target of seconds per run gets batches as large as the memory plan allows."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import numpy.typing as npt
import onnx
import pytest

import onnx_bisect
from onnx_bisect.backends.protocol import Tensors
from onnx_bisect.engine.measure import isolate as isolate_module
from onnx_bisect.errors import BackendError
from onnx_bisect.graph.extract import derived_kind
from onnx_bisect.result import Verdict
from tests.faulty import FaultyBackend
from tests.models import YOLO, first_conv

FAULT = first_conv()
REFUSED = ("/down1/Sigmoid", "/c2f1/cv1/Sigmoid", "/c2f1/m.0/cv1/Sigmoid")


class RefusesAlone(FaultyBackend):
    """A 5% fault at the first Conv, and an isolation model holding any of ``refused`` is
    refused, naming the first of them as ONNX Runtime does (``named``) or not at all."""

    def __init__(self, named: bool, delay: float = 0.0) -> None:
        super().__init__(FAULT)
        self.named, self.delay = named, delay

    def _run(self, model: onnx.ModelProto, feeds: Mapping[str, npt.NDArray[Any]]) -> Tensors:
        time.sleep(self.delay)
        held = [n.name for n in model.graph.node if n.name in REFUSED]
        if derived_kind(model) == "isolated" and held:
            where = f"Name:'{held[0]}'" if self.named else "a node"
            raise BackendError(f"Non-zero status code returned while running {where}")
        return super()._run(model, feeds)


@pytest.mark.parametrize(("named", "most"), [(True, 7), (False, 40)], ids=["named", "unnamed"])
def test_a_failing_batch_is_split_not_run_node_by_node(named: bool, most: int) -> None:
    """192 nodes in one batch, three of them refused alone. Named by the runtime: the batch,
    then per refused node itself and the rest (1 + 2 × 3 = 7 runs). Not named: halves, about
    two runs per refused node per halving (node by node would be 192 runs)."""
    result = onnx_bisect.bisect(YOLO, target=RefusesAlone(named), repro=None)
    runs = result.stage_runs["isolate"]
    assert runs <= most, result.stage_runs
    if named:
        assert runs == 7, result.stage_runs
    failed = {n.name for n in result.nodes if n.verdict is Verdict.FAILED}
    assert failed == set(REFUSED)
    assert result.root_cause is not None and result.root_cause.nodes == (FAULT,)


@pytest.mark.slow
def test_a_slow_target_gets_batches_as_large_as_memory_allows(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With the batch cap small enough to make one batch per few nodes, a target whose runs
    take SLOW_RUN_S (1 s) or more is isolated in one batch all the same."""
    monkeypatch.setattr(isolate_module, "ISOLATION_BATCH_BYTES", 64 << 10)
    fast = onnx_bisect.bisect(YOLO, target=FaultyBackend(FAULT), repro=None)
    assert fast.stage_runs["isolate"] > 10, fast.stage_runs
    delay = isolate_module.SLOW_RUN_S
    slow = onnx_bisect.bisect(YOLO, target=RefusesAlone(True, delay=delay), repro=None)
    assert slow.stage_runs["isolate"] == 7, slow.stage_runs  # one batch, split as above
    assert slow.root_cause is not None and slow.root_cause.nodes == (FAULT,)
