"""A search that counts compiles (issue 29, scope 5): a target whose every run is a compile is
localized in about ⌈log2 N⌉ runs, whether it says so (``Capabilities.compiles``) or not."""

from __future__ import annotations

import hashlib
import shlex
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy.typing as npt
import onnx
import pytest

import onnx_bisect
from onnx_bisect.backends.protocol import BackendBase, Capabilities, Tensors
from onnx_bisect.backends.registry import create_backend
from onnx_bisect.backends.spec import BackendSpec
from onnx_bisect.errors import BackendError
from onnx_bisect.result import CauseKind
from tests.models import FAULTY_RUNTIME, chain

NODES = 300  # chain(150): mm0, act0, ..., mm149, act149
BROKEN = "act100"  # node #201


class SimulatedCompiler(BackendBase):
    """ONNX Runtime behind a 'compile' that fails whenever ``node`` is in the model, as IREE's
    does on an op it cannot legalize; ``compiled`` counts the distinct models it was given."""

    capabilities = Capabilities(compiles=True)

    def __init__(self, node: str) -> None:
        super().__init__(BackendSpec(text="simulated-compiler", name="simulated-compiler"))
        self.node = node
        self.inner = create_backend("cpu")
        self.compiled: set[str] = set()
        self.runs = 0

    def _run(self, model: onnx.ModelProto, feeds: Mapping[str, npt.NDArray[Any]]) -> Tensors:
        self.runs += 1
        self.compiled.add(hashlib.sha256(model.SerializeToString()).hexdigest())
        for n in model.graph.node:
            if n.name == self.node:
                raise BackendError(
                    f"error: failed to legalize operation 'torch.operator' (node {n.name})"
                )
        return self.inner.run(model, feeds)


def _check(result: onnx_bisect.BisectResult) -> None:
    assert result.root_cause is not None and result.root_cause.nodes == (BROKEN,)
    assert result.root_cause.kind is CauseKind.UNSUPPORTED


def test_a_declared_compiler_is_localized_in_log2_n_runs() -> None:
    target = SimulatedCompiler(BROKEN)
    result = onnx_bisect.bisect(chain(NODES // 2), target=target)
    _check(result)
    # The screen, ⌈log2 300⌉ = 9 prefixes, and the node alone: no extra check, no probe.
    assert result.runs["target"] == target.runs <= 11
    assert len(target.compiled) == target.runs  # no model compiled twice


@pytest.mark.slow
def test_a_sleeping_exec_compiler_is_localized_in_at_most_12_runs(tmp_path: Path) -> None:
    marks = tmp_path / "runs.txt"
    cmd = [sys.executable, str(FAULTY_RUNTIME), "{model}", "{inputs}", "{outputs}"]
    cmd += ["--fail-on", BROKEN, "--sleep", "0.5", "--mark", str(marks)]
    result = onnx_bisect.bisect(chain(NODES // 2), target="exec:" + shlex.join(cmd))
    assert result.root_cause is not None and result.root_cause.nodes == (BROKEN,)
    runs = marks.read_text().splitlines()
    assert result.runs["target"] == len(runs) <= 12
