"""Backends: the protocol, spec parsing, the registry and the built-in adapters."""

from onnx_bisect.adapters.base import (
    ALIASES,
    Adapter,
    Backend,
    BackendBase,
    BackendSpec,
    Tensors,
    adapters,
    create_backend,
    parse_spec,
)

__all__ = [
    "ALIASES",
    "Adapter",
    "Backend",
    "BackendBase",
    "BackendSpec",
    "Tensors",
    "adapters",
    "create_backend",
    "parse_spec",
]
