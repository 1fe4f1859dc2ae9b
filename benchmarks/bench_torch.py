#!/usr/bin/env python3
"""Benchmark: the torch backend's plain run and its float64 oracle, against their yardsticks.

    python benchmarks/bench_torch.py [--models DIR_OR_FILES ...] [--repeat 5]

Models: the shipped examples, plus any ``.onnx`` given (e.g. the real models of the nudenet,
rapidocr-onnxruntime and silero-vad wheels: ``pip download --no-deps nudenet`` and unzip).
Dynamic dims are fixed with ``--shape NAME=1x3x320x320`` as for ``bisect``.

Columns (median of ``--repeat`` runs after one warm-up, in this process, each through
``create_backend(spec).run(model, feeds)``, which includes the per-model setup a search pays on
every run: binding the graph and converting initializers):

    ort s          ONNX Runtime CPU through its adapter (a session per run, as the search pays).
    ort infer s    ONNX Runtime's inference alone, the session built once: the floor.
    torch s        ``torch:cpu``, plain run. Target: <= 3 x ort infer s (torch/infer), judged
                   where ort infer s >= 5 ms (YOLOv8n-320 is 13-15 ms): on the toy examples
                   ORT takes 0.1-2 ms and the interpreter's ~25 us per node dominates, which
                   says nothing about kernels (n/a there).
    f64 torch s    ``torch:cpu?dtype=float64`` with every float tensor marked as an output: the
                   ``--threshold auto`` oracle's pass. Target: <= 0.5 s on YOLOv8n-320.
    f64 ref s      the same on ``ref?dtype=float64`` (onnx.reference), the previous oracle.

PASS/MISS per target. Exit status 0 unless a backend failed.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import onnx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from onnx_bisect.backends.registry import create_backend  # noqa: E402
from onnx_bisect.errors import InputError  # noqa: E402
from onnx_bisect.graph.extract import with_outputs  # noqa: E402
from onnx_bisect.inputs.feeds import make_feeds  # noqa: E402

TARGET_TORCH_RATIO = 3.0
TARGET_F64_S = 0.5
RATIO_JUDGED_FROM_S = 0.005  # ort infer s below this: a toy model, the ratio is n/a


def _median(fn: Callable[[], Any], repeat: int) -> float:
    fn()  # warm-up: imports, allocator, thread pools
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _float_tensors(model: onnx.ModelProto) -> list[str]:
    inferred = onnx.shape_inference.infer_shapes(model)
    floats = {
        v.name
        for v in [*inferred.graph.value_info, *inferred.graph.output]
        if v.type.tensor_type.elem_type == onnx.TensorProto.FLOAT
    }
    return [o for n in model.graph.node for o in n.output if o in floats]


def _ort_session_reused(model: onnx.ModelProto, feeds: dict[str, Any]) -> Callable[[], Any]:
    """ONNX Runtime's inference alone, the session built once: the strictest floor."""
    import onnxruntime as ort

    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    names = {i.name for i in session.get_inputs()}
    return lambda: session.run(None, {k: v for k, v in feeds.items() if k in names})


def measure(path: Path, shapes: dict[str, tuple[int, ...]], repeat: int) -> dict[str, Any]:
    model = onnx.load(str(path))
    try:
        feeds = make_feeds(model, shapes=shapes, seed=0)
    except InputError:  # a --shape meant for another model's dynamic dims
        feeds = make_feeds(model, seed=0)
    marked = with_outputs(model, _float_tensors(model))
    ort, torch_cpu = create_backend("cpu"), create_backend("torch:cpu")
    f64, ref64 = create_backend("torch:cpu?dtype=float64"), create_backend("ref?dtype=float64")
    row: dict[str, Any] = {"model": path.name, "nodes": len(model.graph.node)}
    row["ort s"] = _median(lambda: ort.run(model, feeds), repeat)
    row["ort infer s"] = _median(_ort_session_reused(model, feeds), repeat)
    row["torch s"] = _median(lambda: torch_cpu.run(model, feeds), repeat)
    row["f64 torch s"] = _median(lambda: f64.run(marked, feeds), repeat)
    row["f64 ref s"] = _median(lambda: ref64.run(marked, feeds), max(1, repeat // 2))
    row["torch/ort"] = row["torch s"] / row["ort s"]
    row["torch/infer"] = row["torch s"] / row["ort infer s"]
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("models", nargs="*", type=Path)
    parser.add_argument("--shape", action="append", default=[], help="NAME=1x3x320x320")
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args(argv)
    shapes = {
        k: tuple(int(d) for d in v.split("x")) for k, v in (s.split("=", 1) for s in args.shape)
    }
    paths = args.models or sorted((REPO / "examples" / "models").glob("*.onnx"))
    rows = []
    for path in paths:
        wanted = {k: v for k, v in shapes.items() if k in _input_names(path)}
        rows.append(measure(path, wanted, args.repeat))
    cols = ["model", "nodes", "ort s", "ort infer s", "torch s", "torch/ort", "torch/infer",
            "f64 torch s", "f64 ref s"]  # fmt: skip
    print(" | ".join(f"{c:>12}" for c in cols) + " | targets")
    for row in rows:
        ratio = (
            "n/a"
            if row["ort infer s"] < RATIO_JUDGED_FROM_S
            else ("PASS" if row["torch/infer"] <= TARGET_TORCH_RATIO else "MISS")
        )
        ok_f64 = row["f64 torch s"] <= TARGET_F64_S
        cells = [
            f"{row[c]:>12.3f}" if isinstance(row[c], float) else f"{row[c]!s:>12}" for c in cols
        ]
        verdict = f"torch<=3x ort infer {ratio}, f64<=0.5s {'PASS' if ok_f64 else 'MISS'}"
        print(" | ".join(cells) + " | " + verdict)
    return 0


def _input_names(path: Path) -> set[str]:
    return {i.name for i in onnx.load(str(path), load_external_data=False).graph.input}


if __name__ == "__main__":
    raise SystemExit(main())
