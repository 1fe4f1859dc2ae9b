"""onnx-bisect: find where an ONNX model's numbers go wrong on another backend.

>>> import onnx_bisect
>>> result = onnx_bisect.bisect("model.onnx", ref="cpu", target="openvino")  # doctest: +SKIP
>>> result.first_divergence.name, result.root_cause.nodes  # doctest: +SKIP
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from onnx_bisect.version import VERSION

if TYPE_CHECKING:
    from onnx_bisect.api import bisect
    from onnx_bisect.backends import (
        Backend,
        BackendBase,
        BackendSpec,
        Capabilities,
        create_backend,
        parse_spec,
    )
    from onnx_bisect.cases.run import sweep
    from onnx_bisect.compare.criterion import Comparison, Criterion
    from onnx_bisect.compare.tensors import compare_tensors
    from onnx_bisect.dataset_result import DatasetSummary, NodeStats
    from onnx_bisect.errors import (
        BackendError,
        BackendUnavailableError,
        InputError,
        ModelLoadError,
        OnnxBisectError,
        SpecError,
    )
    from onnx_bisect.inputs.feeds import save_npz
    from onnx_bisect.options import BisectOptions
    from onnx_bisect.report import to_dict, to_frame, write_reports
    from onnx_bisect.result import BisectResult, NodeResult, RootCause, Verdict
    from onnx_bisect.sweep_result import CaseOutcome, CaseResult, Stage, SweepResult

    compare = compare_tensors

# Names resolved on first use (PEP 562): `import onnx_bisect` and the console scripts' entry
# stay light, so that `bisect` can start the float64 oracle's process (torch's import, ~1.4 s)
# before onnxruntime, onnx and pandas are imported here (~0.6 s).
_LAZY = {
    "bisect": "onnx_bisect.api",
    **dict.fromkeys(
        ("Backend", "BackendBase", "BackendSpec", "Capabilities", "create_backend", "parse_spec"),
        "onnx_bisect.backends",
    ),
    "Comparison": "onnx_bisect.compare.criterion",
    "Criterion": "onnx_bisect.compare.criterion",
    "compare_tensors": "onnx_bisect.compare.tensors",
    "DatasetSummary": "onnx_bisect.dataset_result",
    "NodeStats": "onnx_bisect.dataset_result",
    **dict.fromkeys(
        (
            "BackendError",
            "BackendUnavailableError",
            "InputError",
            "ModelLoadError",
            "OnnxBisectError",
            "SpecError",
        ),
        "onnx_bisect.errors",
    ),
    "BisectOptions": "onnx_bisect.options",
    # For an exec: runtime's wrapper: np.savez(**outputs) cannot write a tensor named `file`.
    "save_npz": "onnx_bisect.inputs.feeds",
    **dict.fromkeys(("to_dict", "to_frame", "write_reports"), "onnx_bisect.report"),
    **dict.fromkeys(("BisectResult", "NodeResult", "RootCause", "Verdict"), "onnx_bisect.result"),
    "sweep": "onnx_bisect.cases.run",
    **dict.fromkeys(
        ("CaseOutcome", "CaseResult", "Stage", "SweepResult"), "onnx_bisect.sweep_result"
    ),
}
_ALIASES = {"compare": "compare_tensors"}

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
    "CaseOutcome",
    "CaseResult",
    "Comparison",
    "Criterion",
    "DatasetSummary",
    "InputError",
    "ModelLoadError",
    "NodeResult",
    "NodeStats",
    "OnnxBisectError",
    "RootCause",
    "SpecError",
    "Stage",
    "SweepResult",
    "Verdict",
    "bisect",
    "compare",
    "compare_tensors",
    "create_backend",
    "parse_spec",
    "save_npz",
    "sweep",
    "to_dict",
    "to_frame",
    "write_reports",
]


# The subpackage `compare` is imported now, so that its import (which names it on this package)
# is over before the function of the same name is looked up here.
importlib.import_module("onnx_bisect.compare")
del globals()["compare"]


def __getattr__(name: str) -> Any:
    real = _ALIASES.get(name, name)
    if real not in _LAZY:
        raise AttributeError(f"module 'onnx_bisect' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[real]), real)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


__version__ = VERSION
