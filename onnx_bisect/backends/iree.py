"""``iree[:llvm-cpu|cuda|vulkan][?flags=...]``: IREE, the MLIR-based ML compiler and runtime.

Each model is imported as ``iree-import-onnx`` would (the ONNX importer of
``iree-base-compiler``, in-process), compiled by ``iree-compile`` (a child process of the
compiler package, so its aborts come back as errors) for the device's target backend, and run
by ``iree.runtime`` on the device's driver: ``llvm-cpu`` on ``local-task`` (the default),
``cuda`` on ``cuda``, ``vulkan`` (``vulkan-spirv``) on ``vulkan``. ``flags`` are more
``iree-compile`` flags, separated by spaces (``flags=--iree-opt-level=O0
--iree-input-demote-f32-to-f16``). What it compiled is kept by model hash for the process
(``backends/compiled.py``).
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from typing import Any

import numpy as np
import numpy.typing as npt
import onnx

from onnx_bisect.backends.compiled import CompileCache, OnDisk, fed_inputs, pinned_model
from onnx_bisect.backends.compiler_passes import IreeFlags
from onnx_bisect.backends.passes import PassControl
from onnx_bisect.backends.protocol import BackendBase, Capabilities, Tensors
from onnx_bisect.backends.spec import BackendSpec
from onnx_bisect.errors import BackendError, BackendUnavailableError, SpecError

__all__ = ["DEVICES", "IreeBackend", "IreeDevice", "compiler_message"]

# What this process compiled, for every backend of this adapter (the key holds its settings).
_CACHE: CompileCache[bytes] = CompileCache(
    disk=OnDisk(".vmfb", lambda vmfb, path: path.write_bytes(vmfb), lambda path: path.read_bytes())
)


@dataclass(frozen=True)
class IreeDevice:
    """What a spec's device means to IREE: the compiler's target backend and flags, and the
    runtime's driver."""

    target: str
    driver: str
    flags: tuple[str, ...] = ()


DEVICES = {
    # `host`: the code is for this CPU, as a deployment on it would be.
    "llvm-cpu": IreeDevice("llvm-cpu", "local-task", ("--iree-llvmcpu-target-cpu=host",)),
    "cuda": IreeDevice("cuda", "cuda"),
    "vulkan": IreeDevice("vulkan-spirv", "vulkan"),
}

_INSTALL = "pip install 'onnx-bisect[iree]'"
_FUNCTION = "main_graph"
# The ONNX importer leaves an op it has no conversion for as a generic `torch.operator` named
# after it, which the compiler then refuses to legalize: the op is unsupported (at this opset).
_ILLEGAL_OP = re.compile(r"failed to legalize operation 'torch\.operator'.*?name = \"([\w.]+)\"")


class IreeBackend(BackendBase):
    # Each run of a model not compiled before in this process is a compile (seconds to
    # minutes): the searches spend as few runs as they can.
    capabilities = Capabilities(compiles=True)

    def __init__(self, spec: BackendSpec) -> None:
        super().__init__(spec)
        spec.check_options(["flags"])
        name = spec.device or "llvm-cpu"
        if name not in DEVICES:
            raise SpecError(
                f"backend {spec.text!r}: IREE device must be one of {', '.join(DEVICES)}"
            )
        reason = self.unavailable_reason()
        if reason:
            raise BackendUnavailableError(f"backend {spec.text!r} is not available: {reason}")
        self.device = DEVICES[name]
        missing = _no_device(self.device.driver)
        if missing:
            raise BackendUnavailableError(f"backend {spec.text!r}: {missing}")
        try:
            self.flags = tuple(shlex.split(spec.option("flags") or ""))
        except ValueError as exc:
            raise SpecError(f"backend {spec.text!r}: cannot split flags ({exc})") from None

    @staticmethod
    def unavailable_reason() -> str | None:
        try:
            import iree.compiler  # noqa: F401
            import iree.runtime  # noqa: F401
        except ImportError:
            return f"iree-base-compiler and iree-base-runtime are not installed ({_INSTALL})"
        return None

    @staticmethod
    def details() -> str:
        return f"iree-base-compiler {_version('compiler')}"

    def _run(self, model: onnx.ModelProto, feeds: Mapping[str, npt.NDArray[Any]]) -> Tensors:
        import iree.runtime as rt

        pinned = pinned_model(model, feeds)
        pinned.graph.name = _FUNCTION  # the importer names the function after the graph
        order = [i.name for i in fed_inputs(pinned)]
        missing = [n for n in order if n not in feeds]
        if missing:
            raise BackendError(f"{self.spec.text}: no value for input(s) {', '.join(missing)}")
        key = CompileCache.key(pinned, self.device, self.flags)
        vmfb = _CACHE.get(key, lambda: self._compile(pinned))
        context = rt.SystemContext(config=rt.Config(self.device.driver))
        context.add_vm_module(rt.VmModule.copy_buffer(context.instance, vmfb))
        main = context.modules.module[_FUNCTION]
        results = main(*(np.require(feeds[n], requirements="C") for n in order))
        if not isinstance(results, list | tuple):
            results = (results,)
        names = [o.name for o in model.graph.output]
        if len(results) != len(names):
            raise BackendError(
                f"{self.spec.text}: returned {len(results)} output(s), the model has {len(names)}"
            )
        return {n: np.asarray(r.to_host()) for n, r in zip(names, results, strict=True)}

    def pass_control(self, declared: Sequence[str]) -> PassControl | None:
        """Its ``flags``, each a switch (``backends/compiler_passes.py``); None without."""
        return IreeFlags(self.spec, self.flags) if self.flags else None

    def _compile(self, model: onnx.ModelProto) -> bytes:
        from iree.compiler.tools import CompilerToolError, compile_str

        asm = _imported(model)
        flags = [*self.device.flags, *self.flags]
        self._note(f"compiled by iree-compile for {self.device.target}")
        try:
            vmfb: bytes = compile_str(asm, target_backends=[self.device.target], extra_args=flags)
        except CompilerToolError as exc:
            message = compiler_message(str(exc))
            # The detail leads with the summary, so that either reads as the same kind.
            detail = f"{self.spec.text}: {message}\n{exc}"
            raise BackendError(f"{self.spec.text}: {message}", detail=detail) from None
        return vmfb

    def describe(self) -> str:
        extra = f" {' '.join(self.flags)}" if self.flags else ""
        return f"IREE {_version('compiler')} {self.device.target} on {self.device.driver}{extra}"

    def versions(self) -> dict[str, str]:
        return {
            "iree-base-compiler": _version("compiler"),
            "iree-base-runtime": _version("runtime"),
        }


def _imported(model: onnx.ModelProto) -> str:
    """The model as MLIR (torch-onnx dialect), as ``iree-import-onnx`` writes it."""
    from iree.compiler import ir
    from iree.compiler.extras import onnx_importer

    info = onnx_importer.ModelInfo(model)
    module = info.create_module(context=ir.Context()).operation
    onnx_importer.NodeImporter.define_function(info.main_graph, module).import_all()
    module.verify()
    asm: str = module.get_asm(assume_verified=True)
    return asm


def compiler_message(text: str) -> str:
    """iree-compile's diagnostics as one line: its first error, without the IR it prints.

    An op left as ``torch.operator`` is named and said to be unsupported (see
    ``_ILLEGAL_OP``); the failure search reads that word as "the target lacks the op".
    """
    flat = " ".join(text.split())
    illegal = _ILLEGAL_OP.search(flat)
    if illegal:
        return (
            f"unsupported op {illegal.group(1)} (iree-compile: failed to legalize operation "
            f"'torch.operator' {illegal.group(1)})"
        )
    errors = [ln.strip() for ln in text.splitlines() if "error:" in ln]
    if errors:
        first = errors[0].split("error:", 1)[1].strip()
        return f"iree-compile: {first}"
    return f"iree-compile failed: {flat[:300]}"


def _version(part: str) -> str:
    try:
        return version(f"iree-base-{part}")
    except PackageNotFoundError:
        return "unknown"


def _no_device(driver: str) -> str | None:
    """Why IREE's ``driver`` has no device here (no CUDA library, no Vulkan loader), else None:
    said before any compile, not as a failure of every run."""
    import iree.runtime as rt

    try:
        devices = rt.get_driver(driver).query_available_devices()
    except Exception as exc:  # the runtime says what is missing
        text = " ".join(str(exc).split())
        return f"IREE's {driver} driver does not start: {text[:300]}"
    return None if devices else f"IREE's {driver} driver finds no device"
