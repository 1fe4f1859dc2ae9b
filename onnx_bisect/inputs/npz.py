"""Reading an .npz of many tensors in one pass (``inputs.feeds.save_npz`` writes them).

A probe run of a 20,000-node model through ``exec:`` returns an .npz of 20,000 arrays. Read
through ``np.load``, each lookup opens its zip member anew and parses its header with
``ast.literal_eval``: 0.15 ms an array, 3 s for that file. ``read_npz`` walks the zip's
directory once, parses each distinct header once and reads every array straight into its own
buffer; a member it cannot read that way (compressed, say) goes through numpy's reader.
"""

from __future__ import annotations

import functools
import io
import struct
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

__all__ = ["read_npz"]

# A zip local file header: signature, 5 shorts, 3 longs, then the name and extra lengths.
_LOCAL = struct.Struct("<4s5H3L2H")
_NPY_MAGIC = b"\x93NUMPY"


def read_npz(path: Path) -> dict[str, npt.NDArray[Any]]:
    """Every array of the .npz at ``path``, keyed as ``np.load`` keys them (``.npy`` dropped).
    Arrays of Python objects are refused, as with ``allow_pickle=False``."""
    out: dict[str, npt.NDArray[Any]] = {}
    with zipfile.ZipFile(path) as zf, open(path, "rb") as raw:
        for info in zf.infolist():
            key = info.filename.removesuffix(".npy")
            value = _stored(raw, info) if info.compress_type == zipfile.ZIP_STORED else None
            if value is None:
                with zf.open(info) as member:
                    value = np.lib.format.read_array(member, allow_pickle=False)
            out[key] = value
    return out


def _stored(raw: io.BufferedReader, info: zipfile.ZipInfo) -> npt.NDArray[Any] | None:
    """The array of an uncompressed member read in place, or None to leave it to numpy."""
    raw.seek(info.header_offset)
    local = raw.read(_LOCAL.size)
    if len(local) != _LOCAL.size or local[:4] != b"PK\x03\x04":
        return None
    name_len, extra_len = _LOCAL.unpack(local)[-2:]
    raw.seek(info.header_offset + _LOCAL.size + name_len + extra_len)
    magic = raw.read(8)
    if magic[:6] != _NPY_MAGIC or magic[6:] not in (b"\x01\x00", b"\x02\x00"):
        return None  # not .npy, or format 3.0 (utf-8 field names): numpy's reader knows it
    size_bytes = 2 if magic[6] == 1 else 4
    header = raw.read(size_bytes)
    header += raw.read(int.from_bytes(header, "little"))
    shape, fortran, dtype = _header(magic + header)
    if dtype.hasobject:
        raise ValueError(f"{info.filename}: object arrays cannot be loaded without pickle")
    # A Fortran-ordered array's bytes are its transpose's, in C order.
    value = np.empty(shape[::-1] if fortran else shape, dtype)
    flat = value.reshape(-1).view(np.uint8)
    if raw.readinto(flat.data) != flat.size:
        raise ValueError(f"{info.filename}: truncated array data")
    return value.T if fortran else value


@functools.lru_cache(maxsize=1024)
def _header(prefix: bytes) -> tuple[tuple[int, ...], bool, np.dtype[Any]]:
    """shape, Fortran order and dtype of an .npy header; cached, since the arrays of one file
    mostly share a few headers and parsing one costs more than reading a small array."""
    f = io.BytesIO(prefix)
    if np.lib.format.read_magic(f) == (1, 0):
        shape, fortran, dtype = np.lib.format.read_array_header_1_0(f)
    else:
        shape, fortran, dtype = np.lib.format.read_array_header_2_0(f)
    return tuple(shape), bool(fortran), dtype
