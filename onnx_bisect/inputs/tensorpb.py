"""Reading one ONNX test-case tensor (``input_0.pb``, a dump's ``.pb``) from anyone's file.

A TensorProto's bytes are read whole, so the file must be a regular one (a link to
``/dev/zero`` would never end) and fit the limit; its dims and dtype are then checked
against the limit before the array is made, and dims that claim more than the data holds
(1e12 elements over a few bytes) are an error about the file rather than numpy's "cannot
reshape". Data kept outside the file (``data_location: EXTERNAL``) is refused: a path in a
tensor someone sent would be read from this machine.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import onnx
from onnx import helper, numpy_helper

from onnx_bisect.errors import InputError
from onnx_bisect.inputs.limits import ByteLimit, nbytes
from onnx_bisect.inputs.npz import regular_file

__all__ = ["read_tensor_pb", "tensor_pb_name"]


def _parsed(path: Path, limit: ByteLimit, what: str) -> onnx.TensorProto:
    size = regular_file(path, what)
    limit.check(f"{what} {path}", size, fix="give a smaller tensor")
    tensor = onnx.TensorProto()
    try:
        tensor.ParseFromString(path.read_bytes())
    except Exception as exc:  # protobuf's DecodeError, from an untyped module
        raise InputError(f"{what} {path}: not a TensorProto ({_first_line(exc)})") from None
    if not isinstance(tensor.name, str):  # protobuf hands invalid UTF-8 over as bytes
        raise InputError(f"{what} {path}: its name is not UTF-8 text ({tensor.name!r})")
    return tensor


def tensor_pb_name(path: Path, *, limit: ByteLimit, what: str) -> str:
    """The name a .pb's tensor carries ("" for none)."""
    return _parsed(path, limit, what).name


def read_tensor_pb(
    path: Path, *, limit: ByteLimit, what: str = "inputs"
) -> tuple[str, npt.NDArray[Any]]:
    """The name (maybe "") and value of the TensorProto in ``path``, or an ``InputError``
    (``what`` leads it) saying what is wrong with the file."""
    tensor = _parsed(path, limit, what)
    where = f"{what} {path}"
    if tensor.data_location == onnx.TensorProto.EXTERNAL:
        raise InputError(f"{where}: keeps its data in another file; give a tensor that holds it")
    try:
        dtype = np.dtype(helper.tensor_dtype_to_np_dtype(tensor.data_type))
    except (KeyError, TypeError, ValueError):
        raise InputError(f"{where}: unknown data type {tensor.data_type}") from None
    dims = tuple(tensor.dims)
    if any(d < 0 for d in dims):
        raise InputError(f"{where}: negative dims {list(dims)}")
    limit.check(where, nbytes(dims, dtype), fix="give a smaller tensor")
    try:
        value = numpy_helper.to_array(tensor)
    except (ValueError, TypeError, KeyError, IndexError, AssertionError) as exc:
        shown = "x".join(str(d) for d in dims) or "scalar"
        raise InputError(
            f"{where}: its dims ({shown}) do not match the data it holds ({_first_line(exc)})"
        ) from None
    return tensor.name, value


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
