"""``torch[:DEVICE]``: ONNX executed by torch on cpu, cuda, mps or xpu, in any float dtype,
eagerly or through ``torch.compile``.

The model is run by our interpreter (``interpreter.Program``), one torch call per node; see
docs/architecture.md for why we interpret instead of converting with onnx2fx.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy.typing as npt
import onnx

from onnx_bisect.backends.protocol import BackendBase, Capabilities, Emit, Tensors
from onnx_bisect.backends.spec import BackendSpec
from onnx_bisect.backends.torch.devices import (
    check_device,
    present_devices,
    torch_missing,
    unavailable_without_torch,
)
from onnx_bisect.backends.torch.options import TorchOptions, float32_nodes
from onnx_bisect.compare.precision import Precision, PrecisionInfo
from onnx_bisect.errors import BackendUnavailableError

if TYPE_CHECKING:
    from onnx_bisect.backends.torch.stand_in import StandIn

__all__ = ["TorchBackend"]


class TorchBackend(BackendBase):
    # Eager, node by node: each probe can be handed over as soon as its node has run.
    capabilities = Capabilities(streams=True)

    def __init__(self, spec: BackendSpec) -> None:
        super().__init__(spec)
        self.options = TorchOptions.parse(spec)  # a bad spec is a usage error even without torch
        missing = torch_missing()
        if missing:
            device, text = self.options.device, spec.text
            raise BackendUnavailableError(unavailable_without_torch(device, text, missing))
        check_device(self.options.device, spec.text)
        self._weights: Any = None  # a WeightCache, made on the first run (it imports torch)
        # ``fallback=1``: the nodes computed without torch so far, by name (``StandIn``).
        self.stand_ins: dict[str, StandIn] = {}

    @staticmethod
    def unavailable_reason() -> str | None:
        return torch_missing()

    @staticmethod
    def details() -> str:
        import torch

        return f"torch {torch.__version__}; devices here: {', '.join(present_devices())}"

    def _run(self, model: onnx.ModelProto, feeds: Mapping[str, npt.NDArray[Any]]) -> Tensors:
        return self.run_compiled(model, feeds, self.options.compile)

    def _stream(
        self, model: onnx.ModelProto, feeds: Mapping[str, npt.NDArray[Any]], emit: Emit
    ) -> None:
        """Eagerly (a ``compile=`` spec streams its eager run: the oracle's use), each
        output copied to numpy and handed over as its node finishes."""
        self.stream_pinned(model, feeds, emit, {})

    def stream_pinned(
        self,
        model: onnx.ModelProto,
        feeds: Mapping[str, npt.NDArray[Any]],
        emit: Emit,
        pinned: Mapping[str, npt.NDArray[Any]],
    ) -> None:
        """``_stream`` with the nodes that compute ``pinned`` (every output of each) not run:
        their values are taken as given (the float64 oracle takes a float -> integer node's
        integers from its fp32 twin, see ``engine/oracle/job.py``)."""
        import torch

        from onnx_bisect.backends.torch.context import to_numpy
        from onnx_bisect.backends.torch.numerics import intra_op_threads, numerics

        program = self._program(model)
        inputs = program.feed(feeds)
        known = program.tensors(pinned) if pinned else None

        def take(name: str, value: torch.Tensor | None) -> None:
            if value is not None:
                emit(name, to_numpy(value))

        o = self.options
        policy = numerics(tf32=o.tf32, deterministic=o.deterministic)
        try:
            with policy, intra_op_threads(o.threads), torch.inference_mode():
                program.run(inputs, emit=take, known=known)
        finally:
            self._took_stand_ins(program)

    def _program(self, model: onnx.ModelProto) -> Any:
        import torch

        from onnx_bisect.backends.torch.interpreter import Program, WeightCache

        o = self.options
        policy = getattr(torch, o.dtype) if o.dtype else None
        opsets = {_domain(i.domain): i.version for i in model.opset_import}
        if self._weights is None:
            self._weights = WeightCache()
        rounding = None
        if o.round is not None:
            from onnx_bisect.backends.torch.rounding import Rounding

            policy, rounding = torch.float32, Rounding(o.round)
        device = torch.device(o.device)
        return Program(
            model.graph,
            opsets,
            device,
            policy,
            self._weights,
            rounding,
            fallback=o.fallback,
            float32_nodes=float32_nodes(model),
        )

    def _took_stand_ins(self, program: Any) -> None:
        """Each node a run computed without torch (``fallback=1``), kept and said once."""
        for node, used in program.stand_ins.items():
            self.stand_ins[node] = used
            self._note(used.describe(), once=True)

    def run_compiled(
        self, model: onnx.ModelProto, feeds: Mapping[str, npt.NDArray[Any]], compiler: str | None
    ) -> Tensors:
        """The model's outputs with ``torch.compile(backend=compiler)`` (None: eagerly), any
        backend torch knows: torch's own bisector names more than ``compile=`` takes."""
        import torch

        from onnx_bisect.backends.torch.context import to_numpy
        from onnx_bisect.backends.torch.numerics import intra_op_threads, numerics

        o = self.options
        program = self._program(model)
        inputs = program.feed(feeds)
        with numerics(tf32=o.tf32, deterministic=o.deterministic), intra_op_threads(o.threads):
            if compiler:
                from onnx_bisect.backends.torch.compiled import compiled_run

                with torch.no_grad():  # tracing needs autograd's dispatch, not inference mode
                    out = compiled_run(program, inputs, compiler)
            else:
                try:
                    with torch.inference_mode():
                        out = program.run(inputs)
                finally:
                    self._took_stand_ins(program)
        # One at a time, each tensor dropped once copied: a copy of all of them beside the
        # tensors would double the run's outputs.
        arrays: Tensors = {}
        for name in list(out):
            value = out.pop(name)
            if value is not None:
                arrays[name] = to_numpy(value)
            del value
        return arrays

    def computes_in(self) -> PrecisionInfo | None:
        o, spec = self.options, self.spec.text
        if o.dtype in ("float16", "bfloat16"):
            return PrecisionInfo(Precision(o.dtype), "declared", f"dtype={o.dtype} in {spec}", True)
        if o.round is not None:
            how = f"round={o.round} in {spec}"
            return PrecisionInfo(Precision(o.round), "declared", how, True)
        if o.tf32 and o.device.startswith("cuda"):
            return PrecisionInfo(Precision.TF32, "declared", f"tf32=1 in {spec}", True)
        if o.dtype in ("float32", "float64") or o.device.startswith("cuda"):
            how = f"dtype={o.dtype}" if o.dtype else "tf32 off"
            return PrecisionInfo(Precision.FLOAT32, "declared", f"{how} in {spec}", True)
        return None

    def describe(self) -> str:
        import torch

        return f"torch {torch.__version__} {self.options.device} {self.options.label()}"

    def versions(self) -> dict[str, str]:
        import torch

        return {"torch": torch.__version__}


def _domain(name: str) -> str:
    return "" if name == "ai.onnx" else name
