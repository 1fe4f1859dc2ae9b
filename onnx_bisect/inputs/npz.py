"""Reading an .npz array by array: headers first, then only the arrays wanted.

Anyone can write an .npz, and its headers say what reading it costs: a 4 MB file can hold a
4 GiB array of zeros, compressed. So ``npz_headers`` reads each member's .npy header alone
(the first bytes of its stream, decompressed only that far), and ``read_npz`` reads only the
arrays asked for, each checked against a ``ByteLimit`` from its header before a byte of it is
allocated. Arrays of Python objects are refused from their header: nothing is ever unpickled
(numpy's ``allow_pickle=False``).

It is also fast: a probe run of a 20,000-node model through ``exec:`` returns an .npz of
20,000 arrays. Read through ``np.load``, each lookup opens its zip member anew and parses its
header with ``ast.literal_eval``: 0.15 ms an array, 3 s for that file. ``read_npz`` walks the
zip's directory once, parses each distinct header once and reads every uncompressed array
straight into its own buffer.
"""

from __future__ import annotations

import functools
import io
import lzma
import os
import stat
import struct
import tokenize
import zipfile
import zlib
from collections.abc import Collection, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import numpy as np
import numpy.typing as npt

from onnx_bisect.errors import InputError
from onnx_bisect.inputs.limits import ByteLimit, nbytes

__all__ = ["NpyHeader", "npz_headers", "read_npy", "read_npz", "regular_file"]

# A zip local file header: signature, 5 shorts, 3 longs, then the name and extra lengths.
_LOCAL = struct.Struct("<4s5H3L2H")
_NPY_MAGIC = b"\x93NUMPY"
_SLICE = 64 << 20
_STORED = zipfile.ZIP_STORED
_MALFORMED = (
    ValueError, SyntaxError, TypeError, KeyError, IndexError, OverflowError, RecursionError,
    tokenize.TokenError,
)  # fmt: skip


@dataclass(frozen=True)
class NpyHeader:
    """What an .npy header promises: the array's shape and dtype, and its byte order."""

    shape: tuple[int, ...]
    dtype: np.dtype[Any]
    fortran: bool = False

    @functools.cached_property
    def nbytes(self) -> int:
        return nbytes(self.shape, self.dtype)


def regular_file(path: Path, what: str) -> int:
    """The size of ``path``, which must be a regular file (a link to one is fine): a device
    (``/dev/zero``), a FIFO or a socket never ends, or never starts."""
    try:
        st = os.stat(path)
    except OSError as exc:
        raise InputError(f"{what} {path}: cannot read ({exc.strerror})") from None
    if not stat.S_ISREG(st.st_mode):
        raise InputError(f"{what} {path}: not a regular file (a device, FIFO or socket?)")
    return st.st_size


def npz_headers(path: Path, *, what: str = "inputs") -> dict[str, NpyHeader]:
    """Every array's header, keyed as ``np.load`` keys them (``.npy`` dropped); no data is
    read or decompressed beyond the headers."""
    regular_file(path, what)
    with _opened(path, what) as zf:
        found: dict[str, NpyHeader] = {}
        for info in zf.infolist():
            with _errors(f"{what} {path}: {info.filename}"), zf.open(info) as member:
                found[_key(info)] = _no_objects(_read_header(member))
        return found


def read_npz(
    path: Path,
    names: Collection[str] | None = None,
    *,
    limit: ByteLimit | None = None,
    what: str = "inputs",
) -> dict[str, npt.NDArray[Any]]:
    """The arrays of the .npz at ``path`` named in ``names`` (None: all), keyed as ``np.load``
    keys them; the others are never read. Each is checked against ``limit`` (default: what
    the machine has) from its header first; any flaw is an ``InputError`` naming the file."""
    regular_file(path, what)
    limit = limit or ByteLimit.here(None)
    cap = limit.bytes
    out: dict[str, npt.NDArray[Any]] = {}
    with _opened(path, what) as zf, open(path, "rb") as raw:
        # One try for every member, not a context per member: 20,000 arrays of a probe run
        # are read here, and each microsecond per array is 20 ms.
        member, label = "", f"{what} {path}: array"
        try:
            for info in zf.infolist():
                key = _key(info)
                if names is not None and key not in names:
                    continue
                member = info.filename
                stored = _stored_header(raw, info) if info.compress_type == _STORED else None
                if stored is not None:  # raw stands at its first byte
                    out[key] = _fill(raw, _fits(stored, limit, cap, f"{label} {key!r}"))
                    continue
                with zf.open(info) as stream:
                    header = _read_header(stream)
                    out[key] = _fill(stream, _fits(header, limit, cap, f"{label} {key!r}"))
        except _FLAWS as exc:
            raise _flaw(f"{what} {path}: {member}", exc) from None
    return out


def read_npy(path: Path, *, limit: ByteLimit, what: str = "inputs") -> npt.NDArray[Any]:
    """The array of the .npy at ``path``, checked against ``limit`` from its header first."""
    regular_file(path, what)
    with _errors(f"{what} {path}:"), open(path, "rb") as f:
        header = _no_objects(_read_header(f))
        limit.check(f"{what} {path}", header.nbytes)
        return _fill(f, header)


def _fits(header: NpyHeader, limit: ByteLimit, cap: int | None, what: str) -> NpyHeader:
    """``header``, once its array is known to hold no objects and to fit ``limit``."""
    _no_objects(header)
    if cap is not None and header.nbytes > cap:
        limit.check(what, header.nbytes)
    return header


def _key(info: zipfile.ZipInfo) -> str:
    return info.filename.removesuffix(".npy")


def _no_objects(header: NpyHeader) -> NpyHeader:
    if header.dtype.hasobject:
        raise ValueError(
            "holds Python objects (a pickle), which are never unpickled (allow_pickle=False)"
        )
    return header


def _opened(path: Path, what: str) -> zipfile.ZipFile:
    try:
        return zipfile.ZipFile(path)
    except (zipfile.BadZipFile, OSError, ValueError, EOFError, NotImplementedError) as exc:
        raise InputError(f"{what} {path}: cannot read ({_first_line(exc)})") from None


# What zipfile, zlib, lzma and numpy raise for a damaged file; an OSError is a read failing.
_FLAWS = (
    ValueError, OSError, EOFError, zipfile.BadZipFile, SyntaxError, zlib.error,
    NotImplementedError, RuntimeError, struct.error, lzma.LZMAError,
)  # fmt: skip


def _flaw(where: str, exc: BaseException) -> InputError:
    """A flaw in the file or member ``where`` names, as one ``InputError``."""
    if isinstance(exc, (NotImplementedError, RuntimeError, struct.error, lzma.LZMAError)):
        return InputError(f"{where} cannot be read ({_first_line(exc)})")
    return InputError(f"{where} {_first_line(exc)}")


@contextmanager
def _errors(where: str) -> Iterator[None]:
    """A flaw in the file or member ``where`` names as one ``InputError``."""
    try:
        yield
    except _FLAWS as exc:
        raise _flaw(where, exc) from None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _read_header(f: IO[bytes]) -> NpyHeader:
    """The header of the .npy stream ``f``, which is left at the array's first byte."""
    try:
        version = np.lib.format.read_magic(f)
    except ValueError:
        raise ValueError("is not an .npy array") from None
    if version not in ((1, 0), (2, 0)):
        raise ValueError(f"is .npy format {version[0]}.{version[1]}; save it with np.savez")
    read = np.lib.format.read_array_header_1_0
    if version == (2, 0):
        read = np.lib.format.read_array_header_2_0
    try:
        shape, fortran, dtype = read(f)
        return NpyHeader(tuple(int(d) for d in shape), np.dtype(dtype), bool(fortran))
    except _MALFORMED as exc:
        # numpy parses the header with Python's tokenizer and literal_eval: their errors.
        raise ValueError(f"has a malformed .npy header ({_first_line(exc)})") from None


def _stored_header(raw: IO[bytes], info: zipfile.ZipInfo) -> NpyHeader | None:
    """The header of an uncompressed member, with ``raw`` left at its data; None to leave
    the member to the zip reader."""
    raw.seek(info.header_offset)
    local = raw.read(_LOCAL.size)
    if len(local) != _LOCAL.size or local[:4] != b"PK\x03\x04":
        return None
    name_len, extra_len = _LOCAL.unpack(local)[-2:]
    raw.seek(info.header_offset + _LOCAL.size + name_len + extra_len)
    magic = raw.read(8)
    if magic[:6] != _NPY_MAGIC or magic[6:] not in (b"\x01\x00", b"\x02\x00"):
        return None  # not .npy, or format 3.0: the general path says which
    size_bytes = 2 if magic[6] == 1 else 4
    header = raw.read(size_bytes)
    header += raw.read(int.from_bytes(header, "little"))
    return _header(magic + header)


def _fill(f: IO[bytes], header: NpyHeader) -> npt.NDArray[Any]:
    """The array ``header`` describes, read from ``f`` into its own buffer."""
    # A Fortran-ordered array's bytes are its transpose's, in C order.
    shape = header.shape[::-1] if header.fortran else header.shape
    value = np.empty(shape, header.dtype)
    view = value.reshape(-1).view(np.uint8).data
    done = 0
    while done < len(view):
        # In slices: a zip member's readinto reads the whole request into bytes first.
        got = f.readinto(view[done : done + _SLICE])  # type: ignore[attr-defined]
        if not got:
            raise ValueError(f"is truncated: {done} of {len(view)} bytes of array data")
        done += got
    return value.T if header.fortran else value


@functools.lru_cache(maxsize=1024)
def _header(prefix: bytes) -> NpyHeader:
    """An .npy header, parsed; cached, since the arrays of one file mostly share a few
    headers and parsing one costs more than reading a small array."""
    return _read_header(io.BytesIO(prefix))
