"""Model transforms named by a ``+NAME[=ARG]`` suffix on a backend spec.

``cpu+fp16`` means: run on ``cpu`` the model as onnxconverter-common converts it to float16. The
transform rewrites the model before the backend sees it, so the search compares two different
graphs, matched by tensor name (see ``matching``); names a transform reuses for another value
are found there and left out.

Each transform is a thin call into the library that owns it; the only code of our own is the
repair of what onnxconverter-common gets wrong (see ``_repair_fp16_casts``).
"""

from __future__ import annotations

import json
import logging
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import onnx

from onnx_bisect.errors import BackendUnavailableError, ModelLoadError, SpecError

__all__ = ["TRANSFORMS", "Transform", "TransformRecord", "apply_transforms", "parse_transform"]

log = logging.getLogger(__name__)

_FLOAT, _FLOAT16 = onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16


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
    if name not in TRANSFORMS:
        raise SpecError(f"unknown transform +{text}; known: +{', +'.join(TRANSFORMS)}")
    kind = TRANSFORMS[name]
    if kind.arg_required and not arg.strip():
        raise SpecError(f"transform +{name} needs an argument: +{name}={kind.arg}")
    if sep and not kind.arg:
        raise SpecError(f"transform +{name} takes no argument (got {text!r})")
    return Transform(text=text.strip(), name=name, arg=arg.strip() or None)


def apply_transforms(
    model: onnx.ModelProto,
    transforms: Sequence[str | Transform],
    role: str,
    shapes: Mapping[str, Sequence[int]] | None = None,
) -> tuple[onnx.ModelProto, tuple[TransformRecord, ...]]:
    """``model`` rewritten by each transform in turn; the caller's model is not touched.

    ``shapes`` (the inputs' concrete shapes) lets simplifiers fold shape arithmetic, as they
    would for a deployment with fixed input sizes.
    """
    records: list[TransformRecord] = []
    current = model
    for t in transforms:
        parsed = parse_transform(t) if isinstance(t, str) else t
        tool = _tool(parsed, TRANSFORMS[parsed.name].package)
        before = len(current.graph.node)
        current, notes = _in_child(current, parsed, tool, dict(shapes or {}))
        record = TransformRecord(role, parsed.text, tool, before, len(current.graph.node), notes)
        log.info("%s", record.summary())
        records.append(record)
    return current, tuple(records)


def _in_child(
    model: onnx.ModelProto, t: Transform, tool: str, shapes: dict[str, Sequence[int]]
) -> tuple[onnx.ModelProto, Notes]:
    """One transform in ``python -m onnx_bisect.transform_child``: the optimizers' C++ cores can
    crash (onnxoptimizer segfaults on BatchNorm parameters given as Constant value_floats),
    and a crash there must not take the diagnosis down with it (see ``transform_child``)."""
    from onnx_bisect.model import save_model
    from onnx_bisect.sandbox import python_child_env  # not at the top: sandbox imports us

    with tempfile.TemporaryDirectory(prefix="onnx-bisect-transform-") as tmp:
        src = save_model(model, Path(tmp), "in.onnx")
        out = Path(tmp) / "out"
        argv = [sys.executable, "-m", "onnx_bisect.transform_child", str(src), str(out), t.text]
        proc = subprocess.run(
            [*argv, json.dumps({k: list(v) for k, v in shapes.items()})],
            capture_output=True,
            text=True,
            env=python_child_env(),
            check=False,
        )
        if proc.stdout.strip() or proc.stderr.strip():
            log.debug("+%s printed:\n%s%s", t.text, proc.stdout, proc.stderr)
        if proc.returncode < 0:
            raise ModelLoadError(
                f"transform +{t.text} crashed ({_signal(-proc.returncode)}) on this model: "
                f"a bug in {tool}, not in the model or the backends"
            )
        lines = proc.stderr.strip().splitlines()
        message = lines[-1] if lines else f"exit code {proc.returncode}"
        if proc.returncode == EXIT_SPEC:
            raise SpecError(message)
        if proc.returncode != 0:
            raise ModelLoadError(f"transform +{t.text} failed: {message}")
        notes = tuple(json.loads((out / "notes.json").read_text()))
        return onnx.load(str(out / "model.onnx")), notes


EXIT_SPEC, EXIT_FAILED = 2, 1  # the child's exit codes


def _signal(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _tool(t: Transform, package: str) -> str:
    try:
        return f"{package} {version(package)}"
    except PackageNotFoundError:
        raise BackendUnavailableError(
            f"transform +{t.name} needs the {package} package: "
            "pip install 'onnx-bisect[transforms]'"
        ) from None


Notes = tuple[str, ...]
_Fn = Callable[
    [onnx.ModelProto, str | None, dict[str, Sequence[int]]], tuple[onnx.ModelProto, Notes]
]


def _fp16(model: onnx.ModelProto, arg: str | None, shapes: dict[str, Sequence[int]]) -> Any:
    from onnxconverter_common import float16

    # keep_io_types: the inputs stay float32, so the same feeds serve both models.
    converted = float16.convert_float_to_float16(model, keep_io_types=True)
    repaired = _repair_fp16_casts(converted)
    notes = (
        (f"repaired {repaired} Cast(to=FLOAT) output(s) the converter mislabelled as float16",)
        if repaired
        else ()
    )
    return converted, notes


def _repair_fp16_casts(model: onnx.ModelProto) -> int:
    """onnxconverter-common keeps a model's own ``Cast(to=FLOAT)`` but labels its output float16
    (YOLOv8n's anchor arithmetic: ORT refuses to load the result). The Cast keeps computing
    float32, as in the original; readers the converter moved to float16 get an explicit Cast.
    Returns the number of Casts repaired."""
    graph = model.graph
    infos = {v.name: v for v in graph.value_info}
    outputs = {o.name for o in graph.output}
    readers: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        for name in node.input:
            readers.setdefault(name, []).append(node)
    repaired = 0
    new_nodes: list[onnx.NodeProto] = []
    for node in graph.node:
        new_nodes.append(node)
        if node.op_type != "Cast" or _cast_to(node) != _FLOAT:
            continue
        out = node.output[0]
        info = infos.get(out)
        if info is None or info.type.tensor_type.elem_type != _FLOAT16:
            continue
        info.type.tensor_type.elem_type = _FLOAT
        repaired += 1
        half = f"{out}_fp16"
        moved = [r for r in readers.get(out, []) if r.op_type != "Cast"]
        if moved and out not in outputs:
            cast = onnx.helper.make_node(
                "Cast", [out], [half], name=f"{node.name}_fp16", to=_FLOAT16
            )
            new_nodes.append(cast)
            shape = info.type.tensor_type.shape if info.type.tensor_type.HasField("shape") else None
            dims = [d.dim_value or d.dim_param or None for d in shape.dim] if shape else None
            graph.value_info.append(onnx.helper.make_tensor_value_info(half, _FLOAT16, dims))
            for r in moved:
                r.input[:] = [half if i == out else i for i in r.input]
    del graph.node[:]
    graph.node.extend(new_nodes)
    return repaired


def _cast_to(node: onnx.NodeProto) -> int | None:
    return next((a.i for a in node.attribute if a.name == "to"), None)


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
    passes = [p.strip() for p in (arg or "").split(",") if p.strip()]
    unknown = [p for p in passes if p not in available]
    if unknown:
        raise SpecError(
            f"transform +onnxoptimizer: unknown pass(es) {', '.join(unknown)}; "
            f"see onnxoptimizer.get_available_passes()"
        )
    chosen = passes or list(onnxoptimizer.get_fuse_and_elimination_passes())
    optimized = onnxoptimizer.optimize(model, chosen)
    return optimized, (f"passes: {', '.join(chosen) if passes else 'fuse and elimination'}",)


def _onnxsim(model: onnx.ModelProto, arg: str | None, shapes: dict[str, Sequence[int]]) -> Any:
    import onnxsim

    fixed = {k: list(v) for k, v in shapes.items()}
    # check_n=0: whether the copy agrees is what onnx-bisect itself is here to find out.
    simplified, _ = onnxsim.simplify(model, check_n=0, overwrite_input_shapes=fixed or None)
    return simplified, ()


def _onnxslim(model: onnx.ModelProto, arg: str | None, shapes: dict[str, Sequence[int]]) -> Any:
    import onnxslim

    fixed = [f"{k}:{','.join(str(d) for d in v)}" for k, v in shapes.items()]
    slimmed = onnxslim.slim(model, input_shapes=fixed or None)
    return slimmed, ()


@dataclass(frozen=True)
class _Kind:
    package: str  # the distribution that does the work, recorded with its version
    apply: _Fn
    arg: str = ""  # the argument's form, for messages; "" takes none
    arg_required: bool = False
    summary: str = ""


TRANSFORMS: Mapping[str, _Kind] = {
    "fp16": _Kind("onnxconverter-common", _fp16, summary="float16, float32 inputs and outputs"),
    "opset": _Kind("onnx", _opset, "N", True, "onnx.version_converter to opset N"),
    "onnxoptimizer": _Kind(
        "onnxoptimizer", _onnxoptimizer, "PASS,PASS", False, "onnxoptimizer passes"
    ),
    "onnxsim": _Kind("onnxsim", _onnxsim, summary="onnx-simplifier"),
    "onnxslim": _Kind("onnxslim", _onnxslim, summary="onnxslim"),
}
