"""Input tensors for a run: generated from the model's signature, or loaded from files; and
validated against the signature before any backend sees them."""

from __future__ import annotations

import math
import re
import zipfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import onnx

from onnx_bisect.errors import InputError
from onnx_bisect.inputs.limits import ByteLimit, check_finite, nbytes
from onnx_bisect.inputs.npz import npz_headers, read_npy, read_npz, regular_file
from onnx_bisect.inputs.shapes import parse_shape, resolve_shape
from onnx_bisect.inputs.signature import Dim, InputSpec, format_dims, input_specs
from onnx_bisect.inputs.tensorpb import read_tensor_pb
from onnx_bisect.inputs.values import Ranges, Values, draw, fills_for

# Dim, InputSpec, input_specs and parse_shape are re-exported: callers import them from here.
__all__ = [
    "Dim",
    "InputSpec",
    "check_signature",
    "generate_feeds",
    "input_specs",
    "load_feeds",
    "make_feeds",
    "parse_shape",
    "save_npz",
    "validate_feeds",
]

Feeds = dict[str, npt.NDArray[np.generic]]


def generate_feeds(
    specs: Sequence[InputSpec],
    shapes: Mapping[str, Sequence[int]] | None = None,
    seed: int = 0,
    *,
    values: Values | None = None,
    ranges: Ranges | None = None,
    limit: ByteLimit | None = None,
) -> Feeds:
    """Seeded inputs: each input holds its dtype's default values (``values.default_fill``),
    or the constant ``values[name]``, or values in ``ranges[name]``; their bytes are checked
    against ``limit`` (default: what the machine has) before any is drawn."""
    shapes = dict(shapes or {})
    unknown = sorted(set(shapes) - {s.name for s in specs})
    if unknown:
        raise InputError(
            f"shapes names unknown input(s) {', '.join(unknown)}; model inputs are "
            f"{', '.join(s.name for s in specs)}",
            option="shapes",
        )
    fills = fills_for(specs, values, ranges)
    resolved = {spec.name: resolve_shape(spec, shapes.get(spec.name)) for spec in specs}
    for spec in specs:
        if fills[spec.name] is None:
            raise InputError(
                f"input {spec.name!r} has dtype {spec.dtype}, which cannot be generated"
            )
    sizes = {s.name: nbytes(resolved[s.name], s.dtype) for s in specs}
    largest = max(specs, key=lambda s: sizes[s.name], default=None)
    if largest is not None:
        shown = "x".join(str(d) for d in resolved[largest.name]) or "scalar"
        what = f"the generated inputs (the largest, {largest.name!r}: {shown} {largest.dtype})"
        (limit or ByteLimit.here(None)).check(
            what, sum(sizes.values()), fix="give smaller shapes (--shape)"
        )
    rng = np.random.default_rng(seed)
    feeds: Feeds = {}
    for spec in specs:
        fill = fills[spec.name]
        assert fill is not None  # checked above
        feeds[spec.name] = draw(rng, spec.dtype, resolved[spec.name], fill)
    return feeds


def load_feeds(path: Path, specs: Sequence[InputSpec], *, limit: ByteLimit | None = None) -> Feeds:
    """Inputs from .npz (keyed by input name), .npy (single-input models) or a test-case dir.
    Headers come first: names, dtypes, shapes and bytes (against ``limit``, default what the
    machine has) are checked before any array is read."""
    limit = limit or ByteLimit.here(None)
    if not path.exists():
        raise InputError(f"inputs {path}: no such file or directory", option="inputs")
    if path.is_dir():
        return _load_pb_dir(path, specs, limit)
    if path.suffix == ".npz":
        headers = npz_headers(path)
        check_signature({k: (h.dtype, h.shape) for k, h in headers.items()}, specs)
        limit.check(f"inputs {path}", sum(h.nbytes for h in headers.values()))
        return read_npz(path, limit=limit)
    if path.suffix == ".npy":
        if len(specs) != 1:
            names = ", ".join(s.name for s in specs)
            raise InputError(
                f"inputs {path}: a .npy holds one tensor but the model has {len(specs)} "
                f"inputs ({names}); use a .npz keyed by input name",
                option="inputs",
            )
        return {specs[0].name: read_npy(path, limit=limit)}
    raise InputError(
        f"inputs {path}: expected .npz, .npy or a directory of input_N.pb files", option="inputs"
    )


def _load_pb_dir(path: Path, specs: Sequence[InputSpec], limit: ByteLimit) -> Feeds:
    sets = sorted(path.glob("test_data_set_*"))
    data_dir = sets[0] if sets and not list(path.glob("input_*.pb")) else path
    files = sorted(data_dir.glob("input_*.pb"), key=lambda p: int(re.sub(r"\D", "", p.stem) or 0))
    if not files:
        raise InputError(f"inputs {path}: no input_N.pb files found", option="inputs")
    total = sum(regular_file(f, "inputs") for f in files)
    limit.check(f"inputs {data_dir}", total)
    feeds: Feeds = {}
    for i, f in enumerate(files):
        name, value = read_tensor_pb(f, limit=limit)
        feeds[name or (specs[i].name if i < len(specs) else f.stem)] = value
    return feeds


def validate_feeds(
    feeds: Mapping[str, npt.NDArray[np.generic]], specs: Sequence[InputSpec]
) -> None:
    """Names, rank, static dims and dtype, checked before any backend sees the data."""
    arrays = {name: np.asarray(value) for name, value in feeds.items()}
    check_signature({k: (a.dtype, a.shape) for k, a in arrays.items()}, specs)


def check_signature(
    given: Mapping[str, tuple[np.dtype[Any], tuple[int, ...]]], specs: Sequence[InputSpec]
) -> None:
    """Names, rank, static dims and dtype of inputs (by name: dtype and shape), which may not
    be read yet: an .npz is checked from its headers."""
    names = {s.name for s in specs}
    extra = sorted(set(given) - names)
    missing = sorted(names - set(given))
    if extra or missing:
        parts = []
        if extra:
            parts.append(f"unknown input(s) {', '.join(extra)}")
        if missing:
            parts.append(f"missing input(s) {', '.join(missing)}")
        raise InputError("; ".join(parts) + f"; the model's inputs are {', '.join(sorted(names))}")
    for spec in specs:
        dtype, shape = given[spec.name]
        if dtype != spec.dtype:
            raise InputError(
                f"input {spec.name!r} has dtype {dtype} but the model expects {spec.dtype}; "
                f"cast it (e.g. arr.astype(np.{spec.dtype}))"
            )
        if len(shape) != len(spec.dims):
            raise InputError(
                f"input {spec.name!r} has shape {tuple(shape)} (rank {len(shape)}) but the model "
                f"expects rank {len(spec.dims)} {format_dims(spec.dims)}"
            )
        for i, (want, got) in enumerate(zip(spec.dims, shape, strict=True)):
            if isinstance(want, int) and want != got:
                raise InputError(
                    f"input {spec.name!r} has shape {tuple(shape)} but dim {i} must be {want} "
                    f"{format_dims(spec.dims)}"
                )


def make_feeds(
    model: onnx.ModelProto,
    *,
    inputs: Path | Mapping[str, npt.NDArray[np.generic]] | None = None,
    shapes: Mapping[str, Sequence[int]] | None = None,
    seed: int = 0,
    values: Values | None = None,
    ranges: Ranges | None = None,
    max_memory: int | None = None,
    allow_nonfinite: bool = False,
) -> Feeds:
    """The feeds a run uses: loaded or given when ``inputs`` is set, else generated; validated,
    their bytes within ``max_memory`` and what the machine has before any is made or read,
    and NaN or Inf refused unless ``allow_nonfinite``."""
    specs = input_specs(model)
    if inputs is not None and shapes:
        raise InputError(
            "shapes: for generated inputs only, and the inputs are given; they keep their own "
            "shapes (leave shapes out)",
            option="shapes",
        )
    if inputs is not None and (values or ranges):
        # Given inputs must hold every input (see validate_feeds), so nothing is left to fill.
        named = ", ".join(sorted({*(values or {}), *(ranges or {})}))
        raise InputError(
            f"a constant value or range (for {named}) applies to generated inputs only, and "
            "these inputs are given; put the values in the given inputs instead"
        )
    limit = ByteLimit.here(max_memory)
    if inputs is None:
        if not allow_nonfinite:
            _finite_values(values)
        feeds = generate_feeds(specs, shapes, seed, values=values, ranges=ranges, limit=limit)
    elif isinstance(inputs, Path):
        feeds = load_feeds(inputs, specs, limit=limit)
    else:
        feeds = {k: np.asarray(v) for k, v in inputs.items()}
    validate_feeds(feeds, specs)
    if not allow_nonfinite:
        check_finite(feeds, source="the given" if inputs is not None else "the generated")
    return feeds


def _finite_values(values: Values | None) -> None:
    """A constant NaN or Inf, refused before anything is drawn (see ``check_finite``)."""
    for name, value in (values or {}).items():
        if isinstance(value, float) and not math.isfinite(value):
            raise InputError(
                f"values: {name}={value} is not finite, which hides any divergence (NaN is "
                "unequal to itself, an infinity swallows any error); give a finite value, or "
                "pass --allow-nonfinite (allow_nonfinite=True) to diagnose it anyway",
                option="values",
            )


def save_npz(path: str | Path, tensors: Mapping[str, npt.ArrayLike]) -> None:
    """Write tensors keyed by name, readable by ``np.load``; any name round-trips.

    Public as ``onnx_bisect.save_npz``, for an ``exec:`` runtime's wrapper to write its
    ``outputs.npz`` with (docs/exec-protocol.md).

    Written entry by entry rather than through ``np.savez(**tensors)``, whose keyword arguments
    would swallow tensors named ``file`` or ``allow_pickle``.
    """
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_STORED, allowZip64=True) as zf:
        for name, value in tensors.items():
            with zf.open(f"{name}.npy", "w", force_zip64=True) as f:
                np.lib.format.write_array(f, np.asarray(value), allow_pickle=False)
