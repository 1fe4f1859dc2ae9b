"""In the float64 oracle's process: one job, the probes in float64 and fp32, values to files.

Run by the loop of ``oracle/child.py``; the parent (``oracle/float64.py``) reads the answer.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import numpy.typing as npt
import onnx

from onnx_bisect.backends.protocol import Backend, BackendBase, Tensors, streams
from onnx_bisect.backends.registry import create_backend
from onnx_bisect.backends.torch.backend import TorchBackend
from onnx_bisect.compare.noise import fp32_noise
from onnx_bisect.engine.oracle.pins import pinned_values
from onnx_bisect.errors import BackendError
from onnx_bisect.graph.extract import with_outputs
from onnx_bisect.graph.weights import read_model

__all__ = ["ORACLE", "TWIN", "precision_floors", "run_job"]


def _threads() -> int:
    """Half the cores this process may use: the oracle runs beside the screen's runtimes, and
    an OpenMP team larger than the free cores makes every small op wait for it (a 64x16
    float64 MatMul took 8 ms on two busy cores with two threads, 5 us with one)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        cores = os.cpu_count() or 2
    return max(1, cores // 2)


# The oracle the child runs, and its fp32 twin. ``fallback=1``: a node torch cannot compute is
# computed alone another way (``backends/torch/stand_in.py``), the rest stays on torch.
ORACLE = f"torch:cpu?dtype=float64&threads={_threads()}&fallback=1"
TWIN = f"torch:cpu?threads={_threads()}&fallback=1"


def run_job(job: Mapping[str, Any]) -> dict[str, Any]:
    """In the child: the probes of ``job["chunks"]`` in float64 and fp32, values to files.

    Returns what the parent needs, as JSON: each value's file, offset, dtype and shape; the fp32
    twin's noise per tensor; the oracle's description and notes; each run's seconds.
    """
    # Written by ``save_for_child``: the weights stay in the user's files (onnx.load would
    # read them all, and refuses a weight file with two links as a "hardlink attack").
    model = read_model(Path(job["model"]), own=True)
    with np.load(job["feeds"], allow_pickle=False) as data:
        feeds = {k: data[k] for k in data.files}
    backend = create_backend(ORACLE)
    fp32 = create_backend(TWIN)
    out_dir = Path(job["out"])
    out_dir.mkdir(parents=True, exist_ok=True)
    seconds: list[float] = []
    floors: tuple[dict[str, float], dict[str, float]] = ({}, {})
    if streams(backend) and streams(fp32):
        marked = with_outputs(model, [name for chunk in job["chunks"] for name in chunk])
        files, noise = _streamed(backend, fp32, marked, feeds, out_dir, seconds)
        if job.get("precision"):
            start = time.perf_counter()
            floors = precision_floors(model, marked, feeds, _Reader(files).get, job["precision"])
            seconds.append(time.perf_counter() - start)
    else:
        files, noise = _chunked(backend, fp32, model, feeds, job["chunks"], out_dir, seconds)
    return {
        "files": files,
        "noise": noise,
        "precision_noise": floors[0],
        "precision_isolated": floors[1],
        "describe": backend.describe(),
        "notes": oracle_notes(backend, fp32),
        "inexact": inexact(backend),
        "seconds": seconds,
    }


Placed = dict[str, tuple[str, int, str, list[int]]]


def oracle_notes(*backends: Backend) -> list[str]:
    """The oracle's notes, each once (its fp32 twin computes the same nodes by stand-ins);
    torch's (the nodes it computed by stand-ins) said to be the oracle's, not the target's."""
    from onnx_bisect.backends.torch.backend import TorchBackend

    notes = [
        f"float64 oracle: {n}" if isinstance(b, TorchBackend) else n
        for b in backends
        if isinstance(b, BackendBase)
        for n in b.notes()
    ]
    return list(dict.fromkeys(notes))


def inexact(backend: Backend) -> list[str]:
    """The tensors the float64 oracle computed without a float64 value: a node torch could
    not compute and only ONNX Runtime could, in float32 (``stand_in.StandIn.exact``)."""
    from onnx_bisect.backends.torch.backend import TorchBackend

    if not isinstance(backend, TorchBackend):
        return []
    return [o for s in backend.stand_ins.values() if not s.exact for o in s.outputs]


def precision_floors(
    model: onnx.ModelProto,
    marked: onnx.ModelProto,
    feeds: Mapping[str, npt.NDArray[Any]],
    float64: Callable[[str], npt.NDArray[Any]],
    precision: str,
) -> tuple[dict[str, float], dict[str, float]]:
    """The error ``precision`` itself predicts, per tensor, against the float64 values: the
    faithful twin's accumulated error over the whole run (``marked``'s outputs), and each
    node's isolated error when fed exact operands (``backends/torch/floors.py``)."""
    from onnx_bisect.backends.torch.floors import isolated_floors
    from onnx_bisect.backends.torch.numerics import intra_op_threads

    twin = create_backend(f"torch:cpu?round={precision}&threads={_threads()}&fallback=1")
    accumulated: dict[str, float] = {}

    def take(name: str, value: npt.NDArray[Any]) -> None:
        measured = fp32_noise(float64(name), value)
        if measured is not None:
            accumulated[name] = measured

    if not streams(twin):
        raise BackendError("the faithful lower-precision twin needs torch")
    twin.stream(marked, feeds, take)
    with intra_op_threads(_threads()):
        isolated = isolated_floors(model, feeds, precision)
    return accumulated, isolated


def _streamed(
    backend: BackendBase,
    fp32: BackendBase,
    marked: onnx.ModelProto,
    feeds: Tensors,
    out_dir: Path,
    seconds: list[float],
) -> tuple[Placed, dict[str, float]]:
    """Every probe in one float64 run, each value written as it comes, then one fp32 run,
    each value compared with its float64 one as it comes: one value held at a time."""
    packer = _Packer(out_dir)
    start = time.perf_counter()
    pins = pinned_values(marked)
    if pins and isinstance(backend, TorchBackend):
        # Integers as float32 computes them: see ``oracle/pins.py``.
        pinned = fp32.run(with_outputs(marked, pins), feeds)
        backend.stream_pinned(marked, feeds, packer.put, pinned)
    else:
        backend.stream(marked, feeds, packer.put)
    seconds.append(time.perf_counter() - start)
    packer.close()
    reader = _Reader(packer.placed)
    noise: dict[str, float] = {}

    def twin(name: str, single: npt.NDArray[Any]) -> None:
        measured = fp32_noise(reader.get(name), single)
        if measured is not None:
            noise[name] = measured

    start = time.perf_counter()
    fp32.stream(marked, feeds, twin)
    seconds.append(time.perf_counter() - start)
    return packer.placed, noise


def _chunked(
    backend: Backend,
    fp32: Backend,
    model: onnx.ModelProto,
    feeds: Tensors,
    chunks: list[list[str]],
    out_dir: Path,
    seconds: list[float],
) -> tuple[Placed, dict[str, float]]:
    """The probes chunk by chunk (a chunk fits the memory plan in float64), the float64
    values written and dropped before the twin runs."""
    files: Placed = {}
    noise: dict[str, float] = {}
    for index, chunk in enumerate(chunks):
        marked = with_outputs(model, chunk)
        out = _timed(backend, marked, feeds, seconds)
        placed = _pack(out_dir / f"chunk{index:04d}.bin", {name: out[name] for name in chunk})
        files |= placed
        del out
        out32 = _timed(fp32, marked, feeds, seconds)
        reader = _Reader(placed)
        for name in chunk:
            single = out32.get(name)
            measured = None if single is None else fp32_noise(reader.get(name), single)
            if measured is not None:
                noise[name] = measured
    return files, noise


def _timed(
    backend: Backend, model: onnx.ModelProto, feeds: Tensors, seconds: list[float]
) -> Tensors:
    start = time.perf_counter()
    out = backend.run(model, feeds)
    seconds.append(time.perf_counter() - start)
    return out


# Values start at multiples of this, so that every view of the mapped file is aligned.
_ALIGN = 64

# A file of values is closed, and the next begun, past this size: the parent maps a file whole
# (``TensorStore.adopt``), so this bounds what one mapping holds resident, while a file per
# tensor would cost minutes to open and delete on models of 20,000 small tensors.
PACK_BYTES = 32 << 20


class _Packer:
    """Values written back to back into files of about ``PACK_BYTES`` (raw, C order,
    aligned), as they come; ``placed`` says where each is."""

    def __init__(self, out_dir: Path) -> None:
        self.out_dir = out_dir
        self.placed: Placed = {}
        self._file: BinaryIO | None = None
        self._count = 0

    def put(self, name: str, value: npt.NDArray[Any]) -> None:
        if self._file is None or self._file.tell() >= PACK_BYTES:
            self.close()
            self._file = open(self.out_dir / f"values{self._count:05d}.bin", "wb")  # noqa: SIM115
            self._count += 1
        self.placed[name] = _write(self._file, value)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def _write(f: BinaryIO, value: npt.NDArray[Any]) -> tuple[str, int, str, list[int]]:
    array = np.asarray(value, order="C")  # ascontiguousarray would make 0-d 1-d
    offset = -(-f.tell() // _ALIGN) * _ALIGN
    f.write(b"\0" * (offset - f.tell()))
    f.write(array.reshape(-1).view(np.uint8).data)
    return (f.name, offset, array.dtype.str, list(array.shape))


def _pack(path: Path, values: Mapping[str, Any]) -> Placed:
    """``values`` back to back in one file; per value its file, offset, dtype and shape."""
    with open(path, "wb") as f:
        return {name: _write(f, value) for name, value in values.items()}


class _Reader:
    """Values written by ``_Packer`` or ``_pack``, read back through a map of one file at a
    time (the one asked for last), so that no more than a file is resident."""

    def __init__(self, placed: Placed) -> None:
        self.placed = placed
        self._path: str | None = None
        self._map: npt.NDArray[np.uint8] | None = None

    def get(self, name: str) -> npt.NDArray[Any]:
        path, offset, dtype, shape = self.placed[name]
        size = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        if not size:  # an empty file cannot be mapped
            return np.empty(shape, dtype)
        if path != self._path or self._map is None:
            self._map, self._path = np.asarray(np.memmap(path, np.uint8, mode="r")), path
        return self._map[offset : offset + size].view(dtype).reshape(shape)
