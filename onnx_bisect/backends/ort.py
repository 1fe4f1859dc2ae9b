"""ONNX Runtime with any execution provider: ``ort:DEVICE?opt=...&disable=A,B&threads=N``.

A model whose IR version is newer than this onnxruntime reads runs as a copy declaring the
highest one it reads, when the model's opsets allow it (with a note); else a one-line error.
"""

from __future__ import annotations

import re
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy.typing as npt
import onnx

from onnx_bisect.backends.ort_passes import OrtPasses, graph_level
from onnx_bisect.backends.passes import PassControl
from onnx_bisect.backends.protocol import BackendBase, Tensors
from onnx_bisect.backends.spec import BackendSpec
from onnx_bisect.errors import BackendError, BackendUnavailableError, SpecError
from onnx_bisect.graph.irversion import lowered, min_ir_version, runnable_ir_version
from onnx_bisect.graph.save import save_model
from onnx_bisect.graph.sizes import model_bytes
from onnx_bisect.graph.weights import relative_locations

__all__ = ["OrtBackend", "PROVIDERS"]


PROVIDERS: Mapping[str, str] = {
    "cpu": "CPUExecutionProvider",
    "cuda": "CUDAExecutionProvider",
    "tensorrt": "TensorrtExecutionProvider",
    "coreml": "CoreMLExecutionProvider",
    "dml": "DmlExecutionProvider",
    "rocm": "ROCMExecutionProvider",
    "openvino": "OpenVINOExecutionProvider",
}


# The pip package whose onnxruntime build carries each provider; they all install the same
# `onnxruntime` module, so one replaces another rather than joining it.
_PACKAGES: Mapping[str, str] = {
    "cuda": "onnxruntime-gpu",
    "tensorrt": "onnxruntime-gpu",
    "rocm": "onnxruntime-rocm",
    "dml": "onnxruntime-directml",
    "openvino": "onnxruntime-openvino",
}


_OPT_LEVELS = ("disable", "basic", "extended", "all")


# Above this size the bytes API would copy the whole model once more; a file avoids it.
_BYTES_LIMIT = 1 << 30

# Where a model given as bytes finds its external data (relative locations are taken from it).
_WEIGHTS_FOLDER = "session.model_external_initializers_file_folder_path"

# onnxruntime has no API for the highest IR version it reads; its refusal names it.
_IR_REFUSED = re.compile(r"Unsupported model IR version: (\d+), max supported IR version: (\d+)")

# FATAL only: ERROR lines ("[E:onnxruntime:...] Non-zero status code returned while running
# Reshape node") repeat on stderr what the exception already carries into our one-line error.
_LOG_FATAL_ONLY = 4


class OrtBackend(BackendBase):
    def __init__(self, spec: BackendSpec) -> None:
        super().__init__(spec)
        import onnxruntime as ort

        spec.check_options(["opt", "disable", "threads"])
        device = spec.device or "cpu"
        if device not in PROVIDERS:
            choices = ", ".join(PROVIDERS)
            raise SpecError(
                f"backend {spec.text!r}: unknown device {device!r}; choose from {choices}"
            )
        provider = PROVIDERS[device]
        available = ort.get_available_providers()
        if provider not in available:
            raise BackendUnavailableError(
                f"backend {spec.text!r}: this onnxruntime {ort.__version__} build has no {provider}"
                f" (available: {', '.join(available)}); {_install_hint(device)}"
            )
        self.providers = (
            [provider]
            if provider == "CPUExecutionProvider"
            else [
                provider,
                "CPUExecutionProvider",
            ]
        )
        opt = spec.option("opt", "all") or "all"
        if opt not in _OPT_LEVELS:
            raise SpecError(f"backend {spec.text!r}: opt must be one of {', '.join(_OPT_LEVELS)}")
        self.opt = opt
        self.disabled = [d for d in (spec.option("disable") or "").split(",") if d]
        threads = spec.option("threads")
        try:
            self.threads = int(threads) if threads is not None else 0
        except ValueError:
            raise SpecError(f"backend {spec.text!r}: threads must be an integer") from None
        # Learned from the first refusal, so later models are lowered without one.
        self.highest_ir: int | None = None

    @staticmethod
    def unavailable_reason() -> str | None:
        try:
            import onnxruntime  # noqa: F401
        except ImportError as exc:
            return str(exc)
        return None

    def _session_options(self) -> Any:
        import onnxruntime as ort

        so = ort.SessionOptions()
        so.graph_optimization_level = graph_level(self.opt)
        so.log_severity_level = _LOG_FATAL_ONLY
        # The arena keeps its high-water mark for the session's life; a diagnosis runs many
        # short sessions next to another runtime, so plain malloc keeps the peak lower.
        so.enable_cpu_mem_arena = False
        if self.threads:
            so.intra_op_num_threads = self.threads
        return so

    def _run(self, model: onnx.ModelProto, feeds: Mapping[str, npt.NDArray[Any]]) -> Tensors:
        if self.highest_ir is not None and model.ir_version > self.highest_ir:
            return self._run_session(self._lowered(model, self.highest_ir), feeds)
        try:
            return self._run_session(model, feeds)
        except Exception as exc:  # onnxruntime's own Fail type
            refused = _IR_REFUSED.search(str(exc))
            if refused is None or self.highest_ir is not None:
                raise
            self.highest_ir = int(refused.group(2))
        return self._run_session(self._lowered(model, self.highest_ir), feeds)

    def _lowered(self, model: onnx.ModelProto, highest: int) -> onnx.ModelProto:
        import onnxruntime as ort

        version = runnable_ir_version(model, highest)
        if version is None:
            needed = min_ir_version(model)
            why = (
                f"its opsets need IR {needed}"
                if needed is not None
                else f"its opsets are newer than onnx {onnx.__version__} knows"
            )
            raise BackendError(
                f"{self.spec.text}: the model has IR version {model.ir_version} and {why}, but "
                f"onnxruntime {ort.__version__} reads IR versions up to {highest}; "
                "install a newer onnxruntime"
            )
        self._note(
            f"{self.spec.text}: onnxruntime {ort.__version__} reads IR versions up to "
            f"{highest}; ran copies of the model lowered from IR {model.ir_version} to {version}",
            once=True,
        )
        return lowered(model, version)

    def _run_session(
        self, model: onnx.ModelProto, feeds: Mapping[str, npt.NDArray[Any]]
    ) -> Tensors:
        import onnxruntime as ort

        kwargs: dict[str, Any] = {"providers": self.providers}
        if self.disabled:
            kwargs["disabled_optimizers"] = self.disabled
        if model_bytes(model).message < _BYTES_LIMIT:
            options = self._session_options()
            relative = relative_locations(model)
            if relative is not None:
                # External weights are read by ONNX Runtime from their own files, not copied
                # into the message; it wants them relative to one folder.
                model, folder = relative
                options.add_session_config_entry(_WEIGHTS_FOLDER, str(folder))
            sess = ort.InferenceSession(model.SerializeToString(), options, **kwargs)
            return self._infer(sess, feeds)
        with tempfile.TemporaryDirectory(prefix="onnx-bisect-ort-") as tmp:
            path = save_model(model, Path(tmp))
            sess = ort.InferenceSession(str(path), self._session_options(), **kwargs)
            return self._infer(sess, feeds)

    @staticmethod
    def _infer(sess: Any, feeds: Mapping[str, npt.NDArray[Any]]) -> Tensors:
        names = [o.name for o in sess.get_outputs()]
        wanted = {i.name for i in sess.get_inputs()}
        values = sess.run(names, {k: v for k, v in feeds.items() if k in wanted})
        return dict(zip(names, values, strict=True))

    def pass_control(self, declared: Sequence[str]) -> PassControl | None:
        """Its graph transformers, where any are on (``declared`` is for exec: runtimes)."""
        if self.opt == "disable":
            return None
        return OrtPasses(self.spec, self.providers, self.disabled)

    def describe(self) -> str:
        extra = f" opt={self.opt}"
        if self.disabled:
            extra += f" disabled={','.join(self.disabled)}"
        return f"onnxruntime {self.providers[0]}{extra}"

    def versions(self) -> dict[str, str]:
        import onnxruntime as ort

        return {"onnxruntime": ort.__version__}


def _install_hint(device: str) -> str:
    package = _PACKAGES.get(device)
    if package is None:  # coreml, cpu: in every wheel for the platforms that have them
        return "onnxruntime's wheels have it on the platforms that support it"
    return f"install the {package} package in place of onnxruntime (not beside it)"
