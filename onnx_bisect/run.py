"""Running a backend with probes: memory-bounded chunks and an on-disk tensor cache.

The reference's probe values are needed twice, to compare against the target and to feed the
isolation model, so they are written to disk once and memory-mapped back: a model whose
activations exceed RAM can still be diagnosed within ``max_memory``.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import numpy.typing as npt
import onnx

from onnx_bisect.adapters.base import Backend, Tensors
from onnx_bisect.errors import BackendError
from onnx_bisect.model import TensorMeta

__all__ = ["RunStats", "TensorStore", "plan_chunks", "run_pair", "timed_run"]

log = logging.getLogger(__name__)

T = TypeVar("T")
U = TypeVar("U")


@dataclass
class RunStats:
    """Mutable tallies for the report: runs and seconds spent per backend role."""

    runs: dict[str, int] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)

    def record(self, role: str, seconds: float) -> None:
        self.runs[role] = self.runs.get(role, 0) + 1
        self.seconds[role] = self.seconds.get(role, 0.0) + seconds


def plan_chunks(
    names: Sequence[str], sizes: Mapping[str, int | None], budget: int
) -> list[list[str]]:
    """Split ``names`` (kept in order) into runs whose outputs fit ``budget`` bytes.

    A tensor of unknown size counts as the largest known one; one over budget runs alone.
    """
    known = [s for s in sizes.values() if s is not None]
    fallback = max(known) if known else 0
    chunks: list[list[str]] = []
    current: list[str] = []
    used = 0
    for name in names:
        size = sizes.get(name)
        size = fallback if size is None else size
        if current and used + size > budget:
            chunks.append(current)
            current, used = [], 0
        current.append(name)
        used += size
    if current:
        chunks.append(current)
    return chunks


class TensorStore:
    """Arrays kept as .npy files under a directory and read back memory-mapped, or kept in
    memory when ``directory`` is None (the caller decided they fit the budget)."""

    def __init__(self, directory: Path | None) -> None:
        self.directory = directory
        if directory is not None:
            directory.mkdir(parents=True, exist_ok=True)
        self._files: dict[str, Path] = {}
        self._arrays: dict[str, npt.NDArray[Any]] = {}
        self._meta: dict[str, TensorMeta] = {}
        self._count = 0

    def put(self, name: str, value: npt.NDArray[Any]) -> None:
        self._meta[name] = TensorMeta(np.dtype(value.dtype), tuple(value.shape))
        if self.directory is None:
            self._arrays[name] = value
            return
        safe = re.sub(r"[^\w.-]", "_", name)[:80]
        # A running counter, not len(): storing a name twice must not reuse another's file.
        self._count += 1
        path = self.directory / f"{self._count:06d}_{safe}.npy"
        np.save(path, np.asarray(value, order="C"), allow_pickle=False)  # keeps 0-d shapes
        self._files[name] = path

    def get(self, name: str) -> npt.NDArray[Any]:
        if name in self._arrays:
            return self._arrays[name]
        arr: npt.NDArray[Any] = np.load(self._files[name], mmap_mode="r", allow_pickle=False)
        return arr

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

    def subset(self, names: Sequence[str]) -> TensorStore:
        """A store that answers only for ``names``, sharing this one's arrays and files."""
        return self.view({n: n for n in names})

    def view(self, names: Mapping[str, str]) -> TensorStore:
        """A store answering under each key for the tensor its value names here (another
        model's name for the same tensor), sharing this one's arrays and files."""
        # What is put into a view stays in memory: its files would share names with ours.
        view = TensorStore(None)
        keep = {k: v for k, v in names.items() if v in self._meta}
        view._meta = {k: self._meta[v] for k, v in keep.items()}
        view._arrays = {k: self._arrays[v] for k, v in keep.items() if v in self._arrays}
        view._files = {k: self._files[v] for k, v in keep.items() if v in self._files}
        return view


def timed_run(
    backend: Backend,
    model: onnx.ModelProto,
    feeds: Mapping[str, npt.NDArray[Any]],
    role: str,
    stats: RunStats,
) -> Tensors:
    start = time.perf_counter()
    try:
        return backend.run(model, feeds)
    except BackendError as exc:
        who = "reference" if role == "ref" else role
        raise type(exc)(f"{who} failed: {exc}", node=exc.node, role=role) from exc
    finally:
        stats.record(role, time.perf_counter() - start)


def run_pair(
    ref_job: Callable[[], T], target_job: Callable[[], U], parallel: bool = True
) -> tuple[T, U]:
    """Run the reference's and the target's jobs, concurrently when ``parallel``.

    Runtimes release the GIL while compiling and running, so on two cores the pair costs about
    as much as the slower one. A reference failure is reported first: it is the trusted side.
    """
    if not parallel:
        return ref_job(), target_job()
    with ThreadPoolExecutor(max_workers=1) as pool:
        future = pool.submit(ref_job)
        try:
            target_value = target_job()
        except BaseException:
            future.result()  # raises the reference's error if it failed too
            raise
        return future.result(), target_value
