"""ONNX Runtime's graph transformers, as pass control for pass bisection.

onnxruntime has no API that lists its transformers (onnxruntime#17476), their names change
between releases (GeluFusion became GeluFusionL1/L2), and ``disabled_optimizers`` silently
ignores a name it does not know. So the names come from this model and this onnxruntime: a
session created at verbose logging says "GraphTransformer X modified: 1" for each one that
rewrote the graph. That runs in a child process (``python -m onnx_bisect.backends.ort_passes``),
since onnxruntime logs to the process's stderr, which a child's is easy to read and ours is
not. The nodes a pass rewrote come from the optimized models onnxruntime saves with and
without it.
"""

from __future__ import annotations

import re
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy.typing as npt
import onnx

from onnx_bisect.backends.passes import Workaround, spec_with_options
from onnx_bisect.backends.spec import BackendSpec
from onnx_bisect.errors import BackendError
from onnx_bisect.graph.save import save_model
from onnx_bisect.process import python_child_env

__all__ = ["OrtPasses", "graph_level", "modified_transformers"]

_MODIFIED = re.compile(r"GraphTransformer (\S+) modified: 1")
_CONFIG_KEY = "optimization.disable_specified_optimizers"

# onnxruntime's rewrite rules per level, as GenerateRewriteRules registers them in 1.32
# (onnxruntime/core/optimizer/graph_transformer_utils.cc; each name is its RewriteRule's own,
# e.g. PadFusion's is "Pad_Fusion"). No log line or API names them: a rule-based transformer
# logs only "GraphTransformer Level1_RuleBasedTransformer modified: 1", though
# disabled_optimizers takes rule names as it takes transformer names. So these are candidates:
# a rule counts only where switching it off changes the graph this onnxruntime makes of this
# model, and a rule added or renamed later is missed, its transformer then named whole.
_RULES = {
    1: (
        "EliminateIdentity", "EliminateSlice", "UnsqueezeElimination", "EliminateDropout",
        "ExpandElimination", "CastElimination", "CastChainElimination",
        "PreShapeNodeElimination", "NoopElimination", "DivMulFusion", "FuseReluClip",
        "GemmSumFusion", "GemmTransposeFusion", "NotWhereFusion", "ConvAddFusion",
        "ConvMulFusion", "ConvBNFusion", "Pad_Fusion", "MatMul_BatchNormalization_Fusion",
        "LabelEncoderFusion",
    ),
    2: ("ClipQuantRewrite", "ReluQuantRewrite", "GemmTransposeFusion"),
}  # fmt: skip
_RULE_BASED = re.compile(r"Level(\d+)_RuleBasedTransformer")
# The lowest opt= at which a level's transformers run.
_LEVEL_OPT = {1: "basic", 2: "extended"}


def graph_level(opt: str) -> Any:
    """onnxruntime's GraphOptimizationLevel for an ``opt=`` value."""
    import onnxruntime as ort

    return {
        "disable": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
        "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
        "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
        "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
    }[opt]


def modified_transformers(log: str) -> list[str]:
    """The transformers a verbose onnxruntime log says rewrote the graph, first seen first."""
    return list(dict.fromkeys(_MODIFIED.findall(log)))


class OrtPasses:
    """Pass control of one ``ort`` spec (see module)."""

    def __init__(self, spec: BackendSpec, providers: Sequence[str], disabled: Sequence[str]):
        self.spec, self.providers, self.disabled = spec, list(providers), list(disabled)

    def all_off(self) -> str:
        return spec_with_options(self.spec, opt="disable", disable=None)

    def passes(self, model: onnx.ModelProto, feeds: Mapping[str, npt.NDArray[Any]]) -> list[str]:
        with tempfile.TemporaryDirectory(prefix="onnx-bisect-passes-") as tmp:
            path = save_model(model, Path(tmp))
            argv = [sys.executable, "-m", __name__, str(path), ",".join(self.providers)]
            argv += [self.spec.option("opt", "all") or "all", ",".join(self.disabled)]
            proc = subprocess.run(
                argv, capture_output=True, text=True, env=python_child_env(), timeout=600
            )
        if proc.returncode != 0:
            tail = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
            raise BackendError(f"{self.spec.text}: listing its transformers failed: {tail}")
        return [p for p in modified_transformers(proc.stderr) if p not in self.disabled]

    def only(self, enabled: Sequence[str], among: Sequence[str]) -> str:
        off = [*self.disabled, *(p for p in among if p not in enabled)]
        return spec_with_options(self.spec, disable=",".join(off) or None)

    def workaround(self, guilty: Sequence[str]) -> Workaround:
        off = [*self.disabled, *(g for g in guilty if g not in self.disabled)]
        names = ", ".join(repr(n) for n in off)
        return Workaround(
            spec=spec_with_options(self.spec, disable=",".join(off)),
            forms=(
                (
                    "Python",
                    f"onnxruntime.InferenceSession(path, providers={self.providers!r}, "
                    f"disabled_optimizers=[{names}])",
                ),
                (
                    "C/C++",
                    f'session_options.AddConfigEntry("{_CONFIG_KEY}", "{";".join(off)}");',
                ),
            ),
        )

    def rewritten(self, model: onnx.ModelProto, guilty: Sequence[str]) -> tuple[str, ...]:
        opt = self.spec.option("opt", "all") or "all"
        with tempfile.TemporaryDirectory(prefix="onnx-bisect-passes-") as tmp:
            path = save_model(model, Path(tmp))
            with_pass = _optimized(path, self.providers, opt, self.disabled)
            without = _optimized(path, self.providers, opt, [*self.disabled, *guilty])
        kept, fused = _names(without), _names(with_pass)
        return tuple(n.name for n in model.graph.node if n.name in kept - fused)

    def parts(self, name: str, model: onnx.ModelProto) -> list[str] | None:
        """A rule-based transformer's rules that change ``model`` (see ``_RULES``), each found
        by an optimized graph that differs with it switched off."""
        level = _RULE_BASED.fullmatch(name)
        if level is None:
            return None
        rules = [r for r in _RULES.get(int(level.group(1)), ()) if r not in self.disabled]
        opt = _LEVEL_OPT.get(int(level.group(1)), "all")
        with tempfile.TemporaryDirectory(prefix="onnx-bisect-passes-") as tmp:
            path = save_model(model, Path(tmp))
            base = _shape(_optimized(path, self.providers, opt, self.disabled))
            return [
                r
                for r in rules
                if _shape(_optimized(path, self.providers, opt, [*self.disabled, r])) != base
            ]


def _optimized(
    path: Path, providers: Sequence[str], opt: str, disabled: Sequence[str]
) -> onnx.GraphProto:
    """The graph onnxruntime optimizes ``path`` into at ``opt`` with ``disabled`` off."""
    import onnxruntime as ort

    out = path.with_name("optimized.onnx")
    options = ort.SessionOptions()
    options.optimized_model_filepath = str(out)
    options.graph_optimization_level = graph_level(opt)
    options.log_severity_level = 4  # it warns that an NCHWc-optimized file is machine-specific
    kwargs: dict[str, Any] = {"providers": list(providers)}
    if disabled:
        kwargs["disabled_optimizers"] = list(disabled)
    ort.InferenceSession(str(path), options, **kwargs)
    return onnx.load(str(out), load_external_data=False).graph


def _names(graph: onnx.GraphProto) -> set[str]:
    return {n.name for n in graph.node}


def _shape(graph: onnx.GraphProto) -> tuple[object, ...]:
    """What a rewrite changes: the nodes and how they connect, and the initializers' names."""
    nodes = tuple((n.op_type, n.domain, tuple(n.input), tuple(n.output)) for n in graph.node)
    return nodes, tuple(sorted(i.name for i in graph.initializer))


def _main(argv: Sequence[str]) -> int:
    """Create one session at verbose logging; the log goes to this process's stderr."""
    import onnxruntime as ort

    path, providers, opt, disabled = argv
    options = ort.SessionOptions()
    options.log_severity_level = 0
    options.log_verbosity_level = 0
    options.graph_optimization_level = graph_level(opt)
    kwargs: dict[str, Any] = {"providers": providers.split(",")}
    if disabled:
        kwargs["disabled_optimizers"] = disabled.split(",")
    ort.InferenceSession(path, options, **kwargs)
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
