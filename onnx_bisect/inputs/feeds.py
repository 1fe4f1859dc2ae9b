"""Input tensors for a run: generated from the model's signature, or loaded from files; and
validated against the signature before any backend sees them."""

from __future__ import annotations

import re
import zipfile
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import numpy.typing as npt
import onnx
from onnx import numpy_helper

from onnx_bisect.errors import InputError
from onnx_bisect.inputs.shapes import parse_shape, resolve_shape
from onnx_bisect.inputs.signature import Dim, InputSpec, format_dims, input_specs
from onnx_bisect.inputs.values import Ranges, Values, draw, fills_for

# Dim, InputSpec, input_specs and parse_shape are re-exported: callers import them from here.
__all__ = [
    "Dim",
    "InputSpec",
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
) -> Feeds:
    """Seeded inputs: each input holds its dtype's default values (``values.default_fill``),
    or the constant ``values[name]``, or values in ``ranges[name]``."""
    shapes = dict(shapes or {})
    unknown = sorted(set(shapes) - {s.name for s in specs})
    if unknown:
        raise InputError(
            f"shapes names unknown input(s) {', '.join(unknown)}; model inputs are "
            f"{', '.join(s.name for s in specs)}",
            option="shapes",
        )
    fills = fills_for(specs, values, ranges)
    rng = np.random.default_rng(seed)
    feeds: Feeds = {}
    for spec in specs:
        shape = resolve_shape(spec, shapes.get(spec.name))
        fill = fills[spec.name]
        if fill is None:
            raise InputError(
                f"input {spec.name!r} has dtype {spec.dtype}, which cannot be generated"
            )
        feeds[spec.name] = draw(rng, spec.dtype, shape, fill)
    return feeds


def load_feeds(path: Path, specs: Sequence[InputSpec]) -> Feeds:
    """Inputs from .npz (keyed by input name), .npy (single-input models) or a test-case dir."""
    if not path.exists():
        raise InputError(f"inputs {path}: no such file or directory", option="inputs")
    if path.is_dir():
        return _load_pb_dir(path, specs)
    try:
        if path.suffix == ".npz":
            with np.load(path, allow_pickle=False) as z:
                return {k: z[k] for k in z.files}
        if path.suffix == ".npy":
            if len(specs) != 1:
                names = ", ".join(s.name for s in specs)
                raise InputError(
                    f"inputs {path}: a .npy holds one tensor but the model has {len(specs)} "
                    f"inputs ({names}); use a .npz keyed by input name",
                    option="inputs",
                )
            return {specs[0].name: np.load(path, allow_pickle=False)}
    except InputError:
        raise
    except Exception as exc:
        first = str(exc).splitlines()[0]
        raise InputError(f"inputs {path}: cannot read ({first})", option="inputs") from exc
    raise InputError(
        f"inputs {path}: expected .npz, .npy or a directory of input_N.pb files", option="inputs"
    )


def _load_pb_dir(path: Path, specs: Sequence[InputSpec]) -> Feeds:
    sets = sorted(path.glob("test_data_set_*"))
    data_dir = sets[0] if sets and not list(path.glob("input_*.pb")) else path
    files = sorted(data_dir.glob("input_*.pb"), key=lambda p: int(re.sub(r"\D", "", p.stem) or 0))
    if not files:
        raise InputError(f"inputs {path}: no input_N.pb files found", option="inputs")
    feeds: Feeds = {}
    for i, f in enumerate(files):
        t = onnx.TensorProto()
        try:
            t.ParseFromString(f.read_bytes())
        except Exception as exc:
            raise InputError(f"inputs {f}: not a TensorProto ({exc})", option="inputs") from exc
        name = t.name or (specs[i].name if i < len(specs) else f.stem)
        feeds[name] = numpy_helper.to_array(t)
    return feeds


def validate_feeds(
    feeds: Mapping[str, npt.NDArray[np.generic]], specs: Sequence[InputSpec]
) -> None:
    """Names, rank, static dims and dtype, checked before any backend sees the data."""
    names = {s.name for s in specs}
    extra = sorted(set(feeds) - names)
    missing = sorted(names - set(feeds))
    if extra or missing:
        parts = []
        if extra:
            parts.append(f"unknown input(s) {', '.join(extra)}")
        if missing:
            parts.append(f"missing input(s) {', '.join(missing)}")
        raise InputError("; ".join(parts) + f"; the model's inputs are {', '.join(sorted(names))}")
    for spec in specs:
        arr = np.asarray(feeds[spec.name])
        if arr.dtype != spec.dtype:
            raise InputError(
                f"input {spec.name!r} has dtype {arr.dtype} but the model expects {spec.dtype}; "
                f"cast it (e.g. arr.astype(np.{spec.dtype}))"
            )
        if arr.ndim != len(spec.dims):
            raise InputError(
                f"input {spec.name!r} has shape {tuple(arr.shape)} (rank {arr.ndim}) but the model "
                f"expects rank {len(spec.dims)} {format_dims(spec.dims)}"
            )
        for i, (want, got) in enumerate(zip(spec.dims, arr.shape, strict=True)):
            if isinstance(want, int) and want != got:
                raise InputError(
                    f"input {spec.name!r} has shape {tuple(arr.shape)} but dim {i} must be {want} "
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
) -> Feeds:
    """The feeds a run uses: loaded or given when ``inputs`` is set, else generated; validated."""
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
    if inputs is None:
        feeds = generate_feeds(specs, shapes, seed, values=values, ranges=ranges)
    elif isinstance(inputs, Path):
        feeds = load_feeds(inputs, specs)
    else:
        feeds = {k: np.asarray(v) for k, v in inputs.items()}
    validate_feeds(feeds, specs)
    return feeds


def save_npz(path: Path, tensors: Mapping[str, npt.NDArray[np.generic]]) -> None:
    """Write tensors keyed by name, readable by ``np.load``; any name round-trips.

    Written entry by entry rather than through ``np.savez(**tensors)``, whose keyword arguments
    would swallow tensors named ``file`` or ``allow_pickle``.
    """
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_STORED, allowZip64=True) as zf:
        for name, value in tensors.items():
            with zf.open(f"{name}.npy", "w", force_zip64=True) as f:
                np.lib.format.write_array(f, np.asarray(value), allow_pickle=False)
