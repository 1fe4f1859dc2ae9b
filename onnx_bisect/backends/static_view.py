"""What a runtime makes of a model's tensors before it runs them: each graph output's element
type and shape as the runtime's importer types it (``StaticType``), for the backends that can
say (OpenVINO's ONNX frontend, tract's analysis); None for the others.

A runtime that converts a model types every tensor first, and a node whose input it types
with an unknown rank may be refused there, though the node runs on the same values fed
directly (OpenVINO's Conv: "The input data tensor's rank has to be known (static)"). A run
cannot show where that rank was lost: the prefix ending at the node that loses it runs, with
the right values. This view can, and the failure search asks it (``engine/search/typeloss.py``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt
import onnx

__all__ = ["StaticType", "static_types"]


@dataclass(frozen=True)
class StaticType:
    """A tensor as a runtime types it before running. ``dtype`` None: the runtime does not know
    it; ``shape`` None: it does not know the rank; a None dimension: a size it does not know.
    ``said``: the runtime's own notation ("[...]", "?,?,f64"), for the report."""

    dtype: np.dtype[Any] | None
    shape: tuple[int | None, ...] | None
    said: str


@runtime_checkable
class _HasStaticView(Protocol):
    def static_types(
        self, model: onnx.ModelProto, feeds: Mapping[str, npt.NDArray[Any]]
    ) -> dict[str, StaticType] | None: ...


def static_types(
    backend: object, model: onnx.ModelProto, feeds: Mapping[str, npt.NDArray[Any]]
) -> dict[str, StaticType] | None:
    """Each graph output of ``model`` as ``backend`` types it before a run on ``feeds`` (a
    backend may take its input types from them, as tract does), by tensor name; None where the
    backend cannot say. Raises ``BackendError`` where the runtime fails to read the model."""
    if isinstance(backend, _HasStaticView):
        return backend.static_types(model, feeds)
    return None
