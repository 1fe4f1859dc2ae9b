"""``tvm[:llvm|cuda][?opt_level=N&fp16=1]``: Apache TVM, through its Relax ONNX frontend.

Each model goes ``relax.frontend.onnx.from_onnx`` (the inputs' shapes and dtypes those of the
arrays fed) → ``DecomposeOpsForInference`` → [``ToMixedPrecision`` with ``fp16=1``: float16
operands, float32 accumulation, TVM's default; it must come before ``LegalizeOps`` or it does
nothing] → ``LegalizeOps`` → ``tvm.compile`` for ``llvm`` (the default) or ``cuda`` under a
``PassContext(opt_level=N)`` (3 unless told) → ``relax.VirtualMachine``. What it compiled is
kept by model hash for the process (``backends/compiled.py``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import onnx

from onnx_bisect.backends.compiled import CompileCache, OnDisk, fed_inputs, pinned_model
from onnx_bisect.backends.compiler_passes import TvmPasses
from onnx_bisect.backends.passes import PassControl
from onnx_bisect.backends.protocol import BackendBase, Capabilities, Tensors, one_line
from onnx_bisect.backends.spec import BackendSpec
from onnx_bisect.compare.precision import PrecisionInfo, parse_precision
from onnx_bisect.errors import BackendError, BackendUnavailableError, SpecError

__all__ = ["TARGETS", "TvmBackend"]

# What this process compiled, for every backend of this adapter (the key holds its settings).
_CACHE: CompileCache[Any] = CompileCache(
    # A shared library (linked by the system's C compiler), loaded back as a runtime module.
    disk=OnDisk(".so", lambda ex, path: ex.export_library(str(path)), lambda path: _load(path))
)

TARGETS = ("llvm", "cuda")
_INSTALL = "pip install 'onnx-bisect[tvm]'"
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


class TvmBackend(BackendBase):
    # Each run of a model not compiled before in this process is a compile (seconds to
    # minutes): the searches spend as few runs as they can.
    capabilities = Capabilities(compiles=True)

    def __init__(self, spec: BackendSpec) -> None:
        super().__init__(spec)
        spec.check_options(["opt_level", "fp16", "disable"])
        self.target = spec.device or "llvm"
        if self.target not in TARGETS:
            raise SpecError(
                f"backend {spec.text!r}: TVM target must be one of {', '.join(TARGETS)}"
            )
        level = spec.option("opt_level", "3") or "3"
        if not level.isdigit() or int(level) > 4:
            raise SpecError(f"backend {spec.text!r}: opt_level must be 0 to 4, not {level!r}")
        self.opt_level = int(level)
        fp16 = (spec.option("fp16", "0") or "0").lower()
        if fp16 not in _TRUE + _FALSE:
            raise SpecError(f"backend {spec.text!r}: fp16 must be 1 or 0, not {fp16!r}")
        self.fp16 = fp16 in _TRUE
        self.disabled = tuple(p for p in (spec.option("disable") or "").split(",") if p)
        reason = self.unavailable_reason()
        if reason:
            raise BackendUnavailableError(f"backend {spec.text!r} is not available: {reason}")
        if self.target == "cuda" and not _device("cuda").exist:
            raise BackendUnavailableError(f"backend {spec.text!r}: TVM sees no CUDA device here")

    @staticmethod
    def unavailable_reason() -> str | None:
        try:
            import tvm  # noqa: F401
        except ImportError:
            return f"the apache-tvm package is not installed ({_INSTALL})"
        return None

    @staticmethod
    def details() -> str:
        return f"apache-tvm {_version()}"

    def _run(self, model: onnx.ModelProto, feeds: Mapping[str, npt.NDArray[Any]]) -> Tensors:
        import tvm
        from tvm import relax

        pinned = pinned_model(model, feeds)
        order = [i.name for i in fed_inputs(pinned)]
        missing = [n for n in order if n not in feeds]
        if missing:
            raise BackendError(f"{self.spec.text}: no value for input(s) {', '.join(missing)}")
        settings = (self.target, self.opt_level, self.fp16, self.disabled)
        key = CompileCache.key(pinned, *settings)
        executable = _CACHE.get(key, lambda: self._compile(pinned, feeds))
        device = _device(self.target)
        vm = relax.VirtualMachine(executable, device)
        args = [tvm.runtime.tensor(np.require(feeds[n], requirements="C"), device) for n in order]
        results = _flatten(vm["main"](*args))
        names = [o.name for o in model.graph.output]
        if len(results) != len(names):
            raise BackendError(
                f"{self.spec.text}: returned {len(results)} output(s), the model has {len(names)}"
            )
        return dict(zip(names, results, strict=True))

    def pass_control(self, declared: Sequence[str]) -> PassControl | None:
        """TVM's passes by name (``backends/compiler_passes.py``)."""
        return TvmPasses(self.spec, self.disabled, self.opt_level, self._passes_seen)

    def _passes_seen(
        self, model: onnx.ModelProto, feeds: Mapping[str, npt.NDArray[Any]]
    ) -> list[str]:
        """The passes that change ``model``'s module when compiled for ``feeds``, in order."""
        import tvm_ffi
        from tvm.ir.instrument import pass_instrument

        @pass_instrument
        class Seen:
            def __init__(self) -> None:
                self.before: list[int] = []
                self.changed: list[str] = []

            def run_before_pass(self, mod: Any, info: Any) -> None:
                self.before.append(tvm_ffi.structural_hash(mod))

            def run_after_pass(self, mod: Any, info: Any) -> None:
                if self.before.pop() != tvm_ffi.structural_hash(mod):
                    self.changed.append(str(info.name))

        seen = Seen()
        self._compile(pinned_model(model, feeds), feeds, instruments=[seen])
        return list(seen.changed)

    def _compile(
        self,
        model: onnx.ModelProto,
        feeds: Mapping[str, npt.NDArray[Any]],
        instruments: Sequence[Any] = (),
    ) -> Any:
        import tvm
        from tvm import relax
        from tvm.relax.frontend.onnx import from_onnx

        self._note(f"compiled by TVM for {self.target}")
        order = [i.name for i in fed_inputs(model)]
        shapes = {n: list(np.shape(feeds[n])) for n in order}
        dtypes = {n: str(np.asarray(feeds[n]).dtype) for n in order}
        context = tvm.transform.PassContext(
            opt_level=self.opt_level, disabled_pass=self.disabled, instruments=list(instruments)
        )
        with context:
            try:
                mod = from_onnx(model, shape_dict=shapes, dtype_dict=dtypes)
                mod = relax.transform.DecomposeOpsForInference()(mod)
                if self.fp16 and "ToMixedPrecision" not in self.disabled:
                    # Called directly, a pass runs whatever disabled_pass says: asked here.
                    mod = relax.transform.ToMixedPrecision()(mod)
                mod = relax.transform.LegalizeOps()(mod)
                return tvm.compile(mod, target=self.target)
            except tvm.error.OpNotImplemented as exc:
                # "The following operators are not supported for frontend ONNX: LSTM": said
                # in the word the failure search reads as "the target lacks the op".
                text = " ".join(str(exc).split())
                raise BackendError(f"{self.spec.text}: unsupported op(s): {text}") from None
            except MemoryError:
                raise
            except Exception as exc:
                # TVM's importer and passes raise TypeError, ValueError, TVMError...: a refusal
                # of this model, raised as the backend's error so the compile cache keeps it
                # and the same model is not compiled again to fail again.
                raise BackendError(
                    f"{self.spec.text}: {one_line(exc)}", detail=f"{self.spec.text}: {exc}"
                ) from exc

    def computes_in(self) -> PrecisionInfo | None:
        if not self.fp16:
            return None
        how = f"fp16=1 in {self.spec.text} (ToMixedPrecision)"
        return PrecisionInfo(parse_precision("f16"), "declared", how, True)

    def describe(self) -> str:
        extra = " fp16" if self.fp16 else ""
        return f"TVM {_version()} {self.target} opt_level={self.opt_level}{extra}"

    def versions(self) -> dict[str, str]:
        return {"apache-tvm": _version()}


def _load(path: Path) -> Any:
    import tvm

    return tvm.runtime.load_module(str(path))


def _device(target: str) -> Any:
    import tvm

    return tvm.cuda() if target == "cuda" else tvm.cpu()


def _flatten(value: Any) -> list[npt.NDArray[Any]]:
    """The VM's result (a tensor, or a tuple of them, nested) as arrays in order. A shape
    computed at compile time comes back as a shape (a tuple of ints), a scalar as a number."""
    if hasattr(value, "numpy"):
        return [np.asarray(value.numpy())]
    if isinstance(value, int | float):
        return [np.asarray(value)]
    if "Shape" in type(value).__name__:
        return [np.asarray(list(value), dtype=np.int64)]
    return [a for item in value for a in _flatten(item)]


def _version() -> str:
    try:
        return version("apache-tvm")
    except PackageNotFoundError:
        return "unknown"
