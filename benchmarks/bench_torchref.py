"""What PyTorch as the reference costs against a plain bisect of the same ONNX model (issue
37: "time within 2× a plain bisect"): the tests' small transformer (tests/torch_models.py)
exported by the dynamo exporter with the wrong GELU planted, diagnosed with reports and a
repro bundle (``--out``) in three ways:

- plain: ``--ref cpu`` against the simulated faulty runtime (the first GELU's output off by
  5%), a divergence found by the usual search;
- PyTorch reference, same target: ``--ref pytorch:tests/torch_models.py:make``;
- PyTorch reference on ``--target cpu``: the planted export fault (the acceptance case).

    PYTHONPATH=. python benchmarks/bench_torchref.py --repeat 3

The commands are interleaved per repetition; the medians of wall time and of CPU time (user +
system of the whole process tree) are printed and written to ``DIR/bench-torchref.json``.
Exit 0 whatever the numbers (a measurement, not a test); 1 when a command failed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT))
from bench_crash import measure  # noqa: E402
from bench_yolo import console_script, load_average  # noqa: E402

FAULTY = (
    "exec:{python} examples/faulty_runtime.py {model} {inputs} {outputs} --fault node_gelu=0.05"
)
TORCH = f"pytorch:{ROOT / 'tests' / 'torch_models.py'}:make"
MODES = {
    "plain bisect (--ref cpu, faulty target)": ["--ref", "cpu", "--target", FAULTY],
    "PyTorch reference (faulty target)": ["--ref", TORCH, "--target", FAULTY],
    "PyTorch reference (--target cpu, export fault)": ["--ref", TORCH, "--target", "cpu"],
}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("bench-out"))
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    from tests import torch_models

    model = torch_models.export(args.out / "wrong.onnx", dynamo=True, wrong=True)
    bisect = console_script("bisect")
    if bisect is None:
        print("skipped: no bisect console script")
        return 0
    samples: dict[str, list[dict[str, Any]]] = {k: [] for k in MODES}
    load_before = load_average()
    for i in range(args.repeat):
        for mode, flags in MODES.items():
            cmd = [str(bisect), str(model), *flags, "--out", str(args.out / "torchref-report")]
            sample = measure(cmd)
            if sample["rc"] != 1:
                print(f"{mode}: exit {sample['rc']} (1 expected): {' '.join(cmd)}")
                return 1
            samples[mode].append(sample)
            wall, cpu = sample["wall_s"], sample["cpu_s"]
            print(f"{i + 1}/{args.repeat} {mode}: {wall:.2f} s, cpu {cpu:.2f} s")
    first = next(iter(MODES))
    base = statistics.median(s["wall_s"] for s in samples[first])
    base_cpu = statistics.median(s["cpu_s"] for s in samples[first])
    table = {}
    print(f"\ntests/torch_models.py (dynamo, wrong GELU), median of {args.repeat}")
    print(f"{'mode':48} {'wall s':>7} {'vs plain':>8} {'cpu s':>7} {'vs':>6}")
    for mode in MODES:
        wall = statistics.median(s["wall_s"] for s in samples[mode])
        cpu = statistics.median(s["cpu_s"] for s in samples[mode])
        table[mode] = {"wall_s": wall, "cpu_s": cpu, "samples": samples[mode]}
        print(f"{mode:48} {wall:7.2f} {wall / base:7.2f}× {cpu:7.2f} {cpu / base_cpu:5.2f}×")
    print(f"load average: {load_before} at start, {load_average()} at end")
    (args.out / "bench-torchref.json").write_text(json.dumps(table, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
