"""Weights in external files: left on disk, addressed by absolute path while in memory.

A loaded model never holds external data in its message (``resolve_locations`` turns each
``location`` into the file's absolute path instead), so a model with gigabytes of weights is a
message of a few kB: it can be copied, cut, marked and serialized like any other, and protobuf's
2 GB limit never comes near. The files are touched only where bytes are needed:

- a runtime that reads a file gets one written by ``place_weights`` with ``link=True``: the
  weight files shared next to it (runtimes refuse absolute paths, ``..`` and symlinks alike).
  Never by a hard link to the user's file: onnx refuses a weight file with two links as a
  "hardlink attack", so the user's own ``onnx.load`` would fail while one existed. The file is
  cloned where the file system can (copy-on-write: no byte copied), else copied once per
  process into ``weights_cache`` and each run hard-links that private copy;
- this package's own child processes get the model with absolute locations (``read_model``
  with ``own=True``): nothing placed at all;
- a bundle that must travel gets ``link=False``: the bytes of the tensors it uses, copied;
- in-process evaluators read values with ``tensor_array`` or ``with_loaded_weights``.
"""

from __future__ import annotations

import atexit
import logging
import os
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy.typing as npt
import onnx
from onnx import numpy_helper

from onnx_bisect.errors import ModelLoadError
from onnx_bisect.leftovers import RUN_PREFIX

__all__ = [
    "ExternalRef",
    "LINK_MIN_BYTES",
    "all_tensors",
    "external_ref",
    "has_external",
    "is_external",
    "place_weights",
    "read_model",
    "relative_locations",
    "resolve_locations",
    "tensor_array",
    "weights_cache",
    "with_loaded_weights",
]

log = logging.getLogger(__name__)

# Copied data starts on this boundary, so that a runtime may map each tensor.
_ALIGN = 4096
# Below this many bytes of external weights in all a run gets a copy of the tensors it uses
# instead of shared files: the copy costs nothing worth saving, and a plain file of one link is
# what ``onnx.load`` accepts (it refuses a file with two links as a "hardlink attack"). In all,
# not per file: an exporter's file per tensor (2 GB in 400 files of under 64 MiB) was copied
# whole at every run of the whole model, 4-12 s each.
LINK_MIN_BYTES = 64 << 20
_COPY_CHUNK = 64 << 20


def all_tensors(model: onnx.ModelProto) -> Iterator[onnx.TensorProto]:
    """Every TensorProto of the model: initializers, sparse ones' values and indices,
    attribute tensors, in the graph, its subgraphs and the model's functions."""
    yield from _graph_tensors(model.graph)
    for fn in model.functions:
        for node in fn.node:
            yield from _node_tensors(node)


def _graph_tensors(graph: onnx.GraphProto) -> Iterator[onnx.TensorProto]:
    yield from graph.initializer
    for sparse in graph.sparse_initializer:
        yield from (sparse.values, sparse.indices)
    for node in graph.node:
        yield from _node_tensors(node)


def _node_tensors(node: onnx.NodeProto) -> Iterator[onnx.TensorProto]:
    for attr in node.attribute:
        if attr.HasField("t"):
            yield attr.t
        yield from attr.tensors
        if attr.HasField("sparse_tensor"):
            yield from (attr.sparse_tensor.values, attr.sparse_tensor.indices)
        if attr.HasField("g"):
            yield from _graph_tensors(attr.g)
        for g in attr.graphs:
            yield from _graph_tensors(g)


def is_external(t: onnx.TensorProto) -> bool:
    return t.data_location == onnx.TensorProto.EXTERNAL


def has_external(model: onnx.ModelProto) -> bool:
    return any(is_external(t) for t in all_tensors(model))


@dataclass(frozen=True)
class ExternalRef:
    """Where an external tensor's bytes are: ``path`` as stored (absolute once resolved)."""

    path: Path
    offset: int
    length: int


def external_ref(t: onnx.TensorProto) -> ExternalRef:
    """The tensor's file, offset and length; a length left out means the rest of the file
    (as ``onnx.load`` reads it) and is filled in from the file's size."""
    info = {e.key: e.value for e in t.external_data}
    path = Path(info.get("location", ""))
    offset = int(info.get("offset") or 0)
    length = info.get("length")
    if length is None:
        return ExternalRef(path, offset, max(0, path.stat().st_size - offset))
    return ExternalRef(path, offset, int(length))


def _set_ref(t: onnx.TensorProto, location: str, offset: int, length: int) -> None:
    # A recorded basepath would no longer hold; a checksum of the same bytes still does.
    replaced = ("location", "offset", "length", "basepath")
    kept = [e for e in t.external_data if e.key not in replaced]
    del t.external_data[:]
    t.external_data.add(key="location", value=location)
    t.external_data.add(key="offset", value=str(offset))
    t.external_data.add(key="length", value=str(length))
    t.external_data.extend(kept)


def resolve_locations(
    model: onnx.ModelProto, base: Path, source: str, *, absolute_ok: bool = False
) -> None:
    """In place: every external tensor's location made absolute against ``base`` (the model
    file's directory), after checking that it stays inside ``base`` and that its bytes are
    there. ``source`` names the model in the error: a missing or short weight file fails
    here, in one line, not in a runtime. ``absolute_ok``: an absolute location is taken as it
    is (in a file this package wrote for its own child; see ``read_model``)."""
    for t in all_tensors(model):
        if not is_external(t):
            continue
        location = next((e.value for e in t.external_data if e.key == "location"), "")
        if not location:
            raise ModelLoadError(f"{source}: tensor {t.name!r} is external but names no file")
        path = (base / location).resolve()
        if absolute_ok and Path(location).is_absolute():
            pass  # where the parent found it: the user's file, checked when it was loaded
        elif not path.is_relative_to(base.resolve()):
            # The rule every runtime applies (ONNX Runtime, OpenVINO, tract): a model may not
            # point at files outside its directory, by path or by symlink.
            raise ModelLoadError(
                f"{source}: tensor {t.name!r} is stored in {location}, outside the model's "
                "directory; move the weight file next to the model"
            )
        if not path.is_file():
            raise ModelLoadError(
                f"{source}: cannot load external data: tensor {t.name!r} is stored in "
                f"{location}, which is not a file next to the model ({path})"
            )
        for entry in t.external_data:
            if entry.key == "location":
                entry.value = str(path)
    _check_extents(model, source)


def read_model(path: Path, *, own: bool = False) -> onnx.ModelProto:
    """The model file at ``path`` with its external weights located, not read: for a child
    process handed a model this package wrote (whose weight files may be hard links, which
    ``onnx.load`` refuses as a "hardlink attack").

    ``own``: the file was written by this package for its own child (``save_for_child``), so
    its absolute locations (the user's weight files, where the parent found them) are kept;
    otherwise every location must lie beside the model, as runtimes require."""
    model = onnx.load(str(path), load_external_data=False)
    # Relative ones too: weights held in the message that were too large for it, spilled.
    resolve_locations(model, path.parent, str(path), absolute_ok=own)
    return model


def _check_extents(model: onnx.ModelProto, source: str) -> None:
    for t in all_tensors(model):
        if not is_external(t):
            continue
        ref = external_ref(t)
        size = ref.path.stat().st_size
        if ref.offset + ref.length > size:
            raise ModelLoadError(
                f"{source}: cannot load external data: tensor {t.name!r} needs bytes "
                f"{ref.offset}..{ref.offset + ref.length} of {ref.path.name}, which has {size}"
            )


def _read(ref: ExternalRef) -> bytes:
    with ref.path.open("rb") as f:
        f.seek(ref.offset)
        data = f.read(ref.length)
    if len(data) != ref.length:
        raise ModelLoadError(f"{ref.path}: ended after {len(data)} of {ref.length} bytes")
    return data


def _loaded(t: onnx.TensorProto) -> onnx.TensorProto:
    """A copy of ``t`` with its external bytes read into ``raw_data``."""
    out = onnx.TensorProto()
    out.CopyFrom(t)
    if is_external(t):
        out.raw_data = _read(external_ref(t))
        del out.external_data[:]
        out.data_location = onnx.TensorProto.DEFAULT
    return out


def tensor_array(t: onnx.TensorProto) -> npt.NDArray[Any]:
    """The tensor's value, read from its file when it is external (the location resolved)."""
    return numpy_helper.to_array(_loaded(t) if is_external(t) else t)


def with_loaded_weights(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy holding every external tensor's bytes, for an evaluator that reads the message
    (onnx.reference); the model itself is returned when nothing is external."""
    if not has_external(model):
        return model
    out = onnx.ModelProto()
    out.CopyFrom(model)
    for t in all_tensors(out):
        if is_external(t):
            t.CopyFrom(_loaded(t))
    return out


def relative_locations(model: onnx.ModelProto) -> tuple[onnx.ModelProto, Path] | None:
    """A copy whose external locations are relative to one directory, and that directory:
    what ONNX Runtime takes with a model given as bytes. None when nothing is external."""
    paths = {external_ref(t).path for t in all_tensors(model) if is_external(t)}
    if not paths:
        return None
    folder = Path(os.path.commonpath([str(p.parent) for p in paths]))
    out = onnx.ModelProto()
    out.CopyFrom(model)
    for t in all_tensors(out):
        if is_external(t):
            ref = external_ref(t)
            _set_ref(t, str(ref.path.relative_to(folder)), ref.offset, ref.length)
    return out, folder


def place_weights(
    model: onnx.ModelProto, directory: Path, name: str, *, link: bool
) -> onnx.ModelProto:
    """A copy of ``model`` to be written as ``directory/name``, its external tensors in files
    beside it (``name.data``, ``name.1.data``, ... one per source file), located relatively.

    ``link``: share the source files when the model uses ``LINK_MIN_BYTES`` or more of them
    in all (``_share``: a clone, or a hard link to this process's private copy, never a link to
    the user's file); where that fails (another device), for less, or without ``link``, the
    bytes of the tensors this model uses are copied.
    """
    if not has_external(model):
        return model
    out = onnx.ModelProto()
    out.CopyFrom(model)
    groups: dict[Path, list[onnx.TensorProto]] = {}
    for t in all_tensors(out):
        if is_external(t):
            groups.setdefault(external_ref(t).path, []).append(t)
    used = sum(external_ref(t).length for tensors in groups.values() for t in tensors)
    for i, (source, tensors) in enumerate(groups.items()):
        target = directory / (f"{name}.data" if i == 0 else f"{name}.{i}.data")
        if link and used >= LINK_MIN_BYTES and _share(source, target):
            for t in tensors:
                ref = external_ref(t)
                _set_ref(t, target.name, ref.offset, ref.length)
            continue
        with target.open("wb") as f:
            for t in tensors:
                ref = external_ref(t)
                f.write(b"\0" * (-f.tell() % _ALIGN))
                start = f.tell()
                _copy_range(ref, f)
                _set_ref(t, target.name, start, ref.length)
    return out


def _share(source: Path, target: Path) -> bool:
    """``target`` made to hold ``source``'s bytes without copying them per run and without
    adding a link to ``source``: a copy-on-write clone, or a hard link to the private copy."""
    if _clone(source, target):
        return True
    copy = weights_cache().copy_of(source)
    if copy is None:
        return False
    try:
        os.link(copy, target)
    except OSError as exc:
        _warn_copy(source, target.parent, exc)
        return False
    return True


_warned_copy = False


def _warn_copy(source: Path, directory: Path, exc: OSError) -> None:
    global _warned_copy
    if not _warned_copy:
        _warned_copy = True
        log.warning(
            "cannot link the copy of %s into %s (%s): the weights each run uses are copied; "
            "a TMPDIR on one file system avoids that",
            source,
            directory,
            exc.strerror or exc,
        )


# Linux's FICLONE ioctl: the destination shares the source's extents (btrfs, XFS, bcachefs).
_FICLONE = 0x40049409


def _clone(source: Path, target: Path) -> bool:
    if not sys.platform.startswith("linux"):
        return False
    import fcntl

    try:
        with source.open("rb") as src, target.open("wb") as dst:
            fcntl.ioctl(dst.fileno(), _FICLONE, src.fileno())
    except OSError:
        target.unlink(missing_ok=True)
        return False
    return True


class WeightsCache:
    """Private copies of the user's weight files, one per file, made the first time a runtime
    needs a file that cannot be cloned. Within a command's temporary folder (the console
    scripts make one: ``leftovers.run_temp_dir``) they are kept in its ``weights/``, which the
    command's child processes share (it is their ``TMPDIR``: a sandboxed OpenVINO copies
    nothing again) and which goes with the folder, a killed command's with the next one's
    sweep; elsewhere, in a folder of this process's, removed at exit."""

    def __init__(self) -> None:
        self._own: Path | None = None
        self._failed: set[Path] = set()
        self._lock = threading.Lock()

    def copy_of(self, source: Path) -> Path | None:
        """The copy of ``source`` (made now if there is none), or None when none can be made."""
        with self._lock:
            if source in self._failed:
                return None
            st = source.stat()
            folder = self._folder()
            # Named by the file's identity and version: an edited file gets a new copy.
            target = folder / f"{st.st_dev}-{st.st_ino}-{st.st_size}-{st.st_mtime_ns}.data"
            if target.exists() or self._copy(source, target):
                return target
            self._failed.add(source)
            return None

    def _folder(self) -> Path:
        here = Path(tempfile.gettempdir())
        if here.name.startswith(RUN_PREFIX):
            shared = here / "weights"
            shared.mkdir(exist_ok=True)
            return shared
        if self._own is None or not self._own.is_dir():
            if self._own is None:
                atexit.register(self.clear)
            self._own = Path(tempfile.mkdtemp(prefix="onnx-bisect-weights-"))
        return self._own

    @staticmethod
    def _copy(source: Path, target: Path) -> bool:
        # Written under another name and renamed: a child copying the same file meanwhile
        # never links half of one.
        partial = target.with_name(f".{target.name}.{os.getpid()}-{threading.get_ident()}")
        start = time.perf_counter()
        try:
            _copy_file(source, partial)
            os.replace(partial, target)
        except OSError as exc:
            partial.unlink(missing_ok=True)
            log.warning("cannot copy %s into %s: %s", source, target.parent, exc.strerror or exc)
            return False
        log.info(
            "weights %s copied once for file-reading runtimes (%.1f GB, %.1f s): this file "
            "system cannot clone, and a hard link would make onnx refuse the user's model",
            source,
            target.stat().st_size / 1e9,
            time.perf_counter() - start,
        )
        return True

    def clear(self) -> None:
        """Remove this process's own copies (a command's shared ones go with its folder)."""
        with self._lock:
            if self._own is not None:
                shutil.rmtree(self._own, ignore_errors=True)
            self._own = None
            self._failed.clear()


_cache = WeightsCache()


def weights_cache() -> WeightsCache:
    return _cache


def _copy_file(source: Path, target: Path) -> None:
    """``source``'s bytes into a new ``target``, in the kernel (``copy_file_range``), its
    holes left holes: a sparse weight file (a test's, a preallocated export) costs nothing."""
    if not hasattr(os, "copy_file_range") or not hasattr(os, "SEEK_DATA"):
        shutil.copyfile(source, target)  # macOS clones in copyfile where it can
        return
    with source.open("rb") as src, target.open("wb") as dst:
        size = os.fstat(src.fileno()).st_size
        offset = 0
        while offset < size:
            try:
                start = os.lseek(src.fileno(), offset, os.SEEK_DATA)
            except OSError:  # ENXIO: only a hole is left
                break
            end = os.lseek(src.fileno(), start, os.SEEK_HOLE)
            while start < end:
                copied = os.copy_file_range(src.fileno(), dst.fileno(), end - start, start, start)
                if copied == 0:
                    raise OSError(f"{source}: ended at byte {start} of {size}")
                start += copied
            offset = end
        dst.truncate(size)


def _copy_range(ref: ExternalRef, dest: BinaryIO) -> None:
    with ref.path.open("rb") as src:
        src.seek(ref.offset)
        left = ref.length
        while left:
            chunk = src.read(min(left, _COPY_CHUNK))
            if not chunk:
                raise ModelLoadError(f"{ref.path}: ended {left} bytes early")
            dest.write(chunk)
            left -= len(chunk)
