"""The ML compilers' own switches, as pass control for pass bisection (``backends/passes.py``).

- **TVM**: passes by name, switched off through ``PassContext(disabled_pass=[...])`` (the spec's
  ``disable=A,B``). Which of them rewrite a model is seen, as with ONNX Runtime, by compiling
  it: a pass instrument compares the module's structural hash before and after each pass. Only
  passes the compile can do without are candidates (``TVM_OPTIONAL``); switching off one it
  needs (``LegalizeOps``, ``VMShapeLower``) fails the compile, which the search would read as
  "still wrong".
- **IREE**: ``iree-compile`` has no switch per pass, and its optimization flags say nothing of
  their defaults, so the candidates are the flags the user gave (``flags=``): which of them
  breaks the model (``--iree-global-opt-demote-contraction-inputs-type=bf16``, a demotion).
"""

from __future__ import annotations

import shlex
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy.typing as npt
import onnx

from onnx_bisect.backends.passes import Workaround, spec_with_options
from onnx_bisect.backends.spec import BackendSpec

__all__ = ["TVM_OPTIONAL", "IreeFlags", "TvmPasses"]

# TVM 0.27 passes a compile for llvm runs and does without (each checked: all off, the example
# models compile and agree with onnxruntime). ToMixedPrecision is fp16=1's.
TVM_OPTIONAL = (
    "ToMixedPrecision", "FoldConstant", "FuseOps", "FuseTIR", "RewriteDataflowReshape",
    "StaticPlanBlockMemory", "KillAfterLastUse", "s_tir.StmtSimplify", "tirx.StmtSimplify",
    "tirx.NarrowDataType", "tirx.StorageRewrite", "s_tir.HoistIfThenElse",
    "s_tir.RenormalizeSplitPattern", "tirx.CommonSubexprElim",
)  # fmt: skip


class TvmPasses:
    """Pass control of one ``tvm`` spec; ``compile_seen`` compiles a model for its feeds and
    returns the names of the passes that changed it, in the order they ran."""

    def __init__(
        self,
        spec: BackendSpec,
        disabled: Sequence[str],
        opt_level: int,
        compile_seen: Callable[[onnx.ModelProto, Mapping[str, npt.NDArray[Any]]], list[str]],
    ) -> None:
        self.spec, self.disabled, self.opt_level = spec, list(disabled), opt_level
        self._compile_seen = compile_seen

    def all_off(self) -> str:
        return self._spec([*self.disabled, *(p for p in TVM_OPTIONAL if p not in self.disabled)])

    def passes(self, model: onnx.ModelProto, feeds: Mapping[str, npt.NDArray[Any]]) -> list[str]:
        seen = self._compile_seen(model, feeds)
        return [p for p in dict.fromkeys(seen) if p in TVM_OPTIONAL and p not in self.disabled]

    def only(self, enabled: Sequence[str], among: Sequence[str]) -> str:
        return self._spec([*self.disabled, *(p for p in among if p not in enabled)])

    def workaround(self, guilty: Sequence[str]) -> Workaround:
        off = [*self.disabled, *(g for g in guilty if g not in self.disabled)]
        python = f"tvm.transform.PassContext(opt_level={self.opt_level}, disabled_pass={off!r})"
        return Workaround(self._spec(off), (("Python", python),))

    def rewritten(self, model: onnx.ModelProto, guilty: Sequence[str]) -> tuple[str, ...]:
        return ()  # a Relax or TIR pass rewrites functions, not ONNX nodes

    def parts(self, name: str, model: onnx.ModelProto) -> list[str] | None:
        return None

    def _spec(self, off: Sequence[str]) -> str:
        return spec_with_options(self.spec, disable=",".join(off) or None)


class IreeFlags:
    """Pass control of one ``iree`` spec: its ``flags``, each a switch (see module)."""

    def __init__(self, spec: BackendSpec, flags: Sequence[str]) -> None:
        self.spec, self.flags = spec, list(flags)

    def all_off(self) -> str:
        return self._spec([])

    def passes(self, model: onnx.ModelProto, feeds: Mapping[str, npt.NDArray[Any]]) -> list[str]:
        return list(self.flags)  # which of them change this model, only a compile would say

    def only(self, enabled: Sequence[str], among: Sequence[str]) -> str:
        return self._spec([f for f in self.flags if f in enabled or f not in among])

    def workaround(self, guilty: Sequence[str]) -> Workaround:
        kept = [f for f in self.flags if f not in guilty]
        command = shlex.join(["iree-compile", "model.mlir", *kept])
        return Workaround(self._spec(kept), (("iree-compile", command),))

    def rewritten(self, model: onnx.ModelProto, guilty: Sequence[str]) -> tuple[str, ...]:
        return ()

    def parts(self, name: str, model: onnx.ModelProto) -> list[str] | None:
        return None

    def _spec(self, flags: Sequence[str]) -> str:
        return spec_with_options(self.spec, flags=shlex.join(flags) or None)
