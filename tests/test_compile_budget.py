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
from tests.faulty import FaultyBackend
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
    assert sandboxed.capabilities == Capabilities(child_process=True, process_per_run=True)
    worker = create_backend("torch:cpu", in_child=None)  # the default: one long-lived child
    assert worker.capabilities == Capabilities(child_process=True)
    np.save(tmp_path / "y.npy", np.zeros(3, np.float32))
    dump = create_backend(f"dump:{tmp_path}", in_child=True)
    assert dump.capabilities == Capabilities(
        computes=False, partial=True, child_process=True, process_per_run=True
    )
    # A dump reads files: nothing in it can crash, so the default keeps it here.
    assert create_backend(f"dump:{tmp_path}", in_child=None).capabilities == Capabilities(
        computes=False, partial=True
    )


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
    said = (
        f"target runs by stage: screen 1, bisect {by_stage['bisect']} "
        f"({1 + by_stage['bisect']} in all); and 1 by the repro bundle's own repro.py"
    )
    assert said in " ".join(res.output.split())
    assert said in (out / "report.md").read_text()


def _compiler_command(log: Path, *options: str) -> str:
    cmd = [sys.executable, str(COMPILER_RUNTIME), "{model}", "{inputs}", "{outputs}"]
    return "exec:" + shlex.join([*cmd, "--log", str(log), *options])


@pytest.mark.slow
def test_an_exec_compiler_that_declares_it_gets_the_compile_counting_search(
    tmp_path: Path,
) -> None:
    """An exec: program that says on stderr that it compiles (docs/exec-protocol.md) is
    searched as a compiler: the prefixes are bisected without the check one position further
    (⌈log2 300⌉ = 9 runs and the node alone), and the report says its runs are compiles."""
    model = tmp_path / "chain.onnx"
    onnx.save(chain(NODES // 2), model)
    log, out = tmp_path / "compiles.txt", tmp_path / "out"
    target = _compiler_command(log, "--illegal", BROKEN, "--declare")
    res = CliRunner().invoke(bisect_app, [str(model), "--target", target, "--out", str(out)])
    assert res.exit_code == 1, res.output
    runs = [line.split()[0] for line in log.read_text().splitlines()]
    assert len(set(runs)) == len(runs)
    report = json.loads((out / "report.json").read_text())
    assert report["root_cause"]["nodes"] == [BROKEN]
    assert report["target"]["compiles"]
    by_stage = report["target_runs_by_stage"]
    assert by_stage == {"screen": 1, "bisect": len(runs) - 2, "repro check": 1}
    assert len(runs) <= 1 + 10 + 1
    said = (
        f"target compiles by stage: screen 1, bisect {by_stage['bisect']} "
        f"({1 + by_stage['bisect']} in all); and 1 by the repro bundle's own repro.py"
    )
    assert said in " ".join(res.output.split())


def test_a_compilers_divergence_bundle_is_compiled_once(tmp_path: Path) -> None:
    """A bundle of a divergence on a compiler is run once, by its own repro.py (a run here
    first would compile the same model twice): no model reaches the compiler twice, and the
    repro stage's one compile is the check's."""
    model = tmp_path / "chain.onnx"
    onnx.save(chain(4), model)
    log, out = tmp_path / "compiles.txt", tmp_path / "out"
    target = _compiler_command(log, "--fault", "mm2=0.05", "--declare")
    res = CliRunner().invoke(bisect_app, [str(model), "--target", target, "--out", str(out)])
    assert res.exit_code == 1, res.output
    runs = [line.split()[0] for line in log.read_text().splitlines()]
    assert len(set(runs)) == len(runs)  # nothing compiled twice
    report = json.loads((out / "report.json").read_text())
    assert report["root_cause"]["nodes"] == ["mm2"]
    assert report["repro"]["reproduces"] and report["repro"]["nodes"] == ["mm2"]
    by_stage = report["target_runs_by_stage"]
    assert "repro" not in by_stage and by_stage["repro check"] == 1
    assert sum(by_stage.values()) == len(runs)
    bundle = hashlib.sha256((out / "repro" / "model.onnx").read_bytes()).hexdigest()
    assert runs[-1] == bundle  # the last compile was the bundle's, by its repro.py


def test_a_declared_compilers_bundle_is_checked_once_in_process(tmp_path: Path) -> None:
    """A compiler given as an object (no repro.py can rebuild it): the bundle's one run is
    the check here, so the repro stage costs one compile, not two."""

    class Diverging(FaultyBackend):
        capabilities = Capabilities(compiles=True)

    target = Diverging("mm2")
    result = onnx_bisect.bisect(chain(4), target=target, repro=tmp_path / "repro")
    assert result.root_cause is not None and result.root_cause.nodes == ("mm2",)
    assert result.repro is not None and result.repro.reproduces, result.repro
    assert "repro" not in result.stage_runs and result.stage_runs["repro check"] == 1
    assert sum(result.stage_runs.values()) == target.runs


class NeedsItsProducers(SimulatedCompiler):
    """Fails on ``node`` only when the nodes that compute its input are in the model too (as
    TVM fails on a Reshape whose shape the graph computes, and runs it fed a constant);
    ``models`` keeps the node names of every model it was given."""

    def __init__(self, node: str, needs: tuple[str, ...]) -> None:
        super().__init__(node)
        self.needs = needs
        self.models: list[set[str]] = []

    def _run(self, model: onnx.ModelProto, feeds: Mapping[str, npt.NDArray[Any]]) -> Tensors:
        names = {n.name for n in model.graph.node}
        self.models.append(names)
        self.runs += 1
        self.compiled.add(hashlib.sha256(model.SerializeToString()).hexdigest())
        if self.node in names and set(self.needs) <= names:
            raise BackendError(f"error: cannot lower {self.node}: its shape is not constant")
        return self.inner.run(model, feeds)


def test_a_failure_that_needs_the_graph_before_it_bundles_its_ancestors_only(
    tmp_path: Path,
) -> None:
    """The node ran alone in the failure search and every prefix holding it fails: the bundle
    search neither runs it alone again nor tries windows of its consumers, which cannot fail
    (each a compile); the bundle is its backward window."""
    target = NeedsItsProducers("mm3", needs=("mm2", "act2"))
    result = onnx_bisect.bisect(chain(6), target=target, repro=tmp_path / "repro")
    assert result.root_cause is not None and result.root_cause.nodes == ("mm3",)
    assert result.root_cause.kind is CauseKind.ERROR
    assert result.repro is not None and result.repro.reproduces, result.repro
    assert result.repro.nodes == ("mm2", "act2", "mm3")
    checks = result.stage_runs["repro check"]
    assert "repro" not in result.stage_runs  # a compiler runs each candidate in the check only
    bundle_runs = target.models[-checks:]
    alone = [m for m in target.models if m == {"mm3"}]
    assert len(alone) == 1  # the failure search's check, not run again
    after = {f"act{i}" for i in range(3, 6)} | {f"mm{i}" for i in range(4, 6)}
    assert not any(m & after for m in bundle_runs)
    assert len(target.compiled) == target.runs
