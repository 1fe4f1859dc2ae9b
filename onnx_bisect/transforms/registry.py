"""Model transforms named by a ``+NAME[=ARG]`` suffix on a backend spec.

``cpu+fp16`` means: run on ``cpu`` the model as onnxconverter-common converts it to float16. The
transform rewrites the model before the backend sees it, so the search compares two different
graphs, matched by tensor name (see ``matching``); names a transform reuses for another value
are found there and left out.

Each transform is a thin call into the library that owns it; the only code of our own is the
block list that keeps onnxconverter-common from writing invalid models (``transforms/fp16.py``).
More kinds come from the ``onnx_bisect.transforms`` entry-point group (``name = "module:KIND"``, a
``TransformKind``), read in every process, so a transform's child process finds them too.

A kind whose argument is a list of passes says so (``passes``): pass bisection then applies
subsets of that list (``transforms/passes.py``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import cache
from importlib.metadata import entry_points
from typing import Any

import onnx

from onnx_bisect.errors import SpecError
from onnx_bisect.graph.sizes import model_bytes
from onnx_bisect.transforms.fp16 import fp16

__all__ = [
    "EXIT_FAILED",
    "EXIT_SPEC",
    "Notes",
    "TRANSFORMS",
    "Transform",
    "TransformKind",
    "TransformRecord",
    "parse_transform",
    "split_passes",
    "transform_kinds",
]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Transform:
    """One ``+NAME[=ARG]``: ``text`` is what the user wrote."""

    text: str
    name: str
    arg: str | None = None


@dataclass(frozen=True)
class TransformRecord:
    """What a transform did, for the report: the tool and version, node counts, repairs."""

    role: str  # "ref" or "target"
    text: str
    tool: str
    nodes_before: int
    nodes_after: int
    notes: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {
            "role": self.role,
            "transform": self.text,
            "tool": self.tool,
            "nodes_before": self.nodes_before,
            "nodes_after": self.nodes_after,
            "notes": list(self.notes),
        }

    def summary(self) -> str:
        extra = f" ({'; '.join(self.notes)})" if self.notes else ""
        return (
            f"{self.role} model +{self.text}: {self.tool}, {self.nodes_before} -> "
            f"{self.nodes_after} nodes{extra}"
        )


def parse_transform(text: str) -> Transform:
    name, sep, arg = text.strip().partition("=")
    name = name.strip().lower()
    kinds = transform_kinds()
    if name not in kinds:
        raise SpecError(f"unknown transform +{text}; known: +{', +'.join(kinds)}")
    kind = kinds[name]
    if kind.arg_required and not arg.strip():
        raise SpecError(f"transform +{name} needs an argument: +{name}={kind.arg}")
    if sep and not kind.arg:
        raise SpecError(f"transform +{name} takes no argument (got {text!r})")
    return Transform(text=text.strip(), name=name, arg=arg.strip() or None)


EXIT_SPEC, EXIT_FAILED = 2, 1  # the child's exit codes


Notes = tuple[str, ...]


_Fn = Callable[
    [onnx.ModelProto, str | None, dict[str, Sequence[int]]], tuple[onnx.ModelProto, Notes]
]
# The passes an argument names, in the order they are applied (the default list for none).
_Passes = Callable[[str | None], tuple[str, ...]]


def _opset(model: onnx.ModelProto, arg: str | None, shapes: dict[str, Sequence[int]]) -> Any:
    try:
        target = int(arg or "")
    except ValueError:
        raise SpecError(f"transform +opset needs an integer opset, got {arg!r}") from None
    from onnx import version_converter

    current = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)
    converted = version_converter.convert_version(model, target)
    return converted, (f"default-domain opset {current} -> {target}",)


def _onnxoptimizer(
    model: onnx.ModelProto, arg: str | None, shapes: dict[str, Sequence[int]]
) -> Any:
    import onnxoptimizer

    available = set(onnxoptimizer.get_available_passes())
    passes = split_passes(arg)
    unknown = [p for p in passes if p not in available]
    if unknown:
        raise SpecError(
            f"transform +onnxoptimizer: unknown pass(es) {', '.join(unknown)}; "
            f"see onnxoptimizer.get_available_passes()"
        )
    chosen = passes or list(onnxoptimizer.get_fuse_and_elimination_passes())
    optimized = (
        onnxoptimizer.optimize(model, chosen)
        if model_bytes(model).fits
        else _optimize_from_files(model, chosen)
    )
    return optimized, (f"passes: {', '.join(chosen) if passes else 'fuse and elimination'}",)


def _optimize_from_files(model: onnx.ModelProto, passes: Sequence[str]) -> onnx.ModelProto:
    """onnxoptimizer past 2 GB: its own fallback to files runs on ValueError only, and
    protobuf raises EncodeError there, so the files are written here (in the child)."""
    import tempfile
    from pathlib import Path

    from onnxoptimizer import onnx_opt_cpp2py_export as cpp

    with tempfile.TemporaryDirectory(prefix="onnx-bisect-onnxoptimizer-") as tmp:
        src, dst = Path(tmp) / "in.onnx", Path(tmp) / "out.onnx"
        onnx.save_model(model, str(src), save_as_external_data=True, location="in.onnx.data")
        cpp.optimize_from_path(str(src), str(dst), list(passes), "out.onnx.data")
        return onnx.load(str(dst))


def split_passes(arg: str | None) -> list[str]:
    """``PASS,PASS`` as a list."""
    return [p.strip() for p in (arg or "").split(",") if p.strip()]


def _onnxoptimizer_passes(arg: str | None) -> tuple[str, ...]:
    import onnxoptimizer

    return tuple(split_passes(arg) or onnxoptimizer.get_fuse_and_elimination_passes())


def _onnxsim(model: onnx.ModelProto, arg: str | None, shapes: dict[str, Sequence[int]]) -> Any:
    import onnxsim

    fixed = {k: list(v) for k, v in shapes.items()}
    # check_n=0: whether the copy agrees is what onnx-bisect itself is here to find out.
    simplified, _ = onnxsim.simplify(model, check_n=0, overwrite_input_shapes=fixed or None)
    return simplified, ()


def _onnxslim(model: onnx.ModelProto, arg: str | None, shapes: dict[str, Sequence[int]]) -> Any:
    import onnxslim

    fixed = [f"{k}:{','.join(str(d) for d in v)}" for k, v in shapes.items()]
    passes = split_passes(arg)
    known = _onnxslim_passes(None)
    unknown = [p for p in passes if p not in known]
    if unknown:
        raise SpecError(
            f"transform +onnxslim: unknown pass(es) {', '.join(unknown)}; known: {', '.join(known)}"
        )
    skip = _onnxslim_skips(passes) if passes else {}
    slimmed = onnxslim.slim(model, input_shapes=fixed or None, **skip)
    return slimmed, (f"passes: {', '.join(passes)}",) if passes else ()


def _onnxslim_passes(arg: str | None) -> tuple[str, ...]:
    """onnxslim's optimizations, with ``graph_fusion`` as its fusion patterns, one by one:
    it takes them as lists of what to skip (``skip_optimizations``, ``skip_fusion_patterns``)."""
    named = split_passes(arg)
    if named:
        return tuple(named)
    from onnxslim.core.optimization import OptimizationSettings
    from onnxslim.core.pattern.registry import DEFAULT_FUSION_PATTERNS

    keys = OptimizationSettings.keys()  # a classmethod, not a dict
    steps = [k for k in keys if k != "graph_fusion"]
    return (*steps[:1], *DEFAULT_FUSION_PATTERNS, *steps[1:])


def _onnxslim_skips(passes: Sequence[str]) -> dict[str, list[str]]:
    """The ``slim()`` keywords that run only ``passes``."""
    from onnxslim.core.pattern.registry import DEFAULT_FUSION_PATTERNS

    off = [p for p in _onnxslim_passes(None) if p not in passes]
    patterns = [p for p in off if p in DEFAULT_FUSION_PATTERNS]
    steps = [p for p in off if p not in DEFAULT_FUSION_PATTERNS]
    if len(patterns) == len(DEFAULT_FUSION_PATTERNS):
        steps.append("graph_fusion")
    return {"skip_optimizations": steps, "skip_fusion_patterns": patterns}


def _onnxslim_call(passes: Sequence[str]) -> str:
    skips = ", ".join(f"{k}={v!r}" for k, v in _onnxslim_skips(passes).items() if v)
    return f"onnxslim.slim(model{', ' if skips else ''}{skips})"


@dataclass(frozen=True)
class TransformKind:
    """One ``+NAME``: what a plugin's entry point names, too."""

    package: str  # the distribution that does the work, recorded with its version
    apply: _Fn
    arg: str = ""  # the argument's form, for messages; "" takes none
    arg_required: bool = False
    summary: str = ""
    # For an argument that lists passes (``PASS,PASS``): the list it applies, so that pass
    # bisection can apply subsets of it; None for a transform that is one step.
    passes: _Passes | None = None
    # ``PASS,PASS`` as the owning library's own call, for a workaround's "Python" form.
    python: Callable[[Sequence[str]], str] | None = None
    # False: ``apply`` gets the model with its external weights located, not read (a version
    # conversion reads no weight), so that a model over 2 GB stays a small message.
    reads_weights: bool = True
    # True: the child infers shapes before the weights are read and ``apply`` must not infer
    # them itself (onnx serializes the message to infer, which fails past 2 GB).
    infer_shapes: bool = False


def _onnxoptimizer_call(passes: Sequence[str]) -> str:
    return f"onnxoptimizer.optimize(model, {list(passes)!r})"


TRANSFORMS: Mapping[str, TransformKind] = {
    "fp16": TransformKind(
        "onnxconverter-common",
        fp16,
        summary="float16, float32 inputs and outputs",
        infer_shapes=True,
    ),
    "opset": TransformKind(
        "onnx", _opset, "N", True, "onnx.version_converter to opset N", reads_weights=False
    ),
    "onnxoptimizer": TransformKind(
        "onnxoptimizer",
        _onnxoptimizer,
        "PASS,PASS",
        False,
        "onnxoptimizer passes",
        passes=_onnxoptimizer_passes,
        python=_onnxoptimizer_call,
    ),  # fmt: skip
    "onnxsim": TransformKind("onnxsim", _onnxsim, summary="onnx-simplifier"),
    "onnxslim": TransformKind(
        "onnxslim",
        _onnxslim,
        "PASS,PASS",
        False,
        "onnxslim, only the named optimizations",
        passes=_onnxslim_passes,
        python=_onnxslim_call,
    ),  # fmt: skip
}


@cache
def transform_kinds() -> Mapping[str, TransformKind]:
    """The built-in kinds plus those of the ``onnx_bisect.transforms`` entry-point group."""
    found = dict(TRANSFORMS)
    for ep in entry_points(group="onnx_bisect.transforms"):
        name = ep.name.lower()
        if name in found:
            log.warning("transform plugin %s ignored: +%s is taken", ep.value, name)
            continue
        try:
            kind = ep.load()
        except Exception as exc:  # a broken plugin must not break the built-in transforms
            log.warning("transform plugin %s ignored: %s", ep.value, exc)
            continue
        if isinstance(kind, TransformKind):
            found[name] = kind
        else:
            log.warning("transform plugin %s ignored: not a TransformKind", ep.value)
    return found
