"""The shape of a generated input: the user's, checked against the signature, or a default."""

from __future__ import annotations

import re
from collections.abc import Sequence

from onnx_bisect.errors import InputError
from onnx_bisect.inputs.signature import Dim, InputSpec, format_dims

__all__ = ["default_dim", "parse_shape", "resolve_shape"]

# Dynamic dims with these names are batch-like, and 1 is the answer nobody needs to type.
_BATCH = re.compile(r"^(n|b|bs|batch|batch_?size|batches|num_?batch(es)?|unk__\d+_batch)$", re.I)

# Polygraphy's --input-shapes form, ``images:[1,3,320,320]``; the name may hold colons.
_POLYGRAPHY = re.compile(r"(?P<name>.+):\[(?P<dims>[^\[\]]*)\]")


def parse_shape(text: str) -> tuple[str, tuple[int, ...]]:
    """``images=1x3x640x640`` (also ``,`` as separator) or Polygraphy's ``images:[1,3,640,640]``
    -> ("images", (1, 3, 640, 640)). ``x:[]`` is a scalar."""
    m = _POLYGRAPHY.fullmatch(text.strip())
    if m:
        name, dims = m["name"], m["dims"]
        if not dims.strip():
            return name, ()
    else:
        name, sep, dims = text.rpartition("=")
        if not sep or not name:
            raise InputError(
                f"shapes {text!r}: expected NAME=1x3x640x640 or NAME:[1,3,640,640]",
                option="shapes",
            )
    try:
        shape = tuple(int(d) for d in re.split(r"[x,]", dims.strip()))
    except ValueError:
        raise InputError(
            f"shapes {text!r}: dims must be integers, e.g. {name}=1x3x640x640", option="shapes"
        ) from None
    if any(d < 1 for d in shape):
        raise InputError(
            f"shapes {text!r}: dims must be >= 1 (where the model says -1 or 0, give the size)",
            option="shapes",
        )
    return name, shape


def default_dim(index: int, dim: Dim) -> int | None:
    """A dynamic dim's size when none is given: 1 for a batch, None where only the user can
    say. A batch is a dim named like one, or dim 0 without a name (-1, 0 or nothing in the
    file): exporters leave the batch unnamed far more often than a sequence or an image side,
    and a wrong 1 there still runs, where a wrong 1 for an image side breaks a Conv."""
    if isinstance(dim, int):
        return dim
    if (dim is None and index == 0) or (isinstance(dim, str) and _BATCH.match(dim)):
        return 1
    return None


def resolve_shape(spec: InputSpec, given: Sequence[int] | None) -> tuple[int, ...]:
    """``given`` checked against the fixed dims and the rank, else the defaults; dynamic dims
    without a default are an error that shows the shape to give."""
    if given is not None:
        if len(given) != len(spec.dims):
            raise InputError(
                f"shapes {spec.name}: rank {len(given)} but the model's input has rank "
                f"{len(spec.dims)} {format_dims(spec.dims)}",
                option="shapes",
            )
        for i, (want, got) in enumerate(zip(spec.dims, given, strict=True)):
            if isinstance(want, int) and want != got:
                raise InputError(
                    f"shapes {spec.name}: dim {i} is {got} but the model fixes it to {want}",
                    option="shapes",
                )
        return tuple(given)
    shape = [default_dim(i, d) for i, d in enumerate(spec.dims)]
    unset = [
        f"dim {i} ({d!r})" if d else f"dim {i} (unnamed)"
        for i, (d, s) in enumerate(zip(spec.dims, shape, strict=True))
        if s is None
    ]
    if unset:
        example = "x".join("?" if s is None else str(s) for s in shape)
        raise InputError(
            f"shapes: input {spec.name!r} {format_dims(spec.dims)} has dynamic "
            f"{', '.join(unset)}; give its shape, e.g. {spec.name}={example}",
            option="shapes",
        )
    return tuple(s for s in shape if s is not None)
