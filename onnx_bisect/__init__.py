"""onnx-bisect: find where an ONNX model's numbers go wrong on another backend.

>>> import onnx_bisect
>>> result = onnx_bisect.bisect("model.onnx", ref="cpu", target="openvino")  # doctest: +SKIP
>>> result.first_divergence.name, result.root_cause.nodes  # doctest: +SKIP
"""

from onnx_bisect.adapters.base import Backend, BackendBase, BackendSpec, create_backend, parse_spec
from onnx_bisect.api import bisect
from onnx_bisect.errors import (
    BackendError,
    BackendUnavailableError,
    InputError,
    ModelLoadError,
    OnnxBisectError,
    SpecError,
)
from onnx_bisect.metrics import Comparison, Criterion, compare_tensors
from onnx_bisect.result import BisectResult, NodeResult, RootCause, Verdict

__all__ = [
    "Backend",
    "BackendBase",
    "BackendError",
    "BackendSpec",
    "BackendUnavailableError",
    "BisectResult",
    "Comparison",
    "Criterion",
    "InputError",
    "ModelLoadError",
    "NodeResult",
    "OnnxBisectError",
    "RootCause",
    "SpecError",
    "Verdict",
    "bisect",
    "compare",
    "compare_tensors",
    "create_backend",
    "parse_spec",
]

compare = compare_tensors
