"""Multi-step diagnosis of a GPT-2-shaped decoder with its KV cache (``--steps``).

    python benchmarks/bench_steps.py [--steps 16] [--layers 2] [--out bench-steps]

The model comes from a transformers config (random weights, nothing downloaded), exported by
torch.onnx's TorchScript exporter with its past key values as inputs and its present ones as
outputs, under Hugging Face's names. Three cases, each a ``bisect`` process timed whole:
ONNX Runtime against itself at ``opt=disable`` (nothing to find), the same with a 5% fault in
layer 1's attention-score MatMul from attention length 9 on (``tests/steps_models.py``'s
``StepFault``: step 8 with a 1-token prompt), and OpenVINO at f32. The floor is the issue's:
16 steps diagnosed within 60 s on 2 cores. Polygraphy has no multi-step mode to compare with.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
FLOOR_S = 60.0
sys.path.insert(0, str(ROOT))
from tests.steps_models import export_gpt2  # noqa: E402  (the tests' model, one definition)


def run_case(model: Path, target: str, steps: int, out: Path) -> dict[str, Any]:
    bisect = Path(sys.executable).parent / "bisect"
    cmd = [str(bisect), str(model), "--target", target, "--steps", str(steps), "--out", str(out)]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=dict(os.environ))
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    report = json.loads((out / "report.json").read_text()) if proc.returncode in (0, 1) else {}
    steps_info = report.get("steps") or {}
    cause = report.get("root_cause") or {}
    return {
        "target": target,
        "exit": proc.returncode,
        "first_step": steps_info.get("first_divergent_step"),
        "root": ", ".join(cause.get("nodes") or []) or "-",
        "wall_s": wall,
        "cpu_s": (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime),
        "stderr": proc.stderr.strip().splitlines()[-1:] if proc.returncode > 1 else [],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("bench-steps"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    model = args.out / "gpt2_kv.onnx"
    attention = export_gpt2(model, args.layers)
    fault = f"tests/steps_models.py:StepFault?node={attention}&length=9"
    cases = ["cpu?opt=disable", fault, "openvino?precision=f32"]
    print(f"GPT-2-shaped decoder, {args.layers} layers, --steps {args.steps}, load "
          f"{os.getloadavg()[0]:.1f}; floor: {FLOOR_S:.0f} s")  # fmt: skip
    print(f"{'target':<58} {'exit':>4} {'step':>4} {'wall s':>7} {'cpu s':>6}  root cause")
    for i, target in enumerate(cases):
        row = run_case(model, target, args.steps, args.out / f"case{i}")
        step = "-" if row["first_step"] is None else str(row["first_step"])
        verdict = "ok" if row["wall_s"] <= FLOOR_S else "OVER THE FLOOR"
        print(f"{target[:58]:<58} {row['exit']:>4} {step:>4} {row['wall_s']:>7.1f} "
              f"{row['cpu_s']:>6.1f}  {row['root']} ({verdict}) "
              f"{' '.join(row['stderr'])}")  # fmt: skip


if __name__ == "__main__":
    main()
