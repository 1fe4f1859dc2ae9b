"""A search that counts compiles (issue 29, scope 5): a target whose every run is a compile is
localized in about ⌈log2 N⌉ runs, whether it says so (``Capabilities.compiles``) or not, sends
no model twice, and the report says how many runs (compiles) each stage took."""

from __future__ import annotations

import hashlib
import json
import shlex
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import onnx
import pytest
from rich.console import Console
from typer.testing import CliRunner

import onnx_bisect
from onnx_bisect.backends.protocol import BackendBase, Capabilities, Tensors
from onnx_bisect.backends.registry import create_backend
from onnx_bisect.backends.spec import BackendSpec
from onnx_bisect.cli import bisect_app
from onnx_bisect.errors import BackendError
from onnx_bisect.report.terminal import print_summary
from onnx_bisect.result import CauseKind
from tests.models import ROOT, chain

COMPILER_RUNTIME = ROOT / "tests" / "compiler_runtime.py"

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
    # Every run but the screen's is the failure search's, the node-alone check included.
    assert result.target.compiles
    assert dict(result.stage_runs) == {"screen": 1, "bisect": target.runs - 1}
    console = Console(record=True, width=200)
    print_summary(result, console)
    said = f"target compiles by stage: screen 1, bisect {target.runs - 1} ({target.runs} in all)"
    assert said in console.export_text()


def test_a_sandbox_passes_on_what_its_runtime_declares(tmp_path: Path) -> None:
    """``--isolate-crashes`` runs the backend in a child per run; what the runtime declares
    (that it computes, answers for some tensors only) still holds, all but streaming. A
    compiler's ``compiles`` is tested on IREE and TVM in test_compilers.py."""
    pytest.importorskip("torch", reason="torch streams; the [torch] extra is not installed")
    assert create_backend("torch:cpu").capabilities.streams
    sandboxed = create_backend("torch:cpu", in_child=True)
    assert sandboxed.capabilities == Capabilities(child_process=True)
    np.save(tmp_path / "y.npy", np.zeros(3, np.float32))
    dump = create_backend(f"dump:{tmp_path}", in_child=True)
    assert dump.capabilities == Capabilities(computes=False, partial=True, child_process=True)


@pytest.mark.slow
def test_a_compiler_of_2_s_per_model_is_localized_in_12_compiles_shown_per_stage(
    tmp_path: Path,
) -> None:
    """Acceptance (issue 29): an exec: compiler that takes 2 s per distinct model and cannot
    lower one node of a 300-node chain. The node is named in at most 12 runs, no model is
    sent twice (the bundle's check in a fresh process included), and the terminal, report.md
    and report.json say how many runs each stage took."""
    model = tmp_path / "chain.onnx"
    onnx.save(chain(NODES // 2), model)
    log = tmp_path / "compiles.txt"
    cmd = [sys.executable, str(COMPILER_RUNTIME), "{model}", "{inputs}", "{outputs}"]
    cmd += ["--log", str(log), "--compile-s", "2", "--illegal", BROKEN]
    out = tmp_path / "out"
    start = time.perf_counter()
    res = CliRunner().invoke(
        bisect_app, [str(model), "--target", "exec:" + shlex.join(cmd), "--out", str(out)]
    )
    seconds = time.perf_counter() - start
    assert res.exit_code == 1, res.output
    runs = [line.split()[0] for line in log.read_text().splitlines()]
    assert len(runs) <= 12
    assert len(set(runs)) == len(runs)  # every run a distinct model: nothing compiled twice
    assert seconds >= 2 * len(runs)
    report = json.loads((out / "report.json").read_text())
    assert report["root_cause"]["nodes"] == [BROKEN]
    assert report["root_cause"]["kind"] == "unsupported"
    by_stage = report["target_runs_by_stage"]
    # The screen, the failure search (⌈log2 300⌉ prefixes at most, the node alone), and the
    # bundle's check by its repro.py, which stands in for another run of the node alone.
    assert by_stage["screen"] == 1 and by_stage["repro check"] == 1
    assert set(by_stage) == {"screen", "bisect", "repro check"}
    assert sum(by_stage.values()) == len(runs)
    assert report["runs"]["target"] == len(runs) - 1
    assert not report["target"]["compiles"]  # an exec: runtime does not say
    said = f"target runs by stage: screen 1, bisect {by_stage['bisect']}, repro check 1"
    assert said in " ".join(res.output.split())
    assert said in (out / "report.md").read_text()
