#!/usr/bin/env python3
"""Benchmark: the per-tensor quantization table against onnxruntime's ``qdq_loss_debug``.

    python benchmarks/bench_quant.py [--model yolov8n.onnx] [--repeat 3] [--out bench-quant]

The float model (YOLOv8n-320 by default: ``/tmp/models/yolov8n.onnx``) is fixed to
1x3x320x320, pre-processed with ``quant_pre_process`` and quantized with ``quantize_static``
(QDQ, uint8 activations, int8 weights, per tensor, 4 seeded calibration inputs in [0, 1)),
as benchmarks/README.md's quantization table has it. Then, in turn (table, debug, table, ...)
so that a machine whose load drifts affects both alike:

    table   ``bisect FLOAT --target-model QDQ --target cpu --shape images=1x3x320x320``: the
            seconds from the start of the diagnosis until its per-tensor table is built (its
            note "per-tensor quantization table: N tensors, ready T s after the start").
    debug   ``qdq_loss_debug`` in a fresh process: both models augmented with every tensor as
            an output, run on one input, matched and their SQNR computed; the seconds from
            the first call to the last, as the table's exclude the imports too.

Printed: each one's times and the ratio pair by pair (target: table/debug <= 2), with the
load average, since other work on the machine inflates every time.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
SHAPE = (1, 3, 320, 320)
TARGET_RATIO = 2.0

_QUANTIZE = """
import sys, numpy as np, onnx
from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static
from onnxruntime.quantization.shape_inference import quant_pre_process
src, fixed, fp32, qdq = sys.argv[1:5]
shape = [1, 3, 320, 320]
m = onnx.load(src)
for d, v in zip(m.graph.input[0].type.tensor_type.shape.dim, shape):
    d.dim_value = v
onnx.save(m, fixed)
quant_pre_process(fixed, fp32)
name = m.graph.input[0].name
class R(CalibrationDataReader):
    def __init__(self):
        rng = [np.random.default_rng(i) for i in range(4)]
        self.it = iter([{name: r.random(shape).astype(np.float32)} for r in rng])
    def get_next(self):
        return next(self.it, None)
quantize_static(fp32, qdq, R(), quant_format=QuantFormat.QDQ,
                activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8)
"""

_DEBUG = """
import sys, time, numpy as np, onnx
from onnxruntime.quantization import CalibrationDataReader
from onnxruntime.quantization.qdq_loss_debug import (
    collect_activations, compute_activation_error, create_activation_matching,
    modify_model_output_intermediate_tensors)
fp32, qdq, out = sys.argv[1:4]
name = onnx.load(fp32, load_external_data=False).graph.input[0].name
class R(CalibrationDataReader):
    def __init__(self):
        x = np.random.default_rng(0).random((1, 3, 320, 320)).astype(np.float32)
        self.it = iter([{name: x}])
    def get_next(self):
        return next(self.it, None)
t0 = time.perf_counter()
modify_model_output_intermediate_tensors(fp32, out + "/fp32_aug.onnx")
modify_model_output_intermediate_tensors(qdq, out + "/qdq_aug.onnx")
f = collect_activations(out + "/fp32_aug.onnx", R())
q = collect_activations(out + "/qdq_aug.onnx", R())
e = compute_activation_error(create_activation_matching(q, f))
print(f"qdq_loss_debug {time.perf_counter() - t0:.3f} s {len(e)} tensors")
"""

_READY = re.compile(r"per-tensor quantization table: (\d+) tensors, ready ([\d.]+) s")


def _models(model: Path, out: Path) -> tuple[Path, Path]:
    fp32, qdq = out / "fp32.onnx", out / "qdq.onnx"
    if not (fp32.is_file() and qdq.is_file()):
        argv = [sys.executable, "-c", _QUANTIZE, str(model), str(out / "fixed.onnx")]
        subprocess.run([*argv, str(fp32), str(qdq)], check=True, capture_output=True)
    return fp32, qdq


def _table(fp32: Path, qdq: Path, out: Path) -> tuple[float, int]:
    argv = [str(BIN / "bisect"), str(fp32), "--target-model", str(qdq), "--target", "cpu"]
    argv += ["--shape", "images=" + "x".join(map(str, SHAPE)), "--no-repro"]
    argv += ["--out", str(out / "report"), "--format", "json"]
    text = subprocess.run(argv, capture_output=True, text=True, env=os.environ).stdout
    found = _READY.search(text)
    if found is None:
        raise SystemExit(f"no table note in the output of {' '.join(argv)}:\n{text[-2000:]}")
    return float(found.group(2)), int(found.group(1))


def _debug(fp32: Path, qdq: Path, out: Path) -> tuple[float, int]:
    argv = [sys.executable, "-c", _DEBUG, str(fp32), str(qdq), str(out)]
    text = subprocess.run(argv, capture_output=True, text=True, check=True).stdout
    found = re.search(r"qdq_loss_debug ([\d.]+) s (\d+) tensors", text)
    assert found is not None, text
    return float(found.group(1)), int(found.group(2))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=Path("/tmp/models/yolov8n.onnx"))
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("bench-quant"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    fp32, qdq = _models(args.model, args.out)
    tables: list[float] = []
    debugs: list[float] = []
    counts: tuple[int, int] = (0, 0)
    for _ in range(args.repeat):
        load = os.getloadavg()[0]
        (t, rows), (d, n) = _table(fp32, qdq, args.out), _debug(fp32, qdq, args.out)
        tables.append(t)
        debugs.append(d)
        counts = (rows, n)
        print(f"load {load:.1f}: table {t:.2f} s ({rows} tensors), qdq_loss_debug {d:.2f} s "
              f"({n} tensors), ratio {t / d:.2f}")  # fmt: skip
        time.sleep(1)
    ratios = [t / d for t, d in zip(tables, debugs, strict=True)]
    summary = {
        "table_s": tables,
        "qdq_loss_debug_s": debugs,
        "ratios": ratios,
        "median_ratio": statistics.median(ratios),
        "tensors": {"table": counts[0], "qdq_loss_debug": counts[1]},
        "target_ratio": TARGET_RATIO,
    }
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary))
    return 0 if summary["median_ratio"] <= TARGET_RATIO else 1


if __name__ == "__main__":
    sys.exit(main())
