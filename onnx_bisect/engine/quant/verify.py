"""The keep-in-float answer checked by the quantizer itself, where it can be: with the float
model's ``--calibration`` inputs (or none, for a dynamic model), onnxruntime quantizes the
float model again with the int8 model's settings, without and with the set excluded
(``requantize.py``), and the goal is measured on both, beside the patched model's numbers.
Either way the answer carries the call to paste."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace

import onnx

from onnx_bisect.engine.quant.requantize import RequantizeError, Requantizer
from onnx_bisect.engine.session import Session
from onnx_bisect.graph.quant_settings import read_settings
from onnx_bisect.graph.save import save_for_child
from onnx_bisect.graph.view import LoadedModel
from onnx_bisect.quant_result import KeepInFloat
from onnx_bisect.text import fmt

__all__ = ["requantized"]

log = logging.getLogger(__name__)


def requantized(
    session: Session,
    target: LoadedModel,
    found: KeepInFloat,
    limit: float,
    measured: Callable[[onnx.ModelProto, str], float],
) -> KeepInFloat:
    """``found`` with the call to paste and, where the quantizer could run, its verdict:
    ``requantized`` (before, after) and ``verified`` by the re-quantized model with the set
    excluded. ``measured``: the goal's number on a model run as the target."""
    settings = read_settings(target.model)
    found = replace(found, call=settings.call(found.nodes), settings=settings.to_dict())
    calibration = session.options.calibration
    if calibration is None and settings.calibrated:
        return found
    ref = session.loaded
    path = ref.path if ref.path is not None and ref.path.is_file() else None
    folder = session.scratch / "requantize"
    folder.mkdir(parents=True, exist_ok=True)
    if path is None:
        path = save_for_child(ref.model, folder, "float.onnx")
    try:
        quantizer = Requantizer(
            path, settings, None if calibration is None else str(calibration), folder
        )
        before = measured(quantizer.model(()), "re-quantized as the target")
        after = measured(quantizer.model(found.nodes), "re-quantized with the set excluded")
    except RequantizeError as exc:
        log.warning("re-quantizing to verify the keep-in-float set failed: %s", exc)
        note = f"not verified by re-quantizing: {exc}"
        return replace(found, note=f"{found.note + '; ' if found.note else ''}{note}")
    log.info("re-quantized: %s %s -> %s", found.goal, fmt(before), fmt(after))
    return replace(found, requantized=(before, after), verified=after <= limit)
