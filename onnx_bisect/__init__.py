"""onnx-bisect: find where an ONNX model's numbers go wrong on another backend.

>>> import onnx_bisect
>>> result = onnx_bisect.bisect("model.onnx", ref="cpu", target="openvino")  # doctest: +SKIP
>>> result.first_divergence.name, result.root_cause.nodes  # doctest: +SKIP
"""

from importlib import metadata

from onnx_bisect.api import bisect
from onnx_bisect.backends import (
    Backend,
    BackendBase,
    BackendSpec,
    Capabilities,
    create_backend,
    parse_spec,
)
from onnx_bisect.compare.criterion import Comparison, Criterion
from onnx_bisect.compare.tensors import compare_tensors
from onnx_bisect.errors import (
    BackendError,
    BackendUnavailableError,
    InputError,
    ModelLoadError,
    OnnxBisectError,
    SpecError,
)
from onnx_bisect.options import BisectOptions
from onnx_bisect.report import to_dict, to_frame, write_reports
from onnx_bisect.result import BisectResult, NodeResult, RootCause, Verdict

__all__ = [
    "__version__",
    "Backend",
    "BackendBase",
    "BackendError",
    "BackendSpec",
    "BackendUnavailableError",
    "BisectOptions",
    "BisectResult",
    "Capabilities",
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
    "to_dict",
    "to_frame",
    "write_reports",
]

compare = compare_tensors


def _version() -> str:
    try:
        return metadata.version("onnx-bisect")
    except metadata.PackageNotFoundError:
        # A source tree on sys.path without an install: no metadata says which release it is,
        # and "0+unknown" sorts below every release (PEP 440) rather than posing as one.
        return "0+unknown"


__version__ = _version()
