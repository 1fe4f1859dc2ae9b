"""``openvino[:CPU|GPU|NPU]?precision=f32|bf16|f16``: the OpenVINO runtime.

Without ``precision`` OpenVINO picks its own default, which is bf16 on CPUs with AVX512-BF16 or
AMX: a real, expected source of divergence from an fp32 reference.
"""

from __future__ import annotations

import io
import tempfile
from collections.abc import Mapping
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import onnx

from onnx_bisect.backends.protocol import BackendBase, Tensors
from onnx_bisect.backends.spec import BackendSpec
from onnx_bisect.backends.static_view import StaticType
from onnx_bisect.compare.precision import PrecisionInfo, parse_precision
from onnx_bisect.errors import BackendUnavailableError, SpecError
from onnx_bisect.graph.save import save_model
from onnx_bisect.graph.sizes import model_bytes

__all__ = ["OpenVinoBackend", "default_precision"]


_BYTES_LIMIT = 1 << 30


_PRECISIONS = {"f32": "f32", "fp32": "f32", "bf16": "bf16", "f16": "f16", "fp16": "f16"}


@cache
def _core() -> Any:
    import openvino as ov

    return ov.Core()


def default_precision(device: str = "CPU") -> str:
    """What OpenVINO runs at when not told: bf16 on CPUs with AVX512-BF16/AMX, else f32."""
    hint = _core().get_property(device, "INFERENCE_PRECISION_HINT")
    name = hint.get_type_name() if hasattr(hint, "get_type_name") else str(hint)
    return str(name)


def _read(core: Any, model: onnx.ModelProto) -> Any:
    """``model`` read by OpenVINO's ONNX frontend (every node converted)."""
    size = model_bytes(model)
    if not size.external and size.message < _BYTES_LIMIT:
        # Straight from memory: a temp-file round trip costs more than the parse.
        return core.read_model(io.BytesIO(model.SerializeToString()))
    # From a file, its external weights linked beside it (OpenVINO reads them from the
    # model's directory only).
    with tempfile.TemporaryDirectory(prefix="onnx-bisect-ov-") as tmp:
        return core.read_model(str(save_model(model, Path(tmp))))


def _static_type(port: Any) -> StaticType:
    """An output port's element type and partial shape, "[...]" where the rank is dynamic."""
    element, shape = port.get_element_type(), port.get_partial_shape()
    dtype = None
    if element.is_static():
        try:
            dtype = np.dtype(element.to_dtype())
        except (TypeError, ValueError, RuntimeError):  # a type numpy lacks (bf16, u4)
            dtype = None
    dims = None
    if shape.rank.is_static:
        dims = tuple(d.get_length() if d.is_static else None for d in shape)
    return StaticType(dtype, dims, f"{element.get_type_name()} {shape}")


class OpenVinoBackend(BackendBase):
    def __init__(self, spec: BackendSpec) -> None:
        super().__init__(spec)
        spec.check_options(["precision"])
        reason = self.unavailable_reason()
        if reason:
            raise BackendUnavailableError(f"backend {spec.text!r} is not available: {reason}")
        self.device = (spec.device or "CPU").upper()
        devices = _core().available_devices
        if not any(d.split(".")[0] == self.device for d in devices):
            raise BackendUnavailableError(
                f"backend {spec.text!r}: OpenVINO has no {self.device} device here "
                f"(available: {', '.join(devices)})"
            )
        precision = spec.option("precision")
        if precision is not None and precision.lower() not in _PRECISIONS:
            raise SpecError(f"backend {spec.text!r}: precision must be f32, bf16 or f16")
        self.precision = _PRECISIONS[precision.lower()] if precision else None

    @staticmethod
    def unavailable_reason() -> str | None:
        try:
            import openvino  # noqa: F401
        except ImportError:
            return "the openvino package is not installed (pip install 'onnx-bisect[openvino]')"
        return None

    def _run(self, model: onnx.ModelProto, feeds: Mapping[str, npt.NDArray[Any]]) -> Tensors:
        core = _core()
        ov_model = _read(core, model)
        wanted = {p.get_any_name() for p in ov_model.inputs}
        feeds = {k: v for k, v in feeds.items() if k in wanted}
        # Static shapes let the CPU plugin pick its fast kernels, as a deployment would.
        ov_model.reshape({k: list(v.shape) for k, v in feeds.items()})
        compiled = core.compile_model(ov_model, self.device, self._config(core))
        # Sharing avoids one copy of every input and output: tens of MB on a detector.
        request = compiled.create_infer_request()
        # Shared inputs must be writeable (the tensor cache memory-maps read-only files).
        shared = {k: v if v.flags.writeable else np.array(v) for k, v in feeds.items()}
        results = request.infer(shared, share_inputs=True, share_outputs=True)
        out: Tensors = {}
        names = [o.name for o in model.graph.output]
        for i, port in enumerate(compiled.outputs):
            value = np.asarray(results[port])
            for name in port.get_names():
                out[name] = value
            # OpenVINO may drop or merge names of marked intermediates; position still holds.
            if i < len(names) and names[i] not in out:
                out[names[i]] = value
        return out

    def static_types(
        self, model: onnx.ModelProto, feeds: Mapping[str, npt.NDArray[Any]]
    ) -> dict[str, StaticType] | None:
        """Each graph output as OpenVINO's ONNX frontend types it on reading the model, before
        the reshape to the fed shapes that a run does: what the conversion of every later node
        is given (the frontend refuses a Conv whose input rank it does not know, whatever
        shapes are fed later). By position, as ``_run`` maps outputs."""
        ov_model = self._wrapped(lambda: _read(_core(), model))
        names = [o.name for o in model.graph.output]
        return {n: _static_type(p) for n, p in zip(names, ov_model.outputs, strict=False)}

    def computes_in(self) -> PrecisionInfo | None:
        if self.precision is not None:
            how = f"precision={self.precision} in {self.spec.text}"
            return PrecisionInfo(parse_precision(self.precision), "declared", how, True)
        picked = default_precision(self.device)
        how = f"OpenVINO's {self.device} default INFERENCE_PRECISION_HINT={picked}"
        return PrecisionInfo(parse_precision(picked), "observed", how, False)

    def _config(self, core: Any) -> dict[str, Any]:
        """The precision asked for. At f32 also no dynamic quantization: the CPU plugin
        otherwise quantizes the activations of MatMuls whose weights are int8 (a weight-only
        int8 model's Cast -> Mul -> MatMul) even under an f32 hint, 5e-3 off on one MatMul
        (3.5e-7 without), which is not what "computes in float32" says."""
        if self.precision is None:
            return {}
        config: dict[str, Any] = {"INFERENCE_PRECISION_HINT": self.precision}
        supported = core.get_property(self.device, "SUPPORTED_PROPERTIES")
        if self.precision == "f32" and "DYNAMIC_QUANTIZATION_GROUP_SIZE" in supported:
            config["DYNAMIC_QUANTIZATION_GROUP_SIZE"] = 0
        return config

    def describe(self) -> str:
        precision = self.precision or default_precision(self.device)
        return f"OpenVINO {self.device} precision={precision}"

    def versions(self) -> dict[str, str]:
        import openvino as ov

        return {"openvino": ov.get_version()}
