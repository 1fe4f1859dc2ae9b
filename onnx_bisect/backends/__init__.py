"""Backends: the protocol, spec parsing, the registry and one module per runtime.

Adapters are imported lazily through the registry, so listing them imports no runtime.
"""

from onnx_bisect.backends.protocol import Backend, BackendBase, Capabilities, Tensors
from onnx_bisect.backends.registry import Adapter, adapters, create_backend
from onnx_bisect.backends.spec import ALIASES, BackendSpec, parse_spec

__all__ = [
    "ALIASES",
    "Adapter",
    "Backend",
    "BackendBase",
    "BackendSpec",
    "Capabilities",
    "Tensors",
    "adapters",
    "create_backend",
    "parse_spec",
]
