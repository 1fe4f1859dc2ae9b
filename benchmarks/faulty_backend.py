"""An in-process SIMULATED faulty runtime, as a plugin spec for the benchmarks:

    --target "benchmarks/faulty_backend.py:FaultyOrt?node=NODE&factor=0.05"

ONNX Runtime CPU in this process, with node NODE's outputs multiplied by (1 + factor): the
same planted fault as ``examples/faulty_runtime.py`` (whose ``plant_fault`` it uses), without
a process per run, so a benchmark can time the search on an in-process target.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy.typing as npt
import onnx

from onnx_bisect.backends.protocol import BackendBase, Tensors
from onnx_bisect.backends.registry import create_backend
from onnx_bisect.backends.spec import BackendSpec
from onnx_bisect.errors import SpecError

_RUNTIME = Path(__file__).resolve().parents[1] / "examples" / "faulty_runtime.py"
_spec = importlib.util.spec_from_file_location("faulty_runtime", _RUNTIME)
assert _spec is not None and _spec.loader is not None
_faulty = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_faulty)


class FaultyOrt(BackendBase):
    """ORT CPU, except that node ``?node=`` outputs (1 + ``?factor=``, default 0.05) times
    the right value wherever it is in a model."""

    def __init__(self, spec: BackendSpec) -> None:
        super().__init__(spec)
        spec.check_options(["node", "factor"])
        self.node = spec.option("node") or ""
        if not self.node:
            raise SpecError(f"backend {spec.text!r}: give the faulty node as ?node=NAME")
        try:
            self.factor = float(spec.option("factor") or "0.05")
        except ValueError:
            raise SpecError(f"backend {spec.text!r}: factor must be a number") from None
        self.inner = create_backend("cpu")

    def _run(self, model: onnx.ModelProto, feeds: Mapping[str, npt.NDArray[Any]]) -> Tensors:
        planted: onnx.ModelProto = _faulty.plant_fault(model, self.node, self.factor)
        return self.inner.run(planted, feeds)

    def describe(self) -> str:
        return f"SIMULATED: onnxruntime CPU with {self.node} off by {self.factor:g}"
