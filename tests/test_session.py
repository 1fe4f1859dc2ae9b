"""The layout's contracts: options shared by the API and the CLI, a setup reused across inputs,
capabilities declared by backends, and cut models marked by metadata rather than by name."""

from __future__ import annotations

import dataclasses
import shlex
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest

import onnx_bisect
from onnx_bisect import BisectOptions, Capabilities, InputError
from onnx_bisect.backends.dump import DumpBackend
from onnx_bisect.backends.registry import create_backend
from onnx_bisect.cli.params import DEFAULTS, MAX_MEMORY_TEXT, THRESHOLD_TEXT, parse_bytes
from onnx_bisect.dumper import dump
from onnx_bisect.engine.diagnose import diagnose, open_session, prepare
from onnx_bisect.engine.session import StageTimer, scratch_dir
from onnx_bisect.errors import BackendError
from onnx_bisect.graph.extract import derived_kind, isolation_model, prefix_model, window_model
from onnx_bisect.graph.load import load_model
from onnx_bisect.graph.view import TensorMeta
from onnx_bisect.inputs.feeds import make_feeds
from onnx_bisect.result import CauseKind, Outcome
from tests.models import FAULTY_RUNTIME, YOLO, chain, node_named

FAULT = "/down1/conv/Conv"


def _faulty(fraction: float) -> str:
    cmd = [sys.executable, str(FAULTY_RUNTIME), "{model}", "{inputs}", "{outputs}"]
    return "exec:" + shlex.join([*cmd, "--fault", f"{FAULT}={fraction}"])


def test_options_object_and_keywords_give_the_same_diagnosis() -> None:
    by_keywords = onnx_bisect.bisect(YOLO, target=_faulty(0.05), seed=3)
    by_object = onnx_bisect.bisect(YOLO, target=_faulty(0.05), options=BisectOptions(seed=3))
    assert by_keywords.root_cause == by_object.root_cause
    assert by_keywords.root_cause is not None and by_keywords.root_cause.nodes == (FAULT,)
    assert by_keywords.runs == by_object.runs


def test_unknown_option_is_an_input_error() -> None:
    with pytest.raises(InputError, match=r"unknown option\(s\) thresold; see BisectOptions"):
        onnx_bisect.bisect(YOLO, target="cpu", thresold=1e-3)


def test_cli_defaults_are_the_api_defaults() -> None:
    assert BisectOptions() == DEFAULTS
    assert parse_bytes(MAX_MEMORY_TEXT) == BisectOptions().max_memory
    assert THRESHOLD_TEXT == BisectOptions().threshold == "auto"


def test_one_setup_serves_several_inputs() -> None:
    """Dataset mode's shape: prepare once, then a session per input, each judged alone."""
    opts = BisectOptions()
    timer = StageTimer()
    setup, first = prepare(YOLO, "cpu", _faulty(0.05), opts, timer)
    second = make_feeds(setup.loaded.model, seed=1)
    assert not np.array_equal(first["images"], second["images"])
    found = []
    for feeds in (first, second):
        with scratch_dir() as scratch:
            session = open_session(setup, feeds, scratch, timer)
            diagnosis = diagnose(session)
            assert diagnosis.diverged and diagnosis.found is not None
            assert diagnosis.found.cause is not None
            found.append(diagnosis.found.cause.nodes)
            # Tallies are per input: each session counts its own runs only.
            assert session.stats.runs["ref"] == 2
    assert found == [(FAULT,), (FAULT,)]


def test_backends_declare_capabilities(tmp_path: Path) -> None:
    assert create_backend("cpu").capabilities == Capabilities()
    exec_backend = create_backend(_faulty(0.05), timeout=7.0)
    assert exec_backend.capabilities.child_process
    assert getattr(exec_backend, "timeout", None) == 7.0  # given at construction
    sandboxed = create_backend("cpu", in_child=True, timeout=3.0)
    assert sandboxed.capabilities.child_process and sandboxed.spec.text == "cpu"
    dump(YOLO, "cpu", tmp_path / "d")
    dumped = create_backend(f"dump:{tmp_path / 'd'}")
    assert dumped.capabilities == Capabilities(computes=False, partial=True)
    recorded = dumped.recorded_inputs()
    assert recorded is not None and set(recorded) == {"images"}
    assert create_backend("cpu").recorded_inputs() is None


def test_cut_models_are_marked_in_metadata_not_by_name() -> None:
    loaded = load_model(chain(3))
    node = node_named(loaded, loaded.nodes[1].name)
    meta = {t: TensorMeta(np.dtype(np.float32), (1, 8)) for t in node.inputs}
    iso, _ = isolation_model(loaded, [node], meta)
    win, _, _ = window_model(loaded, [node], meta)
    assert derived_kind(iso) == "isolated"
    assert derived_kind(win) == "window"
    assert derived_kind(prefix_model(loaded, 2)) == "prefix"
    assert derived_kind(loaded.model) is None
    # The cut model keeps the user's graph name: nothing is read from it.
    assert iso.graph.name == loaded.model.graph.name


def test_a_dump_replays_a_user_graph_whatever_its_name(tmp_path: Path) -> None:
    model = onnx.load(str(YOLO))
    model.graph.name = "detector_window"  # once mistaken for a cut model by its suffix
    path = tmp_path / "named.onnx"
    onnx.save(model, str(path))
    dump(path, "cpu", tmp_path / "d")
    backend = create_backend(f"dump:{tmp_path / 'd'}")
    assert isinstance(backend, DumpBackend)
    out = backend.run(model, {})
    assert set(out) == {o.name for o in model.graph.output}
    with pytest.raises(BackendError, match="a dump cannot compute"):
        backend.run(prefix_model(load_model(path), 3), {})
    result = onnx_bisect.bisect(path, ref="cpu", target=f"dump:{tmp_path / 'd'}")
    assert result.verdict == "match"


def test_result_is_typed_data_and_reports_are_functions(tmp_path: Path) -> None:
    result = onnx_bisect.bisect(YOLO, target=_faulty(0.05))
    assert result.verdict is Outcome.DIVERGED and result.verdict == "diverged"
    assert result.root_cause is not None
    assert result.root_cause.kind is CauseKind.CULPRIT
    assert not any(hasattr(result, m) for m in ("write", "to_dict", "nodes_frame"))
    data = onnx_bisect.to_dict(result)
    assert data["verdict"] == "diverged" and data["root_cause"]["kind"] == "culprit"
    frame = onnx_bisect.to_frame(result)
    assert list(frame["node"]) == [n.name for n in result.nodes]
    names = {p.name for p in onnx_bisect.write_reports(result, tmp_path)}
    overlays = {"accumulated.json", "isolated.json", "view.json"}  # in explorer/
    assert names - {"error_curve.png"} == {
        "report.md",
        "report.json",
        "nodes.csv",
        "report.html",
        "inputs.npz",
        *overlays,
    }
    assert dataclasses.is_dataclass(result)
