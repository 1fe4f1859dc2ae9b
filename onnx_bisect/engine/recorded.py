"""The feeds of a run: the user's inputs, else those a backend recorded (a dump holds the
inputs it was made with, and comparing it on other inputs would be noise), else generated."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy.typing as npt
import onnx

from onnx_bisect.backends.protocol import Backend, Tensors
from onnx_bisect.errors import InputError
from onnx_bisect.inputs.feeds import Feeds, input_specs, make_feeds, validate_feeds
from onnx_bisect.options import BisectOptions

__all__ = ["option_feeds", "run_feeds"]


def run_feeds(
    model: onnx.ModelProto,
    backends: Sequence[Backend],
    *,
    inputs: str | Path | Mapping[str, npt.NDArray[Any]] | None = None,
    shapes: Mapping[str, Sequence[int]] | None = None,
    values: Mapping[str, float] | None = None,
    ranges: Mapping[str, tuple[float, float]] | None = None,
    seed: int = 0,
    max_memory: int | None = None,
    allow_nonfinite: bool = False,
) -> Feeds:
    """Given ``inputs``; else the first of ``backends`` that recorded its inputs; else
    generated from ``shapes``, ``values``, ``ranges`` and ``seed`` (checked against
    ``max_memory`` first; see ``make_feeds`` for ``allow_nonfinite``)."""
    checks: dict[str, Any] = {"max_memory": max_memory, "allow_nonfinite": allow_nonfinite}
    if inputs is None:
        for backend in backends:
            recorded = backend.recorded_inputs()
            if recorded is not None:
                return _recorded_feeds(
                    model, backend.spec.text, recorded, shapes, values, ranges, checks
                )
    return make_feeds(
        model,
        inputs=Path(inputs) if isinstance(inputs, str) else inputs,
        shapes=shapes,
        seed=seed,
        values=values,
        ranges=ranges,
        **checks,
    )


def _recorded_feeds(
    model: onnx.ModelProto,
    source: str,
    recorded: Tensors,
    shapes: Mapping[str, Sequence[int]] | None,
    values: Mapping[str, float] | None,
    ranges: Mapping[str, tuple[float, float]] | None,
    checks: Mapping[str, Any],
) -> Feeds:
    """The recorded inputs, which must fit the model; a ``--shape`` must agree with them (it
    then says nothing new), and a value or range cannot be checked, so it is refused."""
    try:
        validate_feeds(recorded, input_specs(model))
    except InputError as exc:
        raise InputError(
            f"{source} does not fit this model: {exc} (a dump of another model? dump this one "
            "with onnx-bisect dump MODEL --backend SPEC --out DIR)"
        ) from None
    for name, shape in (shapes or {}).items():
        got = tuple(recorded[name].shape) if name in recorded else None
        if got != tuple(shape):
            held = "no such input" if got is None else f"it holds {_dims(got)}"
            raise InputError(
                f"--shape {name}={_dims(shape)} disagrees with the inputs recorded in {source} "
                f"({held}); a dump answers only for the inputs it was made with: drop --shape, "
                "or dump again with it"
            )
    if values or ranges:
        named = ", ".join(sorted({*(values or {}), *(ranges or {})}))
        raise InputError(
            f"--value/--range (for {named}) apply to generated inputs, and {source} holds the "
            "inputs it was made with: drop them, or dump again with them"
        )
    return make_feeds(model, inputs=recorded, **checks)


def _dims(shape: Sequence[int]) -> str:
    return "x".join(str(d) for d in shape)


def option_feeds(
    model: onnx.ModelProto, backends: Sequence[Backend], options: BisectOptions
) -> Feeds:
    """``run_feeds`` with the inputs' options of a diagnosis (a PyTorch reference's too)."""
    return run_feeds(
        model,
        backends,
        inputs=options.inputs,
        shapes=options.shapes,
        seed=options.seed,
        values=options.values,
        ranges=options.ranges,
        max_memory=options.max_memory,
        allow_nonfinite=options.allow_nonfinite,
    )
