"""The amplification chain reaches the outputs however long it is: folded, not cut (issue 28)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import onnx_bisect
from benchmarks.models import NODES_PER_BLOCK, mlp_blocks
from onnx_bisect.compare.criterion import Comparison, Status
from onnx_bisect.engine.chain import KEEP_ENDS, MAX_LINKS, amplification_chain, fold
from onnx_bisect.report.format import chain_line
from onnx_bisect.result import ChainLink, NodeResult, Verdict, chain_positions
from tests.faulty import FaultyBackend


def _link(i: int, gain: float) -> ChainLink:
    return ChainLink(f"n{i}", "Add", i, 0.01, gain)


def test_fold_keeps_the_ends_and_the_largest_gains_and_counts_the_rest() -> None:
    n = 3000
    gains = {1500: 9.0, 2000: 7.0, 100: 8.0}  # 100 is among the first links anyway
    links = [_link(i, gains.get(i, 1.0 + i * 1e-6)) for i in range(n)]
    kept = fold(links)
    assert len(kept) == MAX_LINKS
    assert [c.index for c in kept[:KEEP_ENDS]] == list(range(KEEP_ENDS))
    assert [c.index for c in kept[-KEEP_ENDS:]] == list(range(n - KEEP_ENDS, n))
    assert {1500, 2000} <= {c.index for c in kept}
    assert len(kept) + sum(c.folded for c in kept) == n
    assert chain_positions(kept) == [c.index for c in kept]  # positions in the whole chain
    assert fold(links[:MAX_LINKS]) == tuple(links[:MAX_LINKS])  # short enough: as it was


def _node(i: int, error: float | None, outputs: tuple[str, ...]) -> NodeResult:
    acc = None if error is None else Comparison(f"t{i}", Status.OK, error, {"rel_l2": error})
    return NodeResult(i, f"n{i}", "Relu", (f"t{i - 1}",), outputs, Verdict.OK, acc)


def test_a_chain_that_stops_short_of_the_outputs_says_why() -> None:
    """n2's only consumer (n3, the output) has no measured error: the chain ends at n2, and
    its last link says so; a chain that reaches the output says nothing."""
    nodes = [_node(0, 0.1, ("t0",)), _node(1, 0.2, ("t1",)), _node(2, 0.3, ("t2",))]
    consumers = {0: [1], 1: [2], 2: [3]}
    short = amplification_chain([*nodes, _node(3, None, ("y",))], consumers, 0, ("y",))
    assert [c.node for c in short] == ["n0", "n1", "n2"]
    assert short[-1].stop == "no error measured at its consumers (Relu n3)"
    full = amplification_chain([*nodes, _node(3, 0.4, ("y",))], consumers, 0, ("y",))
    assert [c.node for c in full] == ["n0", "n1", "n2", "n3"] and not full[-1].stop


@pytest.mark.slow
def test_a_chain_longer_than_the_kept_links_reaches_the_output(tmp_path: Path) -> None:
    """150 residual blocks, the fault in the sixth: about 1,300 links from the fault to ``y``
    (the chain used to stop at 1,024, blocks short of the output, without saying so). The
    last block's Div, norm, writes y."""
    model = mlp_blocks(150 * NODES_PER_BLOCK)
    result = onnx_bisect.bisect(model, target=FaultyBackend("block5/mm", 0.05), threshold=1e-4)
    chain = result.chain
    assert result.root_cause is not None and result.root_cause.nodes == ("block5/mm",)
    assert chain[0].node == "block5/mm" and chain[-1].node == "block149/norm"  # it writes y
    total = len(chain) + sum(c.folded for c in chain)
    assert len(chain) == MAX_LINKS and total > MAX_LINKS
    line = chain_line(result)
    assert f"({total - 2} nodes, {total - len(chain)} of them folded in report.json)" in line
    report = onnx_bisect.to_dict(result)
    assert sum(c["folded"] for c in report["chain"]) == total - len(chain)
    assert json.loads(json.dumps(report["chain"]))[-1]["node"] == "block149/norm"
    assert np.isfinite(chain[-1].rel_l2)
