"""What keeps a diagnosis linear in the node count (issue 14), checked by behaviour, not time:
isolation batches capped in nodes, each typed from its own tensors only, isolation in child
processes two at a time without blaming a one-device runtime, the float64 oracle's values in
one file per chunk and mapped once, .npz outputs read in one pass, report.json by the C
encoder. Models come from ``benchmarks/models.py``, the scaling benchmark's own."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import onnx_bisect
from benchmarks.models import NODES_PER_BLOCK, middle_matmul, mlp_blocks
from onnx_bisect.engine.diagnose import open_session, prepare
from onnx_bisect.engine.measure import isolate
from onnx_bisect.engine.measure.operands import reference_operands
from onnx_bisect.engine.measure.store import TensorStore
from onnx_bisect.engine.oracle import float64
from onnx_bisect.engine.session import StageTimer
from onnx_bisect.errors import InputError
from onnx_bisect.graph.extract import derived_kind, with_outputs
from onnx_bisect.graph.load import load_model
from onnx_bisect.graph.view import TensorMeta
from onnx_bisect.inputs.feeds import save_npz
from onnx_bisect.inputs.npz import read_npz
from onnx_bisect.options import BisectOptions
from onnx_bisect.report.jsontext import json_text
from tests.faulty import FaultyBackend
from tests.models import FAULTY_RUNTIME

# 60 blocks: 660 nodes, small enough for a test and long enough for several batches.
BLOCKS = 60


@pytest.fixture(scope="module")
def mlp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("scale") / "mlp.onnx"
    onnx.save(mlp_blocks(BLOCKS * NODES_PER_BLOCK), str(path))
    return path


class CountingFaulty(FaultyBackend):
    """The planted fault, and the node count of every isolation model it was given."""

    def __init__(self, node: str) -> None:
        super().__init__(node)
        self.isolation_nodes: list[int] = []

    def _run(self, model: onnx.ModelProto, feeds: Any) -> Any:
        if derived_kind(model) == "isolated":
            self.isolation_nodes.append(len(model.graph.node))
        return super()._run(model, feeds)


def test_the_generated_model_has_the_size_asked_for() -> None:
    model = mlp_blocks(2000)
    assert len(model.graph.node) == 2000 // NODES_PER_BLOCK * NODES_PER_BLOCK == 1991
    assert middle_matmul(model) == "block90/mm"
    onnx.checker.check_model(model)


def test_isolation_batches_are_capped_in_nodes(mlp: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A session's setup grows faster than its node count (ONNX Runtime checks every feed
    # against a list of all inputs), so no batch may hold more than the cap, whatever the
    # byte budget allows: here all 660 nodes fit the bytes of one batch.
    monkeypatch.setattr(isolate, "ISOLATION_BATCH_NODES", 100)
    fault = middle_matmul(onnx.load(str(mlp)))
    target = CountingFaulty(fault)
    result = onnx_bisect.bisect(mlp, target=target, threshold=1e-3)
    assert result.root_cause is not None and result.root_cause.nodes == (fault,)
    nodes = BLOCKS * NODES_PER_BLOCK
    assert len(target.isolation_nodes) == math.ceil(nodes / 100) == result.runs["target"] - 2
    # Split evenly (6 x 95 + 90), not into 100s and a remainder of 60.
    assert target.isolation_nodes == [95] * 6 + [90]


def test_a_batch_is_typed_from_its_own_tensors_only(mlp: Path) -> None:
    loaded = load_model(mlp)
    store = TensorStore(None)
    for name in loaded.probes:
        store.put(name, np.zeros((64, 16), np.float32))
    node = loaded.nodes[len(loaded.nodes) // 2]
    metas, constants = reference_operands(loaded, store, [node])
    # Not one type per stored tensor: typing the whole store for each batch made isolation
    # quadratic in the node count.
    assert set(metas) == {t for t in (*node.inputs, *node.outputs) if t in store}
    assert constants == {}


def _exec_target(fault: str, *extra: str) -> str:
    cmd = [sys.executable, str(FAULTY_RUNTIME), "{model}", "{inputs}", "{outputs}"]
    return "exec:" + " ".join([*cmd, "--fault", f"{fault}=0.05", *extra])


def _verdicts(result: onnx_bisect.BisectResult) -> dict[str, str]:
    return {n.name: n.verdict.value for n in result.nodes}


@pytest.mark.slow
def test_child_process_isolation_runs_two_at_once_and_blames_no_busy_device(
    mlp: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A runtime of one device refuses a second run while the first holds it: the batch it
    refused is run again alone, so the answer is the one-at-a-time answer, at one more run."""
    nodes = BLOCKS * NODES_PER_BLOCK
    monkeypatch.setattr(isolate, "ISOLATION_BATCH_NODES", nodes // 2)  # two batches: one wave
    fault = middle_matmul(onnx.load(str(mlp)))
    # Slow enough that the two batches' runs overlap whatever the machine's load.
    target = _exec_target(fault, "--exclusive", str(tmp_path / "device.lock"), "--sleep", "2")
    alone = onnx_bisect.bisect(mlp, target=target, threshold=1e-3, parallel=False)
    together = onnx_bisect.bisect(mlp, target=target, threshold=1e-3)
    assert alone.root_cause is not None and alone.root_cause.nodes == (fault,)
    assert together.root_cause == alone.root_cause
    assert _verdicts(together) == _verdicts(alone)
    assert alone.runs["target"] == 2 + 2  # screen, scan, two batches one after the other
    assert together.runs["target"] == alone.runs["target"] + 1  # the refused batch, again


def test_in_process_isolation_runs_one_batch_at_a_time() -> None:
    session = _session(mlp_blocks(BLOCKS * NODES_PER_BLOCK), target=FaultyBackend("x"))
    assert isolate._workers(session) == 1


def _session(model: onnx.ModelProto, target: Any = "cpu", tmp: Path | None = None) -> Any:
    options = BisectOptions(threshold=1e-3)
    timer = StageTimer()
    setup, feeds = prepare(model, "cpu", target, options, timer)
    return open_session(setup, feeds, tmp or Path("."), timer)


def test_float64_values_come_back_in_one_file_per_chunk(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    session = _session(mlp_blocks(BLOCKS * NODES_PER_BLOCK), tmp=tmp_path)
    measured = float64._in_child(session)
    probes = session.loaded.probes
    files = list((tmp_path / "float64-child" / "values").iterdir())
    assert len(files) == 1  # every probe fits one chunk of the default budget
    here = float64._here(session, *float64.FLOAT64_ORACLES[0])
    for name in probes:
        np.testing.assert_array_equal(measured.run.values.get(name), here.run.values.get(name))


@pytest.mark.skipif(not Path("/proc/self/maps").is_file(), reason="needs Linux /proc")
def test_a_packed_file_is_mapped_once_for_all_its_values(tmp_path: Path) -> None:
    values = {f"t{i}": np.full((3, i % 4), i, dtype=np.float64) for i in range(500)}
    values["scalar"] = np.array(7, dtype=np.int64)
    path = tmp_path / "packed.bin"
    store = TensorStore(None)
    with open(path, "wb") as f:
        for name, value in values.items():
            offset = -(-f.tell() // 64) * 64
            f.write(b"\0" * (offset - f.tell()) + value.tobytes())
            store.adopt(name, path, TensorMeta(value.dtype, value.shape), offset)
    for name, value in values.items():
        got = store.get(name)
        assert got.shape == value.shape and got.dtype == value.dtype, name
        np.testing.assert_array_equal(got, value)
    maps = [line for line in Path("/proc/self/maps").read_text().splitlines() if str(path) in line]
    assert len(maps) == 1
    assert store.view({"alias": "t5"}).get("alias")[0, 0] == 5


def test_read_npz_reads_what_np_load_reads(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    arrays = {
        "x": rng.random((3, 4)).astype(np.float32),
        "fortran": np.asfortranarray(rng.random((3, 5))),
        "scalar": np.array(3.5),
        "empty": np.zeros((0, 4), np.int64),
        "flags": np.array([True, False]),
        "text": np.array(["ab", "c"]),
        "a/b.npy": np.arange(5, dtype=np.uint16),
        "half": rng.random((2, 2)).astype(np.float16),
    }
    path = tmp_path / "many.npz"
    save_npz(path, arrays)
    got = read_npz(path)
    with np.load(path) as z:
        want = {k: z[k] for k in z.files}
    assert list(got) == list(want)
    for name, value in want.items():
        assert got[name].dtype == value.dtype and got[name].shape == value.shape, name
        assert got[name].flags.f_contiguous == value.flags.f_contiguous, name
        assert got[name].flags.writeable, name
        np.testing.assert_array_equal(got[name], value)
    compressed = tmp_path / "compressed.npz"
    np.savez_compressed(compressed, x=arrays["x"], s=arrays["scalar"])
    assert {k: v.tolist() for k, v in read_npz(compressed).items()} == {
        "x": arrays["x"].tolist(),
        "s": 3.5,
    }
    pickled = tmp_path / "objects.npz"
    np.savez(pickled, o=np.array([{"a": 1}], dtype=object))
    with pytest.raises(InputError, match="holds Python objects .a pickle., which are never"):
        read_npz(pickled)


def test_with_outputs_types_what_the_model_types_and_keeps_the_rest() -> None:
    model = mlp_blocks(2 * NODES_PER_BLOCK)
    model.graph.value_info.append(
        helper.make_tensor_value_info("block0/mm", TensorProto.FLOAT, [64, 16])
    )
    helper.set_model_props(model, {"owner": "test"})
    marked = with_outputs(model, ["block0/mm", "block0/act", "axes", "x"])
    outputs = {o.name: o for o in marked.graph.output}
    assert list(outputs) == ["block0/mm", "block0/act", "axes", "x"]
    assert outputs["block0/mm"].type.tensor_type.elem_type == TensorProto.FLOAT
    assert not outputs["block0/act"].type.HasField("tensor_type")  # untyped: a name only
    assert outputs["axes"].type.tensor_type.elem_type == TensorProto.INT64  # an initializer
    # The former output is described in value_info; nothing is described twice.
    assert "y" in {v.name for v in marked.graph.value_info}
    assert "block0/mm" not in {v.name for v in marked.graph.value_info}
    assert [(p.key, p.value) for p in marked.metadata_props] == [("owner", "test")]
    assert len(marked.graph.initializer) == len(model.graph.initializer)
    out = onnx_bisect.create_backend("cpu").run(marked, {"x": np.ones((64, 16), np.float32)})
    assert list(out) == ["block0/mm", "block0/act", "axes", "x"]


def test_report_json_is_one_line_per_row_and_parses_back() -> None:
    doc = {"schema": "s", "nodes": [{"a": 1, "b": [1.5, None]}, {"a": 2}], "empty": [], "o": {}}
    text = json_text(doc)
    assert json.loads(text) == doc
    assert text.splitlines() == [
        "{",
        '  "schema": "s",',
        '  "nodes": [',
        '    {"a": 1, "b": [1.5, null]},',
        '    {"a": 2}',
        "  ],",
        '  "empty": [],',
        '  "o": {}',
        "}",
    ]
    with pytest.raises(ValueError):
        json_text({"x": [float("nan")]})
