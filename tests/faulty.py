"""Fault-planting test backends: ONNX Runtime with one node made wrong, or one op refused.

The planting itself comes from examples/faulty_runtime.py, so the in-process test adapter and
the exec: runtime share exactly one definition of "the fault".
"""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping
from typing import Any

import numpy.typing as npt
import onnx

from onnx_bisect.backends.protocol import BackendBase, Tensors
from onnx_bisect.backends.registry import create_backend
from onnx_bisect.backends.spec import BackendSpec
from onnx_bisect.errors import BackendError
from tests.models import FAULTY_RUNTIME

_spec = importlib.util.spec_from_file_location("faulty_runtime", FAULTY_RUNTIME)
assert _spec and _spec.loader
faulty_runtime = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(faulty_runtime)
plant_fault = faulty_runtime.plant_fault
silu_pattern_present = faulty_runtime.silu_pattern_present
output_observed = faulty_runtime.output_observed
plant_input_fault = faulty_runtime.plant_input_fault


class FaultyBackend(BackendBase):
    """ORT CPU, except that node ``node`` outputs (1 + factor) times the right value."""

    def __init__(self, node: str, factor: float = 0.05, base: str = "cpu") -> None:
        super().__init__(BackendSpec(text=f"faulty({node}×{1 + factor:g})", name="faulty"))
        self.node, self.factor = node, factor
        self.inner = create_backend(base)
        self.runs = 0

    def _run(self, model: onnx.ModelProto, feeds: Mapping[str, npt.NDArray[Any]]) -> Tensors:
        self.runs += 1
        return self.inner.run(plant_fault(model, self.node, self.factor), feeds)


class RefusingBackend(BackendBase):
    """ORT CPU that lacks a kernel for ``op_type``, like a young runtime."""

    def __init__(self, op_type: str) -> None:
        super().__init__(BackendSpec(text=f"refusing({op_type})", name="refusing"))
        self.op_type = op_type
        self.inner = create_backend("cpu")

    def _run(self, model: onnx.ModelProto, feeds: Mapping[str, npt.NDArray[Any]]) -> Tensors:
        for node in model.graph.node:
            if node.op_type == self.op_type:
                raise BackendError(f"op {self.op_type} is not implemented (node {node.name})")
        return self.inner.run(model, feeds)


class PatternFaultBackend(BackendBase):
    """ORT CPU whose fused SiLU is wrong: Mul ``node`` is off by ``factor`` only when the model
    also computes its inputs as Conv -> Sigmoid of that Conv."""

    def __init__(self, node: str, factor: float = 0.05) -> None:
        super().__init__(BackendSpec(text=f"pattern-faulty({node})", name="pattern-faulty"))
        self.node, self.factor = node, factor
        self.inner = create_backend("cpu")

    def _run(self, model: onnx.ModelProto, feeds: Mapping[str, npt.NDArray[Any]]) -> Tensors:
        if silu_pattern_present(model, self.node):
            model = plant_fault(model, self.node, self.factor)
        return self.inner.run(model, feeds)


class HiddenFaultBackend(BackendBase):
    """ORT CPU where ``node`` is wrong only while its output is not a graph output: a fusion
    bug that vanishes when observed."""

    def __init__(self, node: str, factor: float = 0.05) -> None:
        super().__init__(BackendSpec(text=f"hidden-faulty({node})", name="hidden-faulty"))
        self.node, self.factor = node, factor
        self.inner = create_backend("cpu")
        self.runs = 0

    def _run(self, model: onnx.ModelProto, feeds: Mapping[str, npt.NDArray[Any]]) -> Tensors:
        self.runs += 1
        present = any(n.name == self.node for n in model.graph.node)
        if present and not output_observed(model, self.node):
            model = plant_fault(model, self.node, self.factor)
        return self.inner.run(model, feeds)


class AbortingBackend(BackendBase):
    """ORT CPU that aborts the whole process when node ``?node=NAME`` is in the model, like a
    runtime that segfaults on one kernel. Only safe to run in a child process."""

    def __init__(self, spec: BackendSpec) -> None:
        super().__init__(spec)
        spec.check_options(["node"])
        self.node = spec.option("node") or ""
        self.inner = create_backend("cpu")

    def _run(self, model: onnx.ModelProto, feeds: Mapping[str, npt.NDArray[Any]]) -> Tensors:
        if any(n.name == self.node for n in model.graph.node):
            import os

            os.abort()
        return self.inner.run(model, feeds)


class InputFaultBackend(BackendBase):
    """ORT CPU where node ``?node=NAME`` outputs (1 + ``factor``) × the right value only when
    max |its first input| > ``trigger``: a bug that fires on some inputs (``--input-fault``).
    A spec string (``tests.faulty:InputFaultBackend?node=...&factor=...&trigger=...``), so
    that dataset workers can build it."""

    def __init__(self, spec: BackendSpec) -> None:
        super().__init__(spec)
        spec.check_options(["node", "factor", "trigger"])
        self.node = spec.option("node") or ""
        self.factor = float(spec.option("factor") or 0.05)
        self.trigger = float(spec.option("trigger") or 0.0)
        self.inner = create_backend("cpu")

    def _run(self, model: onnx.ModelProto, feeds: Mapping[str, npt.NDArray[Any]]) -> Tensors:
        planted = plant_input_fault(model, self.node, self.factor, self.trigger)
        return self.inner.run(planted, feeds)


class FusionFaultBackend(BackendBase):
    """ORT CPU with a fusion across ``tensor``: node ``node`` (a reader of ``tensor``) is off
    by ``factor`` only while the model computes ``tensor`` and does not mark it as an output,
    as OpenVINO computes a T5 encoder's attention mask wrong until the mask is observed. The
    node's own output may be marked: the fault stays."""

    def __init__(self, node: str, tensor: str, factor: float = 0.05) -> None:
        super().__init__(BackendSpec(text=f"fusion-faulty({tensor}->{node})", name="fusion"))
        self.node, self.tensor, self.factor = node, tensor, factor
        self.inner = create_backend("cpu")

    def _run(self, model: onnx.ModelProto, feeds: Mapping[str, npt.NDArray[Any]]) -> Tensors:
        computed = any(self.tensor in n.output for n in model.graph.node)
        marked = any(o.name == self.tensor for o in model.graph.output)
        present = any(n.name == self.node for n in model.graph.node)
        if present and computed and not marked:
            model = plant_fault(model, self.node, self.factor)
        return self.inner.run(model, feeds)


class FoldFaultBackend(BackendBase):
    """ORT CPU that folds ``tensor`` wrongly into ``node``: the node, reading ``tensor``, is off
    by ``factor`` whenever ``tensor`` is a constant to the runtime: embedded as an initializer,
    or computed in a model that holds its shape source ``source`` (a Shape of a graph input),
    as OpenVINO folds a T5 encoder's position bias into the attention mask's arithmetic at
    static shapes. Fed as an input, it is right."""

    def __init__(self, node: str, tensor: str, source: str, factor: float = 0.05) -> None:
        super().__init__(BackendSpec(text=f"fold-faulty({tensor}->{node})", name="fold"))
        self.node, self.tensor, self.source, self.factor = node, tensor, source, factor
        self.inner = create_backend("cpu")

    def _run(self, model: onnx.ModelProto, feeds: Mapping[str, npt.NDArray[Any]]) -> Tensors:
        # Embedded, the tensor may be renamed (a window's ``const__b``).
        inits = {i.name for i in model.graph.initializer}
        embedded = {i for i in inits if i == self.tensor or i.endswith("__" + self.tensor)}
        source = any(n.name == self.source for n in model.graph.node)
        read = {t for n in model.graph.node if n.name == self.node for t in n.input}
        if (source and self.tensor in read) or (embedded & read):
            model = plant_fault(model, self.node, self.factor)
        return self.inner.run(model, feeds)
