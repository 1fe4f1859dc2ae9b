"""Model loading and graph surgery, plus the memory planning (plan_chunks, TensorStore) on top."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from onnx_bisect.backends import create_backend
from onnx_bisect.engine.measure.runs import plan_chunks
from onnx_bisect.engine.measure.store import TensorStore
from onnx_bisect.errors import ModelLoadError
from onnx_bisect.graph.extract import isolation_model, with_outputs
from onnx_bisect.graph.load import load_model
from onnx_bisect.graph.save import save_model
from onnx_bisect.graph.sizes import fix_input_shapes, tensor_nbytes
from onnx_bisect.graph.view import LoadedModel, NotProbed, TensorMeta
from tests.models import chain, make, node_named, residual, unsorted, with_if

X = np.linspace(-1, 1, 16, dtype=np.float32).reshape(2, 8)


def _ort(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    return dict(zip(names, sess.run(names, feeds), strict=True))


def _unnamed(model: onnx.ModelProto) -> onnx.ModelProto:
    for n in model.graph.node:
        n.name = ""
    return model


# --- load_model -----------------------------------------------------------------------------


def test_load_from_path(tmp_path: Path) -> None:
    path = tmp_path / "chain.onnx"
    onnx.save_model(chain(2), str(path))
    loaded = load_model(path)
    assert loaded.path == path
    assert [n.name for n in loaded.nodes] == ["mm0", "act0", "mm1", "act1"]
    assert loaded.inputs == ("x",)
    assert loaded.outputs == ("y",)
    assert loaded.initializers == frozenset({"W0", "W1"})
    assert loaded.notes == ()
    assert loaded.not_probed == ()
    assert load_model(str(path)).probes == loaded.probes


def test_load_from_proto_does_not_mutate_it() -> None:
    proto = _unnamed(unsorted())
    before = proto.SerializeToString()
    loaded = load_model(proto)
    assert proto.SerializeToString() == before
    assert loaded.path is None
    assert loaded.model is not proto
    # Shape inference ran on the private copy only.
    assert len(loaded.model.graph.value_info) > 0
    assert len(proto.graph.value_info) == 0


def test_probes_are_every_node_output_in_topological_order() -> None:
    loaded = load_model(chain(4))
    assert loaded.probes == ("h0", "a0", "h1", "a1", "h2", "a2", "h3", "y")
    assert loaded.producer["a1"].name == "act1"
    assert node_named(loaded, "mm2").inputs == ("a1", "W2")
    assert node_named(loaded, "mm2").index == 4
    with pytest.raises(KeyError):
        node_named(loaded, "nope")


def test_unsorted_model_is_resorted_with_a_note() -> None:
    proto = unsorted()
    assert [n.name for n in proto.graph.node] == ["act1", "mm1", "act0", "mm0"]
    loaded = load_model(proto)
    assert [n.name for n in loaded.nodes] == ["mm0", "act0", "mm1", "act1"]
    assert [n.name for n in loaded.model.graph.node] == ["mm0", "act0", "mm1", "act1"]
    assert [n.index for n in loaded.nodes] == [0, 1, 2, 3]
    assert loaded.notes == ("nodes were not in topological order; re-sorted",)
    assert [n.name for n in proto.graph.node] == ["act1", "mm1", "act0", "mm0"]


def test_unnamed_nodes_get_unique_synthetic_names() -> None:
    proto = _unnamed(chain(2))
    loaded = load_model(proto)
    assert [n.name for n in loaded.nodes] == ["MatMul_0", "Tanh_1", "MatMul_2", "Tanh_3"]
    assert loaded.notes == ("4 unnamed or duplicate node names were given synthetic names",)
    assert [n.name for n in proto.graph.node] == ["", "", "", ""]


def test_duplicate_node_names_are_made_unique() -> None:
    proto = chain(2)
    for n in proto.graph.node:
        n.name = "same"
    loaded = load_model(proto)
    assert [n.name for n in loaded.nodes] == ["same", "same__1", "same__2", "same__3"]
    assert loaded.notes == ("3 unnamed or duplicate node names were given synthetic names",)


def test_synthetic_names_do_not_collide_with_real_ones() -> None:
    proto = chain(1)  # mm0 (MatMul), act0 (Tanh)
    proto.graph.node[0].name = "Tanh_1"
    proto.graph.node[1].name = ""
    loaded = load_model(proto)
    assert [n.name for n in loaded.nodes] == ["Tanh_1", "Tanh_1__1"]


def test_subgraph_tensors_are_not_probed() -> None:
    loaded = load_model(with_if())
    assert loaded.probes == ("r", "s", "c", "y")
    # helper.make_node sorts attributes by name, so the else body comes first.
    assert loaded.not_probed == (
        NotProbed(
            "else_out",
            "branch",
            "inside the 'else_branch' body of If 'branch'; "
            "only top-level tensors can be marked as outputs",
        ),
        NotProbed(
            "then_out",
            "branch",
            "inside the 'then_branch' body of If 'branch'; "
            "only top-level tensors can be marked as outputs",
        ),
    )
    assert node_named(loaded, "branch").implicit_inputs == ("r",)
    assert node_named(loaded, "branch").inputs == ("c",)


def test_implicit_inputs_order_the_sort() -> None:
    # The If reads `r` only from inside its bodies; it must still come after Relu.
    proto = with_if()
    nodes = list(proto.graph.node)
    del proto.graph.node[:]
    proto.graph.node.extend([nodes[1], nodes[2], nodes[3], nodes[0]])  # Relu last
    assert [n.name for n in load_model(proto).nodes] == ["relu", "sum", "gt", "branch"]


def _load_error(path: Path) -> str:
    with pytest.raises(ModelLoadError) as err:
        load_model(path)
    message = str(err.value)
    assert "\n" not in message
    assert str(path) in message
    return message


def test_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "missing.onnx"
    assert _load_error(path) == f"model file not found: {path}"


def test_directory(tmp_path: Path) -> None:
    assert _load_error(tmp_path) == f"{tmp_path} is a directory; pass the .onnx file"


def test_garbage_bytes(tmp_path: Path) -> None:
    path = tmp_path / "garbage.onnx"
    path.write_bytes(b"this is not an onnx model\x00\xff\xfe")
    message = _load_error(path)
    assert message.startswith(f"{path}: not a valid ONNX model (")


def test_empty_file(tmp_path: Path) -> None:
    path = tmp_path / "empty.onnx"
    path.write_bytes(b"")
    assert _load_error(path) == f"{path}: not a valid ONNX model (empty or not a ModelProto)"


def test_graph_without_nodes() -> None:
    proto = make([], [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])], [])
    with pytest.raises(ModelLoadError) as err:
        load_model(proto)
    assert str(err.value) == "model: the graph has no nodes"


def test_unproduced_tensor() -> None:
    proto = make(
        [helper.make_node("Add", ["x", "ghost"], ["y"], name="add")],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])],
    )
    with pytest.raises(ModelLoadError) as err:
        load_model(proto)
    assert str(err.value) == "graph reads tensors that nothing produces: ghost"


def test_cycle() -> None:
    proto = make(
        [
            helper.make_node("Add", ["x", "b"], ["a"], name="n1"),
            helper.make_node("Relu", ["a"], ["b"], name="n2"),
        ],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
        [helper.make_tensor_value_info("b", TensorProto.FLOAT, [2])],
    )
    with pytest.raises(ModelLoadError) as err:
        load_model(proto)
    assert str(err.value) == "graph has a cycle through: n1, n2"


# --- with_outputs ---------------------------------------------------------------------------


def test_with_outputs() -> None:
    proto = chain(3)
    before = proto.SerializeToString()
    marked = with_outputs(proto, ["a0", "y", "h1"])
    assert proto.SerializeToString() == before
    assert [o.name for o in marked.graph.output] == ["a0", "y", "h1"]
    out = _ort(marked, {"x": X})
    assert list(out) == ["a0", "y", "h1"]
    w0 = onnx.numpy_helper.to_array(proto.graph.initializer[0])
    np.testing.assert_allclose(out["a0"], np.tanh(X @ w0), rtol=1e-6, atol=1e-7)
    full = _ort(proto, {"x": X})
    np.testing.assert_array_equal(out["y"], full["y"])


def test_with_outputs_unknown_tensor() -> None:
    with pytest.raises(KeyError, match="nope"):
        with_outputs(chain(1), ["y", "nope"])


# --- isolation_model ------------------------------------------------------------------------


def _reference_values(loaded: LoadedModel, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return _ort(with_outputs(loaded.model, list(loaded.probes)), feeds)


@pytest.mark.parametrize("build", [chain, residual])
def test_isolation_model_reproduces_each_node(build: Callable[[], onnx.ModelProto]) -> None:
    loaded = load_model(build())
    feeds = {"x": X[:1]}
    values = _reference_values(loaded, feeds)
    meta = {k: TensorMeta(v.dtype, v.shape) for k, v in values.items()}
    before = loaded.model.SerializeToString()
    iso, fed = isolation_model(loaded, loaded.nodes, meta)
    assert loaded.model.SerializeToString() == before
    # Every activation a node reads comes in as a fresh `ref__` graph input.
    activations = [t for t in loaded.probes if any(t in n.inputs for n in loaded.nodes)]
    assert fed == {f"ref__{t}": t for t in activations}
    inputs = [i.name for i in iso.graph.input]
    assert inputs[0] == "x"
    assert inputs[1:] == [f"ref__{t}" for t in activations]
    assert [o.name for o in iso.graph.output] == list(loaded.probes)
    iso_feeds = dict(feeds) | {name: values[t] for name, t in fed.items()}
    out = _ort(iso, iso_feeds)
    for name in loaded.probes:
        np.testing.assert_array_equal(out[name], values[name], err_msg=name)


def test_isolation_model_of_a_subset() -> None:
    loaded = load_model(chain(3))
    values = _reference_values(loaded, {"x": X})
    meta = {k: TensorMeta(v.dtype, v.shape) for k, v in values.items()}
    iso, fed = isolation_model(loaded, [node_named(loaded, "mm1")], meta)
    assert fed == {"ref__a0": "a0"}
    assert [i.name for i in iso.graph.input] == ["ref__a0"]
    assert [t.name for t in iso.graph.initializer] == ["W1"]
    out = _ort(iso, {"ref__a0": values["a0"]})
    assert list(out) == ["h1"]
    np.testing.assert_array_equal(out["h1"], values["h1"])


def test_isolation_of_an_if_feeds_outer_names_under_their_own_names() -> None:
    loaded = load_model(with_if())
    x = np.array([1.0, -2.0, 3.0, -4.0], np.float32)
    values = _reference_values(loaded, {"x": x})
    meta = {k: TensorMeta(v.dtype, v.shape) for k, v in values.items()}
    iso, fed = isolation_model(loaded, [node_named(loaded, "branch")], meta)
    assert fed == {"ref__c": "c", "r": "r"}
    out = _ort(iso, {name: values[t] for name, t in fed.items()})
    np.testing.assert_array_equal(out["y"], -np.maximum(x, 0))
    np.testing.assert_array_equal(out["y"], values["y"])


def test_isolation_feed_names_avoid_existing_names() -> None:
    proto = make(
        [
            helper.make_node("Relu", ["x"], ["h"], name="relu"),
            helper.make_node("Add", ["h", "ref__h"], ["y"], name="add"),
        ],
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, [3]),
            helper.make_tensor_value_info("ref__h", TensorProto.FLOAT, [3]),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3])],
    )
    loaded = load_model(proto)
    meta = {t: TensorMeta(np.dtype(np.float32), (3,)) for t in ("h", "y")}
    iso, fed = isolation_model(loaded, [node_named(loaded, "add")], meta)
    assert fed == {"ref__h__1": "h"}
    assert [i.name for i in iso.graph.input] == ["ref__h", "ref__h__1"]
    h = np.array([1.0, 2.0, 3.0], np.float32)
    out = _ort(iso, {"ref__h": np.ones(3, np.float32), "ref__h__1": h})
    np.testing.assert_array_equal(out["y"], h + 1)


# --- external data, save_model, sizes -------------------------------------------------------


def test_external_data_stays_on_disk_located_absolutely(tmp_path: Path) -> None:
    proto = chain(3)
    copy = onnx.ModelProto()
    copy.CopyFrom(proto)
    path = tmp_path / "ext.onnx"
    onnx.save_model(
        copy,
        str(path),
        save_as_external_data=True,
        all_tensors_to_one_file=True,
        location="ext.onnx.data",
        size_threshold=0,
    )
    assert (tmp_path / "ext.onnx.data").stat().st_size == 3 * 8 * 8 * 4
    assert path.stat().st_size < 3 * 8 * 8 * 4
    loaded = load_model(path)
    for i, t in enumerate(loaded.model.graph.initializer):
        assert t.data_location == TensorProto.EXTERNAL and not t.HasField("raw_data")
        info = {e.key: e.value for e in t.external_data}
        assert info == {
            "location": str((tmp_path / "ext.onnx.data").resolve()),
            "offset": str(i * 8 * 8 * 4),
            "length": str(8 * 8 * 4),
        }
    cpu = create_backend("cpu")
    got = cpu.run(loaded.model, {"x": X})
    want = cpu.run(proto, {"x": X})
    np.testing.assert_array_equal(got["y"], want["y"])


def test_missing_external_data_file(tmp_path: Path) -> None:
    copy = chain(1)
    path = tmp_path / "ext.onnx"
    onnx.save_model(
        copy, str(path), save_as_external_data=True, location="ext.data", size_threshold=0
    )
    for f in tmp_path.iterdir():
        if f != path:
            f.unlink()
    with pytest.raises(ModelLoadError) as err:
        load_model(path)
    assert str(err.value) == (
        f"{path}: cannot load external data: tensor 'W0' is stored in ext.data, which is not "
        f"a file next to the model ({(tmp_path / 'ext.data').resolve()})"
    )


def test_save_model_writes_one_file_for_small_models(tmp_path: Path) -> None:
    proto = chain(2)
    path = save_model(proto, tmp_path / "out")
    assert path == tmp_path / "out" / "model.onnx"
    assert list((tmp_path / "out").iterdir()) == [path]
    assert onnx.load(str(path)).SerializeToString() == proto.SerializeToString()
    assert save_model(proto, tmp_path, "other.onnx") == tmp_path / "other.onnx"


def test_fix_input_shapes_gives_exact_sizes() -> None:
    proto = chain(3, width=8)
    before = proto.SerializeToString()
    fixed = fix_input_shapes(proto, {"x": (2, 8)})
    assert proto.SerializeToString() == before
    sizes = tensor_nbytes(fixed)
    assert sizes == {name: 2 * 8 * 4 for name in ("h0", "a0", "h1", "a1", "h2", "y", "x")}
    # Without the fix the batch dim is symbolic and every size is unknown.
    assert tensor_nbytes(load_model(proto).model) == {
        name: None for name in ("h0", "a0", "h1", "a1", "h2", "y", "x")
    }


def test_tensor_nbytes_of_mixed_dtypes() -> None:
    loaded = load_model(with_if())
    sizes = tensor_nbytes(fix_input_shapes(loaded.model, {"x": (4,)}))
    assert sizes["x"] == 16
    assert sizes["r"] == 16
    assert sizes["s"] == 4  # float32 scalar
    assert sizes["c"] == 1  # bool scalar
    assert sizes["y"] == 16


# --- plan_chunks ----------------------------------------------------------------------------


def test_plan_chunks_respects_budget_and_order() -> None:
    names = ["a", "b", "c", "d", "e"]
    sizes = dict.fromkeys(names, 40)
    chunks = plan_chunks(names, sizes, 100)
    assert chunks == [["a", "b"], ["c", "d"], ["e"]]
    assert plan_chunks(names, sizes, 80) == [["a", "b"], ["c", "d"], ["e"]]  # == budget fits
    assert plan_chunks(names, sizes, 10**9) == [names]
    assert plan_chunks([], sizes, 100) == []


def test_plan_chunks_unknown_sizes_count_as_largest_known() -> None:
    sizes: dict[str, int | None] = {"a": 10, "b": None, "c": 30}
    # b counts as 30: a + b = 40 fills the budget, so c starts a new chunk.
    assert plan_chunks(["a", "b", "c"], sizes, 40) == [["a", "b"], ["c"]]
    # A name absent from the size table is unknown too.
    assert plan_chunks(["a", "zz", "c"], sizes, 40) == [["a", "zz"], ["c"]]


def test_plan_chunks_oversize_tensor_runs_alone() -> None:
    sizes = {"a": 10, "big": 500, "b": 10, "c": 10}
    assert plan_chunks(["a", "big", "b", "c"], sizes, 100) == [["a"], ["big"], ["b", "c"]]
    assert plan_chunks(["big"], sizes, 100) == [["big"]]


# --- TensorStore ----------------------------------------------------------------------------


def test_tensor_store_round_trips(tmp_path: Path) -> None:
    store = TensorStore(tmp_path / "cache")
    values = {
        "/backbone/conv/Conv_output_0": np.arange(6, dtype=np.float32).reshape(2, 3),
        "input:0": np.array(3.5, np.float32),
        "flag": np.array(True),
        "ids": np.array([[1, -2], [2**40, 0]], np.int64),
        "a/b": np.array([1.0], np.float64),
        "a:b": np.array([2.0], np.float64),
        "x" * 200: np.zeros((0, 4), np.float16),
        "fortran": np.asfortranarray(np.arange(6, dtype=np.int32).reshape(2, 3)),
    }
    for name, value in values.items():
        store.put(name, value)
    for name, value in values.items():
        assert name in store
        got = store.get(name)
        assert got.dtype == value.dtype, name
        assert got.shape == value.shape, name
        np.testing.assert_array_equal(got, value, err_msg=name)
        assert store.meta(name) == TensorMeta(value.dtype, value.shape)
        assert store.nbytes(name) == value.nbytes
    assert "missing" not in store
    assert set(store.metas) == set(values)
    # Packed into one file whatever the names (no file per value to name safely).
    assert len(list((tmp_path / "cache").iterdir())) == 1


def test_tensor_store_keeps_numpy_scalars_zero_d(tmp_path: Path) -> None:
    store = TensorStore(tmp_path)
    store.put("s", np.float32(2.5))  # type: ignore[arg-type]
    assert store.get("s").shape == ()
    assert float(store.get("s")) == 2.5
    assert store.nbytes("s") == 4


def test_tensor_store_put_again_then_similar_name(tmp_path: Path) -> None:
    store = TensorStore(tmp_path)
    store.put("a/b", np.array([1.0]))
    store.put("a/b", np.array([2.0]))
    store.put("a:b", np.array([3.0]))
    assert store.get("a/b").tolist() == [2.0]
    assert store.get("a:b").tolist() == [3.0]
