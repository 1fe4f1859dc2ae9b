"""What an input may cost before it is made or read: its bytes against ``max_memory`` and the
machine, and its values finite.

A shape typed by hand (``--shape images=1x3x100000x100000``) or a header written by anyone
(an .npy's, a TensorProto's dims) says how many bytes reading it takes; numpy would allocate
them first and fail after (224 GiB for that shape). So each is checked from its header,
before any byte of it is allocated.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from onnx_bisect.errors import InputError

__all__ = ["ByteLimit", "check_finite", "machine_memory", "nbytes", "nonfinite_notes"]

# Elements checked for NaN/Inf at a time: a bool mask of a whole input would be a quarter of
# its float32 bytes again.
_FINITE_BLOCK = 1 << 20


def machine_memory() -> int | None:
    """Bytes this machine can give now (MemAvailable), else its physical memory; None where
    neither is known."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def nbytes(shape: Iterable[int], dtype: np.dtype[Any]) -> int:
    """Bytes of an array of ``shape`` and ``dtype``, exact (Python ints do not overflow)."""
    return math.prod(int(d) for d in shape) * dtype.itemsize


@dataclass(frozen=True)
class ByteLimit:
    """The most bytes one run's inputs may take: ``max_memory`` (None: no budget given) and
    what the machine has (None: unknown), whichever is less."""

    budget: int | None = None
    machine: int | None = None

    @classmethod
    def here(cls, budget: int | None) -> ByteLimit:
        return cls(budget, machine_memory())

    @property
    def bytes(self) -> int | None:
        known = [b for b in (self.budget, self.machine) if b is not None]
        return min(known) if known else None

    def check(self, what: str, size: int, *, fix: str = "give smaller inputs") -> None:
        """An ``InputError`` naming ``what`` when ``size`` bytes are over the limit."""
        limit = self.bytes
        if limit is None or size <= limit:
            return
        if self.budget is not None and limit == self.budget:
            raise InputError(
                f"max_memory {self.budget} cannot hold {what}, {size} bytes ({_size(size)}); "
                f"{fix}, or more memory",
                option="max_memory",
            )
        raise InputError(
            f"{what} would take {_size(size)}, more than this machine has free "
            f"({_size(limit)}); {fix}"
        )


def check_finite(feeds: Mapping[str, npt.NDArray[Any]], *, source: str) -> None:
    """An ``InputError`` for the first input holding NaN or Inf: NaN compares unequal to
    itself and an infinity swallows any error, so such inputs hide divergences."""
    for name, value in feeds.items():
        nan, inf = _nonfinite(value)
        if nan or inf:
            raise InputError(
                f"{source} input {name!r} holds {'NaN' if nan else 'Inf'}, which hides any "
                "divergence (NaN is unequal to itself, an infinity swallows any error); give "
                "finite values, or pass --allow-nonfinite (allow_nonfinite=True) to diagnose "
                "them anyway"
            )


def nonfinite_notes(feeds: Mapping[str, npt.NDArray[Any]]) -> list[str]:
    """A note per input holding NaN or Inf (where ``allow_nonfinite`` let them through): how
    many elements, and that the metrics leave them out, so that "agrees" is read rightly."""
    notes = []
    for name, value in feeds.items():
        nan, inf = _nonfinite(value)
        if nan or inf:
            notes.append(
                f"input {name!r} holds {nan} NaN and {inf} Inf of {np.asarray(value).size} "
                "elements (allowed): the metrics compare the elements finite in both, and NaN "
                "or Inf on one side only is a divergence of its own"
            )
    return notes


def _nonfinite(value: npt.NDArray[Any]) -> tuple[int, int]:
    """How many NaN and how many infinities ``value`` holds, counted block by block."""
    arr = np.asarray(value)
    if not np.issubdtype(arr.dtype, np.inexact):
        return 0, 0
    flat, nan, inf = arr.reshape(-1), 0, 0
    for start in range(0, flat.size, _FINITE_BLOCK):
        block = flat[start : start + _FINITE_BLOCK]
        nan += int(np.count_nonzero(np.isnan(block)))
        inf += int(np.count_nonzero(np.isinf(block)))
    return nan, inf


def _size(n: int) -> str:
    for unit, name in ((1 << 40, "TiB"), (1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB")):
        if n >= unit:
            return f"{n / unit:.3g} {name}"
    return f"{n} bytes"
