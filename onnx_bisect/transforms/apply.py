"""Applying ``+transform``s, each in a child process."""

from __future__ import annotations

import json
import logging
import signal
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import numpy.typing as npt
import onnx

from onnx_bisect.errors import (
    BackendUnavailableError,
    ModelLoadError,
    SpecError,
)
from onnx_bisect.graph.load import load_model
from onnx_bisect.graph.save import save_for_child
from onnx_bisect.graph.view import LoadedModel
from onnx_bisect.graph.weights import read_model, with_loaded_weights
from onnx_bisect.process import python_child_env
from onnx_bisect.transforms.registry import (
    EXIT_SPEC,
    Notes,
    Transform,
    TransformRecord,
    parse_transform,
    transform_kinds,
)

__all__ = ["apply_transforms"]

log = logging.getLogger(__name__)


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
        tool = _tool(parsed, transform_kinds()[parsed.name].package)
        before = len(current.graph.node)
        current, notes = _in_child(current, parsed, tool, dict(shapes or {}))
        record = TransformRecord(role, parsed.text, tool, before, len(current.graph.node), notes)
        log.info("%s", record.summary())
        records.append(record)
    return current, tuple(records)


def _in_child(
    model: onnx.ModelProto, t: Transform, tool: str, shapes: dict[str, Sequence[int]]
) -> tuple[onnx.ModelProto, Notes]:
    """One transform in ``python -m onnx_bisect.transforms.child``: the optimizers' C++ cores can
    crash (onnxoptimizer segfaults on BatchNorm parameters given as Constant value_floats),
    and a crash there must not take the diagnosis down with it (see ``transform_child``)."""

    with tempfile.TemporaryDirectory(prefix="onnx-bisect-transform-") as tmp:
        src = save_for_child(model, Path(tmp), "in.onnx")
        out = Path(tmp) / "out"
        argv = [sys.executable, "-m", "onnx_bisect.transforms.child", str(src), str(out), t.text]
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
        # Read, not onnx.load: its weight files may be hard links (save_model), which
        # onnx.load refuses; the temporary folder goes, so the weights are read now.
        return with_loaded_weights(read_model(out / "model.onnx")), notes


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


def transformed(
    loaded: LoadedModel,
    other: LoadedModel | None,
    ref: Sequence[str],
    target: Sequence[str],
    feeds: Mapping[str, npt.NDArray[Any]],
) -> tuple[LoadedModel, LoadedModel, str, list[TransformRecord]]:
    """The reference and target models after their specs' ``+transform``s (``ref`` and
    ``target`` are the transform texts). The two then differ,
    so the search matches tensors by name (a transform may rename or fuse them)."""
    shapes = {k: v.shape for k, v in feeds.items()}
    source = str(loaded.path or "<in-memory ModelProto>")
    original, records = loaded, list[TransformRecord]()
    if ref:
        model, done = apply_transforms(loaded.model, ref, "ref", shapes)
        loaded, records = load_model(model), [*records, *done]
    target_source = other or original
    label = str(other.path or "<in-memory ModelProto>") if other else source
    if target:
        model, done = apply_transforms(target_source.model, target, "target", shapes)
        other, records = load_model(model), [*records, *done]
        label += "".join(f" +{t}" for t in target)
    return loaded, other or original, label, records
