"""Models whose weights are external data: sized without serializing, left on disk while
loaded, shared with runtimes by hard links, copied into bundles, and run by every adapter.

The models are small (``write_external_mlp``); tests/test_large_model.py runs one over 2 GB.
"""

from __future__ import annotations

import errno
import logging
import os
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnx_bisect
from onnx_bisect.backends import create_backend
from onnx_bisect.backends.spec import parse_spec
from onnx_bisect.engine.oracle import float64
from onnx_bisect.errors import BackendUnavailableError, ModelLoadError
from onnx_bisect.graph import sizes, weights
from onnx_bisect.graph.extract import isolation_model, prefix_model, window_model, with_outputs
from onnx_bisect.graph.load import load_model
from onnx_bisect.graph.save import save_for_child, save_model, save_portable
from onnx_bisect.graph.sizes import model_bytes
from onnx_bisect.graph.view import TensorMeta
from onnx_bisect.graph.weights import read_model
from onnx_bisect.leftovers import run_temp_dir
from onnx_bisect.process import python_child_env
from tests.models import (
    FAULTY_RUNTIME,
    TRANSFORMER,
    YOLO,
    chain,
    make,
    node_named,
    residual,
    with_if,
    write_external_mlp,
)

X = {"x": np.linspace(-1, 1, 8, dtype=np.float32).reshape(1, 8)}
# Bytes of W_i and b_i in write_external_mlp(blocks=3, width=8, hidden=16): 8x16, 16, 16x8, 8, ...
W_BYTES = (8 * 16 * 4, 16 * 8 * 4, 8 * 16 * 4)
B_BYTES = (16 * 4, 8 * 4, 16 * 4)


@pytest.fixture
def ext(tmp_path: Path) -> Path:
    path = tmp_path / "model" / "model.onnx"
    path.parent.mkdir()
    write_external_mlp(path, blocks=3, width=8, hidden=16)
    return path


def _data(path: Path) -> Path:
    return path.with_name(path.name + ".data")


def _ort_inline(path: Path, names: list[str]) -> dict[str, np.ndarray]:
    """ONNX Runtime on the model with its weights read into the message: the expected values."""
    model = with_outputs(onnx.load(str(path)), names)
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return dict(zip(names, sess.run(names, X), strict=True))


def _locations(model: onnx.ModelProto) -> set[str]:
    return {
        e.value for t in model.graph.initializer for e in t.external_data if e.key == "location"
    }


# --- model_bytes ----------------------------------------------------------------------------


def _typed_fields() -> onnx.ModelProto:
    """Tensors in every storage: typed repeated fields, strings, a Constant attribute, raw."""
    floats = helper.make_tensor("f", TensorProto.FLOAT, [3], [1.0, 2.0, 3.0])
    ints = helper.make_tensor("shape", TensorProto.INT64, [2], [1, -1])
    text = helper.make_tensor("s", TensorProto.STRING, [2], [b"a", b"bcd"])
    raw = numpy_helper.from_array(np.arange(64, dtype=np.float32).reshape(8, 8), "W")
    const = helper.make_node("Constant", [], ["c"], name="const", value=floats)
    nodes = [
        const,
        helper.make_node("MatMul", ["x", "W"], ["m"], name="mm"),
        helper.make_node("Reshape", ["m", "shape"], ["r"], name="reshape"),
        helper.make_node("Identity", ["s"], ["t"], name="text"),
    ]
    outputs = [helper.make_value_info(n, onnx.TypeProto()) for n in ("r", "t", "c")]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8])
    return make(nodes, [x], outputs, [ints, text, raw])


@pytest.mark.parametrize(
    "build",
    [
        lambda: chain(4),
        lambda: residual(3),
        with_if,
        _typed_fields,
        lambda: onnx.load(str(YOLO)),
        lambda: onnx.load(str(TRANSFORMER)),
    ],
    ids=["chain", "residual", "with_if", "typed_fields", "yolo", "transformer"],
)
def test_model_bytes_bounds_bytesize_closely(build: object) -> None:
    model = build()  # type: ignore[operator]
    exact = model.ByteSize()
    size = model_bytes(model)
    # An upper bound (it decides what fits in one message), within 2% and half a kB.
    assert exact <= size.message <= 1.02 * exact + 512
    assert size.external == 0 and size.weights == size.inline_data


def test_model_bytes_sums_tensor_data_of_every_storage() -> None:
    size = model_bytes(_typed_fields())
    # 8x8 raw floats, 3 floats in a Constant, 2 int64 varints at their widest, two strings.
    assert size.inline_data == 64 * 4 + 3 * 4 + 2 * 10 + (1 + 7) + (3 + 7)


def test_model_bytes_counts_external_lengths_without_reading_them(ext: Path) -> None:
    loaded = load_model(ext)
    _data(ext).write_bytes(b"")  # lengths come from the model, not from the file
    size = model_bytes(loaded.model)
    assert size.external == sum(W_BYTES) + sum(B_BYTES)
    assert size.inline_data == 0 and size.weights == size.external
    assert size.message < 4096 and size.fits


def test_over_2gb_of_weights_is_sized_and_linked_without_a_byte_read(tmp_path: Path) -> None:
    """3 GiB of external weights in a sparse file: no disk used, nothing serialized."""
    data = tmp_path / "big.onnx.data"
    with data.open("wb") as f:
        f.truncate(3 << 30)
    w = TensorProto(name="W", data_type=TensorProto.FLOAT, dims=[3 << 28])
    w.data_location = TensorProto.EXTERNAL
    w.external_data.add(key="location", value=data.name)
    w.external_data.add(key="offset", value="0")
    w.external_data.add(key="length", value=str(3 << 30))
    model = make(
        [helper.make_node("Identity", ["W"], ["y"], name="id")],
        [],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3 << 28])],
        [w],
    )
    onnx.save_model(model, str(tmp_path / "big.onnx"))
    loaded = load_model(tmp_path / "big.onnx")
    size = model_bytes(loaded.model)
    assert (size.external, size.fits) == (3 << 30, True)
    path = save_model(loaded.model, tmp_path / "run")
    again = save_model(loaded.model, tmp_path / "run2")
    shared = path.with_name("model.onnx.data")
    # One private copy for every run (holes kept: no disk used), never a link to the user's.
    assert os.path.samefile(shared, again.with_name("model.onnx.data"))
    assert shared.stat().st_size == 3 << 30 and shared.stat().st_blocks == 0
    assert data.stat().st_nlink == 1


# --- loading and cutting keep weights on disk -----------------------------------------------


def test_cut_models_point_at_the_same_weight_file(ext: Path) -> None:
    loaded = load_model(ext)
    where = {str(_data(ext).resolve())}
    meta = {t: TensorMeta(np.dtype(np.float32), (1, 16)) for t in ("a0", "z0", "h0")}
    mm1 = node_named(loaded, "mm1")
    cuts = [
        with_outputs(loaded.model, ["h1", "y"]),
        isolation_model(loaded, [mm1], meta)[0],
        window_model(loaded, [mm1, node_named(loaded, "add1")], meta)[0],
        prefix_model(loaded, 5),
    ]
    for cut in cuts:
        assert _locations(cut) == where
        assert all(not t.HasField("raw_data") for t in cut.graph.initializer)
        assert model_bytes(cut).message < 4096


def test_weights_outside_the_model_directory_are_refused(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    write_external_mlp(tmp_path / "model.onnx", blocks=1)
    model = onnx.load(str(tmp_path / "model.onnx"), load_external_data=False)
    for t in model.graph.initializer:
        t.external_data[0].value = "../model.onnx.data"
    onnx.save_model(model, str(tmp_path / "sub" / "escape.onnx"))
    with pytest.raises(ModelLoadError) as err:
        load_model(tmp_path / "sub" / "escape.onnx")
    assert str(err.value) == (
        f"{tmp_path / 'sub' / 'escape.onnx'}: tensor 'W0' is stored in ../model.onnx.data, "
        "outside the model's directory; move the weight file next to the model"
    )


def test_a_short_weight_file_is_named_at_load(ext: Path) -> None:
    with _data(ext).open("r+b") as f:
        f.truncate(4096)
    with pytest.raises(ModelLoadError) as err:
        load_model(ext)
    assert str(err.value) == (
        f"{ext}: cannot load external data: tensor 'b0' needs bytes 4096..4160 of "
        "model.onnx.data, which has 4096"
    )


def _per_tensor_files(path: Path) -> None:
    """``write_external_mlp``'s weights moved to one file per tensor, located by name alone
    (no offset, no length), as torch.onnx's legacy exporter writes a model over 2 GB."""
    model = onnx.load(str(path))
    for t in model.graph.initializer:
        (path.parent / t.name).write_bytes(t.raw_data)
        t.ClearField("raw_data")
        t.data_location = TensorProto.EXTERNAL
        t.external_data.add(key="location", value=t.name)
    onnx.save(model, str(path))
    _data(path).unlink()


def test_weights_located_by_name_alone_load_from_any_working_directory(
    ext: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A location without a length is sized from its file, relative to the model's folder:
    from another working directory shape inference used to fail ("No such file")."""
    _per_tensor_files(ext)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    loaded = load_model(Path("..") / "model" / "model.onnx")
    assert loaded.notes == ()
    typed = {v.name for v in loaded.model.graph.value_info}
    assert {"h0", "z1", "a1"} <= typed
    assert model_bytes(loaded.model).external == sum(W_BYTES) + sum(B_BYTES)
    values = create_backend("cpu").run(loaded.model, X)
    assert np.allclose(values["y"], _ort_inline(ext, ["y"])["y"], rtol=1e-6, atol=1e-7)


# --- every adapter runs a model whose weights stay in their file ----------------------------


def _faulty_exec() -> str:
    argv = [sys.executable, str(FAULTY_RUNTIME), "{model}", "{inputs}", "{outputs}"]
    return "exec:" + shlex.join(argv)


@pytest.mark.parametrize(
    ("spec", "in_child"),
    [
        ("cpu", False),
        ("cpu", True),
        ("ref", False),
        ("ref?dtype=float64", False),
        ("openvino?precision=f32", False),
        ("tract", False),
        ("torch:cpu", False),
        (_faulty_exec(), False),
    ],
    ids=["ort", "ort-in-child", "ref", "ref-float64", "openvino", "tract", "torch", "exec"],
)
def test_every_adapter_runs_external_weights(ext: Path, spec: str, in_child: bool) -> None:
    try:
        backend = create_backend(parse_spec(spec), in_child=in_child)
    except BackendUnavailableError as exc:
        pytest.skip(str(exc))
    loaded = load_model(ext)
    got = backend.run(with_outputs(loaded.model, ["h1", "y"]), X)
    want = _ort_inline(ext, ["h1", "y"])
    for name in ("h1", "y"):
        np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-6)
    # No adapter read the weights into the caller's model.
    assert all(t.data_location == TensorProto.EXTERNAL for t in loaded.model.graph.initializer)


# --- writing: linked for a run, copied for a bundle -----------------------------------------


def test_save_model_shares_weights_without_linking_the_users_file(
    ext: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Runs share one private copy of the weights (on a file system that cannot clone), made
    once; the user's file keeps its one link, so onnx.load of the user's model works while
    runs hold their files (onnx refuses a weight file with two links)."""
    monkeypatch.setattr(weights, "LINK_MIN_BYTES", 0)  # shared however small
    monkeypatch.setattr(weights, "_cache", weights.WeightsCache())
    want = _ort_inline(ext, ["y"])["y"]
    loaded = load_model(ext)
    shared = []
    for run in ("run1", "run2"):
        path = save_model(with_outputs(loaded.model, ["y"]), tmp_path / run)
        shared.append(path.with_name("model.onnx.data"))
        assert not os.path.samefile(shared[-1], _data(ext))
        assert shared[-1].read_bytes() == _data(ext).read_bytes()  # offsets are the original
        written = onnx.load(str(path), load_external_data=False)
        assert _locations(written) == {"model.onnx.data"}
        sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        np.testing.assert_allclose(sess.run(["y"], X)[0], want, 1e-6)
        onnx.load(str(ext))  # the user's model loads meanwhile
    assert os.path.samefile(shared[0], shared[1])  # one copy, not one per run
    assert _data(ext).stat().st_nlink == 1
    weights.weights_cache().clear()
    assert shared[0].stat().st_nlink == 2  # the two runs' names; the private copy is gone


def test_a_commands_child_processes_share_its_one_copy(
    ext: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Within a command's temporary folder the copy is its children's too (their TMPDIR): a
    sandboxed runtime's run links the parent's copy instead of copying the weights again."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(weights, "_cache", weights.WeightsCache())
    with run_temp_dir() as root:
        mine = weights.weights_cache().copy_of(_data(ext))
        code = "import sys; from pathlib import Path; from onnx_bisect.graph.weights import "
        code += "weights_cache; print(weights_cache().copy_of(Path(sys.argv[1])))"
        child = subprocess.run(
            [sys.executable, "-c", code, str(_data(ext))],
            env=python_child_env(), capture_output=True, text=True, check=True,
        )  # fmt: skip
        assert mine is not None and mine.parent == root / "weights"
        assert Path(child.stdout.strip()) == mine
        assert [p.name for p in mine.parent.iterdir()] == [mine.name]  # copied once
        assert _data(ext).stat().st_nlink == 1
    assert not root.exists()


def test_a_model_for_the_own_child_keeps_the_users_files_and_spills_the_rest(
    ext: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``save_for_child``: external tensors keep their absolute locations (nothing linked or
    copied), inline ones too large for the message spill beside the model, and the child's
    ``read_model(own=True)`` finds both; a model of anyone else's may not point outside."""
    monkeypatch.setattr(sizes, "PROTO_LIMIT", 2048)
    model = onnx.ModelProto()
    model.CopyFrom(load_model(ext).model)
    extra = numpy_helper.from_array(np.arange(256, dtype=np.float32).reshape(16, 16), "extra")
    model.graph.initializer.append(extra)
    path = save_for_child(model, tmp_path / "child")
    assert sorted(p.name for p in path.parent.iterdir()) == ["model.onnx", "model.onnx.inline.data"]
    assert _data(ext).stat().st_nlink == 1
    monkeypatch.chdir(ext.parent.parent)  # relative locations must not resolve from here
    read = read_model(path, own=True)
    values = {t.name: weights.tensor_array(t) for t in read.graph.initializer}
    original = {t.name: numpy_helper.to_array(t) for t in onnx.load(str(ext)).graph.initializer}
    assert np.array_equal(values["extra"], numpy_helper.to_array(extra))
    assert all(np.array_equal(values[k], v) for k, v in original.items())
    with pytest.raises(ModelLoadError, match="outside the model's directory"):
        read_model(path)


def test_weights_in_a_file_per_tensor_are_shared_when_their_sum_is_large(
    ext: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The threshold is on the bytes a run uses in all: an exporter's file per tensor, each
    under it, is not copied whole at every run (2 GB per run on a Llama)."""
    _per_tensor_files(ext)
    files = {t: ext.parent / t for t in ("W0", "b0", "W1", "b1", "W2", "b2")}
    assert max(p.stat().st_size for p in files.values()) < 1024 < sum(W_BYTES) + sum(B_BYTES)
    monkeypatch.setattr(weights, "LINK_MIN_BYTES", 1024)
    monkeypatch.setattr(weights, "_cache", weights.WeightsCache())
    loaded = load_model(ext)
    placed = []
    for run in ("run1", "run2"):
        path = save_model(loaded.model, tmp_path / run)
        placed.append(sorted(path.parent.glob("model.onnx*.data")))
        assert len(placed[-1]) == 6 and all(p.stat().st_nlink >= 2 for p in placed[-1])
        out = create_backend("cpu").run(read_model(path), X)
        np.testing.assert_allclose(out["y"], _ort_inline(ext, ["y"])["y"], 1e-6)
    assert all(os.path.samefile(a, b) for a, b in zip(*placed, strict=True))  # one copy each
    assert all(p.stat().st_nlink == 1 for p in files.values())  # never the user's own
    weights.weights_cache().clear()


def test_small_weights_are_copied_into_a_plain_file(ext: Path, tmp_path: Path) -> None:
    """Under LINK_MIN_BYTES a run gets its own file, which onnx.load accepts (it refuses a
    file with two links), and the user's file keeps its one link."""
    path = save_model(load_model(ext).model, tmp_path / "run")
    copied = path.with_name("model.onnx.data")
    assert copied.stat().st_nlink == 1 and _data(ext).stat().st_nlink == 1
    assert not os.path.samefile(copied, _data(ext))
    full = onnx.load(str(path))
    original = onnx.load(str(ext))
    assert [t.raw_data for t in full.graph.initializer] == [
        t.raw_data for t in original.graph.initializer
    ]


def test_without_a_link_only_the_used_weights_are_copied(
    ext: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def refuse(src: object, dst: object) -> None:
        raise OSError(errno.EXDEV, "Invalid cross-device link")

    monkeypatch.setattr(weights.os, "link", refuse)
    monkeypatch.setattr(weights, "_warned_copy", False)
    monkeypatch.setattr(weights, "LINK_MIN_BYTES", 0)
    monkeypatch.setattr(weights, "_cache", weights.WeightsCache())
    loaded = load_model(ext)
    meta = {"a0": TensorMeta(np.dtype(np.float32), (1, 16))}
    window, feeds = isolation_model(loaded, [node_named(loaded, "mm1")], meta)
    with caplog.at_level(logging.WARNING, logger="onnx_bisect.graph.weights"):
        path = save_model(window, tmp_path / "run")
        save_model(window, tmp_path / "run2")
    assert len(caplog.records) == 1 and "TMPDIR" in caplog.records[0].getMessage()
    copied = path.with_name("model.onnx.data")
    assert copied.stat().st_size == W_BYTES[1] and copied.stat().st_nlink == 1
    w1 = onnx.load(str(path)).graph.initializer[0]  # onnx's own loader: a plain file
    want = onnx.load(str(ext)).graph.initializer[2]
    assert w1.name == want.name == "W1" and w1.raw_data == want.raw_data


def test_save_portable_copies_the_used_tensors_and_loads_alone(ext: Path, tmp_path: Path) -> None:
    loaded = load_model(ext)
    meta = {"a0": TensorMeta(np.dtype(np.float32), (1, 16))}
    nodes = [node_named(loaded, "mm1"), node_named(loaded, "add1")]
    model, _, _ = window_model(loaded, nodes, meta, keep_names=True)
    path = save_portable(model, tmp_path / "bundle")
    data = path.with_name("model.onnx.data")
    # W1 at 0, b1 on the next 4 KiB boundary: a copy of what the bundle reads, nothing more.
    assert data.stat().st_size == 4096 + B_BYTES[1] and data.stat().st_nlink == 1
    original = {t.name: numpy_helper.to_array(t) for t in onnx.load(str(ext)).graph.initializer}
    _data(ext).unlink()  # the bundle no longer needs the original
    got = {t.name: numpy_helper.to_array(t) for t in onnx.load(str(path)).graph.initializer}
    assert set(got) == {"W1", "b1"}
    assert all(np.array_equal(got[k], original[k]) for k in got)


def test_inline_weights_over_the_limit_spill_beside_the_link(
    ext: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Inline weights too large for one message go to a file of their own: onnx appends to
    the file it writes to, and the shared one is every run's."""
    monkeypatch.setattr(sizes, "PROTO_LIMIT", 2048)
    monkeypatch.setattr(weights, "LINK_MIN_BYTES", 0)
    monkeypatch.setattr(weights, "_cache", weights.WeightsCache())
    loaded = load_model(ext)
    model = onnx.ModelProto()
    model.CopyFrom(loaded.model)
    extra = numpy_helper.from_array(np.ones((16, 16), np.float32), "extra")
    model.graph.initializer.append(extra)
    before = _data(ext).stat().st_size
    path = save_model(model, tmp_path / "run")
    shared = path.with_name("model.onnx.data")
    assert shared.stat().st_nlink == 2  # the private copy and this run's name
    assert shared.stat().st_size == _data(ext).stat().st_size == before
    spilled = path.with_name("model.onnx.inline.data")
    assert spilled.stat().st_size == 16 * 16 * 4
    written = onnx.load(str(path), load_external_data=False)
    assert {t.name: _locations_of(t) for t in written.graph.initializer}["extra"] == spilled.name


def _locations_of(t: TensorProto) -> str:
    return next(e.value for e in t.external_data if e.key == "location")


# --- the whole diagnosis ----------------------------------------------------------------------


def test_planted_fault_found_and_bundle_carries_its_weights(ext: Path, tmp_path: Path) -> None:
    target = _faulty_exec() + " --fault mm1=0.05"
    result = onnx_bisect.bisect(ext, target=target, repro=tmp_path / "repro")
    assert result.root_cause is not None and result.root_cause.nodes == ("mm1",)
    assert result.repro is not None and result.repro.reproduces and result.repro.nodes == ("mm1",)
    bundle = tmp_path / "repro"
    data = bundle / "model.onnx.data"
    assert data.stat().st_size == W_BYTES[1] and data.stat().st_nlink == 1
    # The bundle travels: it reproduces with the original weights gone.
    _data(ext).unlink()
    from onnx_bisect.repro.verify import run_bundle

    code, output = run_bundle(bundle)
    assert code == 1, output


def test_float64_oracle_is_skipped_above_its_weight_limit(
    ext: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Above the limit only torch's oracle runs (it reads each external weight when a node
    uses it); the reference evaluator's, which would hold them all in float64, does not."""
    monkeypatch.setattr(float64, "FLOAT64_MAX_WEIGHTS", 1000)
    monkeypatch.setattr(float64, "FLOAT64_ORACLES", (("ref?dtype=float64", "ref"),))
    result = onnx_bisect.bisect(ext, target="cpu")
    assert result.verdict == "match"
    assert any(
        n.startswith(
            "--threshold auto: no float64 values (no float64 oracle could run the model: "
            "ref?dtype=float64: not run on 0.0 GB of weights"
        )
        for n in result.notes
    ), result.notes


def test_lazy_external_weights_are_read_per_use_and_compute_the_same(
    ext: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    torch = pytest.importorskip("torch")
    from onnx_bisect.backends.torch import interpreter

    loaded = load_model(ext).model
    x = np.random.default_rng(0).standard_normal((1, 8)).astype(np.float32)
    name = loaded.graph.input[0].name
    eager = interpreter.Program(loaded.graph, {"": 18}, torch.device("cpu"), torch.float64)
    monkeypatch.setattr(interpreter, "LAZY_EXTERNAL_BYTES", 0)
    lazy = interpreter.Program(loaded.graph, {"": 18}, torch.device("cpu"), torch.float64)
    assert not any(isinstance(v, interpreter._Lazy) for v in eager.constants.values())
    held = [k for k, v in lazy.constants.items() if isinstance(v, interpreter._Lazy)]
    assert held and len(held) == sum(
        t.data_location == TensorProto.EXTERNAL for t in loaded.graph.initializer
    )
    a = eager.run(eager.feed({name: x}))
    b = lazy.run(lazy.feed({name: x}))
    for out in a:
        assert a[out] is not None and b[out] is not None
        assert a[out].dtype == b[out].dtype == torch.float64
        assert torch.equal(a[out], b[out])


def test_the_torch_oracle_reads_external_weights_as_nodes_use_them(
    ext: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Above the limit the torch oracle still runs: each external weight is read when a node
    reads it (lazy above LAZY_EXTERNAL_BYTES, here 0), and the verdicts are the same."""
    pytest.importorskip("torch")
    from onnx_bisect.backends.torch import interpreter

    monkeypatch.setattr(float64, "FLOAT64_MAX_WEIGHTS", 1000)
    monkeypatch.setattr(interpreter, "LAZY_EXTERNAL_BYTES", 0)
    result = onnx_bisect.bisect(ext, target=_faulty_exec() + " --fault add1=0.05")
    assert result.root_cause is not None and result.root_cause.nodes == ("add1",)
    assert any(n.startswith("--threshold auto: float64 values from torch") for n in result.notes)


def test_a_dump_of_an_external_model_serves_as_the_reference(ext: Path, tmp_path: Path) -> None:
    from onnx_bisect.dumper import dump

    dump(ext, "cpu", tmp_path / "dump")
    target = _faulty_exec() + " --fault add1=0.05"
    result = onnx_bisect.bisect(ext, ref=f"dump:{tmp_path / 'dump'}", target=target)
    assert result.root_cause is not None and result.root_cause.nodes == ("add1",)


def test_a_transform_runs_on_external_weights(ext: Path) -> None:
    pytest.importorskip("onnxoptimizer")
    result = onnx_bisect.bisect(ext, target="cpu+onnxoptimizer", threshold=1e-3)
    assert result.verdict == "match" and len(result.transforms) == 1
