"""Optimizer passes a backend can switch off by name: what pass bisection asks of a runtime.

A backend that implements ``pass_control`` (ONNX Runtime; an ``exec:`` runtime whose command
takes ``{disable}`` and whose pass names the user declares with ``--passes``) says which of
its passes rewrite this model, gives the spec of itself with some of them off, writes the
workaround in the forms its users need, and opens up a pass made of rules that switch off
one by one (ONNX Runtime's rule-based transformers). Everything is expressed as spec strings,
so that a backend in a child process is rebuilt the same way.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import numpy.typing as npt
import onnx

from onnx_bisect.backends.spec import BackendSpec

__all__ = ["PassControl", "Workaround", "spec_with_options", "supports_passes"]


@dataclass(frozen=True)
class Workaround:
    """How to turn the guilty passes off: the spec for this tool, plus each API's form."""

    spec: str
    forms: tuple[tuple[str, str], ...] = ()  # (where, text), e.g. ("Python", "...")


class PassControl(Protocol):
    """A runtime's named optimizer passes (see module)."""

    def all_off(self) -> str:
        """The spec with every optimization off."""
        ...

    def passes(self, model: onnx.ModelProto, feeds: Mapping[str, npt.NDArray[Any]]) -> list[str]:
        """The passes that rewrite ``model``, in the order the runtime applies them."""
        ...

    def only(self, enabled: Sequence[str], among: Sequence[str]) -> str:
        """The spec with the passes of ``among`` that are not in ``enabled`` off."""
        ...

    def workaround(self, guilty: Sequence[str]) -> Workaround:
        """The guilty passes off, everything else as the user had it."""
        ...

    def rewritten(self, model: onnx.ModelProto, guilty: Sequence[str]) -> tuple[str, ...]:
        """The model's nodes that the guilty passes replace ((), where that is not known)."""
        ...

    def parts(self, name: str, model: onnx.ModelProto) -> list[str] | None:
        """For a pass made of rules that switch off by name one by one, the rules that change
        ``model``'s optimized graph ([] when none does); None for a pass that is one piece."""
        ...


@runtime_checkable
class _HasPasses(Protocol):
    def pass_control(self, declared: Sequence[str]) -> PassControl | None: ...


def supports_passes(backend: object, declared: Sequence[str]) -> PassControl | None:
    """The backend's pass control, or None when it has no passes to switch off."""
    if isinstance(backend, _HasPasses):
        return backend.pass_control(declared)
    return None


def spec_with_options(spec: BackendSpec, **options: str | None) -> str:
    """``spec``'s text with ``options`` set (None removes one), in the user's own spelling
    of the name and device."""
    base = spec.text.split("?", 1)[0]
    merged = {k: v for k, v in {**spec.options, **options}.items() if v is not None}
    query = "&".join(f"{k}={v}" for k, v in merged.items())
    return f"{base}?{query}" if query else base
