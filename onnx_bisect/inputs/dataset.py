"""A dataset: many inputs of one model, from a directory, a glob, or one .npz split in rows.

- A directory: its ``.npz``/``.npy`` files and ``test_data_set_*`` folders (an ONNX model
  zoo folder), in natural order (``x_2`` before ``x_10``).
- A glob (``'data/*.npz'``, quoted so that the shell leaves it alone): the files and test-case
  folders it matches, in the same order.
- One ``.npz`` file: its arrays share a leading axis, and row ``i`` is input ``i``. An array one
  rank above the model's input gives ``x[i]``; one of the model's own rank gives ``x[i:i+1]``, a
  batch of one (a stack of ``1×3×H×W`` images saved as ``N×3×H×W``).

One ``.npz`` given to ``inputs`` stays one input; ``dataset`` is what splits it. Every input
must fit the model and hold the same names, dtypes and shapes as the first: a dataset's
per-node statistics compare like with like.
"""

from __future__ import annotations

import functools
import glob
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy.typing as npt

from onnx_bisect.errors import InputError
from onnx_bisect.inputs.feeds import Feeds, load_feeds, validate_feeds
from onnx_bisect.inputs.limits import ByteLimit, check_finite
from onnx_bisect.inputs.npz import read_npz
from onnx_bisect.inputs.signature import InputSpec, format_dims

__all__ = ["DatasetItem", "check_dataset", "find_dataset", "load_item"]

_FILES = (".npz", ".npy")
_GLOB = re.compile(r"[*?\[]")


@dataclass(frozen=True)
class DatasetItem:
    """One input: a file or test-case folder, or row ``row`` of a split .npz."""

    path: Path
    row: int | None = None

    @property
    def label(self) -> str:
        return str(self.path) if self.row is None else f"{self.path}[{self.row}]"


def find_dataset(source: str | os.PathLike[str]) -> tuple[DatasetItem, ...]:
    """The inputs ``source`` names, in order; an ``InputError`` (option ``dataset``) when it
    names none."""
    text = str(source)
    path = Path(text)
    if path.is_dir():
        if any(path.glob("input_*.pb")):
            raise _error(
                f"{text} is one test case (input_N.pb files): give it to inputs, or give the "
                "folder that holds its test_data_set_* folders"
            )
        items = [p for p in path.iterdir() if _is_input(p)]
        if not items:
            raise _error(f"{text}: no .npz or .npy files and no test_data_set_* folders in it")
        return tuple(DatasetItem(p) for p in sorted(items, key=_natural))
    if path.is_file():
        if path.suffix != ".npz":
            raise _error(
                f"{text}: one file must be a .npz whose arrays share a leading axis (split "
                "into inputs); a directory or a quoted glob gives many files"
            )
        return tuple(DatasetItem(path, row) for row in range(_rows(path)))
    if not _GLOB.search(text):
        raise _error(f"{text}: no such file or directory")
    matched = [Path(p) for p in glob.glob(text)]
    items = [p for p in matched if _is_input(p) or (p.is_dir() and any(p.glob("input_*.pb")))]
    if not items:
        what = "matches nothing" if not matched else "matches no .npz, .npy or test-case folder"
        raise _error(f"{text} {what}")
    return tuple(DatasetItem(p) for p in sorted(items, key=_natural))


def load_item(
    item: DatasetItem,
    specs: Sequence[InputSpec],
    *,
    max_memory: int | None = None,
    allow_nonfinite: bool = False,
) -> Feeds:
    """One input's tensors, checked against the model's signature, read within
    ``max_memory`` and, unless ``allow_nonfinite``, finite."""
    try:
        if item.row is None:
            feeds = load_feeds(item.path, specs, limit=ByteLimit.here(max_memory))
        else:
            feeds = _row(_arrays(item.path), item.row, {s.name: s for s in specs})
        validate_feeds(feeds, specs)
        if not allow_nonfinite:
            check_finite(feeds, source="the given")
    except InputError as exc:
        message = str(exc).removeprefix(f"inputs {item.path}: ")
        raise _error(f"{item.label}: {message}") from None
    return feeds


def check_dataset(
    items: Sequence[DatasetItem],
    specs: Sequence[InputSpec],
    *,
    max_memory: int | None = None,
    allow_nonfinite: bool = False,
) -> None:
    """Every input loads, fits the model and has the first input's dtypes and shapes (see
    ``load_item`` for the rest)."""
    first: dict[str, tuple[str, tuple[int, ...]]] = {}
    for item in items:
        feeds = load_item(item, specs, max_memory=max_memory, allow_nonfinite=allow_nonfinite)
        got = {name: (str(a.dtype), tuple(a.shape)) for name, a in feeds.items()}
        if not first:
            first = got
            continue
        for name, (dtype, shape) in got.items():
            if (dtype, shape) != first[name]:
                want_dtype, want_shape = first[name]
                raise _error(
                    f"{item.label} gives {name!r} as {dtype} {_dims(shape)} but "
                    f"{items[0].label} as {want_dtype} {_dims(want_shape)}; every input of a "
                    "dataset has the same dtypes and shapes"
                )


def _is_input(path: Path) -> bool:
    if path.is_dir():
        return path.name.startswith("test_data_set_")
    return path.suffix in _FILES


def _natural(path: Path) -> list[Any]:
    """``x_2`` before ``x_10``: digit runs compare as numbers."""
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", str(path))]


def _rows(path: Path) -> int:
    arrays = _arrays(path)
    if not arrays:
        raise _error(f"{path}: holds no arrays")
    lengths = {name: (a.shape[0] if a.ndim else 0) for name, a in arrays.items()}
    if len(set(lengths.values())) != 1 or 0 in lengths.values():
        shown = ", ".join(f"{name}: {n}" for name, n in lengths.items())
        raise _error(
            f"{path}: the arrays' leading axes differ or are empty ({shown}); row i of every "
            "array is input i"
        )
    return next(iter(lengths.values()))


@functools.lru_cache(maxsize=1)
def _arrays(path: Path) -> Mapping[str, npt.NDArray[Any]]:
    """A split .npz read once per process (its rows are read one by one)."""
    try:
        return read_npz(path, what="dataset")
    except InputError as exc:  # as the dataset option's own error (--dataset on a command line)
        raise _error(str(exc).removeprefix("dataset ")) from None


def _row(arrays: Mapping[str, npt.NDArray[Any]], row: int, specs: Mapping[str, InputSpec]) -> Feeds:
    feeds: Feeds = {}
    for name, a in arrays.items():
        spec = specs.get(name)
        rank = len(spec.dims) if spec is not None else a.ndim - 1
        if a.ndim == rank + 1:
            feeds[name] = a[row]
        elif a.ndim == rank:
            feeds[name] = a[row : row + 1]
        else:
            dims = format_dims(spec.dims) if spec is not None else ""
            raise InputError(
                f"{name!r} has shape {_dims(a.shape)}, but the model's input is {dims}: its "
                f"leading axis indexes the inputs, so it needs rank {rank + 1} (a row per "
                f"input) or {rank} (a batch of one per row)"
            )
    return feeds


def _dims(shape: Sequence[int]) -> str:
    return "x".join(str(d) for d in shape) or "scalar"


def _error(message: str) -> InputError:
    return InputError(f"dataset {message}", option="dataset")
