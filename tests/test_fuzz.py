"""Property-based fuzz: corrupted bytes through the real command line never reach exit 3.

A model, an inputs .npz (stored and deflated) and a test-case ``input_0.pb`` are corrupted the
ways files are: truncated, bytes flipped, foreign bytes spliced in. Each is fed to ``bisect``
in-process (typer's CliRunner, for speed). Whatever the corruption, the answer is exit 2 with
one ``error:`` line and no traceback, or, where the corruption is harmless (a flipped weight,
a changed input value), a normal 0 or 1; never 3, which is a bug of ours.

Each test is bounded to a few seconds: a fixed number of examples, each with a deadline, and
derandomized so that CI draws the same examples every time.
"""

from __future__ import annotations

import io
import shutil
import tempfile
import zipfile
import zlib
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import onnx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from onnx import numpy_helper
from typer.testing import CliRunner

from onnx_bisect.cli import bisect_app
from onnx_bisect.dumper import dump
from onnx_bisect.inputs.feeds import save_npz
from tests.models import chain

runner = CliRunner()

# A fixed threshold: no float64 oracle (torch) per example, so an example takes ~50 ms.
RUN = ["--target", "cpu", "--threshold", "1e-3", "-q"]
FUZZ = settings(
    max_examples=30,
    deadline=3000,  # ms per example; a first ORT session can take a second on a busy machine
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)


@pytest.fixture(scope="module")
def scratch() -> Iterator[Path]:
    # Module-scoped: hypothesis runs every example in one call of the test, and a
    # function-scoped tmp_path would be shared by all of them anyway.
    with tempfile.TemporaryDirectory(prefix="onnx-bisect-fuzz-") as tmp:
        yield Path(tmp)


@st.composite
def corrupted(draw: st.DrawFn, original: bytes) -> bytes:
    """``original`` truncated, with bytes flipped, or with bytes spliced in (or removed)."""
    kind = draw(st.sampled_from(["truncate", "flip", "splice"]))
    at = draw(st.integers(0, len(original)))
    if kind == "truncate":
        return original[:at]
    if kind == "flip":
        data = bytearray(original)
        for _ in range(draw(st.integers(1, 8))):
            i = draw(st.integers(0, len(data) - 1))
            data[i] ^= draw(st.integers(1, 255))
        return bytes(data)
    cut = draw(st.integers(0, 16))
    return original[:at] + draw(st.binary(max_size=32)) + original[at + cut :]


def invoke(*args: str) -> tuple[int, str]:
    res = runner.invoke(bisect_app, list(args))
    # An exception typer did not turn into an exit is ours: it would be a traceback.
    if res.exception is not None and not isinstance(res.exception, SystemExit):
        raise res.exception
    return res.exit_code, res.stderr


def check(code: int, err: str) -> None:
    """Exit 2 with one error line, or a normal run; never 3, never a traceback."""
    assert "Traceback" not in err, err
    assert code in (0, 1, 2), (code, err)
    if code == 2:
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: "), err


MODEL = chain(2).SerializeToString()
X = np.random.default_rng(0).random((1, 8)).astype(np.float32)


def _npz(compressed: bool) -> bytes:
    buf = io.BytesIO()
    (np.savez_compressed if compressed else np.savez)(buf, x=X)
    return buf.getvalue()


def _stored_npz(scratch: Path) -> bytes:
    """The tool's own .npz writer (stored, zip64), as ``--out``'s inputs.npz is written."""
    save_npz(scratch / "base.npz", {"x": X})
    return (scratch / "base.npz").read_bytes()


@FUZZ
@given(data=st.data())
def test_a_corrupted_model_is_an_error_or_a_run(scratch: Path, data: st.DataObject) -> None:
    model = scratch / "model.onnx"
    model.write_bytes(data.draw(corrupted(MODEL)))
    check(*invoke(str(model), *RUN))


@FUZZ
@given(data=st.data(), compressed=st.booleans())
def test_a_corrupted_npz_is_an_error_or_a_run(
    scratch: Path, data: st.DataObject, compressed: bool
) -> None:
    model = scratch / "good.onnx"
    model.write_bytes(MODEL)
    given_npz = scratch / "x.npz"
    given_npz.write_bytes(data.draw(corrupted(_npz(compressed))))
    check(*invoke(str(model), "-i", str(given_npz), *RUN))


@FUZZ
@given(data=st.data())
def test_a_corrupted_stored_npz_is_an_error_or_a_run(scratch: Path, data: st.DataObject) -> None:
    """The uncompressed reader reads arrays in place from the zip's local headers."""
    model = scratch / "good.onnx"
    model.write_bytes(MODEL)
    given_npz = scratch / "stored.npz"
    given_npz.write_bytes(data.draw(corrupted(_stored_npz(scratch))))
    check(*invoke(str(model), "-i", str(given_npz), *RUN))


@FUZZ
@given(data=st.data())
def test_a_corrupted_pb_is_an_error_or_a_run(scratch: Path, data: st.DataObject) -> None:
    model = scratch / "good.onnx"
    model.write_bytes(MODEL)
    case = scratch / "case"
    case.mkdir(exist_ok=True)
    tensor = numpy_helper.from_array(X, "x").SerializeToString()
    (case / "input_0.pb").write_bytes(data.draw(corrupted(tensor)))
    check(*invoke(str(model), "-i", str(case), *RUN))


@FUZZ
@given(data=st.data())
def test_a_corrupted_npy_is_an_error_or_a_run(scratch: Path, data: st.DataObject) -> None:
    model = scratch / "good.onnx"
    model.write_bytes(MODEL)
    buf = io.BytesIO()
    np.save(buf, X)
    given_npy = scratch / "x.npy"
    given_npy.write_bytes(data.draw(corrupted(buf.getvalue())))
    check(*invoke(str(model), "-i", str(given_npy), *RUN))


@pytest.fixture(scope="module")
def dumped(scratch: Path) -> Path:
    """A real dump of the model on cpu: a .npy per tensor, inputs.npz, manifest.json."""
    model = scratch / "dumped.onnx"
    model.write_bytes(MODEL)
    dump(model, "cpu", scratch / "dump")
    return scratch / "dump"


@FUZZ
@given(data=st.data())
def test_a_corrupted_dump_is_an_error_or_a_run(
    scratch: Path, dumped: Path, data: st.DataObject
) -> None:
    """Any one file of a dump corrupted: a tensor's .npy, the recorded inputs, the manifest."""
    model = scratch / "dumped.onnx"
    copy = scratch / "dump-copy"
    shutil.rmtree(copy, ignore_errors=True)
    shutil.copytree(dumped, copy)
    victim = copy / data.draw(st.sampled_from(sorted(p.name for p in dumped.iterdir())))
    victim.write_bytes(data.draw(corrupted(victim.read_bytes())))
    check(*invoke(str(model), "-t", f"dump:{copy}", *RUN[2:]))


def test_the_fuzzed_files_are_whole_before_corruption(scratch: Path) -> None:
    """The baselines run: a corruption is what makes an example fail, not its base."""
    model = scratch / "good.onnx"
    model.write_bytes(MODEL)
    assert onnx.load_from_string(MODEL).graph.input[0].name == "x"
    for name, body in (("a.npz", _npz(False)), ("b.npz", _npz(True))):
        (scratch / name).write_bytes(body)
        assert invoke(str(model), "-i", str(scratch / name), *RUN) == (0, "")
    _stored_npz(scratch)
    assert invoke(str(model), "-i", str(scratch / "base.npz"), *RUN) == (0, "")
    case = scratch / "whole"
    case.mkdir()
    (case / "input_0.pb").write_bytes(numpy_helper.from_array(X, "x").SerializeToString())
    assert invoke(str(model), "-i", str(case), *RUN) == (0, "")


# --- what the fuzz found, kept as plain cases --------------------------------------------


def test_names_of_invalid_utf8_are_an_error(scratch: Path) -> None:
    """protobuf hands a string field of invalid UTF-8 over as bytes: a model's node input, a
    tensor's name."""
    model = scratch / "utf8.onnx"
    at = MODEL.index(b"\n\x01x")  # the first node's input "x"
    model.write_bytes(MODEL[:at] + b"\n\x01\xf8" + MODEL[at + 3 :])
    code, err = invoke(str(model), *RUN)
    assert (code, err) == (2, f"error: {model}: not a valid ONNX model (a name is not UTF-8 "
                           "text: b'\\xf8')\n")  # fmt: skip
    good = scratch / "good.onnx"
    good.write_bytes(MODEL)
    case = scratch / "utf8case"
    case.mkdir()
    tensor = numpy_helper.from_array(X, "x")
    raw = tensor.SerializeToString().replace(b"B\x01x", b"B\x01\xf8")
    (case / "input_0.pb").write_bytes(raw)
    code, err = invoke(str(good), "-i", str(case), *RUN)
    assert code == 2 and "input_0.pb: its name is not UTF-8 text (b'\\xf8')" in err, err


def test_a_corrupt_deflate_stream_is_an_error(scratch: Path) -> None:
    """zlib's own error type is no OSError or ValueError."""
    model = scratch / "good.onnx"
    model.write_bytes(MODEL)
    body = bytearray(_npz(compressed=True))
    data = body.index(b"x.npy") + len("x.npy")  # its extra field, then the deflated bytes
    body[data + 20] = 0xFF  # the first block's header: an invalid block type
    with pytest.raises(zlib.error), zipfile.ZipFile(io.BytesIO(body)) as zf:
        zf.read("x.npy")  # the corruption is zlib's to find, not the CRC check's
    broken = scratch / "deflate.npz"
    broken.write_bytes(bytes(body))
    code, err = invoke(str(model), "-i", str(broken), *RUN)
    check(code, err)
    assert code == 2, err


def test_a_malformed_npy_header_is_an_error(scratch: Path) -> None:
    """numpy parses the header with Python's tokenizer, whose TokenError is no ValueError."""
    model = scratch / "good.onnx"
    model.write_bytes(MODEL)
    buf = io.BytesIO()
    np.save(buf, X)
    given_npy = scratch / "tokens.npy"
    given_npy.write_bytes(buf.getvalue().replace(b"alse, 'shape': (", b"1"))
    code, err = invoke(str(model), "-i", str(given_npy), *RUN)
    assert code == 2 and "tokens.npy: has a malformed .npy header" in err, err


def test_a_zip_of_a_future_version_is_an_error(scratch: Path) -> None:
    model = scratch / "good.onnx"
    model.write_bytes(MODEL)
    body = bytearray(_stored_npz(scratch))
    central = body.index(b"PK\x01\x02")
    body[central + 6 : central + 8] = (109).to_bytes(2, "little")  # version needed: 10.9
    future = scratch / "future.npz"
    future.write_bytes(bytes(body))
    code, err = invoke(str(model), "-i", str(future), *RUN)
    assert code == 2 and "future.npz: cannot read (zip file version 10.9)" in err, err


def test_a_damaged_dump_manifest_only_loses_the_backends_name(scratch: Path, dumped: Path) -> None:
    copy = scratch / "manifest-copy"
    shutil.copytree(dumped, copy)
    (copy / "manifest.json").write_bytes(b"\xff not json")
    assert invoke(str(scratch / "dumped.onnx"), "-t", f"dump:{copy}", *RUN[2:]) == (0, "")
