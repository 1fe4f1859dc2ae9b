"""Model Explorer overlays and ``onnx-bisect view``: the keys are the ids Model Explorer's ONNX
adapter gives the model's nodes, and the files are what its node-data classes describe."""

from __future__ import annotations

import importlib.util
import json
import math
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import onnx
import pytest
from typer.testing import CliRunner

import onnx_bisect
from onnx_bisect.cli import app
from onnx_bisect.cli import commands as cli_commands
from onnx_bisect.report.explorer import MAIN_GRAPH, read_explorer, write_explorer
from tests.faulty import FaultyBackend
from tests.models import YOLO, chain, with_if
from tests.test_control_flow import POSITIVE, nested_if
from tests.test_loops import X as LOOP_X
from tests.test_loops import loop_model

FAULT = "/down1/conv/Conv"


@pytest.fixture(scope="module")
def yolo_out(tmp_path_factory: pytest.TempPathFactory) -> tuple[onnx_bisect.BisectResult, Path]:
    out = tmp_path_factory.mktemp("yolo")
    result = onnx_bisect.bisect(YOLO, target=FaultyBackend(FAULT, 0.05))
    onnx_bisect.write_reports(result, out)
    return result, out


def _load(path: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(path.read_text())
    return data


def _adapter_ids(model: Path) -> dict[str, set[str]]:
    """Graph id -> node ids, as the model-explorer-onnx adapter draws ``model``."""
    adapter = pytest.importorskip("model_explorer_onnx.main", reason="model-explorer-onnx absent")
    graphs = adapter.ONNXAdapter().convert(str(model), {})["graphs"]
    return {g.id: {n.id for n in g.nodes} for g in graphs}


def test_overlays_are_keyed_by_the_models_node_names(yolo_out: Any) -> None:
    result, out = yolo_out
    graph = onnx.load(str(YOLO), load_external_data=False).graph
    acc = _load(out / "explorer" / "accumulated.json")
    assert list(acc) == [graph.name]
    results = acc[graph.name]["results"]
    scored = {n.name: n for n in result.nodes if n.accumulated is not None}
    assert set(results) == set(scored)
    assert set(results) <= {n.name for n in graph.node}
    assert results[FAULT]["value"] == pytest.approx(scored[FAULT].accumulated_error)
    # Red where the tensor's own threshold was crossed, green where not.
    colour = {n.name: results[n.name]["bgColor"] for n in scored.values()}
    diverged = {n.name for n in scored.values() if n.accumulated.diverged}
    assert {colour[n] for n in diverged} == {"#ef9a9a"} and FAULT in diverged
    assert {c for n, c in colour.items() if n not in diverged} == {"#a5d6a7"}
    iso = _load(out / "explorer" / "isolated.json")[graph.name]["results"]
    assert set(iso) == {n.name for n in result.nodes if n.isolated is not None}
    assert iso[FAULT]["value"] == pytest.approx(0.05, rel=1e-3)
    assert result.criterion.noise is not None  # per-tensor thresholds: no single legend
    assert "thresholds" not in acc[graph.name]
    # A named model is shown as it is: no copy, the manifest points at the file.
    assert not (out / "explorer" / "model.onnx").exists()
    files = read_explorer(out)
    assert files is not None and files.model == YOLO.resolve()
    assert [p.name for p in files.overlays] == ["accumulated.json", "isolated.json"]


def validate(data: dict[str, Any]) -> None:
    """Check node data against Model Explorer's own classes, where it is installed."""
    if importlib.util.find_spec("model_explorer") is None:
        return
    import dacite
    from model_explorer import node_data_builder as ndb

    # Strict: a field that is not theirs, or one of another type, fails here.
    strict = dacite.Config(strict=True, check_types=True)
    graphs = {gid: dacite.from_dict(ndb.GraphNodeData, g, config=strict) for gid, g in data.items()}
    written = json.loads(ndb.ModelNodeData(graphsData=graphs).to_json_string())
    # Nothing was lost on the way (their writer adds its defaults).
    assert {gid: {k: written[gid][k] for k in g} for gid, g in data.items()} == data
    for g in graphs.values():
        assert all(isinstance(r, ndb.NodeDataResult) for r in g.results.values())
        assert all(isinstance(t, ndb.ThresholdItem) for t in g.thresholds)


def test_overlays_validate_against_model_explorers_node_data_classes(yolo_out: Any) -> None:
    pytest.importorskip("model_explorer.node_data_builder", reason="ai-edge-model-explorer absent")
    _, out = yolo_out
    for name in ("accumulated.json", "isolated.json"):
        validate(_load(out / "explorer" / name))


def test_overlay_keys_are_node_ids_of_model_explorers_onnx_adapter(yolo_out: Any) -> None:
    _, out = yolo_out
    ids = _adapter_ids(YOLO)
    for name in ("accumulated.json", "isolated.json"):
        for gid, g in _load(out / "explorer" / name).items():
            assert set(g["results"]) <= ids[gid]


def test_a_fixed_threshold_is_the_overlays_legend(tmp_path: Path) -> None:
    path = tmp_path / "chain.onnx"
    onnx.save(chain(3), str(path))
    result = onnx_bisect.bisect(path, target=FaultyBackend("mm1", 0.05), threshold=0.01)
    write_explorer(result, tmp_path / "explorer")
    data = _load(tmp_path / "explorer" / "accumulated.json")
    validate(data)
    thresholds = data["g"]["thresholds"]
    assert thresholds[0] == {"value": 0.01, "bgColor": "#a5d6a7"}
    assert thresholds[1]["bgColor"] == "#ef9a9a" and math.isfinite(thresholds[1]["value"])


def test_unnamed_nodes_and_graph_get_our_names_in_a_copy_of_the_model(tmp_path: Path) -> None:
    model = chain(3)
    model.graph.name = ""
    for node in model.graph.node:
        node.name = ""
    path = tmp_path / "unnamed.onnx"
    onnx.save(model, str(path))
    result = onnx_bisect.bisect(path, target=FaultyBackend("MatMul_2", 0.05))
    assert result.root_cause is not None and result.root_cause.nodes == ("MatMul_2",)
    written = write_explorer(result, tmp_path / "explorer")
    assert [p.name for p in written] == [
        "model.onnx",
        "accumulated.json",
        "isolated.json",
        "view.json",
    ]
    acc = _load(tmp_path / "explorer" / "accumulated.json")
    assert list(acc) == [MAIN_GRAPH]
    names = {"MatMul_0", "Tanh_1", "MatMul_2", "Tanh_3", "MatMul_4", "Tanh_5"}
    assert set(acc[MAIN_GRAPH]["results"]) == names
    copy = onnx.load(str(tmp_path / "explorer" / "model.onnx"))
    assert copy.graph.name == MAIN_GRAPH
    assert {n.name for n in copy.graph.node} == set(acc[MAIN_GRAPH]["results"])
    assert _load(tmp_path / "explorer" / "view.json")["model"] == "model.onnx"  # moves with OUT
    ids = _adapter_ids(tmp_path / "explorer" / "model.onnx")
    assert set(acc[MAIN_GRAPH]["results"]) <= ids[MAIN_GRAPH]


def test_inlined_if_branch_nodes_are_keyed_as_model_explorer_draws_them(tmp_path: Path) -> None:
    path = tmp_path / "nested.onnx"
    onnx.save(nested_if(), str(path))
    result = onnx_bisect.bisect(path, target=FaultyBackend("double", 0.05), inputs=POSITIVE)
    assert result.root_cause is not None and result.root_cause.nodes == ("double",)
    write_explorer(result, tmp_path / "explorer")
    results = _load(tmp_path / "explorer" / "accumulated.json")["g"]["results"]
    # Our names: "double" (kept) and "outer/then_branch/relu" (renamed, it clashed with the
    # main graph's "relu"); Model Explorer draws both inside their If, nested Ifs included.
    assert "outer/then_branch/inner/then_branch/double" in results
    assert "outer/then_branch/relu" in results
    assert "relu" in results and "tail" in results
    assert "double" not in results
    fault = next(n for n in result.nodes if n.name == "double")
    assert results["outer/then_branch/inner/then_branch/double"]["value"] == pytest.approx(
        fault.accumulated_error
    )
    assert set(results) <= _adapter_ids(path)["g"]


def test_unrolled_loop_iterations_land_on_the_body_graphs_node(tmp_path: Path) -> None:
    path = tmp_path / "loop.onnx"
    onnx.save(loop_model(), str(path))
    result = onnx_bisect.bisect(path, target=FaultyBackend("body_add", 0.05), inputs=LOOP_X)
    assert result.root_cause is not None
    assert result.root_cause.nodes == ("loop/iteration_0/body_add",)
    write_explorer(result, tmp_path / "explorer")
    data = _load(tmp_path / "explorer" / "accumulated.json")
    assert {"pre", "post"} <= set(data["loop_model"]["results"])
    body = data["loop/body"]["results"]
    # The body's node shows its worst iteration.
    adds = [n for n in result.nodes if n.name.endswith("/body_add")]
    assert len(adds) == 3
    assert body["body_add"]["value"] == pytest.approx(max(n.accumulated_error for n in adds))
    ids = _adapter_ids(path)
    assert all(set(g["results"]) <= ids[gid] for gid, g in data.items())


def test_a_single_if_branch(tmp_path: Path) -> None:
    path = tmp_path / "if.onnx"
    onnx.save(with_if(), str(path))
    result = onnx_bisect.bisect(
        path, target=FaultyBackend("neg", 0.05), inputs={"x": POSITIVE["x"]}
    )
    write_explorer(result, tmp_path / "explorer")
    results = _load(tmp_path / "explorer" / "accumulated.json")["g"]["results"]
    assert {"relu", "branch/then_branch/neg"} <= set(results)


def test_view_launches_model_explorer_with_the_model_and_overlays(
    yolo_out: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("model_explorer", reason="ai-edge-model-explorer absent")
    _, out = yolo_out
    launched: list[list[str]] = []

    def launch(argv: Sequence[str]) -> int:
        launched.append(list(argv))
        return 0

    monkeypatch.setattr(cli_commands, "launcher", launch)
    res = CliRunner().invoke(app, ["view", str(out)])
    assert res.exit_code == 0, res.output
    overlays = f"{out}/explorer/accumulated.json,{out}/explorer/isolated.json"
    assert launched == [
        [
            sys.executable, "-m", "model_explorer", str(YOLO.resolve()),
            "--extensions=model_explorer_onnx", f"--node_data_paths={overlays}",
        ]
    ]  # fmt: skip


def test_view_without_model_explorer_prints_the_command(
    yolo_out: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, out = yolo_out
    real_find_spec = cli_commands.importlib.util.find_spec

    def find_spec(name: str, *args: Any) -> Any:
        return None if name == "model_explorer" else real_find_spec(name, *args)

    monkeypatch.setattr(cli_commands.importlib.util, "find_spec", find_spec)
    monkeypatch.setattr(cli_commands, "launcher", lambda argv: pytest.fail("launched"))
    res = CliRunner().invoke(app, ["view", str(out)])
    assert res.exit_code == 0, res.output
    files = read_explorer(out)
    assert files is not None
    assert res.output.splitlines() == [
        "Model Explorer is not installed; install it and run:",
        "  pip install 'onnx-bisect[explorer]'",
        "  " + shlex.join(files.command()),
    ]


def test_view_of_a_directory_without_overlays_is_a_one_line_error(tmp_path: Path) -> None:
    res = CliRunner().invoke(app, ["view", str(tmp_path)])
    assert res.exit_code == 2
    assert res.output.strip() == (
        f"error: {tmp_path}: no explorer/view.json; write one with bisect MODEL ... "
        f"--out {tmp_path}"
    )
