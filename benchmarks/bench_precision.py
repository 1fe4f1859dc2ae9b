#!/usr/bin/env python3
"""Benchmark: what precision floors cost a diagnosis of a lower-precision target.

    python benchmarks/bench_precision.py [--target cpu+fp16] [--repeat 5] [--nudenet PATH]
                                         [--out bench-precision]

On YOLOv8n-320 (``320n.onnx`` from the ``nudenet`` wheel, found or fetched as
``bench_yolo.py`` does) two diagnoses run in turn, each a fresh ``bisect`` process:

    floors   ``bisect MODEL --target T --shape images=1x3x320x320 --no-repro``: the default
             ``--threshold auto``, whose oracle also measures T's precision floors (the faithful
             twin's accumulated run and the isolated floors).
    fp32     the same with ``--target-precision float32``: T judged against fp32 noise alone, as
             every diagnosis was before precision floors; the oracle runs float64 and its fp32
             twin only.

The table gives each one's median wall time, their ratio pair by pair (target: floors/fp32
<= 1.30), the culprits each named and each exit code. Interleaved (floors, fp32, floors, ...)
so that a machine whose speed drifts affects both alike; the load average is printed, since
other work on the machine inflates every wall time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_yolo import console_script, find_nudenet, load_average, measure  # noqa: E402

TARGET_RATIO = 1.30


def _run(bisect: Path, model: Path, target: str, out: Path, extra: list[str]) -> dict[str, Any]:
    argv = [str(bisect), str(model), "--target", target, "--shape", "images=1x3x320x320"]
    argv += ["--no-repro", "--quiet", "--out", str(out), *extra]
    sample = measure(argv, out.with_suffix(".log"))
    report = json.loads((out / "report.json").read_text())
    verdicts = [n["verdict"] for n in report["nodes"]]
    return {
        "wall_s": sample.wall_s,
        "rc": sample.rc,
        "culprits": verdicts.count("culprit") + verdicts.count("range"),
        "verdict": report["verdict"],
    }


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="cpu+fp16")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--nudenet", type=Path)
    parser.add_argument("--out", type=Path, default=Path("bench-precision"))
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    model, why = find_nudenet(args.nudenet, args.out)
    bisect = console_script("bisect")
    if model is None or bisect is None:
        print(f"skipped: {why or 'no bisect console script'}")
        return 0
    runs: dict[str, list[dict[str, Any]]] = {"floors": [], "fp32": []}
    kinds = {"floors": [], "fp32": ["--target-precision", "float32"]}
    for i in range(args.repeat):
        for name, extra in kinds.items():
            runs[name].append(_run(bisect, model, args.target, args.out / f"{name}{i}", extra))
    ratios = [f["wall_s"] / p["wall_s"] for f, p in zip(runs["floors"], runs["fp32"], strict=True)]
    print(f"YOLOv8n-320, --target {args.target}, {args.repeat} pairs, load {load_average()}")
    print("| judged against | median wall s | culprits | exit |")
    print("|---|---|---|---|")
    for name, label in (("floors", "float16 precision floors"), ("fp32", "fp32 noise")):
        rows = runs[name]
        median = statistics.median(r["wall_s"] for r in rows)
        culprits = sorted({r["culprits"] for r in rows})
        codes = sorted({r["rc"] for r in rows})
        print(f"| {label} | {median:.2f} | {culprits} | {codes} |")
    ratio = statistics.median(ratios)
    verdict = "PASS" if ratio <= TARGET_RATIO else "MISS"
    print(f"floors / fp32, median of pairs: {ratio:.2f} (target <= {TARGET_RATIO}): {verdict}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
