"""Input tensors: seeded generation from the model signature, loading from files, validation."""

from __future__ import annotations

import re
import zipfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt
import onnx
from onnx import helper, numpy_helper

from onnx_bisect.errors import InputError

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


Dim = int | str | None


# Dynamic dims with these names are batch-like, and 1 is the answer nobody needs to type.
_BATCH = re.compile(r"^(n|b|bs|batch|batch_?size|batches|num_?batch(es)?|unk__\d+_batch)$", re.I)


@dataclass(frozen=True)
class InputSpec:
    name: str
    dtype: np.dtype[np.generic]
    dims: tuple[Dim, ...]


def input_specs(model: onnx.ModelProto) -> list[InputSpec]:
    inits = {t.name for t in model.graph.initializer}
    specs = []
    for vi in model.graph.input:
        if vi.name in inits:
            continue
        tt = vi.type.tensor_type
        if not vi.type.HasField("tensor_type"):
            raise InputError(f"input {vi.name!r} is not a tensor; only tensor inputs are supported")
        dtype = np.dtype(helper.tensor_dtype_to_np_dtype(tt.elem_type))
        dims: tuple[Dim, ...] = tuple(
            d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in tt.shape.dim
        )
        specs.append(InputSpec(vi.name, dtype, dims))
    return specs


def parse_shape(text: str) -> tuple[str, tuple[int, ...]]:
    """``images=1x3x640x640`` (also ``,`` as separator) -> ("images", (1, 3, 640, 640))."""
    name, sep, dims = text.rpartition("=")
    if not sep or not name:
        raise InputError(f"--shape {text!r}: expected NAME=1x3x640x640")
    try:
        shape = tuple(int(d) for d in re.split(r"[x,]", dims.strip()))
    except ValueError:
        raise InputError(
            f"--shape {text!r}: dims must be integers, e.g. {name}=1x3x640x640"
        ) from None
    if any(d < 0 for d in shape):
        raise InputError(f"--shape {text!r}: dims must be >= 0")
    return name, shape


def _resolve_shape(spec: InputSpec, given: Sequence[int] | None) -> tuple[int, ...]:
    if given is not None:
        if len(given) != len(spec.dims):
            raise InputError(
                f"--shape {spec.name}: rank {len(given)} but the model's input has rank "
                f"{len(spec.dims)} {_fmt_dims(spec.dims)}"
            )
        for i, (want, got) in enumerate(zip(spec.dims, given, strict=True)):
            if isinstance(want, int) and want != got:
                raise InputError(
                    f"--shape {spec.name}: dim {i} is {got} but the model fixes it to {want}"
                )
        return tuple(given)
    shape: list[int] = []
    unset: list[str] = []
    for i, d in enumerate(spec.dims):
        if isinstance(d, int):
            shape.append(d)
        elif isinstance(d, str) and _BATCH.match(d):
            shape.append(1)
        else:
            unset.append(f"dim {i} ({d!r})" if d else f"dim {i} (unnamed)")
            shape.append(-1)
    if unset:
        example = "x".join(str(s) if s >= 0 else "?" for s in shape)
        raise InputError(
            f"input {spec.name!r} {_fmt_dims(spec.dims)} has dynamic {', '.join(unset)}; "
            f"set them with --shape {spec.name}={example}"
        )
    return tuple(shape)


def _fmt_dims(dims: Sequence[Dim]) -> str:
    return "[" + ", ".join("?" if d is None else str(d) for d in dims) + "]"


def generate_feeds(
    specs: Sequence[InputSpec], shapes: Mapping[str, Sequence[int]] | None = None, seed: int = 0
) -> Feeds:
    """Seeded random inputs. Floats are uniform in [0, 1): image-like and safe for log/sqrt.
    Integers are small non-negative values (valid indices and token ids for most models)."""
    shapes = dict(shapes or {})
    unknown = sorted(set(shapes) - {s.name for s in specs})
    if unknown:
        raise InputError(
            f"--shape names unknown input(s) {', '.join(unknown)}; model inputs are "
            f"{', '.join(s.name for s in specs)}"
        )
    rng = np.random.default_rng(seed)
    feeds: Feeds = {}
    for spec in specs:
        shape = _resolve_shape(spec, shapes.get(spec.name))
        dt = spec.dtype
        if dt == np.bool_:
            feeds[spec.name] = rng.random(shape) < 0.5
        elif np.issubdtype(dt, np.integer):
            # Byte types are pixels or quantized values and use their full range.
            lo, hi = 0, 10
            if dt.itemsize == 1:
                info = np.iinfo(dt.type)  # type: ignore[type-var]
                lo, hi = int(info.min), int(info.max) + 1
            feeds[spec.name] = rng.integers(lo, hi, size=shape).astype(dt)
        elif np.issubdtype(dt, np.floating):
            values = rng.random(shape, dtype=np.float64).astype(dt)
            # Rounding to a narrow float can reach 1.0; keep the promised [0, 1).
            below_one = np.nextafter(dt.type(1), dt.type(0))
            feeds[spec.name] = np.minimum(values, below_one)
        else:
            raise InputError(f"input {spec.name!r} has dtype {dt}, which cannot be generated")
    return feeds


def load_feeds(path: Path, specs: Sequence[InputSpec]) -> Feeds:
    """Inputs from .npz (keyed by input name), .npy (single-input models) or a test-case dir."""
    if not path.exists():
        raise InputError(f"--input {path}: no such file or directory")
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
                    f"--input {path}: a .npy holds one tensor but the model has {len(specs)} "
                    f"inputs ({names}); use a .npz keyed by input name"
                )
            return {specs[0].name: np.load(path, allow_pickle=False)}
    except InputError:
        raise
    except Exception as exc:
        raise InputError(f"--input {path}: cannot read ({str(exc).splitlines()[0]})") from exc
    raise InputError(f"--input {path}: expected .npz, .npy or a directory of input_N.pb files")


def _load_pb_dir(path: Path, specs: Sequence[InputSpec]) -> Feeds:
    sets = sorted(path.glob("test_data_set_*"))
    data_dir = sets[0] if sets and not list(path.glob("input_*.pb")) else path
    files = sorted(data_dir.glob("input_*.pb"), key=lambda p: int(re.sub(r"\D", "", p.stem) or 0))
    if not files:
        raise InputError(f"--input {path}: no input_N.pb files found")
    feeds: Feeds = {}
    for i, f in enumerate(files):
        t = onnx.TensorProto()
        try:
            t.ParseFromString(f.read_bytes())
        except Exception as exc:
            raise InputError(f"--input {f}: not a TensorProto ({exc})") from exc
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
                f"expects rank {len(spec.dims)} {_fmt_dims(spec.dims)}"
            )
        for i, (want, got) in enumerate(zip(spec.dims, arr.shape, strict=True)):
            if isinstance(want, int) and want != got:
                raise InputError(
                    f"input {spec.name!r} has shape {tuple(arr.shape)} but dim {i} must be {want} "
                    f"{_fmt_dims(spec.dims)}"
                )


def make_feeds(
    model: onnx.ModelProto,
    *,
    inputs: Path | Mapping[str, npt.NDArray[np.generic]] | None = None,
    shapes: Mapping[str, Sequence[int]] | None = None,
    seed: int = 0,
) -> Feeds:
    """The feeds a run uses: loaded or given when ``inputs`` is set, else generated; validated."""
    specs = input_specs(model)
    if inputs is not None and shapes:
        raise InputError(
            "--shape applies to generated inputs only; the shapes of --input tensors are used "
            "as they are (drop --shape)"
        )
    if inputs is None:
        feeds = generate_feeds(specs, shapes, seed)
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
