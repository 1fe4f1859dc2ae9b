"""``TensorStore``: the reference's tensors, in memory or in files mapped back.

The reference's probe values are needed twice, to compare against the target and to feed
isolation, so beyond the memory budget they are written to disk once and mapped back: packed
back to back into files of about ``PACK_BYTES`` (a file per tensor cost seconds to write and
half a minute to delete on a model of 10,000 tensors).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from onnx_bisect.graph.view import TensorMeta

__all__ = ["PACK_BYTES", "TensorStore"]

# A file of values is closed, and the next begun, past this size: a file is mapped whole on
# use, so this bounds what one mapping holds resident.
PACK_BYTES = 32 << 20
# Values start at multiples of this, so that every view of a mapped file is aligned.
_ALIGN = 64


class TensorStore:
    """Arrays packed into files under a directory and read back memory-mapped, or kept in
    memory when ``directory`` is None (the caller decided they fit the budget)."""

    def __init__(self, directory: Path | None) -> None:
        self.directory = directory
        if directory is not None:
            directory.mkdir(parents=True, exist_ok=True)
        self._files: dict[str, Path] = {}
        self._arrays: dict[str, npt.NDArray[Any]] = {}
        self._meta: dict[str, TensorMeta] = {}
        self._packed: dict[str, tuple[Path, int]] = {}
        self._maps: OrderedDict[Path, npt.NDArray[np.uint8]] = OrderedDict()
        self._count = 0
        self._size = PACK_BYTES  # of the file being filled; none is yet

    def put(self, name: str, value: npt.NDArray[Any]) -> None:
        self._meta[name] = TensorMeta(np.dtype(value.dtype), tuple(value.shape))
        array = np.asarray(value, order="C")  # ascontiguousarray would make 0-d 1-d
        if self.directory is None or array.dtype.hasobject:  # strings have no raw bytes
            self._arrays[name] = value
            return
        if self._size >= PACK_BYTES:
            self._begin_file()
        path = self.directory / f"values{self._count:05d}.bin"
        offset = -(-self._size // _ALIGN) * _ALIGN
        # Opened per value, not held open: nothing to close, and what is written is in the
        # file before the next lookup maps it.
        with path.open("ab") as f:
            f.write(b"\0" * (offset - self._size))
            f.write(array.reshape(-1).view(np.uint8).data)
        self._size = offset + array.nbytes
        self._files.pop(name, None)  # a value stored again answers for the name
        self._arrays.pop(name, None)
        self._packed[name] = (path, offset)

    def _begin_file(self) -> None:
        """The next file, made here and new: another store of the same name (a second
        session over the same scratch folder) may have its own files in the directory, and
        appending to one of them would put our values past the offsets we note."""
        assert self.directory is not None
        while True:
            self._count += 1
            try:
                (self.directory / f"values{self._count:05d}.bin").open("xb").close()
            except FileExistsError:
                continue
            self._size = 0
            return

    def adopt(self, name: str, path: Path, meta: TensorMeta, offset: int | None = None) -> None:
        """``path``, an .npy file written elsewhere (the float64 oracle's process), as the
        value of ``name``: mapped on use like our own files, never copied. With ``offset``,
        ``path`` packs many values as raw bytes and this one starts there: the file is mapped
        once for all of them (a file per tensor cost an open and a map per lookup, and as
        long to delete: 20,000 of them took minutes on this machine)."""
        self._meta[name] = meta
        if offset is None:
            self._files[name] = path
        else:
            self._packed[name] = (path, offset)

    def get(self, name: str) -> npt.NDArray[Any]:
        if name in self._arrays:
            return self._arrays[name]
        if name in self._packed:
            return self._unpacked(name)
        arr: npt.NDArray[Any] = np.load(self._files[name], mmap_mode="r", allow_pickle=False)
        return arr

    def _unpacked(self, name: str) -> npt.NDArray[Any]:
        path, offset = self._packed[name]
        m = self._meta[name]
        size = self.nbytes(name)
        if not size:  # an empty file cannot be mapped
            return np.empty(m.shape, m.dtype)
        whole = self._maps.get(path)
        if whole is None or whole.nbytes < offset + size:  # mapped before this value was put
            # A plain ndarray over the map: views of a memmap run Python code each.
            self._maps.pop(path, None)
            whole = self._maps[path] = np.asarray(np.memmap(path, np.uint8, mode="r"))
            _evict(self._maps)
        else:
            self._maps.move_to_end(path)
        return whole[offset : offset + size].view(m.dtype).reshape(m.shape)

    def meta(self, name: str) -> TensorMeta:
        return self._meta[name]

    def nbytes(self, name: str) -> int:
        m = self._meta[name]
        return int(np.prod(m.shape, dtype=np.int64)) * m.dtype.itemsize

    def __contains__(self, name: object) -> bool:
        return name in self._meta

    @property
    def metas(self) -> Mapping[str, TensorMeta]:
        return self._meta

    def view(self, names: Mapping[str, str]) -> TensorStore:
        """A store answering under each key for the tensor its value names here (another
        model's name for the same tensor), sharing this one's arrays and files."""
        # What is put into a view stays in memory: its files would share names with ours.
        view = TensorStore(None)
        keep = {k: v for k, v in names.items() if v in self._meta}
        view._meta = {k: self._meta[v] for k, v in keep.items()}
        view._arrays = {k: self._arrays[v] for k, v in keep.items() if v in self._arrays}
        view._files = {k: self._files[v] for k, v in keep.items() if v in self._files}
        view._packed = {k: self._packed[v] for k, v in keep.items() if v in self._packed}
        view._maps = self._maps
        return view


# Bytes of packed files kept mapped, the most recently used first. A map keeps every page read
# through it resident until it is dropped; unbounded, a scan that reads every float64 value
# would hold all of them (twice the model's activations), whatever the memory budget.
MAPPED_BYTES = 64 << 20


def _evict(maps: OrderedDict[Path, npt.NDArray[np.uint8]]) -> None:
    """Drop the least recently used maps past ``MAPPED_BYTES``, never the newest (views
    handed out keep theirs alive until they go)."""
    while len(maps) > 1 and sum(m.nbytes for m in maps.values()) > MAPPED_BYTES:
        maps.popitem(last=False)
