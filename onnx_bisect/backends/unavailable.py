"""Backends that are named in the spec grammar but cannot run in this release or on this OS."""

from __future__ import annotations

import platform
import sys

from onnx_bisect.backends.protocol import BackendBase
from onnx_bisect.backends.spec import BackendSpec
from onnx_bisect.errors import BackendUnavailableError

__all__ = ["TorchBackend"]


class TorchBackend(BackendBase):
    """``torch:cpu|cuda|mps`` and the ``mps`` alias: reserved for the torch adapter."""

    def __init__(self, spec: BackendSpec) -> None:
        super().__init__(spec)
        if spec.device == "mps" and sys.platform != "darwin":
            raise BackendUnavailableError(
                f"backend {spec.text!r} is not available here: MPS needs macOS on Apple silicon "
                f"and this machine runs {platform.system()}; dump tensors on the Mac instead"
            )
        raise BackendUnavailableError(
            f"backend {spec.text!r} is not available in onnx-bisect yet: the torch adapter is "
            "not implemented; use exec:CMD to drive a torch script"
        )

    @staticmethod
    def unavailable_reason() -> str | None:
        return "not implemented yet (mps needs macOS); use exec:CMD"
