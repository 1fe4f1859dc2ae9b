"""Input tensors: generation from a model's signature, loading from files, validation."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnx_bisect.inputs.values as values_module
from onnx_bisect.errors import InputError
from onnx_bisect.inputs.feeds import (
    InputSpec,
    generate_feeds,
    input_specs,
    load_feeds,
    make_feeds,
    parse_shape,
    save_npz,
    validate_feeds,
)
from onnx_bisect.inputs.values import Fill, draw
from tests.models import chain, two_inputs, typed_inputs

TWO = input_specs(two_inputs())  # a[seq, 4] float32, mask[seq, 4] bool


def _two_feeds(seq: int = 3) -> dict[str, np.ndarray]:
    return {
        "a": np.arange(seq * 4, dtype=np.float32).reshape(seq, 4),
        "mask": np.arange(seq * 4).reshape(seq, 4) % 2 == 0,
    }


# --- input_specs and generation -------------------------------------------------------------


def test_input_specs() -> None:
    assert [
        InputSpec("a", np.dtype(np.float32), ("seq", 4)),
        InputSpec("mask", np.dtype(np.bool_), ("seq", 4)),
    ] == TWO
    # Initializers are not inputs, even when they are listed as graph inputs.
    m = chain(1)
    m.graph.input.append(helper.make_tensor_value_info("W0", TensorProto.FLOAT, [8, 8]))
    assert [s.name for s in input_specs(m)] == ["x"]


def test_generate_is_seeded() -> None:
    specs = input_specs(typed_inputs())
    a = generate_feeds(specs, seed=7)
    b = generate_feeds(specs, seed=7)
    c = generate_feeds(specs, seed=8)
    assert list(a) == ["f", "b", "i", "u", "s", "h"]
    for name in a:
        np.testing.assert_array_equal(a[name], b[name])
    assert not np.array_equal(a["f"], c["f"])
    assert not np.array_equal(a["u"], c["u"])


def test_generated_dtypes_and_ranges() -> None:
    feeds = generate_feeds(input_specs(typed_inputs()), seed=0)
    f, b, i, u, s, h = (feeds[k] for k in ("f", "b", "i", "u", "s", "h"))
    # Batch-like dynamic dims ('batch', 'N', 'batch_size') default to 1.
    assert (f.shape, b.shape, i.shape) == ((1, 3), (1, 2), (1, 5))
    assert f.dtype == np.float32
    assert f.min() >= 0.0 and f.max() < 1.0
    assert h.dtype == np.float16 and h.shape == (2, 2)
    assert h.min() >= 0.0 and h.max() <= 1.0
    assert b.dtype == np.bool_
    assert i.dtype == np.int64
    assert i.min() >= 0 and i.max() < 10
    assert u.dtype == np.uint8
    assert (int(u.min()), int(u.max())) == (0, 255)
    assert s.dtype == np.int8
    assert (int(s.min()), int(s.max())) == (-128, 127)


def test_float16_values_stay_below_one() -> None:
    spec = InputSpec("h", np.dtype(np.float16), (100_000,))
    assert generate_feeds([spec])["h"].max() < 1.0


def test_int64_values_are_small_and_nonnegative() -> None:
    spec = InputSpec("ids", np.dtype(np.int64), (1000,))
    ids = generate_feeds([spec])["ids"]
    assert set(np.unique(ids).tolist()) == set(range(10))


def test_bool_values_are_mixed() -> None:
    spec = InputSpec("m", np.dtype(np.bool_), (1000,))
    m = generate_feeds([spec])["m"]
    assert 300 < np.count_nonzero(m) < 700


def test_non_numeric_inputs_cannot_be_generated() -> None:
    spec = InputSpec("text", np.dtype(object), (1,))
    with pytest.raises(InputError) as err:
        generate_feeds([spec])
    assert str(err.value) == "input 'text' has dtype object, which cannot be generated"


@pytest.mark.parametrize("dim", ["batch", "N", "batch_size", "Batch", "bs", "b"])
def test_batch_like_dims_default_to_one(dim: str) -> None:
    spec = InputSpec("x", np.dtype(np.float32), (dim, 3))
    assert generate_feeds([spec])["x"].shape == (1, 3)


def test_other_dynamic_dims_raise_with_a_shape_hint() -> None:
    with pytest.raises(InputError) as err:
        generate_feeds(TWO)
    assert str(err.value) == (
        "shapes: input 'a' [seq, 4] has dynamic dim 0 ('seq'); give its shape, e.g. a=?x4"
    )


def test_several_dynamic_dims_are_all_listed() -> None:
    spec = InputSpec("x", np.dtype(np.float32), ("batch", "seq", None, 4))
    with pytest.raises(InputError) as err:
        generate_feeds([spec])
    assert str(err.value) == (
        "shapes: input 'x' [batch, seq, ?, 4] has dynamic dim 1 ('seq'), dim 2 (unnamed); "
        "give its shape, e.g. x=1x?x?x4"
    )


def test_shape_overrides() -> None:
    feeds = generate_feeds(TWO, {"a": (3, 4), "mask": [3, 4]})
    assert feeds["a"].shape == (3, 4)
    assert feeds["mask"].shape == (3, 4)
    # An override may also set a batch-like dim.
    spec = InputSpec("x", np.dtype(np.float32), ("batch", 3))
    assert generate_feeds([spec], {"x": (5, 3)})["x"].shape == (5, 3)


def test_shape_override_rank_mismatch() -> None:
    with pytest.raises(InputError) as err:
        generate_feeds(TWO, {"a": (12,), "mask": (3, 4)})
    assert str(err.value) == "shapes a: rank 1 but the model's input has rank 2 [seq, 4]"


def test_shape_override_conflicts_with_static_dim() -> None:
    with pytest.raises(InputError) as err:
        generate_feeds(TWO, {"a": (3, 5), "mask": (3, 4)})
    assert str(err.value) == "shapes a: dim 1 is 5 but the model fixes it to 4"


def test_shape_override_unknown_input() -> None:
    with pytest.raises(InputError) as err:
        generate_feeds(TWO, {"a": (3, 4), "mask": (3, 4), "b": (1,)})
    assert str(err.value) == "shapes names unknown input(s) b; model inputs are a, mask"


# --- parse_shape ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("x=1x3x4", ("x", (1, 3, 4))),
        ("x=1,3,4", ("x", (1, 3, 4))),
        ("images=1x3x640x640", ("images", (1, 3, 640, 640))),
        ("input:0=2x5", ("input:0", (2, 5))),
        ("x=7", ("x", (7,))),
        ("x= 1x2 ", ("x", (1, 2))),
        # Polygraphy's --input-shapes form; names may hold colons, [] is a scalar.
        ("images:[1,3,320,320]", ("images", (1, 3, 320, 320))),
        ("input:0:[2, 5]", ("input:0", (2, 5))),
        ("x:[7]", ("x", (7,))),
        ("x:[]", ("x", ())),
    ],
)
def test_parse_shape(text: str, expected: tuple[str, tuple[int, ...]]) -> None:
    assert parse_shape(text) == expected


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("1x3x4", "shapes '1x3x4': expected NAME=1x3x640x640 or NAME:[1,3,640,640]"),
        ("=1x3", "shapes '=1x3': expected NAME=1x3x640x640 or NAME:[1,3,640,640]"),
        (":[1,3]", "shapes ':[1,3]': expected NAME=1x3x640x640 or NAME:[1,3,640,640]"),
        ("x=1xax3", "shapes 'x=1xax3': dims must be integers, e.g. x=1x3x640x640"),
        ("x=1.5x3", "shapes 'x=1.5x3': dims must be integers, e.g. x=1x3x640x640"),
        ("x:[1,,3]", "shapes 'x:[1,,3]': dims must be integers, e.g. x=1x3x640x640"),
        (
            "x=-1x3",
            "shapes 'x=-1x3': dims must be >= 1 (where the model says -1 or 0, give the size)",
        ),
        (
            "x:[-1,3]",
            "shapes 'x:[-1,3]': dims must be >= 1 (where the model says -1 or 0, give the size)",
        ),
        (
            "x=2x0",
            "shapes 'x=2x0': dims must be >= 1 (where the model says -1 or 0, give the size)",
        ),
    ],
)
def test_parse_shape_errors(text: str, message: str) -> None:
    with pytest.raises(InputError) as err:
        parse_shape(text)
    assert str(err.value) == message


# --- loading --------------------------------------------------------------------------------


def test_load_npz(tmp_path: Path) -> None:
    feeds = _two_feeds()
    np.savez(tmp_path / "in.npz", **feeds)
    loaded = load_feeds(tmp_path / "in.npz", TWO)
    assert set(loaded) == {"a", "mask"}
    for k, v in feeds.items():
        np.testing.assert_array_equal(loaded[k], v)
        assert loaded[k].dtype == v.dtype
    validate_feeds(loaded, TWO)


def test_save_npz_round_trips_awkward_names(tmp_path: Path) -> None:
    tensors = {
        "/backbone/conv/Conv_output_0": np.ones((2, 2), np.float32),
        "input:0": np.array(3, np.int64),
        "mask": np.array([True, False]),
    }
    save_npz(tmp_path / "t.npz", tensors)
    specs = [InputSpec(k, v.dtype, tuple(v.shape)) for k, v in tensors.items()]
    loaded = load_feeds(tmp_path / "t.npz", specs)
    assert list(loaded) == list(tensors)
    for k, v in tensors.items():
        np.testing.assert_array_equal(loaded[k], v)
        assert loaded[k].shape == v.shape
    validate_feeds(loaded, specs)


def test_load_npy_single_input(tmp_path: Path) -> None:
    x = np.arange(16, dtype=np.float32).reshape(2, 8)
    np.save(tmp_path / "x.npy", x)
    specs = input_specs(chain())
    loaded = load_feeds(tmp_path / "x.npy", specs)
    assert list(loaded) == ["x"]
    np.testing.assert_array_equal(loaded["x"], x)


def test_load_npy_multi_input_model_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "a.npy"
    np.save(path, np.zeros((3, 4), np.float32))
    with pytest.raises(InputError) as err:
        load_feeds(path, TWO)
    assert str(err.value) == (
        f"inputs {path}: a .npy holds one tensor but the model has 2 inputs (a, mask); "
        "use a .npz keyed by input name"
    )


def _write_pb(directory: Path, feeds: dict[str, np.ndarray], named: bool) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    for i, (name, arr) in enumerate(feeds.items()):
        t = numpy_helper.from_array(arr, name if named else None)
        (directory / f"input_{i}.pb").write_bytes(t.SerializeToString())


@pytest.mark.parametrize("named", [True, False])
def test_load_test_case_data_set_dir(tmp_path: Path, named: bool) -> None:
    feeds = _two_feeds()
    _write_pb(tmp_path / "test_data_set_0", feeds, named)
    loaded = load_feeds(tmp_path / "test_data_set_0", TWO)
    assert list(loaded) == ["a", "mask"]
    for k, v in feeds.items():
        np.testing.assert_array_equal(loaded[k], v)
        assert loaded[k].dtype == v.dtype


def test_load_test_case_parent_dir(tmp_path: Path) -> None:
    feeds = _two_feeds(seq=2)
    _write_pb(tmp_path / "case" / "test_data_set_0", feeds, named=True)
    # A second data set must not be mixed into the first.
    _write_pb(tmp_path / "case" / "test_data_set_1", _two_feeds(seq=5), named=True)
    (tmp_path / "case" / "model.onnx").write_bytes(b"")
    loaded = load_feeds(tmp_path / "case", TWO)
    for k, v in feeds.items():
        np.testing.assert_array_equal(loaded[k], v)


def test_pb_files_are_ordered_numerically(tmp_path: Path) -> None:
    specs = [InputSpec(f"x{i}", np.dtype(np.int64), ()) for i in range(11)]
    for i in range(11):
        t = numpy_helper.from_array(np.array(i, np.int64))
        (tmp_path / f"input_{i}.pb").write_bytes(t.SerializeToString())
    loaded = load_feeds(tmp_path, specs)
    assert {k: int(v) for k, v in loaded.items()} == {f"x{i}": i for i in range(11)}


def test_load_errors(tmp_path: Path) -> None:
    with pytest.raises(InputError) as err:
        load_feeds(tmp_path / "nope.npz", TWO)
    assert str(err.value) == f"inputs {tmp_path / 'nope.npz'}: no such file or directory"

    (tmp_path / "empty").mkdir()
    with pytest.raises(InputError) as err:
        load_feeds(tmp_path / "empty", TWO)
    assert str(err.value) == f"inputs {tmp_path / 'empty'}: no input_N.pb files found"

    txt = tmp_path / "in.txt"
    txt.write_text("1 2 3")
    with pytest.raises(InputError) as err:
        load_feeds(txt, TWO)
    assert str(err.value) == (
        f"inputs {txt}: expected .npz, .npy or a directory of input_N.pb files"
    )

    bad = tmp_path / "bad.npz"
    bad.write_bytes(b"not a zip file")
    with pytest.raises(InputError) as err:
        load_feeds(bad, TWO)
    assert str(err.value).startswith(f"inputs {bad}: cannot read (")
    assert "\n" not in str(err.value)


# --- validation -----------------------------------------------------------------------------


def test_validate_accepts_matching_feeds() -> None:
    validate_feeds(_two_feeds(seq=7), TWO)


def test_validate_unknown_and_missing_names() -> None:
    feeds = {"a": _two_feeds()["a"], "z": np.zeros(1)}
    with pytest.raises(InputError) as err:
        validate_feeds(feeds, TWO)
    assert str(err.value) == (
        "unknown input(s) z; missing input(s) mask; the model's inputs are a, mask"
    )
    with pytest.raises(InputError) as err:
        validate_feeds({"a": feeds["a"]}, TWO)
    assert str(err.value) == "missing input(s) mask; the model's inputs are a, mask"


def test_validate_wrong_dtype_suggests_astype() -> None:
    feeds = _two_feeds()
    feeds["a"] = feeds["a"].astype(np.float64)
    with pytest.raises(InputError) as err:
        validate_feeds(feeds, TWO)
    assert str(err.value) == (
        "input 'a' has dtype float64 but the model expects float32; "
        "cast it (e.g. arr.astype(np.float32))"
    )


def test_validate_wrong_rank() -> None:
    feeds = _two_feeds()
    feeds["a"] = feeds["a"].ravel()
    with pytest.raises(InputError) as err:
        validate_feeds(feeds, TWO)
    assert str(err.value) == (
        "input 'a' has shape (12,) (rank 1) but the model expects rank 2 [seq, 4]"
    )


def test_validate_wrong_static_dim() -> None:
    feeds = {"a": np.zeros((4, 3), np.float32), "mask": np.zeros((4, 3), np.bool_)}
    with pytest.raises(InputError) as err:
        validate_feeds(feeds, TWO)
    assert str(err.value) == "input 'a' has shape (4, 3) but dim 1 must be 4 [seq, 4]"


def test_make_feeds_generates_loads_and_validates(tmp_path: Path) -> None:
    m = two_inputs()
    generated = make_feeds(m, shapes={"a": (2, 4), "mask": (2, 4)}, seed=3)
    assert generated["a"].shape == (2, 4)
    np.testing.assert_array_equal(
        generated["a"], make_feeds(m, shapes={"a": (2, 4), "mask": (2, 4)}, seed=3)["a"]
    )
    given = make_feeds(m, inputs=_two_feeds(seq=1))
    np.testing.assert_array_equal(given["a"], [[0.0, 1.0, 2.0, 3.0]])
    feeds = _two_feeds()
    np.savez(tmp_path / "in.npz", **feeds)
    np.testing.assert_array_equal(make_feeds(m, inputs=tmp_path / "in.npz")["a"], feeds["a"])


def test_make_feeds_rejects_wrong_given_dtype() -> None:
    with pytest.raises(InputError, match="expects float32"):
        make_feeds(
            two_inputs(), inputs={"a": np.zeros((1, 4), np.float64), "mask": np.ones((1, 4), bool)}
        )


def test_parse_shape_rejects_empty_dims() -> None:
    with pytest.raises(InputError, match="dims must be integers"):
        parse_shape("x=1xx3")


def test_save_npz_round_trips_names_numpy_savez_cannot(tmp_path: Path) -> None:
    from onnx_bisect.inputs.feeds import save_npz

    tensors = {"file": np.arange(3), "allow_pickle": np.ones(2), "a/b:c": np.zeros(())}
    save_npz(tmp_path / "t.npz", tensors)
    with np.load(tmp_path / "t.npz") as z:
        assert sorted(z.files) == sorted(tensors)
        for k, v in tensors.items():
            np.testing.assert_array_equal(z[k], v)
            assert z[k].shape == v.shape


# --- dims declared as -1 or 0 ---------------------------------------------------------------


def _declared(*dims: int | str) -> InputSpec:
    m = helper.make_model(
        helper.make_graph(
            [helper.make_node("Identity", ["x"], ["y"])],
            "g",
            [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(dims))],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, list(dims))],
        )
    )
    (spec,) = input_specs(m)
    return spec


def test_minus_one_and_zero_dims_are_dynamic() -> None:
    assert _declared(-1, 3, 0, "h", 5).dims == (None, 3, None, "h", 5)


@pytest.mark.parametrize("batch", [-1, 0])
def test_unnamed_batch_defaults_to_one_and_takes_any_size(batch: int) -> None:
    spec = _declared(batch, 3, 8)
    assert generate_feeds([spec])["x"].shape == (1, 3, 8)
    assert generate_feeds([spec], {"x": (4, 3, 8)})["x"].shape == (4, 3, 8)
    validate_feeds({"x": np.zeros((2, 3, 8), np.float32)}, [spec])


def test_unnamed_dims_past_the_first_still_need_a_shape() -> None:
    # PP-OCR cls: [-1, 3, ?, ?]; the batch gets 1, the image sides are the user's to give.
    with pytest.raises(InputError) as err:
        generate_feeds([_declared(-1, 3, "?", -1)])
    assert str(err.value) == (
        "shapes: input 'x' [?, 3, ?, ?] has dynamic dim 2 ('?'), dim 3 (unnamed); "
        "give its shape, e.g. x=1x3x?x?"
    )


# --- values and ranges ----------------------------------------------------------------------


def test_default_values_are_what_the_seed_always_gave() -> None:
    # The draws of earlier versions, restated: a seed must keep giving the same inputs.
    rng = np.random.default_rng(5)
    f = np.minimum(
        rng.random((1, 3), dtype=np.float64).astype(np.float32),
        np.nextafter(np.float32(1), np.float32(0)),
    )
    b = rng.random((1, 2)) < 0.5
    i = rng.integers(0, 10, size=(1, 5)).astype(np.int64)
    u = rng.integers(0, 256, size=(1, 4096)).astype(np.uint8)
    s = rng.integers(-128, 128, size=(1, 4096)).astype(np.int8)
    feeds = generate_feeds(input_specs(typed_inputs()), seed=5)
    for name, want in zip("fbius", (f, b, i, u, s), strict=True):
        np.testing.assert_array_equal(feeds[name], want)
        assert feeds[name].dtype == want.dtype


def test_constant_values() -> None:
    feeds = generate_feeds(
        input_specs(typed_inputs()),
        values={"f": -2.5, "b": 1, "i": 16000, "u": 255, "s": -128, "h": float("nan")},
    )
    assert (feeds["f"] == -2.5).all() and feeds["f"].dtype == np.float32
    assert feeds["b"].all() and feeds["b"].dtype == np.bool_
    assert (feeds["i"] == 16000).all() and feeds["i"].dtype == np.int64
    assert (feeds["u"] == 255).all() and (feeds["s"] == -128).all()
    assert np.isnan(feeds["h"]).all()


def test_an_int64_constant_is_exact() -> None:
    spec = InputSpec("big", np.dtype(np.int64), (2,))
    assert generate_feeds([spec], values={"big": 2**62 + 1})["big"].tolist() == [2**62 + 1] * 2


def test_integer_ranges_include_both_ends() -> None:
    spec = InputSpec("ids", np.dtype(np.int32), (2000,))
    ids = generate_feeds([spec], ranges={"ids": (-3, 3)})["ids"]
    assert ids.dtype == np.int32
    assert set(np.unique(ids).tolist()) == set(range(-3, 4))


def test_float_ranges_exclude_the_high_end_after_rounding() -> None:
    # In float16, most of [2047, 2048) rounds to 2048; the promise is still [low, high).
    spec = InputSpec("h", np.dtype(np.float16), (10_000,))
    h = generate_feeds([spec], ranges={"h": (2047.0, 2048.0)})["h"]
    assert h.min() >= 2047 and h.max() < 2048
    spec = InputSpec("f", np.dtype(np.float32), (10_000,))
    f = generate_feeds([spec], ranges={"f": (-1.0, 1.0)})["f"]
    assert -1 <= f.min() < -0.99 and 0.99 < f.max() < 1


def test_a_value_or_range_leaves_other_inputs_to_their_defaults() -> None:
    feeds = generate_feeds(TWO, {"a": (3, 4), "mask": (3, 4)}, ranges={"a": (5.0, 6.0)})
    assert feeds["a"].min() >= 5 and feeds["a"].max() < 6
    assert feeds["mask"].dtype == np.bool_


def test_a_range_of_one_value_is_a_constant() -> None:
    spec = InputSpec("m", np.dtype(np.bool_), (10,))
    assert not generate_feeds([spec], ranges={"m": (0, 0)})["m"].any()


@pytest.mark.parametrize(
    ("values", "ranges", "message"),
    [
        ({"i": 0.5}, None, "input 'i' is int64; the constant value 0.5 is not an integer"),
        (
            None,
            {"i": (0, 2.5)},
            "input 'i' is int64; the range 0,2.5 has a bound that is not an integer",
        ),
        ({"b": 2}, None, "input 'b' is bool; the constant value 2 is outside [0, 1]"),
        ({"u": -1}, None, "input 'u' is uint8; the constant value -1 is outside [0, 255]"),
        (None, {"s": (-200, 0)}, "input 's' is int8; the range -200,0 is outside [-128, 127]"),
        ({"h": 1e5}, None, "input 'h' is float16; the constant value 100000.0 is beyond ±65504"),
        (
            None,
            {"h": (1e-9, 2e-9)},
            "input 'h' is float16; the range 1e-09,2e-09 holds no float16 value",
        ),
        (
            {"z": 1},
            {"y": (0, 1)},
            "constant value or range for unknown input(s) y, z; model inputs are f, b, i, u, s, h",
        ),
        ({"f": 1}, {"f": (0, 1)}, "input(s) f given both a constant value and a range; give one"),
        ({"f": "1"}, None, "constant value for input 'f' must be a number, not '1'"),
        (None, {"f": (1, 0)}, "range for input 'f': low 1 is above high 0"),
        (None, {"f": (0, float("inf"))}, "range for input 'f' must be finite, not 0,inf"),
        (None, {"f": 1}, "range for input 'f' must be two numbers (low, high), not 1"),
        ("f=1", None, "constant values must map input names to numbers, not 'f=1'"),
    ],
)
def test_values_and_ranges_that_do_not_fit(
    values: dict[str, float] | None, ranges: dict[str, tuple[float, float]] | None, message: str
) -> None:
    with pytest.raises(InputError) as err:
        generate_feeds(input_specs(typed_inputs()), values=values, ranges=ranges)
    assert str(err.value) == message


def test_values_for_a_dtype_that_cannot_be_generated() -> None:
    spec = InputSpec("text", np.dtype(object), (1,))
    with pytest.raises(InputError) as err:
        generate_feeds([spec], values={"text": 1})
    assert str(err.value) == (
        "input 'text' is object, which cannot be generated; give its values as inputs"
    )


def test_values_do_not_apply_to_given_inputs() -> None:
    with pytest.raises(InputError) as err:
        make_feeds(two_inputs(), inputs=_two_feeds(), values={"mask": 1}, ranges={"a": (0, 1)})
    assert str(err.value) == (
        "a constant value or range (for a, mask) applies to generated inputs only, and these "
        "inputs are given; put the values in the given inputs instead"
    )


def test_options_check_values_without_a_model() -> None:
    from onnx_bisect.options import BisectOptions

    with pytest.raises(InputError, match="low 1 is above high 0"):
        BisectOptions(ranges={"x": (1, 0)})
    assert BisectOptions(values={"sr": 16000}, ranges={"x": (-1.0, 1.0)}).values == {"sr": 16000}


@pytest.mark.parametrize(
    ("dtype", "fill"),
    [
        (np.float32, Fill(0.0, 1.0)),
        (np.float16, Fill(-3.0, 3.0)),
        (np.int64, Fill(0, 9)),
        (np.uint8, Fill(0, 255)),
        (np.bool_, Fill(0, 1)),
        (np.uint64, Fill(0, 2**64 - 1)),
    ],
)
def test_drawing_in_blocks_draws_what_one_draw_does(
    monkeypatch: pytest.MonkeyPatch, dtype: type[np.generic], fill: Fill
) -> None:
    """Blocks keep the peak near the tensor's own bytes; a seed's values and the generator's
    state after them stay those of a single draw."""
    whole_rng, blocks_rng = np.random.default_rng(3), np.random.default_rng(3)
    whole = draw(whole_rng, np.dtype(dtype), (3, 2500), fill)  # one block of 2**20
    monkeypatch.setattr(values_module, "_DRAW_BLOCK", 1000)
    blocks = draw(blocks_rng, np.dtype(dtype), (3, 2500), fill)  # 8 blocks, the last short
    assert blocks.dtype == whole.dtype and np.array_equal(blocks, whole)
    assert blocks_rng.random() == whole_rng.random()
