"""The keep-in-float answer verified by the quantizer itself: the float model quantized again
by onnxruntime.quantization with the settings read from the int8 model
(``graph/quant_settings.py``), the answer's nodes excluded, on the user's ``--calibration``
inputs (none needed for a dynamic model).

The quantizer runs in a child process (``python -m onnx_bisect.engine.quant.requantize``): its
calibration runs a session of the whole augmented model and its shape inference can fail or
crash on a large model, and neither may take the diagnosis down. Calibration runs once: its
ranges are kept in a cache file that every later quantization of the session reads.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from onnx_bisect.errors import OnnxBisectError
from onnx_bisect.graph.quant_settings import QuantSettings
from onnx_bisect.inputs.dataset import find_dataset, load_item
from onnx_bisect.inputs.signature import input_specs
from onnx_bisect.process import python_child_env, run_child

__all__ = ["Requantizer", "RequantizeError"]

log = logging.getLogger(__name__)

# A quantization of a large model (its calibration above all) takes minutes on 2 cores.
TIMEOUT_S = 1800.0


class RequantizeError(OnnxBisectError):
    """onnxruntime's quantizer failed (or crashed) on the float model."""


class Requantizer:
    """Quantizes ``float_path`` again with ``settings``, calibrated on ``calibration`` (a
    directory, a glob or one .npz, read as ``--dataset`` reads one), in ``scratch``."""

    def __init__(
        self,
        float_path: Path,
        settings: QuantSettings,
        calibration: str | None,
        scratch: Path,
    ) -> None:
        self.float_path, self.settings, self.scratch = float_path, settings, scratch
        self.scratch.mkdir(parents=True, exist_ok=True)
        self.inputs: Path | None = None
        if calibration is not None and settings.calibrated:
            self.inputs = _calibration_file(float_path, calibration, scratch)
        self.runs = 0

    def model(self, nodes: Sequence[str], eight_bits: Sequence[str] = ()) -> onnx.ModelProto:
        """The float model quantized with ``nodes`` excluded (a weight-only model: and
        ``eight_bits`` quantized to 8 bits, by RTN's ``customized_weight_config``)."""
        self.runs += 1
        out = self.scratch / f"requantized{self.runs}.onnx"
        job = {
            "float": str(self.float_path),
            "out": str(out),
            "inputs": str(self.inputs) if self.inputs else None,
            "cache": str(self.scratch / "calibration.json"),
            "settings": self.settings.to_dict(),
            "nodes": list(nodes),
            "eight_bits": list(eight_bits),
        }
        argv = [sys.executable, "-m", "onnx_bisect.engine.quant.requantize", json.dumps(job)]
        try:
            proc = run_child(argv, timeout=TIMEOUT_S, env=python_child_env())
        except subprocess.TimeoutExpired:
            raise RequantizeError(f"re-quantizing took over {TIMEOUT_S:.0f} s") from None
        if proc.returncode != 0:
            lines = proc.stderr.decode(errors="replace").strip().splitlines()
            why = lines[-1] if lines else f"exit code {proc.returncode}"
            if proc.returncode < 0:
                why = f"it crashed (signal {-proc.returncode})"
            raise RequantizeError(f"onnxruntime's quantizer failed: {why}")
        return onnx.load(str(out))


def _calibration_file(float_path: Path, source: str, scratch: Path) -> Path:
    """Every calibration input, checked against the float model, in one .npz for the child
    (``<k>/<input name>``)."""
    specs = input_specs(onnx.load(str(float_path), load_external_data=False))
    arrays: dict[str, np.ndarray[Any, Any]] = {}
    items = find_dataset(source)
    for k, item in enumerate(items):
        for name, value in load_item(item, specs).items():
            arrays[f"{k}/{name}"] = np.asarray(value)
    path = scratch / "calibration.npz"
    np.savez(path, **arrays)  # type: ignore[arg-type]
    log.info("calibration: %d inputs from %s", len(items), source)
    return path


def _child(job: dict[str, Any]) -> None:
    """In the child: quantize as the job says (see ``Requantizer.model``)."""
    from onnxruntime.quantization import (
        CalibrationDataReader,
        QuantFormat,
        QuantType,
        quantize_dynamic,
        quantize_static,
    )

    s = job["settings"]
    if s["format"] == "nbits":
        from onnxruntime.quantization.matmul_nbits_quantizer import (
            MatMulNBitsQuantizer,
            RTNWeightOnlyQuantConfig,
        )

        algo = None
        if job["eight_bits"]:
            config = {n: {"bits": 8} for n in job["eight_bits"]}
            algo = RTNWeightOnlyQuantConfig(customized_weight_config=config)
        q = MatMulNBitsQuantizer(
            onnx.load(job["float"]), bits=s["bits"], block_size=s["block_size"],
            is_symmetric=s["is_symmetric"], accuracy_level=s["accuracy_level"],
            nodes_to_exclude=job["nodes"], quant_format=QuantFormat[s["quant_format"]],
            op_types_to_quantize=tuple(s["op_types_to_quantize"]), algo_config=algo,
        )  # fmt: skip
        q.process()
        q.model.save_model_to_file(job["out"])
        return
    common: dict[str, Any] = {
        "weight_type": QuantType[s["weight_type"]],
        "per_channel": s["per_channel"],
        "reduce_range": s["reduce_range"],
        "nodes_to_exclude": job["nodes"],
    }
    if s["format"] == "dynamic":
        quantize_dynamic(job["float"], job["out"], **common)
        return
    if job["inputs"] is None:
        raise SystemExit("a static model needs --calibration inputs")
    data = np.load(job["inputs"])
    rows: dict[str, dict[str, np.ndarray[Any, Any]]] = {}
    for key in data.files:
        k, name = key.split("/", 1)
        rows.setdefault(k, {})[name] = data[key]

    class Reader(CalibrationDataReader):  # type: ignore[misc]
        def __init__(self) -> None:
            self.items = iter(rows[k] for k in sorted(rows, key=int))

        def get_next(self) -> dict[str, np.ndarray[Any, Any]] | None:
            return next(self.items, None)

    extra = {"ActivationSymmetric": True} if s["activation_symmetric"] else {}
    quantize_static(
        job["float"], job["out"], Reader(),
        quant_format=QuantFormat[s["format"]],
        activation_type=QuantType[s["activation_type"]],
        extra_options=extra, calibration_cache_path=job["cache"], **common,
    )  # fmt: skip


if __name__ == "__main__":
    logging.disable(logging.WARNING)  # the quantizer's advice on pre-processing, each call
    _child(json.loads(sys.argv[1]))
