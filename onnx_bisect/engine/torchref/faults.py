"""Typical export faults a PyTorch side can show, named (pure, numpy): the ONNX model's inputs
against the module's forward inputs (the factory's example inputs) in dtype, layout (NCHW
against NHWC) and scale (0–1 against 0–255): ``preprocessing``; and weights the export
captured that the module holds otherwise at run time (an initializer named after a parameter
or buffer whose value differs: captured at export time, changed since)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import permutations
from typing import Any

import numpy as np
import numpy.typing as npt

from onnx_bisect.compare.metrics import rel_l2

__all__ = ["Changed", "Preprocessing", "changed_weights", "preprocessing"]

Array = npt.NDArray[Any]
# An 8-bit image's range against a normalized one: a largest |value| above WIDE is 0–255, one
# up to NARROW is 0–1 or normalized by a mean and standard deviation.
WIDE = 16.0
NARROW = 4.0
# An initializer within this rel_l2 of the module's tensor is the same value (a float16 or a
# folded copy rounds it).
SAME = 1e-6


@dataclass(frozen=True)
class Preprocessing:
    """What the ONNX inputs and the module's forward inputs disagree on, a line each, and the
    axis order that turns each ONNX input into the module's layout (absent: as it is)."""

    said: tuple[str, ...]
    layouts: Mapping[str, tuple[int, ...]]


def preprocessing(
    names: Sequence[str], feeds: Mapping[str, Array], example: Sequence[Array]
) -> Preprocessing:
    """The ONNX inputs ``names`` (as fed) against the module's example inputs, by position."""
    said: list[str] = []
    layouts: dict[str, tuple[int, ...]] = {}
    for name, mine in zip(names, example, strict=False):
        fed = np.asarray(feeds[name])
        if fed.dtype.kind != mine.dtype.kind:
            said.append(
                f"preprocessing: dtype: the ONNX model takes {name} as {fed.dtype}, the module "
                f"{mine.dtype}"
            )
        order = _layout(fed.shape, mine.shape)
        if order is not None:
            layouts[name] = order
            said.append(
                f"preprocessing: layout: the ONNX model takes {name} as {_shape(fed.shape)} "
                f"({_axes(order, fed.ndim)}), the module as {_shape(mine.shape)}: the module "
                "was fed it transposed"
            )
        scale = _scale(fed, mine)
        if scale:
            said.append(f"preprocessing: scale: {name} is {scale}")
    return Preprocessing(tuple(said), layouts)


def _layout(onnx_shape: tuple[int, ...], module_shape: tuple[int, ...]) -> tuple[int, ...] | None:
    """The axis order that makes ``onnx_shape`` ``module_shape``, where the two differ and
    one order does (a channel axis moved: NHWC against NCHW)."""
    if onnx_shape == module_shape or sorted(onnx_shape) != sorted(module_shape):
        return None
    if len(onnx_shape) > 6:
        return None
    for order in permutations(range(len(onnx_shape))):
        if tuple(onnx_shape[i] for i in order) == tuple(module_shape):
            return order
    return None


def _axes(order: tuple[int, ...], ndim: int) -> str:
    """NHWC against NCHW in words, for a 4-d image; the axis order otherwise."""
    if ndim == 4 and order == (0, 3, 1, 2):
        return "NHWC; the module's NCHW"
    if ndim == 4 and order == (0, 2, 3, 1):
        return "NCHW; the module's NHWC"
    return f"axes {list(order)} in the module's order"


def _scale(fed: Array, mine: Array) -> str:
    """0–255 against 0–1 (either way), from the largest |value| of each: the inputs fed and
    the module's example."""
    if fed.dtype.kind not in "fiu" or mine.dtype.kind not in "fiu" or not fed.size or not mine.size:
        return ""
    top_fed = float(np.max(np.abs(fed.astype(np.float64))))
    top_mine = float(np.max(np.abs(mine.astype(np.float64))))
    if top_fed > WIDE and top_mine <= NARROW:
        return (
            f"fed up to {top_fed:g} (0–255), the module's example inputs up to {top_mine:g} "
            "(0–1 or normalized): the ONNX model is fed values the module was not made for"
        )
    if top_mine > WIDE and top_fed <= NARROW:
        return (
            f"fed up to {top_fed:g} (0–1 or normalized), the module's example inputs up to "
            f"{top_mine:g} (0–255): the ONNX model is fed values the module was not made for"
        )
    return ""


def _shape(shape: tuple[int, ...]) -> str:
    return "(" + ", ".join(str(d) for d in shape) + ")"


@dataclass(frozen=True)
class Changed:
    """An initializer that stands for a module's parameter or buffer (``state``, its key)
    and holds another value than the module does at run time."""

    initializer: str
    state: str
    rel_l2: float

    @property
    def said(self) -> str:
        return f"the module's {self.state}, rel_l2={self.rel_l2:.3g}"


def changed_weights(
    initializers: Mapping[str, Array],
    state: Mapping[str, Array],
    owners: Mapping[str, set[str]],
) -> list[Changed]:
    """The initializers that stand for a module's parameter or buffer and whose value differs
    from the module's at run time (the export captured an older value). An initializer stands
    for one by its name (``blocks.0.norm.weight``), else, renamed (``onnx::MatMul_41``), as
    the one tensor of the same or the transposed shape among the parameters of the module
    whose nodes read it (``owners``: the module paths of its readers)."""
    found = []
    for name, value in initializers.items():
        if value.dtype.kind != "f":
            continue
        key, forms = _owned(name, value.shape, state, owners.get(name, set()))
        if not forms:
            continue
        # A square weight may be stored as it is or transposed: the nearer form is it.
        exact = value.astype(np.float64)
        err = min(rel_l2(f.astype(np.float64), exact) for f in forms)
        if err > SAME:
            found.append(Changed(name, key, err))
    return found


def _owned(
    name: str, shape: tuple[int, ...], state: Mapping[str, Array], owners: set[str]
) -> tuple[str, list[Array]]:
    """The parameter or buffer an initializer stands for, and its forms of that shape (as
    it is, transposed): by name, else the one of its readers' module that fits."""
    mine = state.get(name)
    if mine is not None:
        return name, [mine] if mine.shape == shape else []
    if len(owners) != 1:
        return name, []
    (owner,) = owners
    prefix = f"{owner}." if owner else ""
    fits = [
        (k, [f for f in (v, v.T if v.ndim == 2 else v) if f.shape == shape])
        for k, v in state.items()
        if k.startswith(prefix) and "." not in k[len(prefix) :]
    ]
    fits = [(k, forms) for k, forms in fits if forms]
    return fits[0] if len(fits) == 1 else (name, [])
